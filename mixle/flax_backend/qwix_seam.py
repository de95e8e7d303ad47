"""The one seam between mixle and Qwix: the only module that imports ``qwix._src`` or relies on
a private Qwix name; the rest of the Flax backend uses the functions and classes below.

What mixle needs from Qwix beyond its public API (each pinned by ``tests/test_qwix_seam.py``,
so a Qwix upgrade that moves one fails there first, naming it):

| seam                               | Qwix 0.1.8                                                     |
|------------------------------------|----------------------------------------------------------------|
| ``QtProviderBase.current_rule``    | ``QuantizationProvider._get_current_rule_and_op_id``           |
| ``QtProviderBase.rules``           | ``QuantizationProvider._rules``                                |
| ``intercept_method``               | ``qwix._src.model._apply_interceptors``                        |
| ``not_intercepted``                | ``qwix._src.interception.disable_interceptions``               |
| ``current_module``, ``current_module_path``, ``unbox``, ``make_rng`` | ``qwix._src.utils.flax_util``  |
| ``module_method``                  | ``flax_util.get_current_module`` finds an NNX module as a frame's ``self`` |
| ``quantized_dot_general``          | ``qwix._src.core.dot_general_qt`` (``dot_general_qt``, ``DotGeneralQtConfig``) |
| ``quantized_conv_general_dilated`` | ``qwix._src.core.conv_general_qt`` (``conv_general_qt``, ``ConvGeneralQtConfig``) |
| ``stochastic_noise_fn``            | ``qwix._src.core.stochastic_rounding.get_noise_fn``             |
| ``UNQUANTIZED_TYPE``, ``quantized_by_qwix`` | the ``_unquantized_type`` attribute of Qwix-quantized classes |
| ``mark_nnx_module``, ``MODULE_ATTRIBUTES``  | the attributes by which Qwix finds NNX modules and their RNGs |

Public Qwix names go through here too (``QtRule``, ``quantize_dequantize``, ``quantize_model``),
so an upgrade touches this file only.
"""

import functools

import jax
import qwix
from qwix._src import interception
from qwix._src import model as qwix_model
from qwix._src.core import conv_general_qt, dot_general_qt, stochastic_rounding
from qwix._src.utils import flax_util

__all__ = [
    "QtRule", "QtProviderBase", "intercept_method", "not_intercepted", "module_method", "current_module",
    "current_module_path", "unbox", "make_rng", "stochastic_noise_fn", "quantize_dequantize",
    "DOT_GENERAL_QT_FIELDS", "quantized_dot_general", "CONV_GENERAL_QT_FIELDS", "quantized_conv_general_dilated",
    "quantize_model", "UNQUANTIZED_TYPE", "quantized_by_qwix", "MODULE_ATTRIBUTES", "mark_nnx_module",
    "nnx_module_path", "nnx_module_rngs",
]

# Qwix's rule for quantized training (a frozen, keyword-only dataclass; public API).
QtRule = qwix.QtRule


class QtProviderBase(qwix.QtProvider):
    """Qwix's ``QtProvider`` with public names for what a subclass needs from its internals.

    Subclasses override Qwix's op hooks (``dot_general``, ``einsum``, ``conv_general_dilated``,
    ``ragged_dot``, ``get_intercept_map``, ``process_model_inputs``) and look up their rule here.

    >>> provider = QtProviderBase([QtRule(module_path="fc", weight_qtype="int8")])
    >>> [rule.module_path for rule in provider.rules]
    ['fc']
    """

    def current_rule(self, op_name, *, only_rule=False):
        """The first rule matching the current module (and ``op_name``), or None.

        The match counts for ``get_unused_rules``. Without ``only_rule`` the op is also counted
        in Qwix's per-module op numbering (as Qwix's own provider does for that op).

        >>> QtProviderBase([]).current_rule.__name__
        'current_rule'
        """
        return self._get_current_rule_and_op_id(op_name, only_rule=only_rule)[0]

    @property
    def rules(self):
        """The provider's rules in order of precedence, as Qwix initialised them (defaults set)."""
        return tuple(self._rules)


def intercept_method(method, provider, method_name):
    """``method`` running inside ``provider``'s interception (jax ops reach the provider's hooks).

    The provider's ``process_model_inputs`` sees the call's arguments (the first is the module)
    and ``process_model_output(method_name, output)`` its result. Not re-entrant: a nested
    intercepted call runs without intercepting again.

    >>> intercept_method(lambda module, x: x, QtProviderBase([]), "__call__")(None, 2)
    2
    """
    return qwix_model._apply_interceptors(
        method, provider, output_transform=functools.partial(provider.process_model_output, method_name))


def not_intercepted(function):
    """``function`` with Qwix's interceptions turned off while it runs (a decorator).

    >>> not_intercepted(abs)(-3)
    3
    """
    return interception.disable_interceptions(function)


def module_method(function):
    """``function(module, *args, **kwargs)`` as a method whose first parameter is named ``self``.

    Qwix finds the current NNX module as a calling frame's local ``self``: a replacement for a
    module method in ``get_intercept_map`` must keep that name for the module.

    >>> module_method(lambda module, x: (module, x))("m", 1)
    ('m', 1)
    """

    def method(self, *args, **kwargs):
        return function(self, *args, **kwargs)

    return method


def current_module():
    """The Linen or NNX module whose code is running (inside an intercepted call).

    Raises:
        ValueError: no module is running.

    >>> current_module()
    Traceback (most recent call last):
    ...
    ValueError: Current module is not known.
    """
    return flax_util.get_current_module()


def current_module_path():
    """The path (a tuple of names and indices) of ``current_module()``: Linen's ``module.path``,
    the ``path`` given to ``mark_nnx_module`` for NNX.

    >>> current_module_path()
    Traceback (most recent call last):
    ...
    ValueError: Current module is not known.
    """
    return flax_util.get_current_module_path()


def unbox(value):
    """The raw array of a boxed Linen/NNX variable (partitioning metadata, ``nnx.Param``), the
    same object, without applying hooks or sharding constraints; other values unchanged.

    >>> import jax.numpy as jnp
    >>> from flax import linen as nn
    >>> x = jnp.ones(2)
    >>> unbox(nn.Partitioned(x, names=("a",))) is x, unbox(x) is x
    (True, True)
    """
    return flax_util.unbox(value)


def make_rng(stream):
    """A fresh key of RNG ``stream`` of the current module: Linen's ``make_rng``, or the next key
    of the ``nnx.Rngs`` given to ``mark_nnx_module``.

    >>> make_rng("stochastic_rounding")
    Traceback (most recent call last):
    ...
    ValueError: Current module is not known.
    """
    return flax_util.make_rng(stream)


def stochastic_noise_fn(method, key, channelwise_noise_axes=(0,)):
    """Qwix's stochastic-rounding noise for gradients (``method`` 'uniform' or 'low_bit_uniform'),
    drawn from ``key``, shared along all but ``channelwise_noise_axes``.

    >>> stochastic_noise_fn("uniform", jax.random.key(0))(shape=(2, 3)).shape
    (2, 1)
    """
    return stochastic_rounding.get_noise_fn(method=method, key=key, channelwise_noise_axes=channelwise_noise_axes)


def quantize_dequantize(x, qtype, *, channelwise_axes=(), tiled_axes=None, calibration_method="absmax"):
    """Qwix's dynamic-range quantize-then-dequantize of ``x`` (no gradient rule of its own).

    Args:
        x: the array.
        qtype: the code type (``jnp.int8``, ``jnp.int4``, ``jnp.float8_e4m3fn``).
        channelwise_axes: axes with one scale per index.
        tiled_axes: ``{axis: tile size}`` for group-wise scales.
        calibration_method: Qwix's ``'<method>[,<args>]'``, e.g. ``'absmax'``.

    >>> import jax.numpy as jnp
    >>> quantize_dequantize(jnp.array([[2.55, -1.0]]), jnp.int8, channelwise_axes=(0,)).tolist()  # scale 2.55 / 127.5
    [[2.5399999618530273, -1.0]]
    """
    return qwix.dequantize(qwix.quantize(x, qtype, channelwise_axes=channelwise_axes, tiled_axes=tiled_axes,
                                         calibration_method=calibration_method))


# The fields of Qwix's DotGeneralQtConfig / ConvGeneralQtConfig mixle sets.
DOT_GENERAL_QT_FIELDS = frozenset({
    "lhs_qtype", "rhs_qtype", "tile_size", "lhs_calibration_method", "rhs_calibration_method",
    "lhs_disable_channelwise_axes", "rhs_disable_channelwise_axes", "dlhs_grad_qtype",
    "dlhs_grad_calibration_method", "dlhs_stochastic_rounding_noise_fn", "drhs_grad_qtype",
    "drhs_grad_calibration_method", "drhs_stochastic_rounding_noise_fn", "use_original_residuals",
})
CONV_GENERAL_QT_FIELDS = frozenset({
    "lhs_qtype", "rhs_qtype", "lhs_calibration_method", "rhs_calibration_method", "rhs_disable_channelwise_axes",
    "dlhs_grad_qtype", "drhs_grad_qtype", "dlhs_grad_calibration_method", "drhs_grad_calibration_method",
})


def _checked(config, fields, what):
    unknown = sorted(set(config) - fields)
    if unknown:
        raise TypeError(f"{what} takes the Qwix config fields {sorted(fields)}, not {unknown}")
    return config


def quantized_dot_general(lhs, rhs, dimension_numbers, **config):
    """Qwix's quantized ``dot_general`` with its custom gradient.

    Args:
        lhs, rhs, dimension_numbers: as ``jax.lax.dot_general``.
        **config: fields of Qwix's ``DotGeneralQtConfig`` among ``DOT_GENERAL_QT_FIELDS``
            (e.g. ``rhs_qtype=jnp.int8``: the right operand quantized per output channel).

    >>> import jax.numpy as jnp
    >>> quantized_dot_general(jnp.ones((1, 2)), jnp.array([[2.55], [-1.0]]), (((1,), (0,)), ((), ())),
    ...                       rhs_qtype=jnp.int8).tolist()  # 2.54 - 1.0
    [[1.5399999618530273]]
    """
    _checked(config, DOT_GENERAL_QT_FIELDS, "quantized_dot_general")
    return dot_general_qt.dot_general_qt(lhs, rhs, dimension_numbers, dot_general_qt.DotGeneralQtConfig(**config))


def quantized_conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
                                   dimension_numbers, feature_group_count, batch_group_count, out_sharding,
                                   **config):
    """Qwix's quantized ``conv_general_dilated`` with its custom gradient.

    Args:
        lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
            feature_group_count, batch_group_count, out_sharding: as ``jax.lax.conv_general_dilated``.
        **config: fields of Qwix's ``ConvGeneralQtConfig`` among ``CONV_GENERAL_QT_FIELDS``.

    >>> import jax.numpy as jnp
    >>> quantized_conv_general_dilated(jnp.ones((1, 1, 2)), jnp.array([[[2.55, -1.0]]]), (1,), "VALID", None, None,
    ...                                None, 1, 1, None, rhs_qtype=jnp.int8).tolist()
    [[[1.5399999618530273]]]
    """
    _checked(config, CONV_GENERAL_QT_FIELDS, "quantized_conv_general_dilated")
    return conv_general_qt.conv_general_qt(lhs, rhs, conv_general_qt.ConvGeneralQtConfig(**config), window_strides,
                                           padding, lhs_dilation, rhs_dilation, dimension_numbers,
                                           feature_group_count, batch_group_count, out_sharding)


def quantize_model(model, provider):
    """Qwix's ``quantize_model`` of a Linen module: a copy of ``model`` whose class intercepts
    ``__call__`` with ``provider`` (its class's ``UNQUANTIZED_TYPE`` attribute is the original class).

    >>> from flax import linen as nn
    >>> quantized_by_qwix(type(quantize_model(nn.Dense(2), QtProviderBase([]))))
    True
    """
    return qwix.quantize_model(model, provider)


# The class attribute Qwix gives the classes it quantizes: the user's original class.
UNQUANTIZED_TYPE = "_unquantized_type"


def quantized_by_qwix(cls):
    """True when ``cls`` is a class made by Qwix's ``quantize_model`` (or one marked like it).

    >>> from flax import nnx
    >>> quantized_by_qwix(nnx.Linear)
    False
    """
    return hasattr(cls, UNQUANTIZED_TYPE)


# The attributes Qwix reads on every NNX module: its path (Qwix's module path), whether to
# update quantization statistics, and the nnx.Rngs ``make_rng`` draws from.
MODULE_ATTRIBUTES = ("qwix_path", "disable_quant_stats_update", "qwix_rngs")


def mark_nnx_module(module, path, rngs):
    """Give an NNX module the attributes Qwix finds it by (``MODULE_ATTRIBUTES``), as Qwix's
    ``quantize_model`` does, with statistics updates on.

    >>> from flax import nnx
    >>> module = nnx.Module()
    >>> mark_nnx_module(module, ("body", 0), None); nnx_module_path(module), nnx_module_rngs(module)
    (('body', 0), None)
    """
    module.qwix_path = path
    module.disable_quant_stats_update = False
    module.qwix_rngs = rngs


def nnx_module_path(module):
    """The path ``mark_nnx_module`` gave an NNX module (AttributeError if it has none).

    >>> from flax import nnx
    >>> nnx_module_path(nnx.Module())
    Traceback (most recent call last):
    ...
    AttributeError: 'Module' object has no attribute 'qwix_path'
    """
    return module.qwix_path


def nnx_module_rngs(module):
    """The ``nnx.Rngs`` ``mark_nnx_module`` gave an NNX module, or None.

    >>> from flax import nnx
    >>> nnx_module_rngs(nnx.Module()) is None
    True
    """
    return vars(module).get("qwix_rngs")
