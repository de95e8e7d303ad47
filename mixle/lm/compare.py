"""The main job: train a causal LM in fp32, then compare PTQ, fine-tune + PTQ and QAT at int4/int8.

Every training phase is a ``GradLeaf`` M-step on windows of the training text; every quantized
model is evaluated as real integer weights (``quantize_model`` for PTQ, ``convert`` for QAT)
on the same held-out windows, and its size is the real bytes of those weights.

The llama.cpp rows (``gguf``) compare QAT on ``grid="q4_0"`` with a fine-tune followed by PTQ
into Q4_0 (what ``llama-quantize --pure`` does to a float model: ggml's reference Q4_0 of every
matrix), both written with ``save_gguf`` and evaluated from the file's weights: read back with
gguf-py, dequantized with gguf's code and put into a float copy of the model
(``load_gguf_weights``), then run by mixle's forward (and by llama.cpp itself when
llama-cpp-python is installed). llama.cpp's ``gpt2`` graph computes tanh-approximated GELU, so
both start from the fp32 checkpoint with its blocks switched to ``activation="gelu_tanh"`` and get
their own fp32 fine-tune baseline.
"""

import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mixle._optional import require
from mixle.core.spec import SUPPORTED_BITS, QuantSpec

__all__ = ["CompareConfig", "PRESETS", "ExternalQAT", "run_compare", "format_table", "save_plot",
           "write_outputs", "check_out_dir", "prepare_data", "held_out_loss", "held_out_windows", "warmup_cosine", "MIN_DEGRADATION"]

# Below this loss increase (nats per token, ~0.5% perplexity) PTQ has nothing left to recover.
MIN_DEGRADATION = 0.005

# The llama.cpp rows: llama.cpp's Q4_0 grid, and the activation its gpt2 graph computes.
GGUF_SPEC = QuantSpec(grid="q4_0")
GGUF_ACTIVATION = "gelu_tanh"


@dataclass(frozen=True, kw_only=True)
class CompareConfig:
    """Everything that decides a comparison run (validated on construction).

    Args:
        steps: fp32 training steps from scratch.
        finetune_steps: extra steps given to each QAT run and to the fp32 fine-tune baseline.
        bits: the integer widths to compare, a tuple of 4 and/or 8.
        d_model, n_layer, n_head, block: the ``build_causal_lm`` size.
        batch_size: training windows per step.
        lr: peak learning rate of fp32 training (linear warm-up, cosine decay to 10%).
        finetune_lr: peak learning rate of every fine-tune (QAT and fp32 alike), cosine to 0;
            by default the rate fp32 training ends at (10% of ``lr``).
        warmup: warm-up steps of fp32 training (fine-tunes warm up over 5% of their steps).
        group_size, clip_percentile: the QuantSpec options used by PTQ and QAT alike
            (default: per-channel symmetric, no clipping).
        corpus: a UTF-8 text file, or None for the embedded corpus (``mixle.lm.data.default_text``).
        tokenizer: ``"char"`` or ``"byte"``.
        held_out_fraction: share of the text held out for evaluation.
        eval_windows: evaluate on at most this many held-out windows (None: all).
        curve_every, curve_windows: held-out loss on ``curve_windows`` windows every
            ``curve_every`` steps, for the training curves.
        seed: seeds the model initialisation, the split and the batch sampling.
        threads: torch CPU threads (None leaves torch's setting).
        distill: also run QAT with self-distillation from the fp32 checkpoint (``mixle.lm.distill``)
            at ``distill_temperature`` and ``distill_weight``.
        learned_scales: also run QAT with learned scales (``QuantSpec(scale="learned")``), trained
            at ``scale_lr`` (default: 10 x ``finetune_lr``, the best of 1x/10x/30x on a validation
            split of the training text) without weight decay; with ``distill`` also the combination.
        act8: also compare int8-activation int4-weight ("8da4w": asymmetric per-token int8
            activations, int4 symmetric weights in groups of ``act8_group_size``): fine-tune + PTQ
            and QAT on that spec.
        gguf: also the llama.cpp rows (see the module docstring): QAT on ``grid="q4_0"`` vs
            fine-tune + PTQ into Q4_0, evaluated from the GGUF file (needs gguf-py and
            ``d_model`` divisible by 32, Q4_0's block).
    """

    steps: int = 1600
    finetune_steps: int = 400
    bits: tuple = (4, 8)
    d_model: int = 128
    n_layer: int = 3
    n_head: int = 4
    block: int = 64
    batch_size: int = 32
    lr: float = 3e-3
    finetune_lr: float = 3e-4
    warmup: int = 100
    group_size: int | None = None
    clip_percentile: float | None = None
    corpus: str | None = None
    tokenizer: str = "char"
    held_out_fraction: float = 0.1
    eval_windows: int | None = None
    curve_every: int = 100
    curve_windows: int = 64
    seed: int = 0
    threads: int | None = None
    distill: bool = False
    distill_temperature: float = 1.0
    distill_weight: float = 0.1
    learned_scales: bool = False
    scale_lr: float | None = None
    act8: bool = False
    act8_group_size: int = 32
    gguf: bool = True

    def __post_init__(self):
        bits = self.bits if isinstance(self.bits, tuple | list) else (self.bits,)
        for b in bits:
            if b not in SUPPORTED_BITS or isinstance(b, bool):
                raise ValueError(f"bits={b!r} is not supported: compare int4 and/or int8, e.g. bits=(4, 8)")
        if not bits or len(set(bits)) != len(bits):
            raise ValueError(f"bits={self.bits!r} must list 4 and/or 8 once each")
        object.__setattr__(self, "bits", tuple(int(b) for b in bits))
        for name in ("steps", "finetune_steps", "d_model", "n_layer", "n_head", "block", "batch_size",
                     "curve_every", "curve_windows"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        for name in ("warmup", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}={value!r} must be a non-negative int")
        for name in ("eval_windows", "threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive int or None")
        for name in ("lr", "finetune_lr", "distill_temperature", "distill_weight"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r} must be a positive number")
        for name in ("distill", "learned_scales", "act8", "gguf"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.scale_lr is not None and (not isinstance(self.scale_lr, int | float) or not
                                          (math.isfinite(self.scale_lr) and self.scale_lr > 0)):
            raise ValueError(f"scale_lr={self.scale_lr!r} must be a positive number or None")
        if self.act8 and self.d_model % self.act8_group_size:
            raise ValueError(f"act8_group_size={self.act8_group_size} must divide d_model={self.d_model}")
        if self.distill_weight > 1:
            raise ValueError(f"distill_weight={self.distill_weight!r} must be in (0, 1]")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_head={self.n_head}")
        if self.gguf and self.d_model % GGUF_SPEC.group_size:
            raise ValueError(f"gguf=True (the llama.cpp rows) needs d_model divisible by {GGUF_SPEC.group_size}, "
                             f"the Q4_0 block, got d_model={self.d_model}: use e.g. 128, or gguf=False "
                             f"(--no-gguf) to leave those rows out")
        self.spec(self.bits[0])  # validates group_size and clip_percentile
        if self.group_size is not None and self.d_model % self.group_size:
            raise ValueError(
                f"group_size={self.group_size} does not divide d_model={self.d_model}, the input size of "
                f"the model's layers: use a divisor of {self.d_model}, e.g. 32, or leave it out for per-channel scales"
            )

    def spec(self, bits):
        """The QuantSpec shared by PTQ and QAT at ``bits``."""
        return QuantSpec(bits=bits, group_size=self.group_size, clip_percentile=self.clip_percentile)

    def act8_spec(self):
        """The 8da4w QuantSpec: int8 asymmetric per-token activations, int4 symmetric group weights."""
        # torchao's int4 symmetric grid (codes -8..7, scale absmax / 7.5), so torchao's 8da4w QAT
        # is evaluated on the same grid.
        return QuantSpec(bits=4, grid="qwix", group_size=self.act8_group_size, act_bits=8, act_symmetric=False)

    def replace(self, **changes):
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)


PRESETS = {
    "default": CompareConfig(),
    # A few seconds: the CLI and notebook tests run this (one thread is fastest for so small a model).
    "smoke": CompareConfig(steps=60, finetune_steps=30, d_model=32, n_layer=1, n_head=2, block=32,
                           batch_size=8, warmup=10, eval_windows=32, curve_every=15, curve_windows=8, threads=1),
    # The benchmark's preset: a wider, deeper model trained longer.
    "large": CompareConfig(steps=2400, finetune_steps=600, d_model=192, n_layer=4, n_head=6, block=64,
                           batch_size=32, lr=2e-3, finetune_lr=2e-4, warmup=150, curve_every=150),
}


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


def warmup_cosine(warmup, floor=0.0):
    """An ``lr_schedule(step, m_steps)`` for GradLeaf: linear warm-up, then cosine decay to ``floor``.

    >>> f = warmup_cosine(10, floor=0.1)
    >>> round(f(0, 100), 2), f(9, 100), round(f(99, 100), 3)
    (0.1, 1.0, 0.1)
    """

    def schedule(step, m_steps):
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, m_steps - 1 - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return schedule


def _torch():
    return require("torch", extra="torch", purpose="mixle compare")


def _window_density(lm, ids):
    """The module GradLeaf trains: ``log_density(starts)`` = log-prob of the windows at ``starts``."""
    torch = _torch()

    class WindowDensity(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = lm
            self.offsets = torch.arange(lm.block + 1)
            self.ids = ids

        def log_density(self, starts):
            return self.lm.sequence_log_prob(self.ids[starts[:, None] + self.offsets])

        def logits(self, starts):  # for distillation: next-token logits of the windows and their targets
            tokens = self.ids[starts[:, None] + self.offsets]
            return self.lm(tokens[:, :-1], all_positions=True), tokens[:, 1:]

    return WindowDensity()


def held_out_windows(ids, block, max_windows=None):
    """Non-overlapping windows of ``block + 1`` tokens (stride ``block``), evenly thinned to a cap.

    Every token after a window's first is predicted once, with its window as context.

    >>> held_out_windows(np.arange(10), 3).tolist()
    [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    """
    count = (len(ids) - 1) // block
    starts = np.arange(count) * block
    if max_windows is not None and count > max_windows:
        starts = starts[np.linspace(0, count - 1, max_windows).round().astype(int)]
    return np.stack([ids[s : s + block + 1] for s in starts])


def held_out_loss(model, windows, batch=128):
    """Mean next-token cross-entropy (nats) of ``model`` over ``windows``, in eval mode.

    Args:
        model: a ``CausalLM`` (float, QAT-wrapped or converted to int weights).
        windows: int token windows, shape ``(count, length)``.
    """
    torch = _torch()
    windows = torch.as_tensor(windows)
    was_training = model.training
    model.eval()
    total = 0.0
    try:
        with torch.no_grad():
            for i in range(0, len(windows), batch):
                total -= model.sequence_log_prob(windows[i : i + batch]).double().sum().item()
    finally:
        model.train(was_training)
    return total / (windows.shape[0] * (windows.shape[1] - 1))


class CompareData:
    """The tokenized corpus of a run: training ids, held-out windows and the tokenizer.

    Built by ``prepare_data(config)``, which is where bad input is refused (missing corpus file,
    empty text, a block larger than the data), before any training starts.
    """

    def __init__(self, config):
        from mixle.lm.data import check_block, load_splits

        torch = _torch()
        train, held, self.tokenizer = load_splits(config.corpus, config.held_out_fraction, config.seed,
                                                  tokenizer=config.tokenizer)
        check_block(train, config.block, "the training text")
        check_block(held, config.block, "the held-out text")
        self.block = config.block
        self.key = _data_key(config)
        self.train_ids = torch.as_tensor(train)
        self.train_starts = torch.arange(len(train) - config.block)
        self.eval_windows = held_out_windows(held, config.block, config.eval_windows)
        self.curve_windows = held_out_windows(held, config.block, config.curve_windows)
        self.info = {
            "corpus": config.corpus or f"pydoc_data.topics (CPython {platform.python_version()})",
            "tokenizer": config.tokenizer, "vocab": self.tokenizer.vocab_size,
            "train_tokens": len(train), "held_out_tokens": len(held),
            "held_out_windows": len(self.eval_windows),
            "predicted_tokens": int(self.eval_windows.shape[0] * config.block),
        }


def _data_key(config):
    return tuple(getattr(config, name) for name in ("corpus", "tokenizer", "held_out_fraction", "seed", "block",
                                                     "eval_windows", "curve_windows"))


def prepare_data(config):
    """Load, split and tokenize the corpus of ``config``; raises clear errors for bad input.

    >>> prepare_data(PRESETS["smoke"].replace(block=10**7))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: block=10000000 is larger than the data: the training text has ... tokens but one training window needs block + 1 = 10000001; use a smaller block or a longer text
    """
    return CompareData(config)


class _Run:
    """One comparison run: phases, and the rows, curves and timings they produce."""

    def __init__(self, config, data, progress):
        self.config, self.progress, self.torch = config, progress, _torch()
        self.train_ids, self.train_starts = data.train_ids, data.train_starts
        self.eval_windows, self.curve_windows = data.eval_windows, data.curve_windows
        self.tokenizer, self.data = data.tokenizer, data.info
        self.rows, self.curves, self.seconds = [], {}, {}
        self.llama_cpp_info = None

    def train(self, lm, phase, steps, lr, schedule, seed, start, distill=None, optimizer=None):
        """Train ``lm`` through a GradLeaf M-step; records its curves under ``phase``."""
        from mixle.lm.grad_leaf import GradLeaf

        torch, config = self.torch, self.config
        per_token = 1.0 / config.block
        curve = {"step": [], "train_loss": [], "eval_step": [], "held_out_loss": []}

        def record(step, loss):
            curve["step"].append(start + step + 1)
            curve["train_loss"].append(loss * per_token)
            if (step + 1) % config.curve_every == 0 or step + 1 == steps:
                curve["eval_step"].append(start + step + 1)
                curve["held_out_loss"].append(held_out_loss(lm, self.curve_windows))

        curve["eval_step"].append(start)
        curve["held_out_loss"].append(held_out_loss(lm, self.curve_windows))
        leaf = GradLeaf(_window_density(lm, self.train_ids), m_steps=steps, lr=lr, batch_size=config.batch_size,
                        optimizer=optimizer or torch.optim.AdamW, lr_schedule=schedule, grad_clip=float(config.block),
                        seed=seed, progress=phase if self.progress else None, progress_scale=per_token,
                        callback=record, distill=distill)
        began = time.perf_counter()
        leaf.fit(self.train_starts)
        self.seconds[phase] = round(time.perf_counter() - began, 2)
        self.curves[phase] = curve
        return lm

    def add(self, method, bits, model, **extra):
        from mixle.api import model_nbytes

        loss = held_out_loss(model, self.eval_windows)
        row = {"method": method, "bits": bits, "loss": loss, "perplexity": math.exp(loss),
               "bytes": model_nbytes(model).total, **extra}
        self.rows.append(row)
        return row

    def finetune_phase(self, base, phase, prepare=None, distill=False):
        model = copy.deepcopy(base)
        if prepare is not None:
            model = prepare(model)
        config = self.config
        schedule = warmup_cosine(max(1, config.finetune_steps // 20), floor=0.0)
        teacher = None
        if distill:  # the fp32 checkpoint, frozen: one extra copy of the model's weights
            from mixle.lm.distill import SelfDistillation

            teacher = SelfDistillation(_window_density(copy.deepcopy(base), self.train_ids),
                                       config.distill_temperature, config.distill_weight)
        optimizer = None
        if any(getattr(m, "spec", None) is not None and m.spec.scale == "learned" for m in model.modules()):
            from mixle.torch_backend.learned_scale import param_groups

            torch = self.torch
            scale_lr = config.scale_lr or 10 * config.finetune_lr
            optimizer = lambda params, lr: torch.optim.AdamW(param_groups(model, params, lr, scale_lr))  # noqa: E731
        # Every fine-tune sees the same batches in the same order.
        return self.train(model, phase, config.finetune_steps, config.finetune_lr, schedule,
                          config.seed + 1, config.steps, distill=teacher, optimizer=optimizer)


def run_compare(config=None, *, data=None, progress=True, external=()):
    """Train fp32, then compare PTQ, fine-tune + PTQ and QAT at each of ``config.bits``.

    Args:
        config: a CompareConfig (default: ``PRESETS["default"]``).
        data: ``prepare_data(config)`` if already built (else it is built here).
        progress: show a tqdm bar per training phase.
        external: ``ExternalQAT`` entries (e.g. torchao) run like mixle's QAT.

    Returns:
        A JSON-ready dict: ``config``, ``environment``, ``data``, ``model``, ``rows`` (method,
        bits, held-out loss, perplexity, real bytes), ``summary`` per bit width (recovered %),
        ``curves`` per phase and ``seconds`` per phase.
    """
    config = PRESETS["default"] if config is None else config
    if not isinstance(config, CompareConfig):
        raise TypeError(f"config must be a CompareConfig, got {type(config).__name__}")
    torch = _torch()
    from mixle.api import apply_qat
    from mixle.lm.transformer import build_causal_lm
    from mixle.api import convert, quantize_model

    if config.gguf:
        require("gguf", extra="gguf", purpose="the llama.cpp rows of mixle compare (or pass gguf=False / --no-gguf)")
    previous_threads = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    try:
        if data is None:
            data = prepare_data(config)
        elif data.key != _data_key(config):
            raise ValueError("data was prepared for another corpus, split, seed or block: "
                             "build it with prepare_data(config) for this config")
        run = _Run(config, data, progress)
        began = time.perf_counter()
        torch.manual_seed(config.seed)
        lm = build_causal_lm(run.tokenizer.vocab_size, config.d_model, config.n_layer, config.n_head, config.block)
        run.train(lm, "fp32", config.steps, config.lr, warmup_cosine(config.warmup, floor=0.1), config.seed, 0)
        run.add("fp32", 32, lm)
        for bits in config.bits:
            run.add("PTQ", bits, quantize_model(lm, config.spec(bits)))

        tuned = run.finetune_phase(lm, "fp32 fine-tune")
        run.add("fp32 fine-tune", 32, tuned)
        for bits in config.bits:
            run.add("fine-tune + PTQ", bits, quantize_model(tuned, config.spec(bits)))

        for bits in config.bits:
            qat = run.finetune_phase(lm, f"QAT int{bits}", lambda m, b=bits: apply_qat(m, spec=config.spec(b)))
            fake = held_out_loss(qat, run.eval_windows)
            run.add("QAT", bits, convert(qat), fake_quant_loss=fake)

        for method, bits, spec, distill in _option_runs(config):
            qat = run.finetune_phase(lm, f"{method} int{bits}", lambda m, s=spec: apply_qat(m, spec=s), distill=distill)
            run.add(method, bits, convert(qat), fake_quant_loss=held_out_loss(qat, run.eval_windows))

        if config.act8:
            spec = config.act8_spec()
            run.add(ACT8_PTQ, 4, quantize_model(tuned, spec), spec=spec.short())
            qat = run.finetune_phase(lm, ACT8_QAT, lambda m: apply_qat(m, spec=spec))
            run.add(ACT8_QAT, 4, convert(qat), fake_quant_loss=held_out_loss(qat, run.eval_windows), spec=spec.short())

        if config.gguf:
            _gguf_rows(run, lm)

        for ext in external:
            trained = run.finetune_phase(lm, ext.name, ext.prepare)
            fake = held_out_loss(trained, run.eval_windows)
            run.add(ext.name, ext.bits, quantize_model(ext.to_float(trained), ext.spec),
                    fake_quant_loss=fake, spec=ext.spec.short())
        total = time.perf_counter() - began
    finally:
        torch.set_num_threads(previous_threads)

    from mixle.api import model_nbytes

    return {
        "config": dataclasses.asdict(config),
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "threads": config.threads or previous_threads, "platform": platform.platform(),
                        "total_seconds": round(total, 2)},
        "data": run.data,
        "model": {"parameters": sum(p.numel() for p in lm.parameters()), "fp32_bytes": model_nbytes(lm).total},
        "rows": run.rows,
        "summary": summarize(run.rows, config.bits, [e.name for e in external if e.spec.act_bits is None],
                             [e.name for e in external if e.spec.act_bits is not None]),
        "llama_cpp": run.llama_cpp_info,
        "curves": run.curves,
        "seconds": run.seconds,
    }


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
GGUF_METHODS = (GGUF_QAT,)


def _gguf_rows(run, lm):
    """The llama.cpp rows: fp32 fine-tune, its PTQ into Q4_0 and QAT on q4_0, the last two from their files."""
    from mixle.api import apply_qat, quantize_model

    base = copy.deepcopy(lm)
    for block in base.blocks:  # the GELU llama.cpp's gpt2 graph computes
        block.activation = GGUF_ACTIVATION
    tuned = run.finetune_phase(base, GGUF_FINETUNE)
    row = run.add(GGUF_FINETUNE, 32, tuned)
    with tempfile.TemporaryDirectory(prefix="mixle-gguf-") as folder:
        if _llama_cpp() is not None:  # llama.cpp's own baseline: the float model as an F32 file
            from mixle.exports.gguf import save_gguf

            path = os.path.join(folder, "fp32.gguf")
            save_gguf(tuned, path, tokenizer=run.tokenizer, float_matrices="f32")
            _add_llama_cpp_loss(run, row, path)
        _add_from_gguf(run, GGUF_PTQ, quantize_model(tuned, GGUF_SPEC), base, folder)
        qat = run.finetune_phase(base, GGUF_QAT, lambda m: apply_qat(m, spec=GGUF_SPEC))
        _add_from_gguf(run, GGUF_QAT, qat, base, folder, fake_quant_loss=held_out_loss(qat, run.eval_windows))


def _add_from_gguf(run, method, model, template, folder, **extra):
    """A row evaluated from ``model``'s GGUF file: its weights read back into ``template``'s float copy.

    ``bytes`` is the file's tensor data; with llama-cpp-python installed the file is also run by
    llama.cpp on the same held-out windows (``llama_cpp_loss``).
    """
    import gguf

    from mixle.exports.gguf import load_gguf_weights, save_gguf

    path = os.path.join(folder, method.replace(" ", "_").replace("(", "").replace(")", "") + ".gguf")
    save_gguf(model, path, tokenizer=run.tokenizer)
    from_file = load_gguf_weights(template, path)
    nbytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    loss = held_out_loss(from_file, run.eval_windows)
    row = {"method": method, "bits": 4, "loss": loss, "perplexity": math.exp(loss), "bytes": nbytes,
           "spec": GGUF_SPEC.short(), **extra}
    _add_llama_cpp_loss(run, row, path)
    run.rows.append(row)
    return row


def _add_llama_cpp_loss(run, row, path):
    """With llama-cpp-python installed: ``row``'s loss and perplexity from the file run by llama.cpp."""
    cpp = _llama_cpp_loss(path, run.eval_windows, run.config.threads)
    if cpp is not None:
        row["llama_cpp_loss"], run.llama_cpp_info = cpp
        row["llama_cpp_perplexity"] = math.exp(row["llama_cpp_loss"])


def _llama_cpp():
    """llama-cpp-python if installed (the ``llama`` extra), else None: the llama.cpp column is optional."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp


@contextlib.contextmanager
def _quiet_stderr():
    """Silence stderr meanwhile: what C code writes to file descriptor 2 and what Python prints to
    ``sys.stderr`` (llama-cpp-python's log callback)."""
    import io

    try:
        saved = os.dup(2)
    except OSError:
        saved = None
    try:
        with open(os.devnull, "w") as null, contextlib.redirect_stderr(io.StringIO()):
            if saved is not None:
                os.dup2(null.fileno(), 2)
            yield
    finally:
        if saved is not None:
            os.dup2(saved, 2)
            os.close(saved)


def _llama_cpp_loss(path, windows, threads):
    """``(held-out loss, info)`` of the GGUF file run by llama.cpp (F32 KV cache), or None without
    llama-cpp-python."""
    llama_cpp = _llama_cpp()
    if llama_cpp is None:
        return None
    block = windows.shape[1] - 1
    threads = threads or _torch().get_num_threads()
    total = 0.0
    with _quiet_stderr():  # llama.cpp notes that it pads the context to 256 tokens: nothing to act on
        llm = llama_cpp.Llama(model_path=path, n_ctx=block, logits_all=True, n_threads=threads,
                              n_threads_batch=threads, type_k=0, type_v=0, verbose=False)
        for window in windows:
            llm.reset()
            llm.eval(window[:-1].tolist())
            logits = np.asarray(llm.scores[:block], dtype=np.float64)
            top = logits.max(-1, keepdims=True)
            logz = np.log(np.exp(logits - top).sum(-1)) + top[:, 0]
            total += float((logz - logits[np.arange(block), window[1:]]).sum())
        llm.close()
        del llm
    info = {"llama_cpp_python": llama_cpp.__version__, "kv_cache": "f32", "threads": threads}
    return total / (windows.shape[0] * block), info


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


def _row(rows, method, bits):
    return next((r for r in rows if r["method"] == method and r["bits"] == bits), None)


def summarize(rows, bits_list, external_names=(), act8_external=()):
    """Per bit width: how much of fine-tune + PTQ's held-out loss degradation QAT recovers.

    ``recovered = (L_ptq - L_qat) / (L_ptq - L_fp32)`` with L_ptq the fine-tuned model after PTQ
    and L_fp32 the fine-tuned fp32 model (same number of extra steps as QAT). When PTQ loses
    less than ``MIN_DEGRADATION`` nats the ratio is noise, so it is None and a note says why.
    Rows of the 8da4w spec (and ``act8_external`` methods) are measured against the 8da4w
    fine-tune + PTQ baseline, under the key ``"8da4w"``; the llama.cpp rows against their own
    fine-tune + PTQ into Q4_0 and tanh-GELU fp32 fine-tune, under ``"gguf_q4_0"``.

    >>> rows = [{"method": "fp32 fine-tune", "bits": 32, "loss": 1.0}, {"method": "fine-tune + PTQ", "bits": 4, "loss": 1.2},
    ...         {"method": "QAT", "bits": 4, "loss": 1.02}]
    >>> round(summarize(rows, (4,))["int4"]["QAT"]["recovered_percent"], 6)
    90.0
    """
    summary = _summarize(rows, bits_list, external_names)
    act8 = _summarize(rows, (4,), act8_external, baseline_method=ACT8_PTQ, methods=ACT8_METHODS, label="8da4w")
    if act8:
        summary["8da4w"] = act8["int4"]
    gguf = _summarize(rows, (4,), (), baseline_method=GGUF_PTQ, methods=GGUF_METHODS, label="GGUF q4_0",
                      tuned_method=GGUF_FINETUNE)
    if gguf:
        summary["gguf_q4_0"] = gguf["int4"]
    return summary


def _summarize(rows, bits_list, external_names=(), baseline_method="fine-tune + PTQ", methods=("QAT", *OPTION_METHODS),
               label=None, tuned_method="fp32 fine-tune"):
    tuned = _row(rows, tuned_method, 32)
    summary = {}
    for bits in bits_list:
        baseline = _row(rows, baseline_method, bits)
        if baseline is None:
            continue
        degradation = baseline["loss"] - tuned["loss"]
        entry = {"ptq_degradation_nats": degradation,
                 "ptq_perplexity_increase_percent": 100 * math.expm1(degradation)}
        for name in (*methods, *external_names):
            row = _row(rows, name, bits)
            if row is None:
                continue
            gap = 100 * math.expm1(row["loss"] - tuned["loss"])
            if degradation < MIN_DEGRADATION:
                recovered = None
                note = (f"PTQ at {label or f'int{bits}'} loses only {degradation:+.4f} nats ({entry['ptq_perplexity_increase_percent']:+.2f}% "
                        f"perplexity): nothing to recover, so no recovered % is given; {name} is at {gap:+.2f}%")
            else:
                recovered = 100 * (baseline["loss"] - row["loss"]) / degradation
                note = (f"{name} recovers {recovered:.1f}% of the held-out loss PTQ loses at {label or f'int{bits}'}; "
                        f"its perplexity is {gap:+.2f}% vs the {tuned_method} (PTQ: "
                        f"{entry['ptq_perplexity_increase_percent']:+.2f}%)")
            entry[name] = {"recovered_percent": recovered, "perplexity_gap_percent": gap, "note": note}
            cpp = [r.get("llama_cpp_loss") for r in (tuned, baseline, row)]
            if None not in cpp:  # the same measure from llama.cpp's own logits
                cpp_degradation = cpp[1] - cpp[0]
                entry[name]["llama_cpp_recovered_percent"] = (
                    None if cpp_degradation < MIN_DEGRADATION else 100 * (cpp[1] - cpp[2]) / cpp_degradation)
                entry[name]["note"] += "; in llama.cpp " + (
                    "PTQ loses nothing measurable" if cpp_degradation < MIN_DEGRADATION else
                    f"{entry[name]['llama_cpp_recovered_percent']:.1f}% recovered, perplexity "
                    f"{100 * math.expm1(cpp[2] - cpp[0]):+.2f}% (PTQ: {100 * math.expm1(cpp_degradation):+.2f}%)")
        summary[f"int{bits}"] = entry
    return summary


def format_table(results):
    """The results as a plain-text table plus one summary line per bit width."""
    rows = results["rows"]
    fp32_bytes = results["model"]["fp32_bytes"]
    cpp = any("llama_cpp_perplexity" in row for row in rows)
    header = (f"{'method':<28}{'bits':>5}{'held-out loss':>15}{'perplexity':>12}{'bytes':>11}{'size':>8}"
              + (f"{'llama.cpp ppl':>15}" if cpp else ""))
    lines = [header, "-" * len(header)]
    for row in rows:
        bits = "fp32" if row["bits"] == 32 else f"int{row['bits']}"
        lines.append(f"{row['method']:<28}{bits:>5}{row['loss']:>15.4f}{row['perplexity']:>12.4f}"
                     f"{row['bytes']:>11,d}{row['bytes'] / fp32_bytes:>7.1%}"
                     + (f"{row['llama_cpp_perplexity']:>15.4f}" if "llama_cpp_perplexity" in row else ""))
    lines.append("")
    for name, entry in results["summary"].items():
        for method, value in entry.items():
            if isinstance(value, dict):
                lines.append(f"{name}: {value['note']}")
    if any(row["method"] == GGUF_QAT for row in rows):
        lines.append("(GGUF q4_0) rows: evaluated from the GGUF file's weights (gguf-py dequantize), tanh GELU; "
                     "bytes = the file's tensor data"
                     + (f"; llama.cpp ppl: the file run by llama-cpp-python {results['llama_cpp']['llama_cpp_python']}"
                        if results.get("llama_cpp") else ""))
    data, env = results["data"], results["environment"]
    lines.append(f"held-out: {data['predicted_tokens']:,} tokens of {data['corpus']} ({data['tokenizer']}-level, "
                 f"vocab {data['vocab']}); {results['model']['parameters']:,} parameters; torch {env['torch']}, "
                 f"{env['threads']} threads, {env['total_seconds']:.0f} s")
    return "\n".join(lines)


def save_plot(results, path):
    """Write a PNG: fp32 training and fine-tune curves, and held-out perplexity by method and bits."""
    require("matplotlib", extra="bench", purpose="the comparison plot")
    from matplotlib.figure import Figure  # no pyplot: works headless and leaves notebook backends alone

    fig = Figure(figsize=(16, 4.8))
    pretrain, finetune, right = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1, 1, 1.25]})
    for axis, phases, title in ((pretrain, ["fp32"], "fp32 training"),
                                (finetune, [p for p in results["curves"] if p != "fp32"],
                                 "fine-tunes from the fp32 checkpoint (same steps and batches)")):
        for phase in phases:
            curve = results["curves"][phase]
            steps, loss = np.asarray(curve["step"]), np.asarray(curve["train_loss"])
            width = max(1, min(50, len(loss) // 10))
            smooth = np.convolve(loss, np.ones(width) / width, mode="valid")
            line, = axis.plot(steps[width - 1 :], smooth, alpha=0.3, linewidth=1)
            axis.plot(curve["eval_step"], curve["held_out_loss"], marker="o", markersize=3,
                      color=line.get_color(), label=phase)
        axis.set_xlabel("training step")
        axis.set_ylabel("loss (nats/token)")
        axis.set_title(title, fontsize=10)
        axis.legend(fontsize=8, title="faint: train loss, dots: held-out subset", title_fontsize=7)

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
        bars = right.bar(xs, ys, width, label=method)
        right.bar_label(bars, fmt="%.3f", fontsize=7)
    for method, style in (("fp32", ":"), ("fp32 fine-tune", "--"), (GGUF_FINETUNE, "-.")):
        row = _row(results["rows"], method, 32)
        if row is None:
            continue
        right.axhline(row["perplexity"], linestyle=style, color="black", linewidth=1, label=f"{method} ({row['perplexity']:.3f})")
    all_ppl = [r["perplexity"] for r in results["rows"]]
    low, high = min(all_ppl), max(all_ppl)
    right.set_ylim(low - 0.3 * (high - low) - 1e-3, high + 0.25 * (high - low) + 1e-3)
    right.set_xticks(range(len(bit_groups)), [f"int{b}" for b in bit_groups])
    right.set_ylabel("held-out perplexity (real int weights)")
    right.set_title("held-out perplexity by method and bits (lower is better)")
    right.legend(fontsize=8)
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
    >>> check_out_dir(os.path.join(tempfile.mkdtemp(), "new", "run"))
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
