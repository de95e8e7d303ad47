"""The finetune job's results: the recovered-% summary, the table, the plot, the model card, the files.

``write_outputs`` writes ``results.json``, ``table.txt``, ``finetune.png`` and ``README.md`` (a
short model card) into the output directory, each through ``replace_atomically``.
"""

import dataclasses
import json
import math
import os
import time
from pathlib import Path

from mixle._optional import require
from mixle.lm.finetune_chat import answers_markdown
from mixle.lm.report import MIN_DEGRADATION, plot_training_curve

__all__ = ["FLOAT", "PTQ", "PTQ_IMATRIX", "GPTQ", "QAT", "QAT_IMATRIX", "BASELINES", "TRAINED", "GGUF_FILE",
           "COMPRESSED_DIR", "OUTPUTS", "summarize", "format_table", "save_plot", "model_card", "write_outputs",
           "finish_run"]

FLOAT, PTQ, QAT = "float", "PTQ", "QAT"
PTQ_IMATRIX, GPTQ = "PTQ imatrix", "GPTQ"  # the calibrated baselines (mixle.lm.finetune_baselines)
QAT_IMATRIX = "QAT imatrix"  # QAT fake-quantized with the importance matrix
BASELINES = (PTQ, PTQ_IMATRIX, GPTQ)  # the rows QAT's recovered share is stated against
TRAINED = (QAT, QAT_IMATRIX)
GGUF_FILE = "model.gguf"
COMPRESSED_DIR = "compressed-tensors"
OUTPUTS = ("results.json", "table.txt", "finetune.png", "README.md")
# (key prefix, label) of each measure: mixle's and llama.cpp's, on the held-out split and on --eval-data;
# llama.cpp's on the windows' token ids and on their text, which llama.cpp tokenizes itself ("text").
MEASURES = (("", "held-out"), ("llama_cpp_", "held-out, llama.cpp"), ("llama_cpp_text_", "held-out text, llama.cpp"),
            ("eval_data_", "eval data"), ("eval_data_llama_cpp_", "eval data, llama.cpp"),
            ("eval_data_llama_cpp_text_", "eval data text, llama.cpp"))


def _row(rows, methods):
    return next(r for r in rows if r["method"] in methods)


def _recovered(base, baseline, qat):
    """``(L_baseline - L_qat) / (L_baseline - L_float)`` in percent; None when the baseline loses less
    than ``MIN_DEGRADATION``."""
    lost = baseline - base
    return None if lost < MIN_DEGRADATION else 100 * (baseline - qat) / lost


def summarize(rows):
    """Per measure: each baseline's and QAT's perplexity increase over float, and the share QAT recovers.

    ``recovered = (L_ptq - L_qat) / (L_ptq - L_float)`` in held-out loss (nats per token); None
    when PTQ loses less than ``MIN_DEGRADATION``, where the ratio would be noise. The top-level
    keys are against the plain PTQ row; ``baselines`` states it against each baseline row present
    (``PTQ``, ``PTQ imatrix``, ``GPTQ``), and ``qat`` names the trained row.

    >>> rows = [{"method": "float", "loss": 1.0}, {"method": "PTQ", "loss": 1.2}, {"method": "PTQ imatrix",
    ...         "loss": 1.1}, {"method": "QAT", "loss": 1.02}]
    >>> s = summarize(rows)["held-out"]
    >>> round(s["recovered_percent"], 6), round(s["baselines"]["PTQ imatrix"]["recovered_percent"], 6)
    (90.0, 80.0)
    """
    summary = {}
    base, ptq, qat = _row(rows, (FLOAT,)), _row(rows, (PTQ,)), _row(rows, TRAINED)
    baselines = [r for r in rows if r["method"] in BASELINES]
    for key, label in MEASURES:
        name = f"{key}loss"
        if not all(name in r for r in (base, ptq, qat)):
            continue
        summary[label] = {
            "ptq_perplexity_increase_percent": 100 * math.expm1(ptq[name] - base[name]),
            "qat_perplexity_increase_percent": 100 * math.expm1(qat[name] - base[name]),
            "recovered_percent": _recovered(base[name], ptq[name], qat[name]),
            "qat": qat["method"],
            "baselines": {r["method"]: {"perplexity_increase_percent": 100 * math.expm1(r[name] - base[name]),
                                        "recovered_percent": _recovered(base[name], r[name], qat[name])}
                          for r in baselines if name in r},
        }
    return summary


def _cell(row, key):
    value = row.get(f"{key}perplexity")
    return f"{value:>12.4f}" if value is not None else f"{'-':>12}"


def format_table(results):
    """The rows (float, PTQ, QAT) as a plain-text table of perplexities, and the summary lines.

    >>> rows = [{"method": m, "loss": l, "perplexity": math.exp(l)} for m, l in (("float", 1.0), ("PTQ", 1.2),
    ...         ("QAT", 1.02))]
    >>> results = {"rows": rows, "summary": summarize(rows), "config": {"target": "q4_0"},
    ...            "data": {"predicted_tokens": 256, "source": "t.txt"}}
    >>> print(format_table(results))  # doctest: +NORMALIZE_WHITESPACE
    method       held-out
    ---------------------
    float          2.7183
    PTQ            3.3201
    QAT            2.7732
    <BLANKLINE>
    held-out: PTQ +22.14%, QAT +2.02% perplexity vs float: QAT recovers 90.0% of what PTQ loses
    held-out: 256 tokens of t.txt; target q4_0
    """
    rows = results["rows"]
    keys = [(key, label) for key, label in MEASURES if any(f"{key}perplexity" in r for r in rows)]
    width = max(9, *(len(r["method"]) + 2 for r in rows))
    header = f"{'method':<{width}}" + "".join(f"{label:>{max(12, len(label) + 2)}}" for _, label in keys)
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(f"{row['method']:<{width}}" + "".join(
            _cell(row, key).rjust(max(12, len(label) + 2)) for key, label in keys))
    lines.append("")
    for label, entry in results["summary"].items():
        qat = entry.get("qat", QAT)
        against = entry.get("baselines") or {PTQ: {"perplexity_increase_percent":
                                                   entry["ptq_perplexity_increase_percent"],
                                                   "recovered_percent": entry["recovered_percent"]}}
        for method, versus in against.items():
            recovered = versus["recovered_percent"]
            what = (f"{method} loses nothing measurable" if recovered is None else
                    f"{qat} recovers {recovered:.1f}% of what {method} loses")
            lines.append(f"{label}: {method} {versus['perplexity_increase_percent']:+.2f}%, {qat} "
                         f"{entry['qat_perplexity_increase_percent']:+.2f}% perplexity vs float: {what}")
    data = results["data"]
    lines.append(f"held-out: {data['predicted_tokens']:,} tokens of {data['source']}; target {results['config']['target']}")
    lines += _text_lines(results)
    timing = results.get("training", {}).get("step_timing")
    if timing:
        lines.append(f"step: QAT {timing['qat_ms']:.1f} ms, float {timing['float_ms']:.1f} ms ({timing['ratio']:.2f}x; "
                     f"medians of {timing['steps']} each, interleaved, {timing['tokens']:,} tokens a step, "
                     f"{timing['devices']})")
    return "\n".join(lines)


def _text_lines(results):
    """How llama.cpp tokenized the windows' text with the written files, beside the model's tokenizer."""
    text, lines = (results.get("llama_cpp") or {}).get("text") or {}, []
    for key, label in (("", "held-out text"), ("eval_data_", "eval data text")):
        seen = text.get(key.rstrip("_") or "held_out")
        row = next((r for r in results["rows"] if f"{key}llama_cpp_text_tokens" in r), None)
        if seen and row:
            tokens, same = row[f"{key}llama_cpp_text_tokens"], row[f"{key}llama_cpp_text_same_tokens"]
            lines.append(f"{label}: llama.cpp split it into {tokens:,} tokens (the model's tokenizer: "
                         f"{seen['model_tokenizer_tokens']:,}), {same} of {seen['windows']} windows into the same ids")
    return lines


def _plot_curve(axis, results):
    """The held-out loss of the training curve and, on a second axis, the training objective."""
    curve, config = results["curve"], results["config"]
    objective = config.get("objective", "ce")
    held = {"step": [], "train_loss": [], "eval_step": curve["eval_step"], "held_out_loss": curve["held_out_loss"]}
    plot_training_curve(axis, held, "held-out cross-entropy (fake-quant)")
    axis.set_xlabel("training step")
    axis.set_ylabel("held-out loss (nats/token)")
    twin = axis.twinx()
    twin.plot(curve["step"], curve["train_loss"], color="grey", alpha=0.5, linewidth=1,
              label=f"training objective ({objective})")
    twin.set_ylabel(f"training objective ({objective}, nats/token)")
    axis.set_title(f"QAT for {config['target']}", fontsize=10)
    lines = axis.get_legend_handles_labels(), twin.get_legend_handles_labels()
    axis.legend(lines[0][0] + lines[1][0], lines[0][1] + lines[1][1], fontsize=8)


def save_plot(results, path):
    """Write a PNG: the training curve, and the float / PTQ / QAT perplexities (mixle and llama.cpp).

    >>> import os, tempfile
    >>> curve = {"step": [1, 2], "train_loss": [2.0, 1.5], "eval_step": [0, 2], "held_out_loss": [2.1, 1.6]}
    >>> rows = [{"method": m, "perplexity": p} for m, p in (("float", 4.0), ("PTQ", 5.0), ("QAT", 4.2))]
    >>> path = save_plot({"curve": curve, "rows": rows, "config": {"target": "q4_0"}},
    ...                  os.path.join(tempfile.mkdtemp(), "plot.png"))
    >>> open(path, "rb").read(4)
    b'\\x89PNG'
    """
    require("matplotlib", extra="bench", purpose="the finetune plot")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5))
    left, right = fig.subplots(1, 2)
    _plot_curve(left, results)
    rows = results["rows"]
    keys = [(key, label) for key, label in MEASURES if all(f"{key}perplexity" in r for r in rows)]
    width = 0.8 / max(1, len(keys))
    for i, (key, label) in enumerate(keys):
        xs = [j + (i - (len(keys) - 1) / 2) * width for j in range(len(rows))]
        bars = right.bar(xs, [r[f"{key}perplexity"] for r in rows], width, label=label)
        right.bar_label(bars, fmt="%.2f", fontsize=7, rotation=90, padding=2)  # side by side: upright, they overlap
    values = [r[f"{key}perplexity"] for key, _ in keys for r in rows]
    low, high = min(values), max(values)
    right.set_ylim(max(0.0, low - 0.5 * (high - low) - 1e-3), high + 0.4 * (high - low) + 1e-3)
    right.set_xticks(range(len(rows)), [r["method"] for r in rows])
    right.set_ylabel("perplexity (lower is better)")
    right.set_title("perplexity of each row", fontsize=10)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    return path


def _generated_words(data):
    generated = data.get("generated")
    return f" and {generated['tokens']:,} tokens the float model sampled itself" if generated else ""


def model_card(results):
    """A short ``README.md`` for the output directory: base model, data, target, steps, the numbers.

    >>> rows = [{"method": m, "loss": l, "perplexity": math.exp(l)} for m, l in (("float", 1.0), ("PTQ", 1.2),
    ...         ("QAT", 1.02))]
    >>> card = model_card({"rows": rows, "summary": summarize(rows), "config": {"target": "q4_0", "objective": "kl",
    ...     "lr": 2e-5, "batch_size": 4, "block": 128, "accumulate": 1, "lora": None}, "data": {"predicted_tokens": 256,
    ...     "source": "t.txt", "train_tokens": 1000}, "model": {"source": "m", "class": "LlamaForCausalLM",
    ...     "parameters": 10}, "training": {"steps_done": 5, "seconds": 3.0}, "files": {"gguf": "model.gguf"}})
    >>> card.splitlines()[0]
    '# m, quantization-aware fine-tuned for q4_0'
    """
    config, data, model, training = results["config"], results["data"], results["model"], results["training"]
    objective = {"kl": f"distillation from the float model (KL, T = {config.get('temperature', 1.0):g})",
                 "ce": "next-token cross-entropy",
                 "mix": "cross-entropy mixed with distillation"}.get(config["objective"], config["objective"])
    lines = [f"# {model['source']}, quantization-aware fine-tuned for {config['target']}", "",
             f"Base model: `{model['source']}` ({model['class']}, {model['parameters']:,} parameters).",
             f"Trained by `python -m mixle finetune` for {training['steps_done']} steps "
             f"({training['seconds']:.0f} s) of {config['accumulate']} x {config['batch_size']} windows of "
             f"{config['block']} tokens on {data['source']}{_generated_words(data)} ({data['train_tokens']:,} "
             f"training tokens), objective: "
             f"{objective}, AdamW at lr {config['lr']:g} with warm-up and cosine decay"
             + (f", LoRA rank {config['lora']} (merged and requantized)" if config.get("lora") else "") + ".", "",
             "## Files", ""]
    for kind, name in results["files"].items():
        usage = {"gguf": f"llama.cpp: `llama-cli -m {name}`",
                 "compressed_tensors": f"transformers / vLLM: `AutoModelForCausalLM.from_pretrained('{name}')`",
                 "imatrix": f"the importance matrix (llama.cpp's format: `llama-quantize --imatrix {name}`)",
                 "ptq_imatrix": "the PTQ imatrix baseline (llama-quantize --imatrix of the float model)",
                 "gptq": "the GPTQ baseline",
                 "hf": f"the QAT model's float32 weights, a transformers checkpoint: "
                       f"`AutoModelForCausalLM.from_pretrained('{name}')`"}
        lines.append(f"- `{name}`: {usage.get(kind, kind)}")
    lines += _llama_cpp_recipe_lines(results.get("hf"))
    imatrix = results.get("imatrix")
    if imatrix:
        source = (f"calibrated on {imatrix['windows']} windows ({imatrix['tokens']:,} tokens) of the training split, "
                  f"never the held-out text" if imatrix["mode"] == "calibrate" else f"read from `{imatrix['file']}`")
        lines += ["", f"Importance matrix: {source}; QAT trained "
                  + ("with it (the weighted search, as llama-quantize --imatrix)." if imatrix["qat"] else
                     "on the reference quantizer (--no-qat-imatrix).")]
    lines += ["", "## Held-out perplexity", "", "```", format_table(results), "```", ""]
    answers = answers_markdown(results["rows"])
    return "\n".join(lines + ([answers] if answers else []))


def _llama_cpp_recipe_lines(hf):
    """The model card's paragraph on rebuilding the trained blocks from ``hf/`` with llama.cpp's own tools."""
    recipe = (hf or {}).get("llama_cpp") or {}
    if "convert" not in recipe:
        return [] if not recipe else ["", f"`{hf['directory']}` and llama.cpp: {recipe['why']}."]
    return ["", f"llama.cpp's own tools make the trained blocks from `{hf['directory']}` (convert_hf_to_gguf.py "
                f"from llama.cpp's source tree; F32 keeps every trained value, and llama-quantize's blocks of them "
                f"are the ones QAT trained):", "", "```", " ".join(recipe["convert"]), " ".join(recipe["quantize"]),
            "```"]


def write_outputs(results, out_dir):
    """Write ``results.json``, ``table.txt``, ``finetune.png`` and ``README.md`` into ``out_dir``, atomically each.

    Returns:
        ``{name: path}`` of the files.

    >>> write_outputs  # doctest: +ELLIPSIS
    <function write_outputs at ...>
    """
    from mixle.core.fileformat import replace_atomically

    paths = {name: os.path.join(out_dir, name) for name in OUTPUTS}
    writers = {
        "results.json": lambda tmp: Path(tmp).write_text(json.dumps(results, indent=1)),
        "table.txt": lambda tmp: Path(tmp).write_text(format_table(results) + "\n"),
        "finetune.png": lambda tmp: save_plot(results, tmp),
        "README.md": lambda tmp: Path(tmp).write_text(model_card(results)),
    }
    for name in OUTPUTS:
        replace_atomically(paths[name], writers[name])
    return paths


def _training_info(state, config):
    tokens_per_step = config.batch_size * config.block * config.accumulate
    return {"steps_done": state.step, "steps_planned": state.horizon, "stopped_by": state.stopped_by,
            "seconds": round(state.seconds, 2), "tokens": state.tokens,
            "seconds_per_step": state.seconds / max(1, state.step),
            "tokens_per_second": tokens_per_step * state.step / max(1e-9, state.seconds),
            **({} if state.step_timing is None else {"step_timing": state.step_timing})}


def finish_run(config, run, rows, row, files, state, model_info, environment, began, hf=None):
    """Write the results of a finished run (``write_outputs``), remove its checkpoint; returns the results.

    Args:
        config: the run's ``FinetuneConfig``; run: its ``FinetuneRun``.
        rows: the rows before training; row: the QAT row; files: ``{kind: file}`` written.
        state: the loop's ``TrainState``; model_info: the model's entries of ``results["model"]``.
        environment: the run's ``results["environment"]`` so far; began: ``time.perf_counter()`` at its start.
        hf: what ``finetune_hf.write_hf_checkpoint`` wrote (the transformers checkpoint), or None.

    >>> finish_run  # doctest: +ELLIPSIS
    <function finish_run at ...>
    """
    imatrix, kept = run.baseline_info(rows)
    results = {
        "config": dataclasses.asdict(config),
        "model": {**run.loaded.info, **model_info},
        "data": run.data.info,
        "rows": [*rows, row],
        "summary": summarize([*rows, row]),
        "training": _training_info(state, config),
        "curve": state.curve,
        "files": {**files, **kept},
        "imatrix": imatrix,
        "hf": hf,
        "llama_cpp": run.evaluator.llama_cpp_info,
        "environment": {**environment, "total_seconds": round(time.perf_counter() - began, 2),
                        "peak_memory_bytes": run.peaks.total(), "peak_memory_by_phase": run.peaks.phases,
                        "seconds_by_phase": run.peaks.seconds},
    }
    write_outputs(results, run.out)
    if run.checkpoint_path.exists():
        os.remove(run.checkpoint_path)
    return results
