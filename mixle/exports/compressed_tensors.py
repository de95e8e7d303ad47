"""Hugging Face quantized checkpoints: compressed-tensors' ``pack-quantized`` format, both ways.

``save_pretrained_compressed`` writes a converted (or QAT) transformers model as a directory that
``transformers.AutoModelForCausalLM.from_pretrained`` loads (with ``compressed-tensors``
installed) and vLLM serves; ``load_pretrained_compressed`` reads such a directory back into a
transformers model whose Linear layers are mixle ``QuantizedLinear`` layers.

The mapping, per quantized Linear (``weight_args`` / ``spec_of_args``):

* mixle's integer codes and trained scale are stored as they are: ``weight_packed`` (the codes,
  packed by compressed-tensors' own compressor), ``weight_scale`` (mixle's scale, reshaped to
  compressed-tensors' ``(rows, groups)`` layout) and ``weight_shape``. Both symmetric grids fit
  compressed-tensors' signed int range (-8..7 / -128..127), so no code is re-chosen: the writer
  checks that what compressed-tensors packs is exactly mixle's codes.
* ``QuantSpec(bits, granularity, group_size)`` becomes ``QuantizationArgs(num_bits=bits,
  type="int", symmetric=True, strategy=granularity, group_size=...)``; clip settings need no
  field (codes and scale are stored). Grids whose dequantization is not ``code * positive scale
  in the weight's dtype`` (llama.cpp's ``q4_0`` / ``q8_0``) are refused.
* A head tied to the embedding (one codes+scale tensor in mixle) is stored once, as the
  embedding's dequantized float table, and the head is listed in ``ignore``: transformers ties
  ``lm_head.weight`` to ``embed_tokens.weight``, which a packed head does not have.

Mixtures of experts (transformers 5's fused ``Qwen3MoeExperts`` / ``MixtralExperts``): QAT or
converted experts are written as packed per-expert Linear weights, the layout transformers' loader
dequantizes and merges back into the fused Parameters; float experts, and experts on another
scheme than the other layers, are refused before anything is written
(``mixle.exports.compressed_experts``).

compressed-tensors and transformers are imported on first use (the ``hf`` extra).
"""

import copy
import json
import math
import os
from pathlib import Path

import torch
from torch import nn

from mixle._optional import require
from mixle.core.fileformat import checked_directory, replace_directory_atomically
from mixle.core.grids import GRIDS, grid_named
from mixle.core.numerics import QuantizedArray, dequantize_array
from mixle.core.packing import pack_int4
from mixle.core.spec import QuantSpec
from mixle.exports.compressed_experts import check_experts, check_one_scheme, unfuse_experts
from mixle.gguf.flax_twin import is_flax, quantized_twin
from mixle.torch_backend.transforms.convert import check_torch_model, convert
from mixle.torch_backend.transforms.apply import qat_layers
from mixle.torch_backend.layers.quantized import QuantizedEmbedding, QuantizedLinear, QuantizedWeight
from mixle.torch_backend.transforms.swap import Change

__all__ = ["save_pretrained_compressed", "load_pretrained_compressed", "weight_args", "spec_of_args",
           "check_quantization_config"]

FORMAT = "pack-quantized"
QUANT_METHOD = "compressed-tensors"
# compressed-tensors weight strategies that mixle has as a granularity of the same name.
_STRATEGIES = ("tensor", "channel", "group")


def _require_hf(purpose):
    transformers = require("transformers", extra="hf", purpose=purpose)
    require("compressed_tensors", extra="hf", purpose=purpose)
    return transformers


# ----------------------------------------------------------------------------------------------
# The spec <-> QuantizationArgs mapping.


def weight_args(spec):
    """compressed-tensors' ``QuantizationArgs`` for weights quantized with ``spec``.

    Raises:
        ValueError: ``spec`` has no compressed-tensors equivalent (the reason is in the message).

    >>> args = weight_args(QuantSpec(bits=4, group_size=32))
    >>> args.num_bits, args.type, args.symmetric, args.strategy, args.group_size
    (4, 'int', True, 'group', 32)
    """
    require("compressed_tensors", extra="hf", purpose="weight_args")
    from compressed_tensors.quantization import QuantizationArgs

    if not isinstance(spec, QuantSpec):
        raise TypeError(f"spec must be a mixle QuantSpec, got {type(spec).__name__}")
    grid = spec.grid_record
    problems = []
    if grid.scale_rule == "signed_max":
        problems.append(f"its scale comes from the block's signed maximum ({grid.scale_rule}), so it can be negative")
    elif grid.scale_rule != "absmax":
        problems.append(f"its scale comes from the rule {grid.scale_rule!r}, not the symmetric absmax")
    if grid.offset is not None or grid.two_level:
        problems.append("it stores per-block offsets or a second level of scales, which the symmetric scheme has not")
    if grid.scale_dtype is not None:
        problems.append(f"it stores scales as {grid.scale_dtype} (rounded from the weight's dtype)")
    low, high = -(2 ** (spec.bits - 1)), 2 ** (spec.bits - 1) - 1
    if spec.code_min < low or spec.code_max > high:
        problems.append(f"its codes {spec.code_min}..{spec.code_max} exceed int{spec.bits}'s {low}..{high}")
    extra = spec.qwix_only_options()
    if extra:
        problems.append(f"it sets {extra}, which pack-quantized weight checkpoints do not describe")
    if problems:
        raise ValueError(
            f"{spec.short()} cannot be stored as compressed-tensors: its symmetric int scheme dequantizes "
            f"code * weight_scale with codes in {low}..{high} and a positive scale in the weight's dtype, but "
            f"grid={spec.grid!r} ({grid.summary}): {'; '.join(problems)}. Train with grid='symmetric' or "
            f"grid='qwix' to export to compressed-tensors (the GGUF export takes llama.cpp's grids)"
        )
    return QuantizationArgs(num_bits=spec.bits, type="int", symmetric=True, strategy=spec.granularity,
                            group_size=spec.group_size, dynamic=False)


def _grid_reaching(bits, low):
    """The first plain grid (``Grid.is_plain``: mixle's default first) whose codes at ``bits`` reach ``low``."""
    return next(g.name for g in GRIDS.values() if g.is_plain() and bits in g.codes and g.code_range(bits)[0] <= low)


def spec_of_args(args, grid="qwix"):
    """The mixle QuantSpec of compressed-tensors weight ``args`` (the reverse of ``weight_args``).

    Args:
        args: a ``compressed_tensors.quantization.QuantizationArgs``.
        grid: the mixle grid the codes lie on: ``"qwix"`` (codes -2^(b-1)..2^(b-1)-1, scale =
            absmax / (qmax + 0.5): compressed-tensors' own rule) or ``"symmetric"`` (-qmax..qmax).

    Raises:
        ValueError: the scheme has no mixle equivalent; the message says why.

    >>> from compressed_tensors.quantization import QuantizationArgs
    >>> spec_of_args(QuantizationArgs(num_bits=4, strategy="group", group_size=16)).short()
    'int4/group16/qwix'
    """
    reasons = _args_problems(args)
    if reasons:
        raise ValueError(f"compressed-tensors weights {_describe(args)} have no mixle equivalent: {'; '.join(reasons)}")
    group_size = args.group_size if args.strategy == "group" else None
    return QuantSpec(bits=args.num_bits, grid=grid, granularity=args.strategy, group_size=group_size)


def _describe(args):
    return (f"(num_bits={args.num_bits}, type={args.type!r}, symmetric={args.symmetric}, "
            f"strategy={args.strategy!r}, group_size={args.group_size})")


def _args_problems(args):
    """Why mixle's QuantizedLinear cannot hold weights quantized with ``args`` (empty: it can)."""
    problems = []
    if args.type != "int":
        problems.append(f"type={args.type!r} weights are floats (e.g. fp8/fp4), mixle stores integer codes")
    if not args.symmetric:
        problems.append("asymmetric weights carry a zero point, mixle's grids are symmetric (no zero point)")
    if args.num_bits not in (4, 8):
        problems.append(f"num_bits={args.num_bits}: mixle stores 4- or 8-bit codes")
    if args.strategy not in _STRATEGIES:
        problems.append(f"strategy={args.strategy!r}: mixle has per-tensor, per-channel and group scales")
    if args.dynamic is not False:
        problems.append(f"dynamic={args.dynamic!r}: mixle's weight scales are stored, not computed at run time")
    if args.block_structure is not None:
        problems.append(f"block_structure={args.block_structure}: mixle has no 2-D block scales")
    return problems


# ----------------------------------------------------------------------------------------------
# Writing.


def save_pretrained_compressed(model, directory, *, tokenizer=None, overwrite=False):
    """Write a quantized transformers model as a compressed-tensors checkpoint directory.

    ``transformers.AutoModelForCausalLM.from_pretrained(directory)`` (with ``compressed-tensors``
    installed) then loads a model whose logits equal this model's (its fake-quant forward for a
    QAT model), and vLLM serves the directory. ``config.json`` gets a ``quantization_config``
    (``quant_method: "compressed-tensors"``, ``format: "pack-quantized"``, one config group per
    distinct weight scheme, the float Linear layers in ``ignore``); the weights are written by
    compressed-tensors' compressor and the model's own ``save_pretrained`` (safetensors). An
    embedding tied to a quantized head is stored once as its dequantized float table (same
    logits; the head is in ``ignore``), because transformers ties ``lm_head.weight`` to it.

    Args:
        model: a transformers ``PreTrainedModel`` with mixle quantized layers (from ``convert``
            or ``quantize_model``), or with QAT layers (converted here on a copy); or a QAT-wrapped
            or converted Flax causal LM (as its twin: ``mixle.gguf.flax_twin``). Not modified.
        directory: the checkpoint directory to create. It is written to a temporary sibling and
            renamed into place, so a failure leaves nothing behind; with ``overwrite`` the previous
            directory is kept exactly as it was until the new one is in place
            (``mixle.core.fileformat.replace_directory_atomically``).
        tokenizer: optional tokenizer (or processor) saved into the directory too.
        overwrite: replace an existing non-empty ``directory`` (otherwise refused).

    Returns:
        The ``quantization_config`` dict written into ``config.json``.

    Raises:
        TypeError: ``model`` is not a transformers PreTrainedModel.
        ValueError: the model has no quantized or QAT layer, or a layer's spec or kind has no
            compressed-tensors equivalent (checked before anything is written).
        FileExistsError: ``directory`` exists, is not empty and ``overwrite`` is False.

    >>> import tempfile, transformers
    >>> from mixle.torch_backend.transforms.convert import quantize_model
    >>> config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    >>> model = transformers.LlamaForCausalLM(config)
    >>> quantized = quantize_model(model, bits=4, group_size=8, exclude=("lm_head",))
    >>> written = save_pretrained_compressed(quantized, tempfile.mkdtemp() + "/llama-int4")
    >>> written["format"], written["config_groups"]["group_0"]["weights"]["strategy"], written["ignore"]
    ('pack-quantized', 'group', ['lm_head'])
    """
    transformers = _require_hf("save_pretrained_compressed")
    model = quantized_twin(model, "save_pretrained_compressed") if is_flax(model) else model
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"save_pretrained_compressed takes a transformers PreTrainedModel (it writes its config.json "
                        f"and from_pretrained rebuilds it), got {type(model).__name__}: save other torch models with "
                        f"save_quantized(model, path)")
    check_torch_model(model, "save_pretrained_compressed")
    experts = check_experts(model)
    target = checked_directory(directory, overwrite)
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise TypeError(f"tokenizer must have a save_pretrained method (a transformers tokenizer), got "
                        f"{type(tokenizer).__name__}")
    export = _private_quantized_copy(model)
    unfuse_experts(export)  # per-expert QuantizedLinear layers: the layout transformers' loader merges back
    groups, tied = _plan(export)
    check_one_scheme(groups, experts)
    _compress_in_place(export, groups, tied)
    return replace_directory_atomically(target, lambda tmp: _write(export, groups, tmp, tokenizer), overwrite)


def _private_quantized_copy(model):
    """A copy of ``model`` with quantized layers that this module may edit freely."""
    if qat_layers(model):
        return convert(model)  # already an independent copy
    if any(isinstance(m, QuantizedWeight) for m in model.modules()):
        return copy.deepcopy(model)
    raise ValueError(
        f"this {type(model).__name__} has no quantized or QAT layers, so there is nothing to compress: "
        f"prepare it with apply_qat(model, ...) and train, or quantize it with quantize_model(model, ...), then save"
    )


def _plan(model):
    """``(groups, tied)``: ``groups`` maps a weight-args JSON to ``(args, [(path, QuantizedLinear)])``;
    ``tied`` lists ``(embedding path, embedding, [(head path, head)])`` for shared tables.

    Every refusal happens here, before anything is built or written.
    """
    embeddings = {}
    linears = []
    for path, module in model.named_modules():
        if isinstance(module, QuantizedEmbedding):
            embeddings[id(module.codes)] = (path, module, [])
        elif isinstance(module, QuantizedLinear):
            linears.append((path, module))
        elif isinstance(module, QuantizedWeight):
            raise ValueError(f"layer {path!r} is a {type(module).__name__}: compressed-tensors' loaders quantize "
                             f"Linear layers only, so it cannot be exported")
    groups = {}
    for path, layer in linears:
        if id(layer.codes) in embeddings:
            embeddings[id(layer.codes)][2].append((path, layer))
            continue
        try:
            args = weight_args(layer.spec)
        except ValueError as err:
            raise ValueError(f"layer {path!r}: {err}") from None
        groups.setdefault(args.model_dump_json(), (args, []))[1].append((path, layer))
    for path, _, heads in embeddings.values():
        if not heads:
            raise ValueError(f"layer {path!r} is a QuantizedEmbedding not tied to a quantized head: compressed-tensors' "
                             f"loaders (transformers, vLLM) read quantized Linear layers only")
    if not groups:
        raise ValueError(
            "the only quantized layer is a head tied to the embedding, which compressed-tensors stores as its "
            "dequantized float table (transformers ties lm_head.weight to it), so the checkpoint would hold no "
            "quantized layer: quantize the other Linear layers too (apply_qat patterns), or keep mixle's own file "
            "(save_quantized)"
        )
    return groups, list(embeddings.values())


def _compress_in_place(model, groups, tied):
    """Swap each quantized layer of the private ``model`` for the module compressed-tensors saves."""
    from compressed_tensors.compressors.base import compress_module
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.initialize import initialize_module_for_quantization

    replacements = {}
    single = len(groups) == 1
    for args, members in groups.values():
        targets = ["Linear"] if single else [path for path, _ in members]
        for path, layer in members:
            codes = layer.quantized_array().codes
            # The compressor re-derives codes as round(weight / scale). In bfloat16 that division
            # can land half a step off for int8 codes near 127, so it gets code * scale in at least
            # float32, where the product of a 16-bit scale and an 8-bit code is exact.
            work = torch.promote_types(layer.scale.dtype, torch.float32)
            weight = dequantize_array(QuantizedArray(codes, layer.scale.to(work), layer.spec, 0, 1))
            linear = _float_linear(layer, nn.Parameter(weight, requires_grad=False))
            initialize_module_for_quantization(linear, QuantizationScheme(targets=targets, weights=args),
                                               force_zero_point=False)
            if linear.weight_scale.numel() != layer.scale.numel():
                raise RuntimeError(f"layer {path!r}: compressed-tensors expects {list(linear.weight_scale.shape)} "
                                   f"scales, mixle has {layer.scale.numel()}")
            with torch.no_grad():
                linear.weight_scale.copy_(layer.scale.reshape(linear.weight_scale.shape))
            compress_module(linear, CompressionFormat.pack_quantized)
            # Stored in the model's dtype, as compressed-tensors' loaders create weight_scale and
            # dequantize: a bfloat16 model's file holds mixle's codes with bfloat16-rounded scales,
            # so its weights are within one bfloat16 step of QAT's (float32-scale) values.
            linear.weight_scale = nn.Parameter(linear.weight_scale.detach().to(layer.float_dtype), requires_grad=False)
            packed = unpack_from_int32(linear.weight_packed, args.num_bits, torch.Size(layer.weight_shape))
            if not torch.equal(packed, codes):
                raise RuntimeError(f"layer {path!r}: compressed-tensors' compressor re-rounded some of mixle's codes; "
                                   f"nothing was written")
            replacements[id(layer)] = linear
    for _, embedding, heads in tied:
        table = nn.Parameter(embedding.dequantized_weight(), requires_grad=False)
        float_embedding = nn.Embedding(embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx,
                                       embedding.max_norm, embedding.norm_type, embedding.scale_grad_by_freq,
                                       device="meta")
        float_embedding.weight = table
        replacements[id(embedding)] = float_embedding
        for _, head in heads:
            replacements[id(head)] = _float_linear(head, table)
    with Change() as change:
        change.swap(model, replacements)
    _check_targets(model, groups)


def _float_linear(layer, weight):
    """An ``nn.Linear`` holding ``weight`` and a copy of ``layer``'s bias (no random init)."""
    linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
    linear.weight = weight
    if layer.bias is not None:
        linear.bias = nn.Parameter(layer.bias.detach().clone(), requires_grad=False)
    return linear


def _check_targets(model, groups):
    """The written config must select exactly the layers stored packed: match it as loaders do."""
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils import match_named_modules

    config = QuantizationConfig.from_pretrained(model, format=FORMAT)
    for scheme in config.config_groups.values():
        matched = {name for name, _ in match_named_modules(model, scheme.targets, config.ignore)}
        expected = {path for args, members in groups.values() if args == scheme.weights for path, _ in members}
        if matched != expected:
            raise RuntimeError(f"the quantization_config would select {sorted(matched ^ expected)} wrongly; nothing "
                               f"was written")


def _write(model, groups, directory, tokenizer):
    from compressed_tensors.compressors import ModelCompressor

    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=FORMAT)
    model.save_pretrained(directory)
    compressor.update_config(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    with open(Path(directory) / "config.json", encoding="utf-8") as handle:
        return json.load(handle)["quantization_config"]


# ----------------------------------------------------------------------------------------------
# Reading.


def load_pretrained_compressed(directory, *, grid=None, **from_pretrained_kwargs):
    """Load a compressed-tensors checkpoint into a transformers model with mixle QuantizedLinear layers.

    The directory may come from ``save_pretrained_compressed`` or from compressed-tensors /
    llm-compressor for a scheme mixle represents: ``pack-quantized`` symmetric int4/int8
    weights with per-tensor, per-channel or group scales and no activation quantization. The
    codes and ``weight_scale`` are taken as stored (no re-quantization); the other weights load
    through ``AutoModelForCausalLM.from_pretrained``.

    Args:
        directory: the checkpoint directory (or a Hub id transformers can resolve).
        grid: the mixle grid of the loaded specs. ``None`` picks per config group: ``"qwix"``
            (codes -2^(b-1)..2^(b-1)-1, compressed-tensors' own scale rule) when any code of the
            group is -2^(b-1), else ``"symmetric"`` (mixle's default grid); the dequantized
            weights are the same either way.
        **from_pretrained_kwargs: passed to ``from_pretrained`` (e.g. ``dtype``); not
            ``quantization_config``.

    Returns:
        The model: a transformers ``PreTrainedModel`` whose quantized Linear layers are
        ``QuantizedLinear``; it carries no ``quantization_config`` (save it again with
        ``save_pretrained_compressed``).

    Raises:
        ValueError: not a compressed-tensors checkpoint, or a scheme mixle cannot represent
            (asymmetric, float weights, activation or KV-cache quantization, other formats ...);
            refused with the reason before any weight is loaded.

    >>> import tempfile, transformers
    >>> from mixle.torch_backend.transforms.convert import quantize_model
    >>> config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    >>> path = tempfile.mkdtemp() + "/llama-int8"
    >>> _ = save_pretrained_compressed(quantize_model(transformers.LlamaForCausalLM(config), bits=8), path)
    >>> layer = load_pretrained_compressed(path).model.layers[0].mlp.down_proj
    >>> type(layer).__name__, layer.spec.short()
    ('QuantizedLinear', 'int8/channel/symmetric')
    """
    transformers = _require_hf("load_pretrained_compressed")
    if grid is not None:
        grid_named(grid)  # a clear error for an unknown grid name
    if "quantization_config" in from_pretrained_kwargs:
        raise TypeError("load_pretrained_compressed reads the checkpoint's own quantization_config: drop the "
                        "quantization_config argument")
    config = transformers.AutoConfig.from_pretrained(directory)
    check_quantization_config(config, directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, **from_pretrained_kwargs)
    return _to_quantized_linear(model, grid, directory)


def check_quantization_config(config, directory, *, mixle_layers=True):
    """The compressed-tensors ``QuantizationConfig`` of a transformers ``config``, checked by mixle before
    transformers reads a weight of the checkpoint ``directory``.

    Every config group's weights (and input activations) must have a bit width compressed-tensors
    stores (int 1..8, float 4 or 8), and on an empty (meta) copy of the model every layer the group
    targets must hold whole groups: a ``group`` strategy's ``group_size`` divides the layer's input
    width, a ``block`` strategy's block width divides it. Otherwise the stored scales
    cannot fit the weight, and transformers refuses with a size mismatch naming neither. With
    ``mixle_layers`` (``load_pretrained_compressed``) the scheme must also be one mixle's
    ``QuantizedLinear`` holds: ``pack-quantized`` symmetric int4 / int8 weights of Linear layers
    with tensor, channel or group scales, and no activation or KV-cache quantization.

    Args:
        config: the checkpoint's transformers config (``AutoConfig.from_pretrained(directory)``).
        directory: the checkpoint (named in messages).
        mixle_layers: also require a scheme mixle's layers represent; False (``mixle finetune``,
            which reads the model as float through transformers) checks only that the config fits
            the model.

    Returns:
        The ``QuantizationConfig``; None when ``config`` has no compressed-tensors
        ``quantization_config`` and ``mixle_layers`` is False.

    Raises:
        ValueError: the reason, naming the config group, the layer, its width and the group size.

    >>> import transformers
    >>> config = transformers.LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    >>> weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 48}
    >>> config.quantization_config = {"quant_method": "compressed-tensors", "format": "pack-quantized",
    ...     "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}, "ignore": ["lm_head"]}
    >>> check_quantization_config(config, "llama-int4")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: llama-int4: quantization_config group_0 quantizes tensor 'model.layers.0.self_attn.q_proj.weight' of ...
    """
    transformers = _require_hf("reading a compressed-tensors checkpoint")
    raw = getattr(config, "quantization_config", None)
    if hasattr(raw, "to_dict"):
        raw = raw.to_dict()
    if not mixle_layers and (not isinstance(raw, dict) or raw.get("quant_method") != QUANT_METHOD):
        return None
    qconfig = _checked_quantization_config(raw, directory, mixle_layers)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config))
    if mixle_layers:
        _check_layer_types(skeleton, qconfig, directory)
    _check_widths(skeleton, qconfig, directory)
    return qconfig


def _bits_problems(name, kind, args):
    if args is None:
        return []
    allowed = range(1, 9) if args.type == "int" else (4, 8)
    if args.num_bits not in allowed:
        return [f"{name}: {kind} of num_bits={args.num_bits} ({args.type}): compressed-tensors stores int codes of 1 to "
                f"8 bits and floats of 4 or 8"]
    return []


def _check_widths(skeleton, qconfig, directory):
    """Every layer a config group targets holds whole groups (blocks) of its ``group_size`` (``block_structure``)."""
    from compressed_tensors.utils import match_named_modules

    for name, scheme in qconfig.config_groups.items():
        layers = [(path, module.weight.shape) for path, module in
                  match_named_modules(skeleton, scheme.targets, qconfig.ignore)
                  if isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.dim() >= 2]
        for kind, args in (("weights", scheme.weights), ("input_activations", scheme.input_activations)):
            if args is None:
                continue
            group = args.group_size if args.group_size is not None and args.group_size > 0 else None
            block = args.block_structure if kind == "weights" else None
            for path, shape in layers:
                width = int(shape[-1])
                what = f"tensor {path + '.weight'!r}" if kind == "weights" else f"the input of {path!r}"
                if group and width % group:
                    common = math.gcd(*(int(s[-1]) for _, s in layers))
                    raise ValueError(
                        f"{directory}: quantization_config {name} quantizes {what} of width {width} in groups of "
                        f"group_size={group}, which does not divide {width}: the checkpoint's scales cannot fit this "
                        f"model (a damaged or hand-edited config.json?); the group needs a group_size dividing "
                        f"{common} (every width it targets), or {path!r} in ignore")
                if block and width % block[-1]:  # a last block of fewer rows is allowed (vLLM's kernels take it)
                    raise ValueError(
                        f"{directory}: quantization_config {name} quantizes {what} of width {width} in blocks of "
                        f"block_structure={list(block)}, whose {block[-1]} columns do not divide {width}: the "
                        f"checkpoint's scales cannot fit this model; the group needs blocks whose width divides every "
                        f"width it targets, or {path!r} in ignore")


def _checked_quantization_config(raw, directory, mixle_layers=True):
    """compressed-tensors' QuantizationConfig of the checkpoint, or ValueError saying why mixle refuses it."""
    from compressed_tensors.quantization import QuantizationConfig

    if not isinstance(raw, dict) or raw.get("quant_method") != QUANT_METHOD:
        method = raw.get("quant_method") if isinstance(raw, dict) else None
        raise ValueError(
            f"{directory}: config.json has no compressed-tensors quantization_config (quant_method={method!r}): "
            f"load a float checkpoint with from_pretrained and quantize it with quantize_model(model, ...)"
        )
    fields = {k: v for k, v in raw.items() if k in QuantizationConfig.model_fields}
    try:
        qconfig = QuantizationConfig.model_validate(fields)
    except ValueError as err:  # pydantic's ValidationError
        raise ValueError(f"{directory}: config.json's quantization_config is not one this compressed-tensors "
                         f"reads: {err}") from None
    invalid = [problem for name, scheme in qconfig.config_groups.items() for kind in ("weights", "input_activations")
               for problem in _bits_problems(name, kind, getattr(scheme, kind))]
    if invalid:
        raise ValueError(f"{directory}: config.json's quantization_config is not a valid compressed-tensors config: "
                         + "; ".join(invalid))
    if not mixle_layers:
        return qconfig
    problems = [f"{key} is set (sparse or transformed weights)" for key in ("sparsity_config", "transform_config")
                if raw.get(key)]
    if qconfig.kv_cache_scheme is not None:
        problems.append("kv_cache_scheme quantizes the KV cache, which mixle's layers do not")
    for name, scheme in qconfig.config_groups.items():
        form = scheme.format or qconfig.format
        if form != FORMAT:
            problems.append(f"{name}: format {form!r}; mixle reads {FORMAT!r}")
        if scheme.input_activations is not None or scheme.output_activations is not None:
            problems.append(f"{name}: activation quantization (input/output_activations), mixle's torch layers "
                            f"quantize weights only")
        if scheme.weights is None:
            problems.append(f"{name}: no weight quantization")
        else:
            problems += [f"{name}: {reason}" for reason in _args_problems(scheme.weights)]
    if problems:
        raise ValueError(f"{directory}: mixle cannot represent this compressed-tensors checkpoint: "
                         + "; ".join(problems))
    return qconfig


def _check_layer_types(skeleton, qconfig, directory):
    """Refuse schemes that target anything but Linear layers, on an empty (meta) copy of the model."""
    from compressed_tensors.utils import match_named_modules

    for name, scheme in qconfig.config_groups.items():
        for path, module in match_named_modules(skeleton, scheme.targets, qconfig.ignore):
            if type(module) is not nn.Linear:
                raise ValueError(f"{directory}: {name} quantizes {path!r}, a {type(module).__name__}; mixle's "
                                 f"QuantizedLinear replaces plain Linear layers only")


def _to_quantized_linear(model, grid, directory):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    found = {}
    for path, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        if not hasattr(module, "weight_packed"):
            raise ValueError(f"{directory}: layer {path!r} was not loaded in packed form; load without dequantize")
        args = scheme.weights
        shape = torch.Size(int(d) for d in module.weight_shape)
        codes = unpack_from_int32(module.weight_packed, args.num_bits, shape)
        found[path] = (module, args, codes)
    if not found:
        raise ValueError(f"{directory}: no layer of the model matches the quantization_config's targets")
    model_dtype = model.dtype
    low_code = {}
    for _, args, codes in found.values():
        key = args.model_dump_json()
        low_code[key] = min(low_code.get(key, 0), int(codes.min()))
    replacements = {}
    for path, (module, args, codes) in found.items():
        key = args.model_dump_json()
        chosen = grid or _grid_reaching(args.num_bits, low_code[key])
        spec = spec_of_args(args, chosen)
        scale = module.weight_scale.detach()
        if scale.dtype != model_dtype:
            raise ValueError(f"{directory}: layer {path!r} has {scale.dtype} scales but the model computes in "
                             f"{model_dtype}: load with dtype={scale.dtype}")
        stored = pack_int4(codes) if spec.bits == 4 else codes
        bias = None if module.bias is None else module.bias.detach()
        replacements[id(module)] = QuantizedLinear(stored, scale.reshape(1, -1, 1).clone(), spec, tuple(codes.shape), bias)
    with Change() as change:
        model = change.swap(model, replacements)
        hook = getattr(model, "ct_decompress_hook", None)  # compressed-tensors' decompress-on-first-forward
        if hook is not None:
            hook.remove()
            change.delete(model, "ct_decompress_hook")
        change.set(model, "hf_quantizer", None)
        if hasattr(model.config, "quantization_config"):
            delattr(model.config, "quantization_config")
    return model
