"""Choosing layers by regex over module paths: first match wins, unmatched patterns are errors."""

import re

from mixle.core.spec import QuantSpec


def _compile(pattern, argument):
    if not isinstance(pattern, str):
        raise TypeError(f"{argument} entries must be regex strings, got {pattern!r}")
    try:
        return re.compile(pattern)
    except re.error as err:
        raise ValueError(f"{argument} entry {pattern!r} is not a valid regex ({err}): fix or escape it") from None


class LayerSelector:
    """Decides, per dotted module path, which spec applies (Qwix rule semantics).

    Args:
        patterns: regexes matched in full against the path, first match wins. An entry may be
            a ``(regex, spec)`` pair to give those layers their own QuantSpec, or
            ``(regex, None)`` to leave them in float.
        exclude: regexes of paths never quantized (checked before patterns).
        default_spec: the spec for plain-string patterns.
        spec_type: the class of specs allowed in ``(regex, spec)`` pairs (QuantSpec for QAT;
            other layer transforms, such as LoRA, pass their own).
        opt_in: names of layer kinds selected beyond the default ones (e.g. ``("embedding",)``);
            the backend checks the names and refuses those it does not have.

    >>> s = LayerSelector(patterns=[("head", None), ".*"], exclude=(), default_spec=QuantSpec())
    >>> s.decide("head")[0] is None, s.decide("blocks.0.fc")[0].bits
    (True, 4)
    """

    def __init__(self, *, patterns, exclude, default_spec, spec_type=QuantSpec, opt_in=()):
        if isinstance(patterns, (str, bytes)) or isinstance(exclude, (str, bytes)):
            raise TypeError(
                "patterns and exclude take a sequence of regexes, e.g. patterns=('.*',) or "
                "exclude=('head',); a bare string would be read one character at a time"
            )
        if isinstance(opt_in, (str, bytes)) or not all(isinstance(name, str) for name in opt_in):
            raise TypeError(f"opt_in takes a sequence of layer kind names, e.g. opt_in=('embedding',), got {opt_in!r}")
        self.opt_in = tuple(opt_in)
        self.rules = []
        for entry in patterns:
            if isinstance(entry, tuple):
                if len(entry) != 2 or not (entry[1] is None or isinstance(entry[1], spec_type)):
                    raise TypeError(
                        f"patterns entry {entry!r} must be a regex or a (regex, {spec_type.__name__} or None) pair"
                    )
                regex, spec = entry
            else:
                regex, spec = entry, default_spec
            self.rules.append((regex, _compile(regex, "patterns"), spec))
        self.excludes = [(regex, _compile(regex, "exclude")) for regex in exclude]
        if not self.rules:
            raise ValueError("patterns is empty, so no layer could be selected: pass e.g. patterns=('.*',)")

    def rule_for(self, path):
        """The regex of the first pattern matching ``path`` in full, or None."""
        return next((regex for regex, compiled, _ in self.rules if compiled.fullmatch(path)), None)

    def matching_rules(self, paths):
        """The regexes of the patterns that match at least one of ``paths``."""
        return {regex for regex, compiled, _ in self.rules if any(compiled.fullmatch(p) for p in paths)}

    def decide(self, path):
        """``(spec or None, reason)`` for a layer path."""
        for regex, compiled in self.excludes:
            if compiled.fullmatch(path):
                return None, f"excluded by {regex!r}"
        for regex, compiled, spec in self.rules:
            if compiled.fullmatch(path):
                if spec is None:
                    return None, f"pattern {regex!r} maps it to float"
                return spec, f"matched {regex!r}"
        return None, "matched no pattern"

    def check_all_used(self, layer_paths, all_paths, layer_kind, parts=None):
        """Raise ValueError naming any pattern that matches no layer or exclude matching nothing.

        ``parts``: ``{path: why it cannot be selected}`` of paths a pattern may name that are no
        layer of their own (one expert of a fused experts module): a pattern or exclude matching
        one of them, and no layer, is refused with that reason.

        >>> s = LayerSelector(patterns=["moe.experts.3"], exclude=(), default_spec=QuantSpec())
        >>> s.check_all_used(["moe.experts"], ["moe", "moe.experts"], "layer", {"moe.experts.3": "it is fused"})
        Traceback (most recent call last):
        ValueError: patterns entry 'moe.experts.3' cannot be honoured: it is fused
        """
        parts = parts or {}
        for argument, entries, paths in (("patterns", [(r, c) for r, c, _ in self.rules], layer_paths),
                                         ("exclude", self.excludes, all_paths)):
            for regex, compiled in entries:
                named = [why for path, why in parts.items() if compiled.fullmatch(path)]
                if named and not any(compiled.fullmatch(p) for p in paths):
                    raise ValueError(f"{argument} entry {regex!r} cannot be honoured: {named[0]}")
        for regex, compiled, _ in self.rules:
            if not any(compiled.fullmatch(p) for p in layer_paths):
                raise ValueError(
                    f"patterns entry {regex!r} matches no {layer_kind} in the model (a typo?); "
                    f"its {layer_kind} paths are {sorted(layer_paths)[:12]}"
                )
        for regex, compiled in self.excludes:
            if not any(compiled.fullmatch(p) for p in all_paths):
                raise ValueError(
                    f"exclude entry {regex!r} matches no module path in the model (a typo?); "
                    f"paths include {sorted(all_paths)[:12]}"
                )
