"""The record apply_qat keeps: each layer's path, what happened to it and why."""

from dataclasses import dataclass

from mixle.core.spec import QuantSpec

ACTIONS = ("wrapped", "unchanged", "reconfigured", "skipped")


@dataclass(frozen=True, kw_only=True)
class LayerDecision:
    """What apply_qat did with one layer.

    Attributes:
        path: dotted module path ('' is the root).
        kind: the layer's class name.
        action: 'wrapped', 'unchanged' (already wrapped with this spec), 'reconfigured' or
            'skipped'.
        reason: why (the pattern that selected it, or why it was skipped).
        spec: the QuantSpec applied, None when skipped.
        note: anything else worth knowing (e.g. a weight shared with an embedding).
        elements: the element count of its weight, counted once per weight (0 for a repeat of
            a module or weight already counted, and in reports that do not count weights).
    """

    path: str
    kind: str
    action: str
    reason: str
    spec: QuantSpec | None = None
    note: str = ""
    elements: int = 0


class QATReport:
    """All decisions of one apply_qat call; ``print(report)`` shows a table.

    >>> r = QATReport([LayerDecision(path="fc", kind="Linear", action="wrapped", reason="matched '.*'", spec=QuantSpec())])
    >>> r.wrapped
    ['fc']
    """

    def __init__(self, decisions, *, done="quantized", left="left in float"):
        self.decisions = tuple(decisions)
        self._words = (done, left)  # the summary line's verbs; other transforms (LoRA) pass theirs

    @property
    def wrapped(self):
        """Paths now fake-quantized (wrapped, unchanged or reconfigured)."""
        return [d.path for d in self.decisions if d.action != "skipped"]

    @property
    def weight_share(self):
        """``(quantized elements, all weight elements)`` over the floating-point parameters with
        two or more dimensions (each counted once); ``(0, 0)`` when weights are not counted."""
        done = sum(d.elements for d in self.decisions if d.action != "skipped")
        return done, sum(d.elements for d in self.decisions)

    @property
    def skipped(self):
        """Paths left in float."""
        return [d.path for d in self.decisions if d.action == "skipped"]

    def __getitem__(self, path):
        for d in self.decisions:
            if d.path == path:
                return d
        raise KeyError(f"no layer {path!r} in the QAT report; layers: {[d.path for d in self.decisions]}")

    def __str__(self):
        rows = [("path", "kind", "action", "spec", "reason")]
        for d in self.decisions:
            reason = d.reason + (f"; {d.note}" if d.note else "")
            rows.append((d.path or "<root>", d.kind, d.action, d.spec.short() if d.spec else "-", reason))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
        summary = f"{len(self.wrapped)} {self._words[0]}, {len(self.skipped)} {self._words[1]}"
        done, total = self.weight_share
        if total:
            summary += f"; weights {self._words[0]}: {done / total:.1%} of {total:,} elements"
        lines.append(summary)
        return "\n".join(lines)

    def __repr__(self):
        return f"QATReport({len(self.wrapped)} {self._words[0]}, {len(self.skipped)} skipped)"
