"""The compare job's results: its row names, the recovered-% summary, the table, the plot, the files.

``write_outputs`` writes ``results.json``, ``table.txt`` and ``compare.png``, each atomically, and
then ``complete.json`` with their sha256, so a folder holds one finished run's set or says it does
not.
"""

import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mixle._optional import require

__all__ = ["MIN_DEGRADATION", "summarize", "plot_training_curve", "format_table", "save_plot", "write_outputs", "check_out_dir", "OUTPUTS",
           "COMPLETE", "FP32", "PTQ", "FINETUNE", "FINETUNE_PTQ", "QAT", "QAT_DISTILL", "QAT_LEARNED", "QAT_BOTH",
           "OPTION_METHODS", "ACT8_PTQ", "ACT8_QAT", "ACT8_METHODS", "GGUF_FINETUNE", "GGUF_PTQ", "GGUF_QAT",
           "GGUF_METHODS", "gguf_mix_ptq", "gguf_mix_qat", "AGREEMENT_PERCENT", "FINETUNE_GPTQ", "GGUF_PTQ_IMATRIX",
           "GGUF_QAT_IMATRIX", "gguf_mix_ptq_imatrix", "gguf_mix_qat_imatrix", "Comparison", "comparisons"]

# Below this loss increase (nats per token, ~0.5% perplexity) PTQ has nothing left to recover.
MIN_DEGRADATION = 0.005

# The methods, i.e. the rows of the table (also the names of the training phases' curves).
FP32 = "fp32"
PTQ = "PTQ"
FINETUNE = "fp32 fine-tune"
FINETUNE_PTQ = "fine-tune + PTQ"
QAT = "QAT"
QAT_DISTILL = "QAT + distill"
QAT_LEARNED = "QAT + learned scales"
QAT_BOTH = "QAT + learned + distill"
OPTION_METHODS = (QAT_LEARNED, QAT_DISTILL, QAT_BOTH)
ACT8_PTQ = "8da4w fine-tune + PTQ"
ACT8_QAT = "8da4w QAT"
ACT8_METHODS = (ACT8_QAT,)
GGUF_FINETUNE = "fp32 fine-tune (tanh GELU)"
GGUF_PTQ = "fine-tune + PTQ (GGUF q4_0)"
GGUF_QAT = "QAT (GGUF q4_0)"
# The strong PTQ baselines (issue 26), calibrated on training windows only: GPTQ of the fine-tune on
# the int grids, and llama.cpp's importance-matrix quantization; QAT with the same importance.
FINETUNE_GPTQ = "fine-tune + GPTQ"
GGUF_PTQ_IMATRIX = "fine-tune + PTQ imatrix (GGUF q4_0)"
GGUF_QAT_IMATRIX = "QAT imatrix (GGUF q4_0)"
GGUF_METHODS = (GGUF_QAT, GGUF_QAT_IMATRIX)
# llama.cpp's perplexity of a file and mixle's of the same weights agree within this (issue 24).
AGREEMENT_PERCENT = 1.0


def gguf_mix_ptq(mix):
    """The row of ``llama-quantize``'s ``mix`` of the tanh-GELU fp32 fine-tune.

    >>> gguf_mix_ptq("Q4_K_M")
    'fine-tune + PTQ (GGUF Q4_K_M)'
    """
    return f"fine-tune + PTQ (GGUF {mix})"


def gguf_mix_qat(mix):
    """The row (and training phase) of QAT on the llama.cpp ``mix``.

    >>> gguf_mix_qat("Q4_K_M")
    'QAT (GGUF Q4_K_M)'
    """
    return f"QAT (GGUF {mix})"


def gguf_mix_ptq_imatrix(mix):
    """The row of ``llama-quantize --imatrix``'s ``mix`` of the tanh-GELU fp32 fine-tune.

    >>> gguf_mix_ptq_imatrix("Q4_K_M")
    'fine-tune + PTQ imatrix (GGUF Q4_K_M)'
    """
    return f"fine-tune + PTQ imatrix (GGUF {mix})"


def gguf_mix_qat_imatrix(mix):
    """The row (and training phase) of QAT on the llama.cpp ``mix`` with a fixed importance matrix.

    >>> gguf_mix_qat_imatrix("Q4_K_M")
    'QAT imatrix (GGUF Q4_K_M)'
    """
    return f"QAT imatrix (GGUF {mix})"


@dataclass(frozen=True)
class Comparison:
    """One entry of the summary: the QAT rows ``methods`` measured against the PTQ row ``baseline``.

    Attributes:
        key: the summary key (``{bits}`` is replaced by the width).
        baseline: the PTQ row whose loss degradation from ``tuned`` the QAT rows recover.
        methods: the QAT rows measured.
        tuned: the float row both start from (same extra steps as QAT).
        label: how the notes name the comparison (``{bits}`` as in ``key``).
        external: which ``ExternalQAT`` names join ``methods``: ``"weights"``, ``"act8"`` or None.
        per_width: one entry per bit width of the run (else int4 only).
    """

    key: str
    baseline: str
    methods: tuple
    tuned: str = FINETUNE
    label: str = "int{bits}"
    external: str | None = None
    per_width: bool = False


_GPTQ_LABEL = "int{bits} by GPTQ (calibrated on training windows)"
_IMATRIX_LABEL = " with an importance matrix (calibrated on training windows)"


def comparisons(mixes=()):
    """The summary's entries (``Comparison``): each QAT row against each PTQ row it can be compared with.

    >>> [c.key for c in comparisons(("Q4_K_M",))]  # doctest: +NORMALIZE_WHITESPACE
    ['int{bits}', 'int{bits}_gptq', '8da4w', 'gguf_q4_0', 'gguf_q4_0_imatrix', 'gguf_Q4_K_M',
     'gguf_Q4_K_M_imatrix']
    """
    int_methods = (QAT, *OPTION_METHODS)
    table = [Comparison("int{bits}", FINETUNE_PTQ, int_methods, external="weights", per_width=True),
             Comparison("int{bits}_gptq", FINETUNE_GPTQ, int_methods, label=_GPTQ_LABEL, external="weights",
                        per_width=True),
             Comparison("8da4w", ACT8_PTQ, ACT8_METHODS, label="8da4w", external="act8"),
             Comparison("gguf_q4_0", GGUF_PTQ, GGUF_METHODS, GGUF_FINETUNE, "GGUF q4_0"),
             Comparison("gguf_q4_0_imatrix", GGUF_PTQ_IMATRIX, GGUF_METHODS, GGUF_FINETUNE,
                        "GGUF q4_0" + _IMATRIX_LABEL)]
    for mix in mixes:
        methods = (gguf_mix_qat(mix), gguf_mix_qat_imatrix(mix))
        table += [Comparison(f"gguf_{mix}", gguf_mix_ptq(mix), methods, GGUF_FINETUNE, f"GGUF {mix}"),
                  Comparison(f"gguf_{mix}_imatrix", gguf_mix_ptq_imatrix(mix), methods, GGUF_FINETUNE,
                             f"GGUF {mix}" + _IMATRIX_LABEL)]
    return table


def _row(rows, method, bits):
    return next((r for r in rows if r["method"] == method and r["bits"] == bits), None)


def summarize(rows, bits_list, external_names=(), act8_external=()):
    """Per comparison (``comparisons``): how much of a PTQ row's held-out loss degradation QAT recovers.

    ``recovered = (L_ptq - L_qat) / (L_ptq - L_fp32)`` with L_ptq the fine-tuned model after PTQ
    and L_fp32 the fine-tuned fp32 model (same number of extra steps as QAT). When PTQ loses
    less than ``MIN_DEGRADATION`` nats the ratio is noise, so it is None and a note says why.
    Each QAT row is measured against every PTQ it can be compared with: at each width
    fine-tune + PTQ (``"int<bits>"``) and fine-tune + GPTQ (``"int<bits>_gptq"``); rows of the
    8da4w spec (and ``act8_external`` methods) against the 8da4w fine-tune + PTQ (``"8da4w"``);
    the llama.cpp rows (plain and imatrix QAT) against their tanh-GELU fine-tune's PTQ into Q4_0
    without (``"gguf_q4_0"``) and with the importance matrix (``"gguf_q4_0_imatrix"``); the
    rows of a llama.cpp mix (their ``gguf_mix``) likewise (``"gguf_<mix>"``, ``"gguf_<mix>_imatrix"``).
    Each entry names its ``baseline`` row.

    >>> rows = [{"method": "fp32 fine-tune", "bits": 32, "loss": 1.0}, {"method": "fine-tune + PTQ", "bits": 4, "loss": 1.2},
    ...         {"method": "QAT", "bits": 4, "loss": 1.02}]
    >>> round(summarize(rows, (4,))["int4"]["QAT"]["recovered_percent"], 6)
    90.0
    """
    externals = {"weights": tuple(external_names), "act8": tuple(act8_external), None: ()}
    mixes = tuple(dict.fromkeys(r["gguf_mix"] for r in rows if r.get("gguf_mix")))
    summary = {}
    for comparison in comparisons(mixes):
        for bits in bits_list if comparison.per_width else (4,):
            entry = _entry(rows, bits, comparison, externals[comparison.external])
            if entry is not None:
                summary[comparison.key.format(bits=bits)] = entry
    return summary


def _entry(rows, bits, comparison, external_names):
    """``comparison``'s summary entry at ``bits`` (None without its baseline row)."""
    tuned, baseline = _row(rows, comparison.tuned, 32), _row(rows, comparison.baseline, bits)
    if baseline is None:
        return None
    label = comparison.label.format(bits=bits)
    degradation = baseline["loss"] - tuned["loss"]
    entry = {"baseline": comparison.baseline, "ptq_degradation_nats": degradation,
             "ptq_perplexity_increase_percent": 100 * math.expm1(degradation)}
    for name in (*comparison.methods, *external_names):
        row = _row(rows, name, bits)
        if row is not None:
            entry[name] = _recovery(row, name, tuned, baseline, entry, label, comparison.tuned)
    return entry


def _recovery(row, name, tuned, baseline, entry, label, tuned_method):
    """``row``'s share of ``baseline``'s degradation from ``tuned`` it recovers, with its note."""
    degradation = entry["ptq_degradation_nats"]
    gap = 100 * math.expm1(row["loss"] - tuned["loss"])
    if degradation < MIN_DEGRADATION:
        recovered = None
        note = (f"PTQ at {label} loses only {degradation:+.4f} nats ({entry['ptq_perplexity_increase_percent']:+.2f}% "
                f"perplexity): nothing to recover, so no recovered % is given; {name} is at {gap:+.2f}%")
    else:
        recovered = 100 * (baseline["loss"] - row["loss"]) / degradation
        note = (f"{name} recovers {recovered:.1f}% of the held-out loss PTQ loses at {label}; "
                f"its perplexity is {gap:+.2f}% vs the {tuned_method} (PTQ: "
                f"{entry['ptq_perplexity_increase_percent']:+.2f}%)")
    result = {"recovered_percent": recovered, "perplexity_gap_percent": gap, "note": note}
    cpp = [r.get("llama_cpp_loss") for r in (tuned, baseline, row)]
    if None not in cpp:  # the same measure from llama.cpp's own logits
        cpp_degradation = cpp[1] - cpp[0]
        result["llama_cpp_recovered_percent"] = (
            None if cpp_degradation < MIN_DEGRADATION else 100 * (cpp[1] - cpp[2]) / cpp_degradation)
        result["note"] += "; in llama.cpp " + (
            f"PTQ loses only {cpp_degradation:+.4f} nats ({100 * math.expm1(cpp_degradation):+.2f}% perplexity) and "
            f"{name} is at {100 * math.expm1(cpp[2] - cpp[0]):+.2f}%" if cpp_degradation < MIN_DEGRADATION else
            f"{result['llama_cpp_recovered_percent']:.1f}% recovered, perplexity "
            f"{100 * math.expm1(cpp[2] - cpp[0]):+.2f}% (PTQ: {100 * math.expm1(cpp_degradation):+.2f}%)")
    return result


def format_table(results):
    """The results (``run_compare``'s) as a plain-text table plus one summary line per bit width.

    >>> results = {"rows": [{"method": "QAT", "bits": 4, "loss": 1.0, "perplexity": 2.718, "bytes": 25}],
    ...            "model": {"fp32_bytes": 100, "parameters": 25}, "summary": {}, "environment": {
    ...            "torch": "2", "threads": 1, "total_seconds": 3}, "data": {"predicted_tokens": 64,
    ...            "corpus": "t.txt", "tokenizer": "char", "vocab": 9}}
    >>> print(format_table(results))  # doctest: +NORMALIZE_WHITESPACE
    method                       bits  held-out loss  perplexity      bytes    size
    -------------------------------------------------------------------------------
    QAT                          int4         1.0000      2.7180         25   25.0%
    <BLANKLINE>
    held-out: 64 tokens of t.txt (char-level, vocab 9); 25 parameters; torch 2, 1 threads, 3 s
    """
    rows = results["rows"]
    fp32_bytes = results["model"]["fp32_bytes"]
    cpp = any("llama_cpp_perplexity" in row for row in rows)
    width = max([28] + [len(row["method"]) + 1 for row in rows])
    header = (f"{'method':<{width}}{'bits':>5}{'held-out loss':>15}{'perplexity':>12}{'bytes':>11}{'size':>8}"
              + (f"{'llama.cpp ppl':>15}{'vs mixle':>10}" if cpp else ""))
    lines = [header, "-" * len(header)]
    for row in rows:
        bits = "fp32" if row["bits"] == 32 else f"int{row['bits']}"
        lines.append(f"{row['method']:<{width}}{bits:>5}{row['loss']:>15.4f}{row['perplexity']:>12.4f}"
                     f"{row['bytes']:>11,d}{row['bytes'] / fp32_bytes:>7.1%}"
                     + (f"{row['llama_cpp_perplexity']:>15.4f}{_agreement(row):>+9.2f}%"
                        if "llama_cpp_perplexity" in row else ""))
    lines.append("")
    for name, entry in results["summary"].items():
        for method, value in entry.items():
            if isinstance(value, dict):
                lines.append(f"{name}: {value['note']}")
    lines.extend(_gguf_notes(results))
    lines.extend(_calibration_notes(results))
    data, env = results["data"], results["environment"]
    lines.append(f"held-out: {data['predicted_tokens']:,} tokens of {data['corpus']} ({data['tokenizer']}-level, "
                 f"vocab {data['vocab']}); {results['model']['parameters']:,} parameters; torch {env['torch']}, "
                 f"{env['threads']} threads, {env['total_seconds']:.0f} s")
    return "\n".join(lines)


def _agreement(row):
    """llama.cpp's perplexity of ``row``'s file relative to mixle's of the same weights, in percent."""
    return 100 * math.expm1(row["llama_cpp_loss"] - row["loss"])


def _gguf_notes(results):
    """The table's lines on the GGUF rows: how they are evaluated, the mixes' tensor types, llama.cpp's agreement."""
    rows, lines = results["rows"], []
    if any(row["method"] == GGUF_QAT for row in rows):
        lines.append("(GGUF q4_0) rows: evaluated from the GGUF file's weights (gguf-py dequantize), tanh GELU; "
                     "bytes = the file's tensor data"
                     + (f"; llama.cpp ppl: the file run by llama-cpp-python {results['llama_cpp']['llama_cpp_python']}"
                        if "llama_cpp_python" in (results.get("llama_cpp") or {}) else ""))
    for row in rows:
        if row.get("gguf_mix") and row["method"] == gguf_mix_ptq(row["gguf_mix"]):
            types = ", ".join(f"{name} x{count}" for name, count in row["tensor_types"].items())
            lines.append(f"(GGUF {row['gguf_mix']}) rows: PTQ = save_gguf(fp32 fine-tune, gguf_mix={row['gguf_mix']!r}), "
                         f"the file llama-quantize writes; QAT trained on apply_qat(gguf_mix={row['gguf_mix']!r}); "
                         f"both evaluated from their files; quantized tensors: {types}")
    measured = [row for row in rows if "llama_cpp_loss" in row]
    if measured:
        worst = max(measured, key=lambda row: abs(_agreement(row)))
        verdict = "within" if abs(_agreement(worst)) <= AGREEMENT_PERCENT else "NOT within"
        lines.append(f"llama.cpp vs mixle on the same files (F32 KV cache, context = the window, no BOS): largest "
                     f"difference {_agreement(worst):+.3f}% ({worst['method']}), {verdict} {AGREEMENT_PERCENT:g}%")
    return lines


def _calibration_notes(results):
    """The table's line on what the GPTQ and imatrix rows calibrated on (the training text only)."""
    calibration = results.get("calibration")
    if not calibration:
        return []
    used = [what for what, method in (("GPTQ", FINETUNE_GPTQ), ("imatrix", GGUF_PTQ_IMATRIX))
            if any(row["method"] == method for row in results["rows"])]
    how = ("; imatrix PTQ = quantize_model(fine-tune, importance=calibrate_importance(fine-tune)), imatrix QAT = "
           "apply_qat(importance=calibrate_importance(its starting checkpoint)), trained like the plain QAT row"
           if "imatrix" in used else "")
    return [f"{' and '.join(used) or 'calibration'} rows: calibrated on {calibration['windows']:,} evenly spaced windows "
            f"({calibration['tokens']:,} tokens) of the training text, never the held-out text{how}"]


def plot_training_curve(axis, curve, label):
    """Draw one training curve on a matplotlib ``axis``: its smoothed training loss (faint line)
    and its held-out loss (dots), ``curve`` holding ``step``, ``train_loss``, ``eval_step`` and
    ``held_out_loss`` lists (``TrainLog.curve``).

    >>> from matplotlib.figure import Figure
    >>> axis = Figure().subplots()
    >>> plot_training_curve(axis, {"step": [1, 2], "train_loss": [2.0, 1.5], "eval_step": [0, 2],
    ...                            "held_out_loss": [2.1, 1.6]}, "QAT")
    >>> [line.get_label() for line in axis.get_lines()][-1]
    'QAT'
    """
    steps, loss = np.asarray(curve["step"]), np.asarray(curve["train_loss"])
    width = max(1, min(50, len(loss) // 10))
    smooth = np.convolve(loss, np.ones(width) / width, mode="valid") if len(loss) else loss
    line, = axis.plot(steps[width - 1 :] if len(loss) else steps, smooth, alpha=0.3, linewidth=1)
    axis.plot(curve["eval_step"], curve["held_out_loss"], marker="o", markersize=3, color=line.get_color(),
              label=label)


def _plot_curves(results, axis, phases, title):
    """Training curves: smoothed training loss (faint) and held-out loss (dots) of each phase."""
    for phase in phases:
        plot_training_curve(axis, results["curves"][phase], phase)
    axis.set_xlabel("training step")
    axis.set_ylabel("loss (nats/token)")
    axis.set_title(title, fontsize=10)
    axis.legend(fontsize=8, title="faint: train loss, dots: held-out subset", title_fontsize=7)


def _plot_perplexities(results, axis):
    """Bars: held-out perplexity of each quantized method, grouped by bits; lines: the float rows."""
    rows = [r for r in results["rows"] if r["bits"] != 32]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    bit_groups = list(dict.fromkeys(r["bits"] for r in rows))
    width = 0.8 / max(1, len(methods))
    present = {bits: [m for m in methods if _row(rows, m, bits) is not None] for bits in bit_groups}
    for method in methods:
        xs, ys = [], []
        for j, bits in enumerate(bit_groups):
            if method in present[bits]:  # each group's bars are centred on its tick
                i, count = present[bits].index(method), len(present[bits])
                xs.append(j + (i - (count - 1) / 2) * width)
                ys.append(_row(rows, method, bits)["perplexity"])
        bars = axis.bar(xs, ys, width, label=method)
        axis.bar_label(bars, fmt="%.3f", fontsize=7)
    for method, style in ((FP32, ":"), (FINETUNE, "--"), (GGUF_FINETUNE, "-.")):
        row = _row(results["rows"], method, 32)
        if row is None:
            continue
        axis.axhline(row["perplexity"], linestyle=style, color="black", linewidth=1,
                     label=f"{method} ({row['perplexity']:.3f})")
    all_ppl = [r["perplexity"] for r in results["rows"]]
    low, high = min(all_ppl), max(all_ppl)
    axis.set_ylim(low - 0.3 * (high - low) - 1e-3, high + 0.25 * (high - low) + 1e-3)
    axis.set_xticks(range(len(bit_groups)), [f"int{b}" for b in bit_groups])
    axis.set_ylabel("held-out perplexity (real int weights)")
    axis.set_title("held-out perplexity by method and bits (lower is better)")
    axis.legend(fontsize=8)


def save_plot(results, path):
    """Write a PNG: fp32 training and fine-tune curves, and held-out perplexity by method and bits.

    >>> import os, tempfile
    >>> curve = {"step": [1, 2], "train_loss": [2.0, 1.5], "eval_step": [0, 2], "held_out_loss": [2.1, 1.6]}
    >>> results = {"curves": {"fp32": curve, "QAT int4": curve}, "rows": [
    ...     {"method": "fp32", "bits": 32, "perplexity": 4.9}, {"method": "QAT", "bits": 4, "perplexity": 5.0}]}
    >>> path = save_plot(results, os.path.join(tempfile.mkdtemp(), "plot.png"))
    >>> open(path, "rb").read(4)
    b'\\x89PNG'
    """
    require("matplotlib", extra="bench", purpose="the comparison plot")
    from matplotlib.figure import Figure  # no pyplot: works headless and leaves notebook backends alone

    fig = Figure(figsize=(16, 4.8))
    pretrain, finetune, right = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1, 1, 1.25]})
    _plot_curves(results, pretrain, [FP32], "fp32 training")
    _plot_curves(results, finetune, [p for p in results["curves"] if p != FP32],
                 "fine-tunes from the fp32 checkpoint (same steps and batches)")
    _plot_perplexities(results, right)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    return path


OUTPUTS = ("results.json", "table.txt", "compare.png")
COMPLETE = "complete.json"  # written last: the outputs beside it are one finished run's


def check_out_dir(out_dir):
    """Create ``out_dir`` if needed and check that files can be written there, before any training.

    Also checks that matplotlib (for ``compare.png``) is installed.

    Raises:
        ValueError: the directory cannot be created or written (the message says why).
        ImportError: matplotlib is missing (names the extra to install).

    >>> import tempfile, os
    >>> run = os.path.join(tempfile.mkdtemp(), "new", "run")
    >>> check_out_dir(run)
    >>> os.path.isdir(run), os.listdir(run)    # created, and the write probe removed again
    (True, [])
    >>> open(os.path.join(run, "file"), "w").close()
    >>> check_out_dir(os.path.join(run, "file", "sub"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: out_dir='.../file/sub' cannot be created (Not a directory): choose a directory you can write
    """
    require("matplotlib", extra="bench", purpose="the comparison plot")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as err:
        raise ValueError(f"out_dir={str(out_dir)!r} cannot be created ({err.strerror or err}): "
                         f"choose a directory you can write") from None
    try:
        handle, probe = tempfile.mkstemp(dir=out_dir, prefix=".mixle-write-check-")
        os.close(handle)
        os.remove(probe)
    except OSError as err:
        raise ValueError(f"out_dir={str(out_dir)!r} is not writable ({err.strerror or err}): "
                         f"choose a directory you can write") from None


def write_outputs(results, out_dir):
    """Write ``results.json``, ``table.txt``, ``compare.png`` and then ``complete.json`` into ``out_dir``.

    Each file is replaced atomically. ``complete.json`` (each output's sha256) is removed first and
    written last, so outputs without it, or whose hashes disagree with it, are not one finished
    run's set (e.g. a run that failed while writing over an earlier run's folder).

    Returns:
        ``{name: path}`` of the four files.

    >>> import os, tempfile
    >>> curve = {"step": [1], "train_loss": [2.0], "eval_step": [0, 1], "held_out_loss": [2.1, 2.0]}
    >>> results = {"rows": [{"method": "fp32", "bits": 32, "loss": 1.0, "perplexity": 2.718, "bytes": 100}],
    ...            "model": {"fp32_bytes": 100, "parameters": 25}, "summary": {},
    ...            "curves": {"fp32": curve, "fp32 fine-tune": curve},
    ...            "environment": {"torch": "2", "threads": 1, "total_seconds": 3}, "data": {
    ...            "predicted_tokens": 64, "corpus": "t.txt", "tokenizer": "char", "vocab": 9}}
    >>> sorted(write_outputs(results, tempfile.mkdtemp()))
    ['compare.png', 'complete.json', 'results.json', 'table.txt']
    """
    from mixle.core.fileformat import replace_atomically

    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, name) for name in OUTPUTS + (COMPLETE,)}
    if os.path.lexists(paths[COMPLETE]):
        os.remove(paths[COMPLETE])
    writers = {
        "results.json": lambda tmp: Path(tmp).write_text(json.dumps(results, indent=1)),
        "table.txt": lambda tmp: Path(tmp).write_text(format_table(results) + "\n"),
        "compare.png": lambda tmp: save_plot(results, tmp),
    }
    for name in OUTPUTS:
        replace_atomically(paths[name], writers[name])
    digests = {name: hashlib.sha256(Path(paths[name]).read_bytes()).hexdigest() for name in OUTPUTS}
    replace_atomically(paths[COMPLETE], lambda tmp: Path(tmp).write_text(json.dumps({"files": digests}, indent=1)))
    return paths
