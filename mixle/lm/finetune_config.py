"""The finetune job's configuration: one validated dataclass whose fields are also its CLI flags.

Each field declared with ``option`` carries its ``--flag`` help in its metadata, and
``mixle.lm.cli`` generates the ``mixle finetune`` flags from them (``mixle.lm.flags``). The target
(``--target``) is parsed here into the ``QuantSpec`` QAT trains on (``parse_target``), or into the
llama.cpp mix whose block types it trains on (``parse_mix``: ``Q4_K_M``, ...).
"""

import dataclasses
import math
import re
from dataclasses import dataclass

from mixle.core.grids import importance_grid
from mixle.core.gptq import check_gptq_spec
from mixle.core.grids import GRIDS
from mixle.gguf.mixes import GGUF_MIXES, grid_of_type
from mixle.core.spec import QuantSpec
from mixle.core.product_inputs import ACT_ROUNDINGS
from mixle.lm.flags import option, positive_int

__all__ = ["FinetuneConfig", "parse_target", "parse_mix", "OBJECTIVES", "DTYPES", "GPTQ_MODES", "IMATRIX_MODES",
           "FRAMEWORKS", "RESULT_FIELDS"]

OBJECTIVES = ("kl", "ce", "mix")
DTYPES = ("float32", "bfloat16")
# --backend: where the model is trained and evaluated (torch + transformers, or JAX on mixle's Flax causal LM).
FRAMEWORKS = ("torch", "jax")
# --gptq: off, one calibration pass for every matrix's Hessian, or GPTQ's sequential mode (a pass per matrix,
# each through the earlier matrices already quantized: about as many forward passes of the calibration windows
# as the model has matrices).
GPTQ_MODES = ("off", "one-pass", "sequential")
# --imatrix's words; any other value is the path of a llama-imatrix file.
IMATRIX_MODES = ("off", "calibrate")
# The fields that may differ between an interrupted run and its ``--resume``: they change how long
# or where it runs and what it shows, not what a step computes.
RESUMABLE_CHANGES = ("max_minutes", "checkpoint_every", "llama_cpp", "overwrite", "hf_checkpoint")
# Every other field decides the result: a resumed run must be given the same values.
RESULT_FIELDS = None  # filled below from the dataclass

_TARGET = re.compile(r"int(?P<bits>4|8)(?:/(?P<gran>channel|tensor|group(?P<group>\d+)|g(?P<g>\d+)))?"
                     r"(?:/(?P<grid>symmetric|qwix))?")
# What a llama.cpp ftype name looks like (Q4_K_M, Q3_K_S, IQ4_XS, Q2_K, ...): told apart from a typo'd grid.
_MIX_LIKE = re.compile(r"(?i)i?q\d(_\d)?_(k|xs|xxs|s|m|l|nl)(_(s|m|l|xl))?")
_POSITIVE = ("steps", "batch_size", "block", "accumulate", "eval_windows", "curve_windows", "checkpoint_every",
             "calibration_windows", "answer_tokens")
_RATES = ("lr", "temperature")


def parse_mix(target):
    """The llama.cpp mix a ``--target`` names (``"Q4_K_M"``, ...: ``GGUF_MIXES``), or None for a grid target.

    A mix is spelled as ``llama-quantize`` spells it: ``Q4_K_M``, ``Q4_K_S``, ``Q5_K_M``, ``Q5_K_S``,
    ``Q6_K``, ``Q8_0``, ``Q4_0`` (the names that are only mixes also in lower case); a lower-case
    grid name (``q4_0``, ``q6_k``) is the grid on every decoder matrix (``parse_target``).

    Raises:
        ValueError: a llama.cpp ftype mixle does not train (e.g. ``Q3_K_M``), naming the mixes it does.

    >>> parse_mix("Q4_K_M"), parse_mix("q5_k_m"), parse_mix("Q6_K"), parse_mix("q6_k"), parse_mix("int4")
    ('Q4_K_M', 'Q5_K_M', 'Q6_K', None, None)
    """
    if not isinstance(target, str):
        return None
    if target in GGUF_MIXES:
        return target
    if target.lower() in GRIDS:
        return None
    if target.upper() in GGUF_MIXES:
        return target.upper()
    if _MIX_LIKE.fullmatch(target):
        raise ValueError(f"target={target!r} is not a llama.cpp mix mixle trains: use one of {', '.join(GGUF_MIXES)} "
                         f"(the block types llama-quantize gives each tensor), or a grid such as 'q4_0'")
    return None


def parse_target(target):
    """The ``QuantSpec`` of a ``--target``: a llama.cpp grid (``q4_0``, ``q8_0``) or mixle's integers.

    Integer targets are ``int4`` or ``int8``, optionally ``/channel`` (the default), ``/tensor``
    or ``/group<N>`` (also ``/g<N>``), and ``/symmetric`` (the default) or ``/qwix`` (codes
    -8..7, compressed-tensors' own grid): ``spec.short()`` of such a spec parses back to it.

    Raises:
        ValueError: an unknown target, naming the ones that exist.

    >>> parse_target("q4_0").short(), parse_target("int4/g32").short(), parse_target("int8/channel/qwix").short()
    ('int4/group32/q4_0', 'int4/group32/symmetric', 'int8/channel/qwix')
    """
    if not isinstance(target, str):
        raise ValueError(f"target={target!r} must be a string such as 'q4_0' or 'int4/group32'")
    fixed = {name: grid for name, grid in GRIDS.items() if len(grid.codes) == 1 and grid.block is not None}
    if target.lower() in fixed:
        return QuantSpec(bits=next(iter(fixed[target.lower()].codes)), grid=target.lower())
    found = _TARGET.fullmatch(target)
    if found is None:
        raise ValueError(f"target={target!r} is unknown: use one of {sorted(fixed)} (llama.cpp's blocks), a llama.cpp "
                         f"mix ({', '.join(GGUF_MIXES)}), or int4 / int8 with an optional /channel, /tensor or "
                         f"/group<N> and /symmetric or /qwix, e.g. 'int4/group32'")
    group = found["group"] or found["g"]
    granularity = "group" if group else (found["gran"] or "channel")
    return QuantSpec(bits=int(found["bits"]), grid=found["grid"] or "symmetric", granularity=granularity,
                     group_size=int(group) if group else None)


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class FinetuneConfig:
    """Everything that decides a finetune run (validated on construction).

    Args:
        model: a transformers causal-LM directory (config + safetensors + tokenizer), a ``.gguf``
            file (read through transformers' GGUF loader, dequantized to float), or a hub id
            (``owner/name``: downloaded by ``from_pretrained`` where the hub is reachable).
        out: the output directory (created; checked for room before training). It must be new or
            empty (a directory holding an interrupted run's checkpoint is continued with ``--resume``).
        overwrite: write into a non-empty ``out`` anyway: files of the same names are replaced,
            other files kept, a checkpoint there discarded once every input is checked.
        data: UTF-8 text files or directories of them (``*.txt``, ``*.md``, ``*.rst``, sorted);
            None: the embedded corpus (CPython's documentation topics).
        eval_data: optional second held-out text (files/directories), never trained on.
        generated_tokens: also train on this many tokens sampled from the float model itself
            (``mixle.lm.finetune_generated``; sampled by the transformers model for either backend); 0:
            only the data's.
        target: what QAT trains for and the file stores: a grid (``parse_target``) on every
            decoder matrix, or a llama.cpp mix (``parse_mix``: ``Q4_K_M``, ...) on every matrix
            llama-quantize quantizes, the embedding and head included, each on the block type
            llama.cpp gives it.
        steps: optimizer steps (the cosine schedule's length); max_minutes: stop training
            after this many minutes (the schedule is fitted to the steps that fit).
        batch_size, block, accumulate: windows of ``block`` predicted tokens per micro-batch,
            micro-batches per optimizer step (gradient accumulation).
        lr, warmup, weight_decay, grad_clip: AdamW's peak rate, linear warm-up steps (default
            5% of the steps; with ``max_minutes``, of the steps that fit), decoupled weight decay, gradient-norm clip.
        objective: ``kl`` (distillation from the float model: KL at ``temperature``), ``ce``
            (next-token cross-entropy) or ``mix`` (``(1 - w) CE + w T^2 KL``, w = ``mix_weight``).
        lora, lora_alpha: train rank-``lora`` adapters on a frozen base (alpha default 2 x rank),
            merged and requantized at the end; None trains the quantized layers' weights.
        learned_scales, scale_lr: also learn the quantization scales (integer targets), at
            ``scale_lr`` (default 10 x ``lr``).
        act_bits: 8 rounds each product's input as llama.cpp's CPU path does, in QAT and in the
            PTQ rows (``QuantSpec.act_bits``: Q8_0 or Q8_K blocks); llama.cpp targets only.
        act_rounding: the llama.cpp build whose Q8_0 rounding ``act_bits`` reproduces
            (``QuantSpec.act_rounding``: reference, x86 or arm).
        dtype: ``float32``, or ``bfloat16`` (student and teacher under bfloat16 autocast; the
            master weights and the evaluation stay float32).
        device: a torch device (``cpu``, ``cuda``, ``cuda:1``).
        held_out_fraction: the share of the data's tokens (its end) held out and reported.
        eval_windows, curve_windows, curve_every: windows of the reported evaluations, of the
            held-out training curve and its spacing in steps (default: 10 points).
        checkpoint_every: write the training state every this many steps (and on Ctrl-C/SIGTERM).
        float_matrices: how the GGUF stores matrices QAT leaves float (the token embedding); None:
            ``q8_0`` (with a mix target the mix decides every matrix, so it must stay None).
        tokenizer_pre: llama.cpp's pre-tokenizer name the GGUF files get (``tokenizer.ggml.pre``,
            e.g. ``smollm``) when the model's transformers tokenizer is one mixle cannot name
            (``mixle.gguf.tokenizer``); a ``.gguf`` model's tokenizer is copied from it whole.
        seed, threads, llama_cpp: data order seed; torch/llama.cpp threads; also evaluate
            the written files in llama.cpp when llama-cpp-python is installed.
        imatrix: ``"off"``; ``"calibrate"``: llama.cpp's importance matrix (what ``llama-imatrix``
            collects) of the float model on ``calibration_windows`` windows of the training split
            (never the held-out text), written as ``imatrix.gguf``; or the path of a llama-imatrix
            file (GGUF or legacy ``.dat``) of this model. It adds the row "PTQ imatrix"
            (``llama-quantize --imatrix`` of the float model, written as ``ptq-imatrix.gguf``), and
            QAT trains with it (the row "QAT imatrix") unless ``qat_imatrix`` is False. Only for
            targets with ggml's weighted search (q4_0, q4_1, q5_*, the K-quants and their mixes).
        calibration_windows: training windows of ``block`` tokens the importance matrix and GPTQ
            are calibrated on (evenly spread over the training split).
        qat_imatrix: with ``imatrix``, fake-quantize QAT with the importance (True) or with the
            reference quantizer (False; needed with ``lora``).
        backend: ``"torch"`` (transformers' model) or ``"jax"`` (mixle's Flax causal LM,
            ``mixle.lm.finetune_jax``: trained data-parallel over ``jax.devices()``); the jax backend
            refuses the options it cannot honour (``--lora``, ``--learned-scales``, ``--gptq``,
            ``--dtype bfloat16``, a ``--device`` other than cpu).
        gptq: ``"off"``, ``"one-pass"`` or ``"sequential"`` (``GPTQ_MODES``): also report the row
            "GPTQ" (``mixle.gptq_quantize`` calibrated on the same training windows), for targets it
            rounds onto (int4 / int8 grids, q4_0, q8_0).
        hf_checkpoint: also write the QAT model's float32 master weights as a transformers
            checkpoint (``hf/``, about 4 bytes a parameter; ``mixle.lm.finetune_hf``): llama.cpp's
            ``convert_hf_to_gguf.py`` and ``llama-quantize`` make the trained blocks from it.
        prompts, answer_tokens: chat prompts (one user turn each, in the tokenizer's chat template) that
            the float model, the baselines and the trained model answer greedily, with at most
            ``answer_tokens`` tokens each (``mixle.lm.finetune_chat``): in ``results.json`` and the model card.

    >>> FinetuneConfig(model="m", out="o").replace(target="int4/g32").spec().short()
    'int4/group32/symmetric'
    """

    model: str = option(None, "a transformers causal-LM directory, a .gguf file, or a hub id (owner/name)")
    out: str = option(None, "output directory: the GGUF / compressed-tensors files, results, plot, model card")
    overwrite: bool = option(False, "write into an --out that is not empty: files of the same names are replaced, "
                                     "other files kept, an interrupted run's checkpoint there discarded (without it "
                                     "--out must be new or empty, or hold this run's checkpoint: then use --resume)")
    data: tuple[str, ...] | None = option(None, "UTF-8 text files or directories of them to train on (default: "
                                                "the embedded CPython documentation topics)")
    eval_data: tuple[str, ...] | None = option(None, "a second held-out text (files or directories), never trained on")
    generated_tokens: int = option(0, "also train on this many tokens the float model samples itself before "
                                      "training (full distribution, temperature 1, seeded by --seed; written as "
                                      "generated.npy): distilling away from --data's domain (default: 0)")
    target: str = option("q4_0", "what QAT trains for: q4_0, q8_0, ... (a llama.cpp block on every decoder matrix), "
                                 "a llama.cpp mix as llama-quantize names it (Q4_K_M, Q4_K_S, Q5_K_M, Q5_K_S, Q6_K, "
                                 "Q8_0, Q4_0: every matrix on the block type llama.cpp gives it, embedding included), "
                                 "or int4 / int8 [/channel|/tensor|/group<N>][/symmetric|/qwix] (default: q4_0)")
    steps: int = option(240, "optimizer steps (default: 240)", type=positive_int)
    max_minutes: float | None = option(None, "stop training after this many minutes of steps (the learning-rate "
                                             "schedule is fitted to the steps that fit; compiling the step and the "
                                             "first curve point are not counted)")
    batch_size: int = option(4, "windows per micro-batch (default: 4)", type=positive_int)
    block: int = option(128, "tokens predicted per window (default: 128)", type=positive_int)
    accumulate: int = option(1, "micro-batches per optimizer step (gradient accumulation)", type=positive_int)
    lr: float = option(2e-5, "peak learning rate of AdamW (default: 2e-5)")
    warmup: int | None = option(None, "linear warm-up steps before the cosine decay (default: 5%% of --steps; with "
                                           "--max-minutes, of the steps that fit)")
    weight_decay: float = option(0.0, "AdamW's decoupled weight decay (default: 0.0)")
    grad_clip: float | None = option(1.0, "clip the gradient norm to this (default: 1.0)")
    objective: str = option("kl", "kl: distil the float model (KL at --temperature), ce: next-token "
                                  "cross-entropy, mix: (1-w) CE + w KL with w = --mix-weight", choices=OBJECTIVES)
    temperature: float = option(1.0, "temperature of the distillation KL (default: 1.0)")
    mix_weight: float = option(0.5, "w of --objective mix (default: 0.5)")
    lora: int | None = option(None, "train rank-LORA adapters on the frozen base; merged and requantized at the end",
                              type=positive_int)
    lora_alpha: float | None = option(None, "LoRA scale numerator (default: 2 x rank)")
    learned_scales: bool = option(False, "also learn the quantization scales (integer targets only)")
    act_bits: int | None = option(None, "8: QAT and PTQ also round each product's input as llama.cpp's CPU path does "
                                        "(Q8_0 blocks of 32, Q8_K blocks of 256 before K-quant products); llama.cpp "
                                        "targets only", type=positive_int)
    act_rounding: str = option("reference", "with --act-bits 8: round Q8_0 inputs as this llama.cpp build does: "
                                            "reference (ggml's C code, gguf-py), x86 (AVX/AVX2/AVX-512 builds) or "
                                            "arm (NEON builds) (default: reference)", choices=tuple(ACT_ROUNDINGS))
    tie_margin: float = option(0.0, "before the first step, move every quantized weight this fraction of the way to "
                                    "the value PTQ stores for it (the stored values stay the same): a weight on a "
                                    "rounding tie of the target, as in a dequantized llama.cpp file whose lattice "
                                    "divides the target's, then leaves PTQ's bin only once its gradient keeps one "
                                    "sign (default: 0, e.g. 0.05)")
    scale_lr: float | None = option(None, "learning rate of the learned scales (default: 10 x --lr)")
    dtype: str = option("float32", "float32, or bfloat16 autocast for student and teacher", choices=DTYPES)
    device: str = option("cpu", "torch device: cpu, cuda, cuda:1, ... (default: cpu)")
    held_out_fraction: float = option(0.1, "share of the data's tokens held out (its end; default: 0.1)")
    eval_windows: int = option(32, "held-out windows of each reported evaluation (default: 32)",
                               type=positive_int)
    curve_windows: int = 8
    curve_every: int | None = None
    checkpoint_every: int = option(50, "write a checkpoint every this many steps (default: 50)",
                                   type=positive_int)
    float_matrices: str | None = option(None, "GGUF storage of matrices left float (the token embedding): q8_0 "
                                                "(default), f16, f32; not with a mix --target, which decides them",
                                        choices=("q8_0", "f16", "f32"))
    tokenizer_pre: str | None = option(None, "llama.cpp's pre-tokenizer name for the GGUF files (tokenizer.ggml.pre, "
                                             "e.g. smollm), for a tokenizer whose name mixle cannot derive; a .gguf "
                                             "--model's tokenizer is copied from it as it is")
    seed: int = option(0, "seed of the data order (default: 0)")
    threads: int | None = option(None, "torch and llama.cpp CPU threads", type=positive_int)
    llama_cpp: bool = option(True, "skip the llama.cpp evaluation of the written files")
    imatrix: str = option("off", "a second PTQ baseline with llama.cpp's importance matrix, and QAT trained with it: "
                                 "off (default), calibrate (collect it as llama-imatrix does on --calibration-windows "
                                 "windows of the training split, never the held-out text; written as imatrix.gguf), "
                                 "or the path of a llama-imatrix file (.gguf or .dat) of this model; for targets with "
                                 "llama.cpp's weighted search (q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k, the mixes "
                                 "but Q8_0)")
    calibration_windows: int = option(64, "training windows of --block tokens the importance matrix and GPTQ are "
                                          "calibrated on (default: 64)", type=positive_int)
    qat_imatrix: bool = option(True, "with --imatrix: train QAT on the reference quantizer instead of the weighted "
                                     "search (the PTQ imatrix row is still reported; needed with --lora)")
    gptq: str = option("off", "also report GPTQ calibrated on the training windows: one-pass (every Hessian from one "
                              "pass), sequential (GPTQ's layer-by-layer mode: a pass per matrix, slow on large "
                              "models) or off (default); for int4 / int8 targets, q4_0 and q8_0", choices=GPTQ_MODES)
    hf_checkpoint: bool = option(True, "skip the transformers checkpoint of the QAT model's float32 weights (hf/, "
                                       "about 4 bytes a parameter), from which llama.cpp's convert_hf_to_gguf.py and "
                                       "llama-quantize rebuild the trained blocks")
    prompts: tuple[str, ...] | None = option(None, "chat prompts (one user turn each) that the float model, PTQ and "
                                                   "QAT answer greedily before and after training, shown in "
                                                   "results.json and the model card")
    answer_tokens: int = option(48, "at most this many tokens per chat answer (default: 48)", type=positive_int)
    backend: str = option("torch", "torch (default: the transformers model) or jax (mixle's Flax causal LM of a "
                                   "transformers Llama / Qwen2 / Mistral directory, trained data-parallel over "
                                   "jax.devices(); without --lora, --learned-scales, --gptq, --dtype bfloat16, "
                                   "--device)", choices=FRAMEWORKS)
    step_timing: int | None = option(None, "jax backend: before training, time this many QAT steps and as many "
                                           "steps of the float model training the same tensors on the same batch, "
                                           "interleaved; their medians and ratio go to results.json and the table "
                                           "(not counted in --max-minutes)", type=positive_int)

    def __post_init__(self):
        for name in ("model", "out"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name}={value!r}: --{name} is required (a path)")
        for name in ("data", "eval_data"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, (value,))
            elif value is not None and (not isinstance(value, tuple | list) or not value):
                raise ValueError(f"{name}={value!r} must be a list of paths or None")
            elif value is not None:
                object.__setattr__(self, name, tuple(str(v) for v in value))
        if self.prompts is not None:
            prompts = (self.prompts,) if isinstance(self.prompts, str) else self.prompts
            if not isinstance(prompts, tuple | list) or not prompts or not all(
                    isinstance(p, str) and p.strip() for p in prompts):
                raise ValueError(f"prompts={self.prompts!r} must be a list of non-empty strings (chat prompts) or None")
            object.__setattr__(self, "prompts", tuple(prompts))
        self._check_numbers()
        self._check_choices()
        self._check_target()
        self._check_act_bits()
        self._check_baselines()
        self._check_backend()

    def _check_numbers(self):
        for name in _POSITIVE:
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        for name, value in (("curve_every", self.curve_every), ("warmup", self.warmup), ("lora", self.lora),
                            ("threads", self.threads)):
            if value is not None and (not _is_int(value) or value < (0 if name == "warmup" else 1)):
                raise ValueError(f"{name}={value!r} must be a positive int or None")
        for name in _RATES:
            if not _is_rate(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive number")
        for name in ("max_minutes", "lora_alpha", "scale_lr", "grad_clip"):
            value = getattr(self, name)
            if value is not None and not _is_rate(value):
                raise ValueError(f"{name}={value!r} must be a positive number or None")
        if not isinstance(self.weight_decay, int | float) or not 0 <= self.weight_decay < 1:
            raise ValueError(f"weight_decay={self.weight_decay!r} must be in [0, 1)")
        if isinstance(self.tie_margin, bool) or not isinstance(self.tie_margin, int | float) or \
                not 0 <= self.tie_margin < 1:
            raise ValueError(f"tie_margin={self.tie_margin!r} must be in [0, 1), e.g. 0.05 (0: the weights as loaded)")
        if not isinstance(self.mix_weight, int | float) or not 0 < self.mix_weight < 1:
            raise ValueError(f"mix_weight={self.mix_weight!r} must be strictly between 0 and 1")
        if not isinstance(self.held_out_fraction, float) or not 0 < self.held_out_fraction < 1:
            raise ValueError(f"held_out_fraction={self.held_out_fraction!r} must be strictly between 0 and 1, e.g. 0.1")
        if not _is_int(self.generated_tokens) or self.generated_tokens < 0:
            raise ValueError(f"generated_tokens={self.generated_tokens!r} must be a non-negative int (0: train on the "
                             f"data only)")
        if not _is_int(self.seed) or self.seed < 0:
            raise ValueError(f"seed={self.seed!r} must be a non-negative int")

    def _check_choices(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective={self.objective!r} is unknown: use one of {OBJECTIVES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is unknown: use one of {DTYPES}")
        for name in ("learned_scales", "llama_cpp", "qat_imatrix", "overwrite", "hf_checkpoint"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.tokenizer_pre is not None and not (isinstance(self.tokenizer_pre, str) and self.tokenizer_pre.strip()):
            raise ValueError(f"tokenizer_pre={self.tokenizer_pre!r} must be llama.cpp's pre-tokenizer name, "
                             f"e.g. 'smollm'")
        if self.float_matrices is not None and self.float_matrices not in ("q8_0", "f16", "f32"):
            raise ValueError(f"float_matrices={self.float_matrices!r} is unknown: use q8_0, f16 or f32")
        if not isinstance(self.device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?|mps|xpu(:\d+)?", self.device):
            raise ValueError(f"device={self.device!r} is not a torch device: use cpu, cuda or cuda:N")

    def _check_target(self):
        """The target parses; learned scales fit its grid; a mix comes without options it cannot honour."""
        mix = self.mix()
        if mix is None:
            self.spec()
            return
        refused = [(flag, why) for flag, given, why in (
            ("--learned-scales", self.learned_scales, "its block scales come from llama.cpp's own search over each "
                                                      "block, not from a learned scale"),
            ("--float-matrices", self.float_matrices is not None, "it decides how every matrix is stored, as "
                                                                  "llama-quantize does"),
            ("--lora", self.lora is not None, "LoRA on a mix is not supported yet (the mix quantizes the embedding "
                                              "and head too, which apply_lora does not adapt)")) if given]
        if refused:
            flag, why = refused[0]
            raise ValueError(f"{flag} with --target {mix}: {why}; leave {flag} out (or pick a grid target, e.g. "
                             f"q4_0)")

    def _check_act_bits(self):
        """``act_bits`` is 8 on a llama.cpp target (whose products llama.cpp feeds Q8_0 / Q8_K blocks)."""
        if self.act_bits is None:
            if self.act_rounding != "reference":
                raise ValueError(f"--act-rounding {self.act_rounding} chooses how --act-bits 8 rounds each product's "
                                 f"input, but --act-bits is not set: add --act-bits 8, or drop --act-rounding")
            return
        if self.act_bits != 8:
            raise ValueError(f"act_bits={self.act_bits!r}: llama.cpp rounds the input of its products to 8 bits; "
                             f"use --act-bits 8 or leave it out")
        if self.mix() is None and self.spec().grid_record.activation_grid is None:
            raise ValueError(f"--act-bits with --target {self.target}: llama.cpp never runs this target (it is "
                             f"written as compressed-tensors, weight-only), so there is no product input to round "
                             f"as llama.cpp does; leave --act-bits out or pick a llama.cpp target (q4_0, Q4_K_M)")
        if self.gptq != "off":
            raise ValueError("--act-bits with --gptq: the GPTQ baseline rounds weights only; leave one of them out")

    def _check_baselines(self):
        """``imatrix`` and ``gptq`` name something the target can honour (the reason otherwise)."""
        if not isinstance(self.imatrix, str) or not self.imatrix:
            raise ValueError(f"imatrix={self.imatrix!r} must be 'off', 'calibrate' or the path of a llama-imatrix file")
        if self.gptq not in GPTQ_MODES:
            raise ValueError(f"gptq={self.gptq!r} is unknown: use one of {GPTQ_MODES}")
        if self.imatrix != "off":
            self._check_imatrix_target()
        elif not self.qat_imatrix:
            raise ValueError("--no-qat-imatrix without --imatrix: there is no importance matrix to leave out of QAT; "
                             "leave --no-qat-imatrix out, or add --imatrix calibrate")
        if self.gptq != "off":
            if self.mix() is not None:
                raise ValueError(f"--gptq with --target {self.mix()}: GPTQ rounds onto integer codes with one scale "
                                 f"rule, but the mix's K-quant blocks search their scales and mins per block; use a "
                                 f"grid target (int4/group32, q4_0) for --gptq, or --imatrix for the mix's baseline")
            try:
                check_gptq_spec(self.spec(), name=f"--gptq with --target {self.target}")
            except ValueError as err:
                raise ValueError(f"{err}; leave --gptq out") from None

    def _check_imatrix_target(self):
        """The target has ggml's importance-weighted search; no option refuses an importance."""
        mix = self.mix()
        grid = grid_of_type(GGUF_MIXES[mix].default) if mix else self.spec().grid
        try:
            how = importance_grid(grid, name=f"--imatrix with --target {self.target}")
        except ValueError as err:
            raise ValueError(f"{err}; for integer grids --gptq one-pass is the calibrated baseline") from None
        if how == "ignored":
            raise ValueError(f"--imatrix with --target {self.target}: llama.cpp ignores an importance matrix on {grid} "
                             f"(its quantizer has no weighted search), so the imatrix PTQ would be the PTQ row; leave "
                             f"--imatrix out, or pick a target with one (q4_0, q4_k, Q4_K_M, ...)")
        if self.lora is not None and self.qat_imatrix:
            raise ValueError("--lora with --imatrix: LoRA adapts only layers without an importance matrix (the merged "
                             "weights are requantized by the reference quantizer); add --no-qat-imatrix (the PTQ "
                             "imatrix row stays) or leave --lora out")

    def _check_backend(self):
        """``backend`` is known; the jax backend is given no option it cannot honour (the reason otherwise)."""
        if self.backend not in FRAMEWORKS:
            raise ValueError(f"backend={self.backend!r} is unknown: use one of {FRAMEWORKS}")
        if self.backend != "jax":
            if self.step_timing is not None:
                raise ValueError(f"--step-timing with --backend {self.backend}: the torch job's steps change its "
                                 f"model in place, so it times none apart; benchmarks/real_model.py --step-timing "
                                 f"times torch's QAT and float steps side by side (or use --backend jax)")
            return
        refused = [(flag, why) for flag, given, why in (
            ("--lora", self.lora is not None, "it trains the quantized kernels themselves (no adapters)"),
            ("--learned-scales", self.learned_scales, "its kernels fake-quantize with the grid's own scales"),
            ("--gptq", self.gptq != "off", "GPTQ runs on the torch model only"),
            ("--dtype bfloat16", self.dtype != "float32", "it trains and evaluates in float32"),
            (f"--device {self.device}", self.device != "cpu", "it runs on jax.devices(), not on a torch device"))
            if given]
        if refused:
            flag, why = refused[0]
            raise ValueError(f"{flag} with --backend jax: {why}; leave {flag.split()[0]} out, or use --backend torch")

    def importance_mode(self):
        """``"off"``, ``"calibrate"`` or ``"file"`` (``imatrix`` is a llama-imatrix file's path).

        >>> FinetuneConfig(model="m", out="o", imatrix="calibrate").importance_mode()
        'calibrate'
        """
        return self.imatrix if self.imatrix in IMATRIX_MODES else "file"

    def mix(self):
        """The llama.cpp mix the target names (``parse_mix``), or None for a grid target.

        >>> FinetuneConfig(model="m", out="o", target="Q4_K_M").mix(), FinetuneConfig(model="m", out="o").mix()
        ('Q4_K_M', None)
        """
        return parse_mix(self.target)

    def float_storage(self):
        """How the GGUF stores matrices QAT leaves float: ``float_matrices`` or ``"q8_0"``; None with a mix.

        >>> FinetuneConfig(model="m", out="o").float_storage()
        'q8_0'
        """
        return None if self.mix() else self.float_matrices or "q8_0"

    def act_fields(self):
        """The ``act_bits`` and ``act_rounding`` keywords of ``apply_qat`` / ``quantize_model`` ({} when unset).

        >>> FinetuneConfig(model="m", out="o", target="Q4_K_M", act_bits=8, act_rounding="x86").act_fields()
        {'act_bits': 8, 'act_rounding': 'x86'}
        """
        if self.act_bits is None:
            return {}
        return {"act_bits": self.act_bits, **({} if self.act_rounding == "reference" else
                                              {"act_rounding": self.act_rounding})}

    def spec(self):
        """The QuantSpec QAT trains on: the target's, with act_bits and learned scales if asked; None for a mix
        target (each layer then trains on ``gguf_mix_specs``' spec).

        >>> FinetuneConfig(model="m", out="o").spec().short()
        'int4/group32/q4_0'
        """
        if self.mix() is not None:
            return None
        spec = parse_target(self.target)
        spec = spec.replace(**self.act_fields())
        if not self.learned_scales:
            return spec
        try:
            return spec.replace(scale="learned")
        except ValueError as err:
            raise ValueError(f"--learned-scales with --target {self.target}: {err}") from None

    def distill_weight(self):
        """w of ``mixle.lm.distill.distill_row_loss``: 1 for ``kl``, 0 for ``ce``, ``mix_weight`` for ``mix``.

        >>> FinetuneConfig(model="m", out="o", objective="ce").distill_weight()
        0.0
        """
        return {"kl": 1.0, "ce": 0.0, "mix": float(self.mix_weight)}[self.objective]

    def replace(self, **changes):
        """A validated copy with some fields changed.

        >>> FinetuneConfig(model="m", out="o").replace(steps=5).steps
        5
        """
        return dataclasses.replace(self, **changes)


def _is_rate(value):
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


RESULT_FIELDS = tuple(f.name for f in dataclasses.fields(FinetuneConfig)
                      if f.name not in RESUMABLE_CHANGES + ("out", "model"))
