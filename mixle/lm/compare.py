"""The main job: train a causal LM in fp32, then compare PTQ, fine-tune + PTQ and QAT at int4/int8.

Every training phase is a ``GradLeaf`` M-step on windows of the training text
(``mixle.lm.training``); every quantized model is evaluated as real integer weights
(``quantize_model`` for PTQ, ``convert`` for QAT) on the same held-out windows, and its size is
the real bytes of those weights.

The llama.cpp rows (``gguf``) compare QAT on ``grid="q4_0"`` with a fine-tune followed by PTQ
into Q4_0 (what ``llama-quantize --pure`` does to a float model: ggml's reference Q4_0 of every
matrix), both written with ``save_gguf`` and evaluated from the file's weights: read back with
gguf-py, dequantized with gguf's code and put into a float copy of the model
(``load_gguf_weights``), then run by mixle's forward (and by llama.cpp itself when
llama-cpp-python is installed; ``mixle.lm.llama_cpp_eval``). llama.cpp's ``gpt2`` graph computes
tanh-approximated GELU, so both start from the fp32 checkpoint with its blocks switched to
``activation="gelu_tanh"`` and get their own fp32 fine-tune baseline.

The mix rows (``config.gguf_mixes``, default ``Q4_K_M``) do the same for a llama.cpp mix, on the
same tanh-GELU fp32 fine-tune: PTQ is that fine-tune as ``llama-quantize`` writes it in the mix
(``save_gguf(gguf_mix=...)``, bit-identical to llama.cpp's quantizer: every tensor on the block type
llama.cpp picks, with its fallbacks for rows that 256 does not divide), QAT trains on
``apply_qat(gguf_mix=...)``; both are evaluated from their files, and in llama.cpp.

The strong PTQ baselines (``config.gptq``, ``config.imatrix``) calibrate on
``config.calibration_windows`` windows of the training text, never the held-out text
(``mixle.lm.windows.calibration_windows``; no random draw, so every other row is as without them):
fine-tune + GPTQ at each width (``gptq_quantize`` of the fp32 fine-tune, beside its
round-to-nearest PTQ), and after the Q4_0 rows and each mix's, the imatrix rows: PTQ with the
importance matrix of the tanh-GELU fine-tune (``calibrate_importance``, then
``quantize_model(importance=)``: ``llama-quantize --imatrix``'s file) and QAT with the importance
of the checkpoint it starts from (``apply_qat(importance=)``, trained like the plain GGUF QAT row),
both evaluated from their files. The summary measures each QAT row against each PTQ row it can be
compared with (``mixle.lm.report.comparisons``).

The config is ``mixle.lm.config``, the data ``mixle.lm.windows``, the summary, table, plot and
files ``mixle.lm.report``; their names used by callers of this module are importable from it.
"""

import contextlib
import copy
import dataclasses
import math
import os
import platform
import tempfile
import time
from dataclasses import dataclass

from mixle._optional import require
from mixle.core.spec import QuantSpec
from mixle.lm.config import GGUF_ACTIVATION, GGUF_SPEC, PRESETS, CompareConfig
from mixle.lm.llama_cpp_eval import gguf_loss, llama_cpp_loss, llama_cpp_module, llama_cpp_skipped
from mixle.lm.report import (ACT8_PTQ, ACT8_QAT, FINETUNE, FINETUNE_GPTQ, FINETUNE_PTQ, FP32, GGUF_FINETUNE, GGUF_PTQ,
                             GGUF_PTQ_IMATRIX, GGUF_QAT, GGUF_QAT_IMATRIX, PTQ, QAT, QAT_BOTH, QAT_DISTILL, QAT_LEARNED,
                             gguf_mix_ptq, gguf_mix_ptq_imatrix, gguf_mix_qat, gguf_mix_qat_imatrix, summarize)
from mixle.lm.training import held_out_loss, train, warmup_cosine
from mixle.lm.windows import calibration_batches, calibration_windows, data_key, prepare_data

# The names callers import from here, where they lived before the job was split into modules.
from mixle.lm.report import (ACT8_METHODS, COMPLETE, GGUF_METHODS, MIN_DEGRADATION, OPTION_METHODS,  # noqa: F401
                             OUTPUTS, check_out_dir, format_table, save_plot, write_outputs)
from mixle.lm.training import window_density  # noqa: F401
from mixle.lm.windows import CompareData, held_out_windows  # noqa: F401

__all__ = ["CompareConfig", "PRESETS", "ExternalQAT", "CompareRun", "run_compare", "format_table", "save_plot",
           "write_outputs", "check_out_dir", "prepare_data", "held_out_loss", "held_out_windows", "warmup_cosine",
           "MIN_DEGRADATION"]


@dataclass(frozen=True)
class ExternalQAT:
    """Another library's QAT, trained and evaluated exactly like mixle's in ``run_compare``.

    Attributes:
        name: the method name in the table (e.g. ``"torchao QAT"``).
        bits: its integer width.
        prepare: ``f(model) -> model`` preparing a copy of the fp32 checkpoint for QAT.
        to_float: ``f(trained) -> CausalLM`` with the trained float weights, which
            ``quantize_model(·, spec)`` turns into the real int model that is evaluated.
        spec: the QuantSpec reproducing that library's integer grid.
    """

    name: str
    bits: int
    prepare: object
    to_float: object
    spec: QuantSpec


class CompareRun:
    """One comparison run: its config and data, and the rows, curves and timings its phases produce.

    Args:
        config: the run's ``CompareConfig`` (read at every phase, so a caller may replace it
            between phases, e.g. to try other fine-tune settings).
        data: its ``CompareData`` (``prepare_data(config)``).
        progress: show a progress bar per training phase.
        gguf_dir: keep the llama.cpp rows' GGUF files in this existing directory (None: a
            temporary one, removed after evaluation).

    Attributes:
        rows: one dict per evaluated model (method, bits, held-out loss, perplexity, bytes, ...).
        curves, seconds: per training phase, its curves and its training seconds.
        llama_cpp_info: llama-cpp-python's version and settings once llama.cpp evaluated a file;
            ``{"skipped": why}`` while it is installed but crashes here (``llama_cpp_skipped``).
        calibration: what the imatrix and GPTQ rows calibrated on (``calibration_batches``; None
            before any did): the text, windows and tokens, and the importance matrices' counts.

    >>> run = CompareRun(PRESETS["smoke"], prepare_data(PRESETS["smoke"]), progress=False)
    >>> run.build_model().block
    32
    """

    def __init__(self, config, data, progress=True, gguf_dir=None):
        self.config, self.data, self.progress, self.gguf_dir = config, data, progress, gguf_dir
        self.rows, self.curves, self.seconds = [], {}, {}
        self.llama_cpp_info, self.calibration = llama_cpp_skipped(), None
        self._batches = None

    def calibration_batches(self):
        """The calibration batches of the imatrix and GPTQ rows: ``config.calibration_windows`` windows of
        the training text (``mixle.lm.windows.calibration_windows``), never the held-out text."""
        if self._batches is None:
            config = self.config
            self._batches = calibration_batches(calibration_windows(self.data, config.calibration_windows),
                                                config.batch_size)
            self.calibration = {"text": "training (never the held-out text)", "windows": config.calibration_windows,
                                "tokens": config.calibration_windows * config.block}
        return self._batches

    def importance(self, model, which):
        """``calibrate_importance`` of ``model`` on the calibration batches; its counts are recorded
        under ``calibration["imatrix_counts"][which]``."""
        from mixle.api import calibrate_importance

        importance = calibrate_importance(model, self.calibration_batches(), dataset="mixle compare: training windows")
        counts = {path: int(count.sum()) for path, count in importance.counts.items()}
        self.calibration.setdefault("imatrix_counts", {})[which] = counts
        return importance

    def build_model(self):
        """The fp32 model before training: ``build_causal_lm`` of the config's size, seeded by its seed."""
        from mixle.lm.transformer import build_causal_lm

        require("torch", extra="torch", purpose="mixle compare").manual_seed(self.config.seed)
        config = self.config
        return build_causal_lm(self.data.tokenizer.vocab_size, config.d_model, config.n_layer, config.n_head,
                               config.block)

    def train_phase(self, lm, phase, steps, lr, schedule, seed, start, teacher=None, optimizer=None):
        """Train ``lm`` in place (``mixle.lm.training.train``); records its curves and seconds under ``phase``."""
        config, data = self.config, self.data
        log = train(lm, data.train_ids, data.train_starts, steps=steps, lr=lr, batch_size=config.batch_size,
                    block=config.block, schedule=schedule, seed=seed, optimizer=optimizer,
                    grad_clip=float(config.block), teacher=teacher, temperature=config.distill_temperature,
                    weight=config.distill_weight, curve_windows=data.curve_windows, curve_every=config.curve_every,
                    start=start, progress=phase if self.progress else None)
        self.seconds[phase], self.curves[phase] = log.seconds, log.curve
        return lm

    def pretrain(self, lm):
        """The fp32 phase: the config's steps from scratch, warm-up then cosine decay to 10% of ``lr``."""
        config = self.config
        return self.train_phase(lm, FP32, config.steps, config.lr, warmup_cosine(config.warmup, floor=0.1),
                                config.seed, 0)

    def finetune(self, base, phase, prepare=None, distill=False):
        """A fine-tune of a copy of ``base`` (after ``prepare``, e.g. ``apply_qat``); every fine-tune
        sees the same batches in the same order. ``distill``: from ``base``, frozen."""
        model = copy.deepcopy(base)
        if prepare is not None:
            model = prepare(model)
        config = self.config
        schedule = warmup_cosine(max(1, config.finetune_steps // 20), floor=0.0)
        teacher = copy.deepcopy(base) if distill else None  # one extra copy of the model's weights
        optimizer = None
        if any(getattr(m, "spec", None) is not None and m.spec.scale == "learned" for m in model.modules()):
            from mixle.torch_backend.layers.learned_scale import param_groups

            torch = require("torch", extra="torch", purpose="mixle compare")
            scale_lr = config.scale_lr or 10 * config.finetune_lr
            optimizer = lambda params, lr: torch.optim.AdamW(param_groups(model, params, lr, scale_lr))  # noqa: E731
        return self.train_phase(model, phase, config.finetune_steps, config.finetune_lr, schedule,
                                config.seed + 1, config.steps, teacher=teacher, optimizer=optimizer)

    def loss(self, model):
        """``model``'s held-out loss on the run's evaluation windows."""
        return held_out_loss(model, self.data.eval_windows)

    def add(self, method, bits, model, **extra):
        """Evaluate ``model`` and add its row (``extra``: more columns, e.g. ``fake_quant_loss``)."""
        from mixle.api import model_nbytes

        loss = self.loss(model)
        row = {"method": method, "bits": bits, "loss": loss, "perplexity": math.exp(loss),
               "bytes": model_nbytes(model).total, **extra}
        self.rows.append(row)
        return row

    def add_qat(self, method, bits, qat, **extra):
        """The row of a QAT-trained model: evaluated converted to int weights, beside its fake-quant loss."""
        from mixle.api import convert

        fake = self.loss(qat)
        return self.add(method, bits, convert(qat), fake_quant_loss=fake, **extra)


def _option_runs(config):
    """``(method, bits, spec, distill)`` of the optional QAT variants ``config`` asks for."""
    runs = []
    for bits in config.bits:
        learned = config.spec(bits).replace(scale="learned")
        if config.learned_scales:
            runs.append((QAT_LEARNED, bits, learned, False))
        if config.distill:
            runs.append((QAT_DISTILL, bits, config.spec(bits), True))
        if config.distill and config.learned_scales:
            runs.append((QAT_BOTH, bits, learned, True))
    return runs


def _fp32_rows(run):
    """Train fp32 from scratch; its row and its PTQ rows. Returns the fp32 checkpoint."""
    from mixle.api import quantize_model

    lm = run.pretrain(run.build_model())
    run.add(FP32, 32, lm)
    for bits in run.config.bits:
        run.add(PTQ, bits, quantize_model(lm, run.config.spec(bits)))
    return lm


def _finetune_rows(run, lm):
    """The fp32 fine-tune and its PTQ rows; returns the fine-tuned model."""
    from mixle.api import quantize_model

    tuned = run.finetune(lm, FINETUNE)
    run.add(FINETUNE, 32, tuned)
    for bits in run.config.bits:
        run.add(FINETUNE_PTQ, bits, quantize_model(tuned, run.config.spec(bits)))
    if run.config.gptq:  # after the round-to-nearest rows: theirs stay as they were
        from mixle.api import gptq_quantize

        for bits in run.config.bits:
            spec = run.config.spec(bits)
            run.add(FINETUNE_GPTQ, bits, gptq_quantize(tuned, run.calibration_batches(), spec), spec=spec.short(),
                    calibration_tokens=run.calibration["tokens"])
    return tuned


def _qat_rows(run, lm):
    """QAT at each width, then the optional variants (learned scales, distillation, both)."""
    from mixle.api import apply_qat

    config = run.config
    for bits in config.bits:
        qat = run.finetune(lm, f"QAT int{bits}", lambda m, b=bits: apply_qat(m, spec=config.spec(b)))
        run.add_qat(QAT, bits, qat)
    for method, bits, spec, distill in _option_runs(config):
        qat = run.finetune(lm, f"{method} int{bits}", lambda m, s=spec: apply_qat(m, spec=s), distill=distill)
        run.add_qat(method, bits, qat)


def _act8_rows(run, lm, tuned):
    """8da4w: the fine-tuned model's PTQ on that spec, and QAT on it."""
    from mixle.api import apply_qat, quantize_model

    spec = run.config.act8_spec()
    run.add(ACT8_PTQ, 4, quantize_model(tuned, spec), spec=spec.short())
    qat = run.finetune(lm, ACT8_QAT, lambda m: apply_qat(m, spec=spec))
    run.add_qat(ACT8_QAT, 4, qat, spec=spec.short())


def _external_rows(run, lm, external):
    """Each ``ExternalQAT``, trained like mixle's QAT and evaluated as real int weights of its spec."""
    from mixle.api import quantize_model

    for ext in external:
        trained = run.finetune(lm, ext.name, ext.prepare)
        fake = run.loss(trained)
        run.add(ext.name, ext.bits, quantize_model(ext.to_float(trained), ext.spec),
                fake_quant_loss=fake, spec=ext.spec.short())


def _gguf_rows(run, lm):
    """The llama.cpp rows: fp32 fine-tune, its PTQ into Q4_0 and QAT on q4_0, the last two from their files."""
    from mixle.api import apply_qat, quantize_model

    base = copy.deepcopy(lm)
    for block in base.blocks:  # the GELU llama.cpp's gpt2 graph computes
        block.activation = GGUF_ACTIVATION
    tuned = run.finetune(base, GGUF_FINETUNE)
    row = run.add(GGUF_FINETUNE, 32, tuned)
    with _gguf_folder(run.gguf_dir) as folder:
        if llama_cpp_module() is not None or run.gguf_dir is not None:  # the float model as an F32 file
            from mixle.gguf.writer import save_gguf

            path = os.path.join(folder, "fp32.gguf")
            save_gguf(tuned, path, tokenizer=run.data.tokenizer, float_matrices="f32")
            _add_llama_cpp_loss(run, row, path)  # llama.cpp's own baseline
        _add_from_gguf(run, GGUF_PTQ, quantize_model(tuned, GGUF_SPEC), base, folder)
        qat = run.finetune(base, GGUF_QAT, lambda m: apply_qat(m, spec=GGUF_SPEC))
        _add_from_gguf(run, GGUF_QAT, qat, base, folder, fake_quant_loss=run.loss(qat))
        importances = None
        if run.config.imatrix:  # after the rows they extend: those stay as they were
            importances = (run.importance(tuned, GGUF_FINETUNE), run.importance(base, "fp32 (tanh GELU)"))
            _imatrix_rows(run, (GGUF_PTQ_IMATRIX, GGUF_QAT_IMATRIX), tuned, base, folder, importances)
        for mix in run.config.gguf_mixes:  # after the q4_0 rows: theirs stay as they were
            _mix_rows(run, mix, tuned, base, folder, importances)


def _mix_rows(run, mix, tuned, base, folder, importances=None):
    """A llama.cpp mix: the fp32 fine-tune as llama-quantize writes it (PTQ) vs QAT on the mix, from their files.

    ``save_gguf(tuned, gguf_mix=mix)`` quantizes each float matrix to the block type llama.cpp's
    quantizer gives it, bit for bit as it does; ``apply_qat(gguf_mix=mix)`` trains each on that type.
    ``importances`` (of ``tuned``, of ``base``): then the mix's imatrix rows follow (``_imatrix_rows``).
    """
    from mixle.api import apply_qat

    _add_from_gguf(run, gguf_mix_ptq(mix), tuned, base, folder, gguf_mix=mix)
    qat = run.finetune(base, gguf_mix_qat(mix), lambda m: apply_qat(m, gguf_mix=mix))
    _add_from_gguf(run, gguf_mix_qat(mix), qat, base, folder, gguf_mix=mix, fake_quant_loss=run.loss(qat))
    if importances is not None:
        _imatrix_rows(run, (gguf_mix_ptq_imatrix(mix), gguf_mix_qat_imatrix(mix)), tuned, base, folder, importances,
                      gguf_mix=mix)


def _imatrix_rows(run, names, tuned, base, folder, importances, gguf_mix=None):
    """PTQ with an importance matrix and QAT with one, on Q4_0 (``gguf_mix=None``) or a mix, from their files.

    PTQ: ``quantize_model(tuned, importance=)`` with ``tuned``'s importance (what ``llama-quantize
    --imatrix`` writes of it); QAT: ``apply_qat(importance=)`` with the importance of ``base``, the
    checkpoint it starts from, fixed while it trains, on the plain GGUF QAT row's steps and batches.
    Both importances come from the training windows only (``CompareRun.calibration_batches``).
    """
    from mixle.api import apply_qat, quantize_model

    ptq_name, qat_name = names
    tuned_importance, base_importance = importances
    target = {"spec": GGUF_SPEC} if gguf_mix is None else {"gguf_mix": gguf_mix}
    tokens = {"calibration_tokens": run.calibration["tokens"]}
    _add_from_gguf(run, ptq_name, quantize_model(tuned, importance=tuned_importance, **target), base, folder,
                   gguf_mix=gguf_mix, importance=tuned_importance, **tokens)
    qat = run.finetune(base, qat_name, lambda m: apply_qat(m, importance=base_importance, **target))
    _add_from_gguf(run, qat_name, qat, base, folder, gguf_mix=gguf_mix, importance=base_importance,
                   fake_quant_loss=run.loss(qat), **tokens)


def _add_from_gguf(run, method, model, template, folder, gguf_mix=None, importance=None, **extra):
    """A row evaluated from ``model``'s GGUF file: its weights read back into ``template``'s float copy.

    ``bytes`` is the file's tensor data; with llama-cpp-python installed the file is also run by
    llama.cpp on the same held-out windows (``llama_cpp_loss``). ``gguf_mix``: written in that
    llama.cpp mix (the row records it and the file's quantized tensor types); ``importance``: with a
    mix, the importance ``model`` was quantized or trained with (the mix's types with an imatrix).
    """
    path = os.path.join(folder, method.replace(" ", "_").replace("(", "").replace(")", "") + ".gguf")
    result = gguf_loss(model, template, path, run.data.eval_windows, tokenizer=run.data.tokenizer, gguf_mix=gguf_mix,
                       importance=importance if gguf_mix is not None else None)
    row = {"method": method, "bits": 4, "loss": result.loss, "perplexity": math.exp(result.loss),
           "bytes": result.nbytes, "spec": GGUF_SPEC.short() if gguf_mix is None else gguf_mix, **extra}
    if gguf_mix is not None:
        row.update(gguf_mix=gguf_mix, tensor_types=result.types)
    _add_llama_cpp_loss(run, row, path)
    run.rows.append(row)
    return row


def _add_llama_cpp_loss(run, row, path):
    """With llama-cpp-python installed: ``row``'s loss and perplexity from the file run by llama.cpp, and
    how far that perplexity is from mixle's of the same weights (``llama_cpp_vs_mixle_percent``)."""
    cpp = llama_cpp_loss(path, run.data.eval_windows, run.config.threads)
    if cpp is not None:
        row["llama_cpp_loss"], run.llama_cpp_info = cpp
        row["llama_cpp_perplexity"] = math.exp(row["llama_cpp_loss"])
        row["llama_cpp_vs_mixle_percent"] = 100 * math.expm1(row["llama_cpp_loss"] - row["loss"])


@contextlib.contextmanager
def _gguf_folder(kept):
    """``kept`` (an existing directory, checked by ``run_compare``), or a temporary directory removed afterwards."""
    if kept is None:
        with tempfile.TemporaryDirectory(prefix="mixle-gguf-") as folder:
            yield folder
    else:
        yield os.fspath(kept)


@contextlib.contextmanager
def _torch_threads(torch, threads):
    """Use ``threads`` torch CPU threads meanwhile (None: leave the setting); yields the previous count."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield previous
    finally:
        torch.set_num_threads(previous)


def _data_for(config, data):
    """``data`` checked against ``config``, or ``prepare_data(config)`` when it is None."""
    if data is None:
        return prepare_data(config)
    if data.key != data_key(config):
        raise ValueError("data was prepared for another corpus, split, seed or block: "
                         "build it with prepare_data(config) for this config")
    return data


def _results(run, lm, external, torch, threads, total):
    """The JSON-ready result of a finished run (see ``run_compare``)."""
    from mixle.api import model_nbytes

    return {
        "config": dataclasses.asdict(run.config),
        "environment": {"python": platform.python_version(), "torch": torch.__version__, "threads": threads,
                        "platform": platform.platform(), "total_seconds": round(total, 2)},
        "data": run.data.info,
        "model": {"parameters": sum(p.numel() for p in lm.parameters()), "fp32_bytes": model_nbytes(lm).total},
        "rows": run.rows,
        "summary": summarize(run.rows, run.config.bits, [e.name for e in external if e.spec.act_bits is None],
                             [e.name for e in external if e.spec.act_bits is not None]),
        "llama_cpp": run.llama_cpp_info,
        "calibration": run.calibration,
        "curves": run.curves,
        "seconds": run.seconds,
    }


def run_compare(config=None, *, data=None, progress=True, external=(), gguf_dir=None):
    """Train fp32, then compare PTQ, fine-tune + PTQ and QAT at each of ``config.bits``.

    Args:
        config: a CompareConfig (default: ``PRESETS["default"]``).
        data: ``prepare_data(config)`` if already built (else it is built here).
        progress: show a tqdm bar per training phase.
        external: ``ExternalQAT`` entries (e.g. torchao) run like mixle's QAT.
        gguf_dir: keep the llama.cpp rows' GGUF files in this existing directory (default: a
            temporary directory, removed when they are evaluated).

    Returns:
        A JSON-ready dict: ``config``, ``environment``, ``data``, ``model``, ``rows`` (method,
        bits, held-out loss, perplexity, real bytes), ``summary`` per bit width (recovered %),
        ``curves`` per phase and ``seconds`` per phase.

    >>> config = PRESETS["smoke"].replace(steps=2, finetune_steps=2, bits=(4,), eval_windows=2, gguf=False)
    >>> [row["method"] for row in run_compare(config, progress=False)["rows"]]
    ['fp32', 'PTQ', 'fp32 fine-tune', 'fine-tune + PTQ', 'fine-tune + GPTQ', 'QAT']
    """
    config = PRESETS["default"] if config is None else config
    if not isinstance(config, CompareConfig):
        raise TypeError(f"config must be a CompareConfig, got {type(config).__name__}")
    torch = require("torch", extra="torch", purpose="mixle compare")
    if config.gguf:
        require("gguf", extra="gguf", purpose="the llama.cpp rows of mixle compare (or pass gguf=False / --no-gguf)")
    if gguf_dir is not None and not os.path.isdir(gguf_dir):
        raise ValueError(f"gguf_dir={os.fspath(gguf_dir)!r} is not a directory: create it first, or pass None")
    with _torch_threads(torch, config.threads) as previous_threads:
        run = CompareRun(config, _data_for(config, data), progress, gguf_dir)
        if config.gptq or (config.gguf and config.imatrix):  # refused before any training
            calibration_windows(run.data, config.calibration_windows)
        began = time.perf_counter()
        lm = _fp32_rows(run)
        tuned = _finetune_rows(run, lm)
        _qat_rows(run, lm)
        if config.act8:
            _act8_rows(run, lm, tuned)
        if config.gguf:
            _gguf_rows(run, lm)
        _external_rows(run, lm, external)
        total = time.perf_counter() - began
    return _results(run, lm, external, torch, config.threads or previous_threads, total)
