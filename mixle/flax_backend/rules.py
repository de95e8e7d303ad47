"""The one translation of a mixle QuantSpec (and layer patterns) into Qwix ``QtRule``s.

| QuantSpec                       | QtRule                                                      |
|---------------------------------|-------------------------------------------------------------|
| ``bits=4/8``                    | ``weight_qtype=int4/int8``                                  |
| ``weight_format='float8_e4m3fn'`` | ``weight_qtype=float8_e4m3fn``                            |
| ``grid='symmetric'``            | ``weight_calibration_method='absmax,<(qmax+0.5)/qmax>'``    |
| ``grid='qwix'``                 | ``'absmax'``, or ``calibration`` as given                   |
| ``granularity='group'``         | ``tile_size=group_size`` (on the last contracting axis)     |
| ``granularity='tensor'``        | ``disable_channelwise_axes=True``                           |
| ``act_bits``                    | ``act_qtype`` (dynamic, one scale per token, same grid); on |
|                                 | llama.cpp's grids none: mixle rounds the input itself       |
| ``bwd_bits``, ``bwd_stochastic_rounding`` | ``bwd_qtype``, ``bwd_stochastic_rounding``        |
| (always)                        | ``additional_qt_config={'use_original_residuals': False}``  |
| ``clip_percentile=p``           | ``weight_calibration_method='percentile,p'`` (see below)    |

The last row is not a Qwix method: mixle's ``QATProvider`` clips each weight to its live
``p``-th percentile of ``|w|`` before Qwix's absmax calibration; a stock ``QtProvider`` given
such a rule raises ``Unsupported calibration`` instead of silently ignoring it. The textbook
straight-through estimator (``use_original_residuals=False``) makes the input gradient
``g @ q(W)^T``; Qwix's default for forward-only rules would use the float ``W`` there.
"""

import dataclasses
import re

from mixle.core.spec import QuantSpec

__all__ = ["MixleQtRule", "qwix_rule", "qwix_rules", "module_path_regex", "weight_calibration"]


def _rule_class():
    global _MixleQtRule
    if _MixleQtRule is None:
        from mixle.flax_backend.qwix_seam import QtRule  # imports jax, flax and qwix: only when a rule is built

        @dataclasses.dataclass(frozen=True, kw_only=True)
        class MixleQtRule(QtRule):
            """A Qwix QtRule that also carries the mixle QuantSpec it was built from."""

            spec: QuantSpec | None = None

        _MixleQtRule = MixleQtRule
    return _MixleQtRule


_MixleQtRule = None


def __getattr__(name):
    if name == "MixleQtRule":
        return _rule_class()
    raise AttributeError(f"module 'mixle.flax_backend.rules' has no attribute {name!r}")


def _int_qtype(bits):
    import jax.numpy as jnp

    return jnp.int4 if bits == 4 else jnp.int8


def weight_qtype(spec):
    """The Qwix weight qtype of a spec: ``jnp.int4``, ``jnp.int8`` or ``jnp.float8_e4m3fn``."""
    if spec.weight_format != "int":
        import jax.numpy as jnp

        return getattr(jnp, spec.weight_format)
    return _int_qtype(spec.bits)


def _absmax_calibration(spec, bits):
    """Qwix's native scale is absmax / (qmax + 0.5); a grid dividing by d is 'absmax,(qmax + 0.5) / d'."""
    factor = (2 ** (bits - 1) - 0.5) / spec.grid_record.divisor[bits]
    return "absmax" if factor == 1 else f"absmax,{factor!r}"


def range_calibration(spec):
    """Qwix calibration of the weight range without percentile clipping: the spec's own
    ``calibration``, or absmax scaled onto the spec's grid.

    >>> range_calibration(QuantSpec(bits=4)), range_calibration(QuantSpec(bits=4, grid="qwix"))
    ('absmax,1.0714285714285714', 'absmax')
    """
    return spec.calibration or _absmax_calibration(spec, spec.bits)


def weight_calibration(spec):
    """Qwix ``weight_calibration_method`` for a spec (see the module table).

    >>> weight_calibration(QuantSpec(bits=4))
    'absmax,1.0714285714285714'
    >>> weight_calibration(QuantSpec(bits=8, grid="qwix", calibration="rms,3"))
    'rms,3.0'
    """
    if spec.clip_percentile is not None and spec.clip_percentile < 100:
        return f"percentile,{spec.clip_percentile!r}"
    return range_calibration(spec)


def activation_calibration(spec):
    """Calibration of activations (``act_bits``): absmax per token on the spec's grid."""
    return _absmax_calibration(spec, spec.act_bits)


def module_path_regex(pattern):
    """A mixle module-path regex (dotted paths) as a Qwix ``module_path`` regex ('/' paths).

    An escaped dot ``\\.`` (a literal path separator) becomes ``/``; a bare ``.`` stays a
    wildcard, which also matches ``/``.

    >>> module_path_regex(r"blocks\\.0\\..*")
    'blocks/0/.*'
    """
    return re.sub(r"(?<!\\)((?:\\\\)*)\\\.", r"\1/", pattern)


def qwix_rule(spec, module_path=".*"):
    """One Qwix rule for ``module_path`` (a Qwix '/'-path regex) quantizing as ``spec`` says.

    ``spec=None`` gives a rule that keeps matching modules in float (first match wins).

    >>> rule = qwix_rule(QuantSpec(bits=4, group_size=32), "fc")
    >>> rule.weight_qtype.__name__, rule.tile_size, rule.weight_calibration_method
    ('int4', 32, 'absmax,1.0714285714285714')
    """
    cls = _rule_class()
    if spec is None:
        return cls(module_path=module_path, weight_qtype=None)
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"spec must be a mixle QuantSpec or None, got {type(spec).__name__}")
    fields = dict(
        module_path=module_path,
        weight_qtype=weight_qtype(spec),
        weight_calibration_method=weight_calibration(spec),
        tile_size=spec.group_size if spec.granularity == "group" else None,
        disable_channelwise_axes=spec.granularity == "tensor",
        additional_qt_config={"use_original_residuals": False},
        spec=spec,
    )
    if spec.act_bits is not None and spec.grid_record.activation_grid is None:  # llama.cpp's: mixle rounds them
        fields.update(act_qtype=_int_qtype(spec.act_bits), act_calibration_method=activation_calibration(spec))
    if spec.bwd_bits is not None:
        fields.update(bwd_qtype=_int_qtype(spec.bwd_bits), bwd_stochastic_rounding=spec.bwd_stochastic_rounding)
    return cls(**fields)


def qwix_rules(spec=None, patterns=(".*",), **spec_fields):
    """Qwix rules for mixle patterns: same regexes (dotted -> '/'), same order, first match wins.

    Args:
        spec: the default QuantSpec (or its fields as keywords).
        patterns: regexes, ``(regex, QuantSpec)`` or ``(regex, None)`` pairs, as for ``apply_qat``.

    Returns:
        A list of ``MixleQtRule`` (Qwix ``QtRule`` subclasses) for ``mixle``'s ``QATProvider``;
        rules without ``clip_percentile`` also work with a stock ``qwix.QtProvider``, except that
        ``granularity='tensor'`` there also makes activation scales per tensor.

    >>> [r.module_path for r in qwix_rules(QuantSpec(), patterns=[(r"head", None), r"blocks\\..*"])]
    ['head', 'blocks/.*']
    """
    from mixle.core.spec import resolve_spec

    default = resolve_spec(spec, spec_fields)
    if isinstance(patterns, (str, bytes)):
        raise TypeError("patterns takes a sequence of regexes, e.g. patterns=('.*',)")
    rules = []
    for entry in patterns:
        regex, entry_spec = entry if isinstance(entry, tuple) else (entry, default)
        rules.append(qwix_rule(entry_spec, module_path_regex(regex)))
    return rules
