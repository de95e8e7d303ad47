"""mixle's one API over every backend: wrap, toggle, fake-quantize, report, convert, save, load, LoRA.

Nothing here imports torch, jax or flax at import time; each call finds the backend of its
argument in ``mixle.backends`` and imports only that one.
"""

from mixle import backends
from mixle._optional import is_available, stand_in
from mixle.core.numerics import quantize_dequantize_array
from mixle.core.lora_spec import LoRASpec
from mixle.core.report import LayerDecision, QATReport
from mixle.core.selection import LayerSelector
from mixle.core.spec import QuantSpec, resolve_spec
from mixle.gguf.imatrix_file import importance_by_layer, model_imatrix_names
from mixle.gguf.mix_selection import default_fields, mix_importance, mix_selection

__all__ = [
    "QuantSpec",
    "QATReport",
    "LayerDecision",
    "QATWrapper",
    "apply_qat",
    "set_fake_quant_enabled",
    "pull_toward_stored",
    "fake_quantize",
    "fake_quantize_int4",
    "get_qat_report",
    "invalidate_fake_quant_caches",
    "convert",
    "quantize_model",
    "calibrate_importance",
    "gptq_quantize",
    "save_quantized",
    "load_quantized",
    "model_nbytes",
    "LoRASpec",
    "apply_lora",
    "merge_lora",
    "get_lora_report",
    "lora_parameters",
]


def apply_qat(model, *, spec=None, patterns=(".*",), exclude=(), opt_in=(), reconfigure=False,
              example_inputs=None, gguf_mix=None, importance=None, **spec_fields):
    """Make a model's selected layers fake-quantize their weights for quantization-aware training.

    PyTorch: every selected Linear-like layer (``nn.Linear``, transformers' ``Conv1D``,
    ``nn.MultiheadAttention``'s in and out projections) is swapped in place for a QAT layer that
    shares its Parameters; weights, ``state_dict`` keys, tied weights and optimizers are
    untouched. Untied ``nn.Embedding`` tables (per-row scales) and ``nn.Conv1d``/``nn.Conv2d``
    (per output channel) are opt-in: ``opt_in=("embedding", "conv")`` or a pattern matching only
    such layers selects them; an embedding tied to a selected head always follows it. PEFT
    adapters are never quantized. The report lists every floating-point weight (two or more
    dimensions), quantized or not and why, and the share of weight elements quantized.

    Args:
        model: a ``torch.nn.Module`` (or a Flax module, with the ``jax`` extra).
        spec: a QuantSpec; or give its fields as keywords (``bits=4, group_size=32, ...``).
            Default: int4, per-channel, symmetric grid.
        patterns: regexes over dotted module paths, matched in full, first match wins; an entry
            may be ``(regex, QuantSpec)`` or ``(regex, None)`` (keep float). Each must match a
            layer, so typos fail loudly.
        exclude: regexes of module paths to keep in float; each must match a module.
        opt_in: layer kinds selected besides the Linear-like ones: ``"embedding"``, ``"conv"``
            (torch only).
        reconfigure: allow changing the spec of layers that are already wrapped.
        example_inputs: Flax only (required there): the positional inputs of one model call,
            e.g. ``(x,)``. The model is traced once under ``jax.grad`` (shapes only) to find which
            kernels Qwix quantizes; the report lists every kernel as quantized or skipped and why.
            Flax NNX models are changed in place (same object, same Params, class swapped to a
            Qwix subclass of theirs); Linen modules come back as a new module using the same params.
        gguf_mix: a llama.cpp mix (``mixle.GGUF_MIXES``, e.g. ``"Q4_K_M"``): each weight trains on
            the block type llama.cpp's quantizer gives it (``gguf_mix_specs``), for ``save_gguf``;
            it takes ``act_bits=8`` and ``act_rounding`` (inputs rounded as a llama.cpp build does).
        importance: an importance matrix as ``quantize_model`` takes it, fixed from calibration:
            each linear layer with an entry fake-quantizes by ggml's weighted search (STE
            backward), so ``llama-quantize --imatrix`` of the trained weights is the lattice QAT
            trained on; with ``gguf_mix``, as ``quantize_model``'s (types, entries needed). Flax:
            NNX causal LMs of ``mixle.lm.flax_causal_lm``, keyed by Flax or transformers paths.
            Refused on grids without that search (int, nf4) and other layer kinds; unused on
            ``q8_0`` / ``mxfp4`` (which ggml ignores it on), after checking.

    Returns:
        The model (for torch, the replacement if the root itself is an ``nn.Linear``). Its report
        of what was wrapped or skipped and why is ``get_qat_report(model)``.

    Raises:
        ValueError: a pattern matches nothing, a spec is invalid for a layer, or a layer is
            already wrapped with another spec and ``reconfigure`` is False. The model is then
            left exactly as it was.

    >>> import torch
    >>> net = apply_qat(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)), bits=4)
    >>> get_qat_report(net).wrapped
    ['0', '2']
    """
    values = None
    if importance is not None or gguf_mix is not None:
        patterns, opt_in, values = _llama_cpp_choices(model, gguf_mix, importance, spec, spec_fields, patterns,
                                                      exclude, opt_in)
    default = resolve_spec(spec, spec_fields if gguf_mix is None else default_fields(spec_fields))
    return _apply(model, default, patterns, exclude, opt_in, reconfigure, example_inputs, values)


def _apply(model, spec, patterns, exclude, opt_in, reconfigure, example_inputs, values):
    """``apply_qat`` once the mix (if any) has chosen the patterns."""
    if not isinstance(reconfigure, bool):
        raise TypeError(f"reconfigure must be True or False, got {reconfigure!r}")
    backend = backends.for_model(model, "apply_qat")
    selector = LayerSelector(patterns=patterns, exclude=exclude, default_spec=spec, opt_in=opt_in)
    if values is None:
        return backend.apply(model, selector, reconfigure, example_inputs)
    return backend.apply(model, selector, reconfigure, example_inputs, importance=values)


def _llama_cpp_choices(model, gguf_mix, importance, spec, spec_fields, patterns, exclude, opt_in):
    """``(patterns, opt_in, {layer path: importance} or None)`` of ``apply_qat``'s ``gguf_mix`` and
    ``importance``, the model's GGUF layout walked once for all of them."""
    values, source = None, model
    flax = backends.backend_of(model) is not None and backends.backend_of(model).name == "flax"
    if importance is not None:
        source = _torch_plan(model)
        values = importance_by_layer(source, importance)
        if flax:  # keyed by the twin's paths (mixle.gguf.flax_twin), as an imatrix of the torch model is
            from mixle.flax_backend.gguf_tensors import flax_path, torch_path

            values = {torch_path(flax_path(path)): v for path, v in values.items()}
    if gguf_mix is not None:
        patterns, opt_in = mix_selection(model if flax else source, gguf_mix, spec, spec_fields, patterns, exclude,
                                         opt_in, importance=values)
        values = values if values is None else mix_importance(source, gguf_mix, values)
    if flax and values is not None:
        from mixle.flax_backend.gguf_tensors import flax_path

        values = {flax_path(path): v for path, v in values.items()}
    return patterns, opt_in, values


def _torch_plan(model):
    """The GGUF plan of a torch model (``mixle.gguf.plan``), for ``apply_qat``'s ``importance``."""
    record = backends.backend_of(model)
    if record is None:
        raise TypeError(f"apply_qat(importance=...) takes torch and Flax NNX models (llama.cpp's imatrix quantizers), "
                        f"got a {type(model).__name__}: drop importance= for this model")
    from mixle.gguf.plan import plan_of

    if record.name == "flax":  # the plan of its transformers twin (mixle.gguf.flax_twin)
        from mixle.gguf.flax_twin import torch_twin

        model = torch_twin(model, "apply_qat(importance=...)")[0]
    return plan_of(model, "apply_qat(importance=...)")


def set_fake_quant_enabled(model, enabled):
    """Turn fake quantization on or off for every QAT layer of a model; returns the model.

    Off, the model computes exactly what the float model computes (bit-identical outputs and
    gradients), which is how you check fp32 quality during QAT.

    >>> import torch
    >>> net = apply_qat(torch.nn.Linear(4, 4))
    >>> set_fake_quant_enabled(net, False).enabled
    False
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, got {enabled!r}")
    return backends.for_model(model, "set_fake_quant_enabled").set_enabled(model, enabled)


def pull_toward_stored(model, margin):
    """Move every weight a QAT-wrapped model quantizes the fraction ``margin`` of the way to the value
    it stores, ``w + margin * (q - w)``; what it stores stays the same (checked per layer).

    A weight on a rounding tie of the target lattice (the float model a dequantized llama.cpp file
    whose lattice divides the target's) is then ``margin`` half-steps inside the bin PTQ chose, and
    leaves it only once its gradient keeps one sign: Adam's first step would otherwise send every tie
    across at once (``mixle finetune --tie-margin``).

    Returns:
        ``{"margin", "weights", "layers", "kept"}``: the weights and layers moved, and the layers left
        as they were because moving them would change what they store.

    >>> import torch
    >>> net = apply_qat(torch.nn.Sequential(torch.nn.Linear(32, 2)), grid="q4_0")
    >>> pull_toward_stored(net, 0.05)["layers"]
    1
    """
    return backends.for_model(model, "pull_toward_stored").pull_toward_stored(model, margin)


def invalidate_fake_quant_caches():
    """Make every cached fake-quantized torch weight stale, so its next use quantizes afresh.

    mixle quantizes a weight once per version and notices optimizer steps, ``load_state_dict``
    and in-place edits through the Parameter. Edits that bypass its version counter
    (``param.data.mul_(...)``, writes through a NumPy view) are not seen until the next optimizer
    step: call this after them. A no-op before any torch QAT layer has run.

    >>> import torch
    >>> layer = apply_qat(torch.nn.Linear(2, 1, bias=False), bits=4)
    >>> layer.weight.data[:] = torch.tensor([[7.0, -3.0]])  # scale 1: the weights are on the grid
    >>> x = torch.tensor([[1.0, 0.0]])  # picks the first weight
    >>> [layer(x).item() for _ in range(2)]  # the second use keeps the codes (and a fingerprint)
    [7.0, 7.0]
    >>> layer.weight.data[:] = torch.tensor([[-3.0, 7.0]])  # unseen: same version, same sums
    >>> layer(x).item()
    7.0
    >>> invalidate_fake_quant_caches()
    >>> layer(x).item()
    -3.0
    """
    import sys

    module = sys.modules.get("mixle.torch_backend.fake_quant")  # nothing is cached before it is imported
    if module is not None:
        module.invalidate_caches()


def get_qat_report(model):
    """The QATReport of the last ``apply_qat`` on this model.

    >>> import torch
    >>> print(get_qat_report(apply_qat(torch.nn.Sequential(torch.nn.Linear(4, 4)))))  # doctest: +NORMALIZE_WHITESPACE
    path  kind    action   spec                  reason
    0     Linear  wrapped  int4/channel/symmetric  matched '.*'
    1 quantized, 0 left in float; weights quantized: 100.0% of 16 elements
    """
    return backends.for_model(model, "get_qat_report").report(model)


def fake_quantize(x, *, spec=None, **spec_fields):
    """Quantize-dequantize an array; for torch and jax the gradient is the straight-through one.

    The forward equals ``quantize_dequantize_array(x, spec)`` bit for bit in x's own dtype.
    The backward passes the incoming gradient unchanged, or zeroes it where ``|x|`` exceeds the
    ``clip_percentile`` threshold when ``clip_gradient=True``. numpy arrays get the forward only.

    Args:
        x: float torch tensor, jax array or numpy array (rows = axis 0 for per-channel scales).
        spec: a QuantSpec; or its fields as keywords, e.g. ``bits=4, clip_percentile=99.9``.

    >>> import numpy as np
    >>> fake_quantize(np.array([0.7, -0.1, 0.04], np.float32), bits=4).tolist()
    [0.699999988079071, -0.10000000149011612, 0.0]
    """
    spec = resolve_spec(spec, spec_fields)
    if spec.scale == "learned" or spec.act_bits is not None:
        raise ValueError(
            f"fake_quantize(x) quantizes one array with scales computed from it, so it cannot honour "
            f"{'scale=' + repr(spec.scale) if spec.scale == 'learned' else 'act_bits=' + repr(spec.act_bits)}: "
            f"learned scales and activation quantization live in the QAT layers (apply_qat)"
        )
    backend = backends.for_array(x, "fake_quantize")
    if backend is None:
        return quantize_dequantize_array(x, spec)
    return backend.fake_quantize(x, spec)


def fake_quantize_int4(x, *, spec=None, **spec_fields):
    """``fake_quantize`` at 4 bits (symmetric grid: codes -7..7).

    >>> import numpy as np
    >>> fake_quantize_int4(np.array([1.4, 0.1], np.float32)).tolist()
    [1.399999976158142, 0.0]
    """
    bits = spec.bits if spec is not None else spec_fields.setdefault("bits", 4)
    if bits != 4:
        raise ValueError(f"fake_quantize_int4 got bits={bits!r}: use fake_quantize(x, bits={bits!r})")
    return fake_quantize(x, spec=spec, **spec_fields)


def convert(model):
    """Real int codes from a QAT model: each QAT layer becomes its quantized layer (a copy).

    The converted forward equals the QAT model's fake-quant forward bit for bit; tied weights
    are stored once. See ``mixle.torch_backend.transforms.convert.convert``.

    >>> import torch
    >>> [type(m).__name__ for m in convert(apply_qat(torch.nn.Sequential(torch.nn.Linear(8, 4))))]
    ['QuantizedLinear']
    """
    return backends.for_model(model, "convert").convert(model)


def quantize_model(model, spec=None, *, patterns=(".*",), exclude=(), opt_in=(), example_inputs=None,
                   gguf_mix=None, importance=None, **spec_fields):
    """Post-training quantization: ``convert(apply_qat(copy of model, ...))``, same grid as QAT.

    ``opt_in``, ``example_inputs`` (Flax only) and ``gguf_mix`` are as for ``apply_qat``.

    ``importance`` (torch models): llama.cpp's importance matrix, as a ``llama-imatrix`` file's
    path, ``calibrate_importance``'s result or ``{layer path: per-input-column values}``. Each
    linear layer it covers is then quantized by ggml's importance-weighted search, bit for bit as
    ``llama-quantize --imatrix`` (``mixle.gguf.ggml_weighted``), and under ``gguf_mix`` the layers
    get the types llama-quantize gives with an imatrix (Q4_0: the first eighth of ffn_down Q4_1).
    Fused experts (``calibrate_importance``'s ``<experts>.gate_up_proj`` / ``down_proj`` entries,
    or ``ffn_*_exps`` of a file) are quantized per expert with that expert's importance. Entries of
    layers the mix keeps float are unused, as in llama.cpp; under ``gguf_mix`` an importance without
    an entry for a ``blk.*`` matrix the mix quantizes by a weighted search is refused (without a mix,
    layers without an entry get the reference quantizer). ``save_gguf(result, gguf_mix=...,
    importance=...)`` then writes llama-quantize's file.

    >>> import torch
    >>> type(quantize_model(torch.nn.Linear(8, 4), bits=8)).__name__
    'QuantizedLinear'
    """
    if importance is not None:
        return _quantize_with_importance(model, spec, patterns, exclude, opt_in, gguf_mix, importance, spec_fields)
    if gguf_mix is not None:
        patterns, opt_in = mix_selection(model, gguf_mix, spec, spec_fields, patterns, exclude, opt_in)
        spec_fields = default_fields(spec_fields)
    return backends.for_model(model, "quantize_model").quantize_model(
        model, spec, patterns=patterns, exclude=exclude, opt_in=opt_in, example_inputs=example_inputs, **spec_fields)


def _quantize_with_importance(model, spec, patterns, exclude, opt_in, gguf_mix, importance, spec_fields):
    """``quantize_model`` with an importance matrix (torch): the converted copy, re-quantized layer by
    layer by the weighted search."""
    from mixle.gguf.plan import plan_of
    from mixle.torch_backend.transforms.importance import with_importance  # torch models only

    plan = plan_of(model, "quantize_model(importance=...)")  # the GGUF layout, walked once
    values = importance_by_layer(plan, importance)  # a file is read (and checked) once
    if gguf_mix is not None:
        patterns, opt_in = mix_selection(plan, gguf_mix, spec, spec_fields, patterns, exclude, opt_in,
                                         importance=values)
        values = mix_importance(plan, gguf_mix, values)
        spec_fields = default_fields(spec_fields)
    converted = backends.for_model(model, "quantize_model").quantize_model(
        model, spec, patterns=patterns, exclude=exclude, opt_in=opt_in, **spec_fields)
    return with_importance(converted, model, values)


def calibrate_importance(model, batches, *, layers=None, dataset="mixle.calibrate_importance"):
    """llama.cpp's importance matrix of a torch model: what ``llama-imatrix`` collects, per layer.

    Runs ``batches`` (token-id tensors, or dicts of model keywords) through ``model`` and sums,
    for every matrix ``save_gguf`` writes (or the given ``layers`` paths), the squared inputs of
    each input column and the input rows seen (products of fewer than 16 rows are skipped, as
    llama-imatrix skips them; its ``--process-output`` flag is needed for it to collect the head
    too). Fused experts are collected per expert as llama-imatrix collects ``MUL_MAT_ID``: entries
    ``<experts>.gate_up_proj`` / ``<experts>.down_proj`` with sums ``(E, in)`` and counts ``(E,)``
    (tokens routed to each expert, at any batch size). Keep the calibration text apart from
    evaluation text.
    ``dataset`` names the calibration text in the file (``imatrix.datasets``).

    Returns:
        ``mixle.core.imatrix.Imatrix`` keyed by layer path: pass it to ``quantize_model(...,
        importance=)``, or write it for ``llama-quantize --imatrix`` with ``mixle.save_imatrix``.

    >>> import torch
    >>> from mixle.models.transformer import build_causal_lm
    >>> lm = build_causal_lm(vocab=40, d_model=32, n_layer=1, n_head=2, block=16)
    >>> m = calibrate_importance(lm, [torch.randint(0, 40, (2, 16))])
    >>> m.counts["blocks.0.qkv"].tolist(), m.sums["blocks.0.qkv"].shape
    ([32], (1, 32))
    """
    from mixle.torch_backend.transforms.importance import calibrate_importance as collect

    if layers is None:
        layers = list(model_imatrix_names(model))
    return collect(model, batches, layers=list(layers), dataset=dataset)


def gptq_quantize(model, batches, spec=None, *, patterns=(".*",), exclude=(), opt_in=(), damp=0.01, block_size=128,
                  sequential=True, tied="round", **spec_fields):
    """GPTQ post-training quantization (Frantar et al. 2022) of a float torch model, onto mixle's grids.

    The result is ``quantize_model``'s converted copy (same selection, ties, grid, scale rule and
    code range) whose linear layers hold GPTQ's codes instead of round-to-nearest ones: each
    layer's input columns are rounded in order, the error of each spread over the columns not yet
    rounded through the inverse of the layer's damped calibration Hessian ``X^T X`` (lazy batches
    of ``block_size`` columns), with each group's scale computed by the grid's rule from the
    compensated weights when the group starts. mixle's own GPTQ (``mixle.core.gptq``; torchao
    0.18's prototype GPTQ runs on CUDA only, onto its own grid). ``save_quantized``,
    ``model_nbytes``, and ``save_gguf`` (``grid="q4_0"``: llama.cpp's grid and scale rule) take it.

    Args:
        model: a float ``torch.nn.Module`` (left unchanged). Flax models are refused.
        batches: calibration inputs, an iterable of tensors (``model(batch)``) or dicts
            (``model(**batch)``); keep them apart from evaluation text.
        spec, patterns, exclude, opt_in, spec_fields: as for ``quantize_model``. Grids with block
            numerics (K-quants, ``q4_1``, ``q5_*``, ``mxfp4``, ``nf4``), learned scales and
            ``act_bits`` are refused; selected layers other than ``nn.Linear`` must be excluded.
        damp: fraction of ``mean(diag H)`` added to the Hessian's diagonal (GPTQ's percdamp).
        block_size: columns per lazy batch (rounded up to a multiple of the group size).
        sequential: True: layers in model order, each calibrated on inputs through the earlier
            layers already quantized (one calibration pass per layer); False: every Hessian from
            one pass of the float model.
        tied: ``"round"``: a head tied to an embedding keeps round-to-nearest codes; ``"gptq"``:
            it gets GPTQ's codes, which the embedding then shares.

    Raises:
        ValueError: a refused grid or option, a selected layer that is no ``nn.Linear``, or one no
            calibration batch reached (naming it); the model is untouched.

    >>> import torch
    >>> q = gptq_quantize(torch.nn.Linear(64, 8), [torch.randn(128, 64)], bits=4, group_size=32)
    >>> type(q).__name__, model_nbytes(q).total
    ('QuantizedLinear', 352)
    """
    backend = backends.backend_of(model)
    if backend is None or backend.name != "torch":
        kind = "Flax" if backend is not None else type(model).__name__
        raise TypeError(f"gptq_quantize takes a torch.nn.Module, got a {kind} model: GPTQ's calibration hooks "
                        f"and converted layers are torch only; use quantize_model for Flax models")
    from mixle.torch_backend.transforms.gptq import gptq_quantize as run

    return run(model, batches, spec, patterns=patterns, exclude=exclude, opt_in=opt_in, damp=damp,
               block_size=block_size, sequential=sequential, tied=tied, **spec_fields)


def save_quantized(model, path, *, names=None):
    """Save a converted model as safetensors with mixle's hashed manifest; returns the manifest.

    Torch and Flax models write the same file: tensors under the equivalent torch model's
    ``state_dict`` names. A Flax module path is taken for that torch module path unless
    ``names`` maps it (``{"layers.1": "2"}`` where the torch ``nn.Sequential`` has an activation
    between; a tied ``nnx.Embed`` maps to ``(embedding path, head path)``); see
    ``mixle.flax_backend.export``. A torch model's module paths are the file's names already,
    so ``names`` is refused there.

    >>> import torch, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
    >>> save_quantized(quantize_model(torch.nn.Linear(8, 4)), path)["layers"][0]["kind"]
    'linear'
    """
    return backends.for_model(model, "save_quantized").save_quantized(model, path, names=names)


def load_quantized(path, model, *, names=None):
    """Load a ``save_quantized`` file into a copy of a float ``model`` built like the saved one.

    ``names`` (Flax models only) maps Flax module paths to the file's torch module paths, as for
    ``save_quantized``.

    >>> import torch, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
    >>> _ = save_quantized(quantize_model(torch.nn.Linear(8, 4)), path)
    >>> type(load_quantized(path, torch.nn.Linear(8, 4))).__name__
    'QuantizedLinear'
    """
    return backends.for_model(model, "load_quantized").load_quantized(path, model, names=names)


def model_nbytes(model):
    """A model's real storage bytes by kind (float, int8 codes, packed int4 codes, scales).

    >>> import torch
    >>> model_nbytes(quantize_model(torch.nn.Linear(64, 32, bias=False), bits=4)).total
    1152
    """
    return backends.for_model(model, "model_nbytes").model_nbytes(model)


def apply_lora(model, *, rank, alpha, dropout=0.0, patterns=(".*",), exclude=(), train_base=False,
               adapter_spec=None, quantize_merged=False):
    """Add a trainable low-rank adapter to each selected ``nn.Linear``, in place.

    Each selected layer becomes a ``LoRALinear`` (or a ``QATLoRALinear`` if ``apply_qat``
    already wrapped it) computing ``base(x) + alpha/rank * B(A(dropout(x)))``. It shares the
    base ``weight``/``bias`` Parameters, so base ``state_dict`` keys do not change; the adapter
    adds ``<path>.lora_A`` (rank x in, uniform init) and ``<path>.lora_B`` (out x rank, zeros),
    so the model's outputs are bit-identical to before until the adapter trains. ``apply_qat``
    before or after gives the same layers: the base weight is fake-quantized, the adapter is not
    (unless ``adapter_spec``). Layers whose weight is shared with another module (a head tied to
    an embedding) are skipped, because merging would change the other user of the weight too.
    When the goal is a merged int model, pass ``quantize_merged=True``: requantizing
    ``W + alpha/rank * B @ A`` rounds much of a float adapter's correction away
    (``benchmarks/lora_qat.py`` measures both).

    Flax NNX models (``mixle.flax_backend.lora``): each selected ``nnx.Linear`` becomes a
    ``LoRALinear`` in place (same path and Variables, adapter child ``lora`` with
    ``nnx.LoRAParam`` ``lora_a`` (in x r) and ``lora_b`` (r x out)); ``dropout``,
    ``adapter_spec`` and ``quantize_merged`` are torch only. NNX has no ``requires_grad``: train
    the adapters alone with ``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)`` (``train_base``
    changes nothing there).

    Args:
        model: a ``torch.nn.Module``.
        rank: adapter rank r, 1 <= r <= min(in_features, out_features) of every selected layer.
        alpha: the adapter output is scaled by ``alpha / rank``.
        dropout: dropout probability on the adapter input (training mode only).
        patterns: regexes over dotted module paths, matched in full, first match wins (as in
            ``apply_qat``); an entry may be ``(regex, LoRASpec)`` for its own rank/alpha, or
            ``(regex, None)`` to leave those layers without adapter.
        exclude: regexes of module paths never adapted; each must match a module.
        train_base: False (default) sets ``requires_grad=False`` on every parameter of the
            model except the adapters; True leaves every ``requires_grad`` flag as it is.
        adapter_spec: QuantSpec to fake-quantize the adapters too (see ``LoRASpec``).
        quantize_merged: fake-quantize ``W + alpha/rank * B @ A`` as one weight, so training
            sees exactly what merge + convert store (see ``LoRASpec``).

    Returns:
        The model (the replacement if the root itself is an ``nn.Linear``); what was adapted or
        skipped, and why, is ``get_lora_report(model)``.

    Raises:
        ValueError: invalid rank/alpha/dropout, a rank above a selected layer's
            min(in, out), a pattern that matches nothing, no layer left to adapt, or a layer
            that already has an adapter with another spec. The model is then untouched.

    >>> import torch
    >>> net = apply_lora(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)), rank=2, alpha=4)
    >>> get_lora_report(net).wrapped, [n for n, p in net.named_parameters() if p.requires_grad]
    (['0', '2'], ['0.lora_A', '0.lora_B', '2.lora_A', '2.lora_B'])
    """
    lora = LoRASpec(rank=rank, alpha=alpha, dropout=dropout, adapter_spec=adapter_spec,
                    quantize_merged=quantize_merged)
    if not isinstance(train_base, bool):
        raise TypeError(f"train_base must be True or False, got {train_base!r}")
    backend = backends.for_model(model, "apply_lora")
    selector = LayerSelector(patterns=patterns, exclude=exclude, default_spec=lora, spec_type=LoRASpec)
    return backend.apply_lora(model, selector, train_base)


def merge_lora(model):
    """Fold every adapter into its base weight and remove the adapters, in place.

    Each adapted layer's weight becomes ``W + (B @ A) * alpha/rank`` (computed in at least
    float32, with the fake-quantized ``A``/``B`` where ``adapter_spec`` is active) and the layer
    goes back to a ``QATWrapper`` (same spec and on/off state) or a plain ``nn.Linear``, sharing
    the same Parameter objects. ``convert(model)`` then stores the merged weights as real ints.
    ``requires_grad`` flags are left as they are.

    Returns:
        The model (the replacement if the root itself was adapted).

    Raises:
        ValueError: the model has no adapters (it is then untouched).

    >>> import torch
    >>> net = apply_lora(torch.nn.Sequential(torch.nn.Linear(4, 4)), rank=1, alpha=1)
    >>> type(merge_lora(net)[0]).__name__
    'Linear'
    """
    return backends.for_model(model, "merge_lora").merge_lora(model)


def get_lora_report(model):
    """The report of the last ``apply_lora`` on this model (a ``QATReport`` of adapted layers).

    >>> import torch
    >>> print(get_lora_report(apply_lora(torch.nn.Sequential(torch.nn.Linear(4, 4)), rank=2, alpha=2)))  # doctest: +NORMALIZE_WHITESPACE
    path  kind    action   spec         reason
    0     Linear  wrapped  lora r2 a2  matched '.*'
    1 adapted, 0 without adapter
    """
    return backends.for_model(model, "get_lora_report").lora_report(model)


def lora_parameters(model):
    """The adapter Parameters (``lora_A``, ``lora_B`` of every adapted layer), e.g. for an optimizer.

    >>> import torch
    >>> len(lora_parameters(apply_lora(torch.nn.Sequential(torch.nn.Linear(4, 4)), rank=1, alpha=1)))
    2
    """
    return backends.for_model(model, "lora_parameters").lora_parameters(model)


def __getattr__(name):
    if name == "QATWrapper":
        if not is_available("torch"):
            return stand_in("QATWrapper", "torch")
        from mixle.torch_backend.layers.qat import QATWrapper

        return QATWrapper
    raise AttributeError(f"module 'mixle.api' has no attribute {name!r}")
