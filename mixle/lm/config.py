"""The compare job's configuration: one validated dataclass whose fields are also its CLI flags.

Each field declared with ``option`` carries its ``--flag`` help in its metadata, and
``mixle.lm.cli`` generates the ``mixle compare`` flags from them (``mixle.lm.flags``).
"""

import dataclasses
import math
from dataclasses import dataclass

from mixle.core.gptq import check_gptq_spec
from mixle.gguf.mixes import GGUF_MIXES, mix_named
from mixle.core.spec import SUPPORTED_BITS, QuantSpec
from mixle.lm.flags import option, positive_int

__all__ = ["CompareConfig", "PRESETS", "GGUF_SPEC", "GGUF_ACTIVATION", "GGUF_MIX_DEFAULT"]

# The llama.cpp rows: llama.cpp's Q4_0 grid, and the activation its gpt2 graph computes.
GGUF_SPEC = QuantSpec(grid="q4_0")
GGUF_ACTIVATION = "gelu_tanh"
# The llama.cpp mix rows by default: Ollama's default tag and the usual GGUF on model hubs.
GGUF_MIX_DEFAULT = ("Q4_K_M",)

_POSITIVE = ("steps", "finetune_steps", "d_model", "n_layer", "n_head", "block", "batch_size", "curve_every",
             "curve_windows", "calibration_windows")
_NON_NEGATIVE = ("warmup", "seed")
_POSITIVE_OR_NONE = ("eval_windows", "threads")
_RATES = ("lr", "finetune_lr", "distill_temperature", "distill_weight")
_SWITCHES = ("distill", "learned_scales", "act8", "gguf", "imatrix", "gptq")
# llama-imatrix skips products of fewer input rows (mixle.torch_backend.transforms.importance.MIN_ROWS).
_MIN_CALIBRATION_TOKENS = 16


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_rate(value):
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


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
        gguf: also the llama.cpp rows (see ``mixle.lm.compare``): QAT on ``grid="q4_0"`` vs
            fine-tune + PTQ into Q4_0, evaluated from the GGUF file (needs gguf-py and
            ``d_model`` divisible by 32, Q4_0's block).
        gguf_mixes: with ``gguf``, also for each of these llama.cpp mixes (``GGUF_MIXES``): the
            fp32 fine-tune as ``llama-quantize`` writes it in the mix (``save_gguf(gguf_mix=)``)
            vs QAT on the mix (``apply_qat(gguf_mix=)``), both evaluated from their files;
            ``()`` (``--gguf-mixes none``) leaves them out.
        imatrix: with ``gguf``, also the importance-matrix rows after the Q4_0 rows and after each
            mix's: PTQ of the fp32 fine-tune with ``calibrate_importance`` of it
            (``quantize_model(importance=)``, what ``llama-quantize --imatrix`` writes) and QAT
            with the importance of the checkpoint it starts from (``apply_qat(importance=)``,
            trained like the plain GGUF QAT row), both from their files.
        gptq: also fine-tune + GPTQ at each width (``gptq_quantize`` of the fp32 fine-tune onto
            the spec of the fine-tune + PTQ row).
        calibration_windows: the imatrix and GPTQ calibrate on this many windows of ``block``
            tokens of the training text (evenly spaced; never the held-out text).

    >>> CompareConfig(steps=10).replace(bits=[8]).bits
    (8,)
    """

    steps: int = option(1600, "fp32 training steps from scratch", type=positive_int)
    finetune_steps: int = option(400, "extra steps for QAT and for the fp32 fine-tune", type=positive_int)
    bits: tuple[int, ...] = option((4, 8), "bit widths to compare: 4 and/or 8")
    d_model: int = option(128, "model width", type=positive_int)
    n_layer: int = option(3, "transformer blocks", type=positive_int)
    n_head: int = option(4, "attention heads", type=positive_int)
    block: int = option(64, "context length in tokens", type=positive_int)
    batch_size: int = option(32, "windows per training step", type=positive_int)
    lr: float = option(3e-3, "peak learning rate of fp32 training")
    finetune_lr: float = option(3e-4, "peak learning rate of QAT and the fp32 fine-tune")
    warmup: int = 100
    group_size: int | None = option(None, "per-group scales of this many inputs (default: per channel)",
                                    type=positive_int)
    clip_percentile: float | None = option(None, "scale from this percentile of |w| (default: the max)")
    corpus: str | None = option(None, "a UTF-8 text file (default: the embedded CPython documentation topics)")
    tokenizer: str = option("char", "char- or byte-level tokens (default: char)", choices=("char", "byte"))
    held_out_fraction: float = 0.1
    eval_windows: int | None = option(None, "evaluate on at most this many held-out windows", type=positive_int)
    curve_every: int = 100
    curve_windows: int = 64
    seed: int = option(0, "seed of initialisation, split and batches")
    threads: int | None = option(None, "torch CPU threads", type=positive_int)
    distill: bool = option(False, "also run QAT with self-distillation from the fp32 checkpoint (mixle.lm.distill)")
    distill_temperature: float = option(1.0, "temperature T of the distillation KL term")
    distill_weight: float = option(0.1, "weight w in (0, 1] of the distillation KL term")
    learned_scales: bool = option(False, "also run QAT with learned scales (QuantSpec(scale='learned'); "
                                         "with --distill also both)")
    scale_lr: float | None = option(None, "learning rate of the learned scales (default: 10 x --finetune-lr)")
    act8: bool = option(False, "also compare 8da4w (int8 per-token activations, int4 group-32 weights): "
                               "fine-tune + PTQ vs QAT")
    act8_group_size: int = 32
    gguf: bool = option(True, "leave out the llama.cpp rows (QAT on q4_0 vs fine-tune + PTQ into Q4_0, evaluated "
                              "from the GGUF file; also run in llama.cpp when llama-cpp-python is installed), "
                              "the mix rows included")
    gguf_mixes: tuple[str, ...] = option(GGUF_MIX_DEFAULT, "llama.cpp mixes of the mix rows: llama-quantize's mix of "
                                         "the fp32 fine-tune vs QAT on the mix, both from their GGUF files; 'none' "
                                         f"leaves them out (one or more of {', '.join(GGUF_MIXES)}; default: Q4_K_M)")
    imatrix: bool = option(True, "leave out the importance-matrix rows (llama-quantize --imatrix's PTQ and QAT with "
                                 "the same importance, GGUF q4_0 and each mix; calibrated on training windows)")
    gptq: bool = option(True, "leave out the fine-tune + GPTQ rows (GPTQ calibrated on training windows)")
    calibration_windows: int = option(128, "training windows (never held-out text) the imatrix and GPTQ are "
                                           "calibrated on", type=positive_int)

    def __post_init__(self):
        object.__setattr__(self, "bits", _checked_bits(self.bits))
        object.__setattr__(self, "gguf_mixes", _checked_mixes(self.gguf_mixes))
        self._check_kinds()
        self._check_shapes()
        self.spec(self.bits[0])  # validates group_size and clip_percentile
        if self.group_size is not None and self.d_model % self.group_size:
            raise ValueError(
                f"group_size={self.group_size} does not divide d_model={self.d_model}, the input size of "
                f"the model's layers: use a divisor of {self.d_model}, e.g. 32, or leave it out for per-channel scales"
            )

    def _check_kinds(self):
        """Each field is of its kind: positive ints, non-negative ints, rates, switches."""
        for name in _POSITIVE:
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        for name in _NON_NEGATIVE:
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ValueError(f"{name}={value!r} must be a non-negative int")
        for name in _POSITIVE_OR_NONE:
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive int or None")
        for name in _RATES:
            if not _is_rate(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive number")
        for name in _SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.scale_lr is not None and not _is_rate(self.scale_lr):
            raise ValueError(f"scale_lr={self.scale_lr!r} must be a positive number or None")

    def _check_shapes(self):
        """The fields agree with each other: widths divisible by heads and blocks, a weight <= 1."""
        if self.act8 and self.d_model % self.act8_group_size:
            raise ValueError(f"act8_group_size={self.act8_group_size} must divide d_model={self.d_model}")
        if self.distill_weight > 1:
            raise ValueError(f"distill_weight={self.distill_weight!r} must be in (0, 1]")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_head={self.n_head}")
        if (self.imatrix or self.gptq) and self.calibration_windows * self.block < _MIN_CALIBRATION_TOKENS:
            raise ValueError(f"calibration_windows={self.calibration_windows} x block={self.block} gives fewer than "
                             f"{_MIN_CALIBRATION_TOKENS} calibration tokens (llama-imatrix skips smaller batches): "
                             f"use more windows, or --no-imatrix --no-gptq")
        if self.gptq:
            for bits in self.bits:
                check_gptq_spec(self.spec(bits), "gptq=True (the fine-tune + GPTQ rows, --no-gptq leaves them out)")
        if self.gguf and self.d_model % GGUF_SPEC.group_size:
            raise ValueError(f"gguf=True (the llama.cpp rows) needs d_model divisible by {GGUF_SPEC.group_size}, "
                             f"the Q4_0 block, got d_model={self.d_model}: use e.g. 128, or gguf=False "
                             f"(--no-gguf) to leave those rows out")

    def spec(self, bits):
        """The QuantSpec shared by PTQ and QAT at ``bits``.

        >>> CompareConfig().spec(4).short()
        'int4/channel/symmetric'
        """
        return QuantSpec(bits=bits, group_size=self.group_size, clip_percentile=self.clip_percentile)

    def act8_spec(self):
        """The 8da4w QuantSpec: int8 asymmetric per-token activations, int4 symmetric group weights.

        >>> CompareConfig().act8_spec().short()
        'int4/group32/qwix/a8asym'
        """
        # torchao's int4 symmetric grid (codes -8..7, scale absmax / 7.5), so torchao's 8da4w QAT
        # is evaluated on the same grid.
        return QuantSpec(bits=4, grid="qwix", group_size=self.act8_group_size, act_bits=8, act_symmetric=False)

    def replace(self, **changes):
        """A validated copy with some fields changed.

        >>> CompareConfig().replace(steps=5).steps
        5
        """
        return dataclasses.replace(self, **changes)


def _checked_bits(bits):
    """``bits`` as a tuple of distinct supported widths (a single int is one width)."""
    widths = bits if isinstance(bits, tuple | list) else (bits,)
    for b in widths:
        if b not in SUPPORTED_BITS or isinstance(b, bool):
            raise ValueError(f"bits={b!r} is not supported: compare int4 and/or int8, e.g. bits=(4, 8)")
    if not widths or len(set(widths)) != len(widths):
        raise ValueError(f"bits={bits!r} must list 4 and/or 8 once each")
    return tuple(int(b) for b in widths)


def _checked_mixes(mixes):
    """``mixes`` as a tuple of distinct llama.cpp mix names (``("none",)`` or ``None``: no mix rows).

    >>> _checked_mixes(["q4_k_m"]), _checked_mixes(("none",))
    (('Q4_K_M',), ())
    """
    mixes = () if mixes is None else (mixes,) if isinstance(mixes, str) else mixes
    if not isinstance(mixes, tuple | list):
        raise ValueError(f"gguf_mixes={mixes!r} must be a tuple of llama.cpp mix names, e.g. ('Q4_K_M',)")
    if tuple(m.lower() if isinstance(m, str) else m for m in mixes) == ("none",):
        return ()
    names = []
    for mix in mixes:
        try:
            names.append(mix_named(mix).name)
        except ValueError as err:
            raise ValueError(str(err).replace("gguf_mix=", "gguf_mixes: ", 1) + ", or 'none'") from None
    if len(set(names)) != len(names):
        raise ValueError(f"gguf_mixes={tuple(mixes)!r} names a mix twice: list each once")
    return tuple(names)


PRESETS = {
    "default": CompareConfig(),
    # A few seconds: the CLI and notebook tests run this (one thread is fastest for so small a model).
    "smoke": CompareConfig(steps=60, finetune_steps=30, d_model=32, n_layer=1, n_head=2, block=32,
                           batch_size=8, warmup=10, eval_windows=32, curve_every=15, curve_windows=8, threads=1),
    # The benchmark's preset: a wider, deeper model trained longer.
    "large": CompareConfig(steps=2400, finetune_steps=600, d_model=192, n_layer=4, n_head=6, block=64,
                           batch_size=32, lr=2e-3, finetune_lr=2e-4, warmup=150, curve_every=150),
}
