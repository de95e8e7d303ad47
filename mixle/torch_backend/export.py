"""Saving and loading converted torch models in mixle's file format, and their real byte counts.

The format (safetensors plus a hashed JSON manifest) is ``mixle.core.fileformat``'s, its manifest
built and checked by ``mixle.core.manifest`` (shared with the Flax backend); this module maps torch
modules onto it through the layer kinds.
"""

import copy
import dataclasses
import hashlib
import json

import safetensors.torch
import torch

from mixle.core.fileformat import ModelBytes, manifest_from, open_tensors, replace_atomically
from mixle.core.manifest import build_manifest, checked_tensors, layer_entry, manifest_metadata, read_layer
from mixle.core.stored import check_stored
from mixle.torch_backend.layers.expert_layers import QuantizedFusedWeight, fused_weight_names, loaded_fused
from mixle.torch_backend.layers.layer_kinds import QAT_TYPES, QUANTIZED_TYPES, kind_named
from mixle.torch_backend.layers.quantized import GRID_PARTS, QuantizedWeight, file_scale_dtype, scale_nbytes
from mixle.torch_backend.transforms.swap import Change

__all__ = ["model_nbytes", "save_quantized", "load_quantized"]


def model_nbytes(model):
    """Count a torch model's real storage bytes by kind (fp32 vs int8 vs packed int4 vs scales).

    Args:
        model: a torch model, float, QAT-wrapped (counted as float) or quantized.

    Returns:
        ModelBytes.

    >>> import torch
    >>> from mixle.torch_backend.transforms.convert import quantize_model
    >>> nb = model_nbytes(quantize_model(torch.nn.Linear(64, 32, bias=False), bits=4))
    >>> nb.int4_code_bytes, nb.scale_bytes, nb.total  # 64*32/2 code bytes, 32 fp32 scales
    (1024, 128, 1152)
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model_nbytes takes a torch.nn.Module, got {type(model).__name__}")
    counts = {field.name: 0 for field in dataclasses.fields(ModelBytes)}
    seen = set()
    for module in model.modules():
        own = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        for name, tensor in own:
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            size = tensor.numel() * tensor.element_size()
            if isinstance(module, QuantizedWeight) and name == "codes":
                kind = "int4_code_bytes" if module.spec.bits == 4 else "int8_code_bytes"
            elif isinstance(module, QuantizedWeight) and name in ("scale", "offset") and tensor.is_floating_point():
                kind, size = "scale_bytes", scale_nbytes(module.spec, tensor)  # float16 on llama.cpp's grids
            elif isinstance(module, QuantizedWeight) and name in GRID_PARTS:
                kind = "scale_bytes"  # second-level scales and mins (K-quants)
            elif tensor.is_floating_point():
                kind = "float_bytes"
            else:
                kind = "other_bytes"
            counts[kind] += size
    return ModelBytes(**counts)


def _st_dtype(dtype):
    names = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}
    return names.get(dtype)


def _stored(tensor, name):
    """The tensor as it is written: detached, on the CPU, contiguous, of a storable dtype."""
    tensor = tensor.detach().cpu().contiguous()
    if _st_dtype(tensor.dtype) is None:
        raise TypeError(f"tensor {name!r} has dtype {tensor.dtype}, which save_quantized cannot store: "
                        f"cast that module to float32 first")
    return tensor


def _sha256(tensor):
    """sha256 of a contiguous CPU tensor's bytes as safetensors stores them (no copy)."""
    return hashlib.sha256(tensor.reshape(-1).view(torch.uint8).numpy()).hexdigest()


def _describe(tensor, name):
    """``(safetensors dtype, shape, sha256)`` of a stored tensor, as the manifest lists it."""
    return _st_dtype(tensor.dtype), tuple(tensor.shape), _sha256(tensor)


def _layer_entry(path, module, names):
    kind = kind_named(module.KIND)
    check_stored(module.codes, module.scale, module.spec, module.weight_shape, name=f"layer {path!r}",
                 **module.grid_parts())
    options = {"bias": names.get("bias")} if kind.has_bias else {}
    options.update(kind.options_of(module))
    nbytes = (module.codes.numel() * module.codes.element_size(), scale_nbytes(module.spec, module.scale))
    return layer_entry(path, kind.name, module.spec, module.weight_shape, names, nbytes, **options)


def save_quantized(model, path):
    """Save a quantized torch model to a safetensors file with a JSON manifest (never pickle).

    Shared tensors (a tied embedding and head hold one codes+scales pair) are stored once; the
    other names are recorded as aliases. See the module docstring for the manifest.

    Args:
        model: a model from ``convert`` or ``quantize_model``.
        path: the file to write, e.g. ``"model.safetensors"`` (replaced atomically).

    Returns:
        The manifest (a dict), as stored in the file.

    Raises:
        ValueError: the model has QAT layers (convert it first) or no quantized layer.

    >>> import torch, tempfile, os
    >>> from mixle.torch_backend.transforms.convert import quantize_model
    >>> path = os.path.join(tempfile.mkdtemp(), "mlp.safetensors")
    >>> manifest = save_quantized(quantize_model(torch.nn.Sequential(torch.nn.Linear(8, 4)), bits=4), path)
    >>> manifest["layers"][0]["path"], manifest["nbytes"]["int4_code_bytes"]
    ('0', 16)
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"save_quantized takes a torch.nn.Module, got {type(model).__name__}")
    if any(isinstance(m, QAT_TYPES) for m in model.modules()):
        raise ValueError("the model still has QAT layers: save convert(model), the model with real int weights")
    if not any(isinstance(m, QuantizedWeight) for m in model.modules()):
        raise ValueError("the model has no quantized layer: make one with quantize_model(model) or convert(qat_model)")
    state = model.state_dict(keep_vars=True)
    stored, aliases = _stored_state(model, state)
    layers = []
    for path_, module in model.named_modules():
        if isinstance(module, QuantizedWeight):
            prefix = f"{path_}." if path_ else ""
            names = {key: f"{prefix}{key}" for key, t in module.named_buffers(recurse=False) if t is not None}
            missing = [n for n in names.values() if n not in state]
            if missing:
                raise ValueError(f"layer {path_!r}: buffers {missing} are not in the model's state_dict")
            layers.append(_layer_entry(path_, module, names))
    described = {name: _describe(t, name) for name, t in stored.items()}
    manifest = build_manifest(layers, described, aliases, model_nbytes(model))
    metadata = manifest_metadata(manifest)
    replace_atomically(path, lambda tmp: safetensors.torch.save_file(stored, tmp, metadata=metadata))
    return manifest


def _stored_state(model, state):
    """``({name: tensor as written}, {alias: stored name})``: each shared tensor stored once."""
    # Scales of float16 grids (llama.cpp's) are written as the float16 values they hold.
    narrow = {id(t): file_scale_dtype(m.spec) for m in model.modules()
              if isinstance(m, QuantizedWeight) and file_scale_dtype(m.spec) is not None
              for t in (m.scale, m.offset) if t is not None and t.is_floating_point()}
    first_name, aliases, stored, storages = {}, {}, {}, set()
    for name, tensor in state.items():
        if id(tensor) in first_name:
            aliases[name] = first_name[id(tensor)]
            continue
        first_name[id(tensor)] = name
        tensor = _stored(tensor.to(narrow[id(tensor)]) if id(tensor) in narrow else tensor, name)
        if tensor.numel() and tensor.untyped_storage().data_ptr() in storages:
            tensor = tensor.clone()  # a view of a stored tensor's memory: safetensors stores each once
        storages.add(tensor.untyped_storage().data_ptr())
        stored[name] = tensor
    return stored, aliases


def _skeleton_copy(model, replaced_paths):
    """A deep copy of ``model`` whose weights held only by layers about to be replaced are
    meta-device placeholders (their shape and dtype, no memory): the copy costs only what stays."""
    holders = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for _, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), (param, set()))[1].add(path)
    memo = {}
    for param, paths in holders.values():
        if paths <= replaced_paths:
            memo[id(param)] = torch.nn.Parameter(torch.empty_like(param, device="meta"), param.requires_grad)
    return copy.deepcopy(model, memo)


def _scale_dtype(weight_dtype, spec):
    """The dtype convert holds a ``weight_dtype`` weight's scales in: float32 on block-numerics grids and
    for bfloat16/float16 weights (their float32 copy's; files written before hold them in the weight's
    dtype, which loads too: each value is then that scale times its code, as it was), else the weight's."""
    if spec.grid_record.numerics is not None or weight_dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return weight_dtype


def _held_parts(entry, stored, own_weight, widened, where):
    """``(codes, scale, parts)`` of a manifest layer, float16-stored scales (and mins) in the dtype
    convert holds them in for ``own_weight`` (one copy per stored tensor: ``widened``), checked
    against the entry's byte counts."""
    spec = stored.spec
    codes, scale = stored.parts["codes"], stored.parts["scale"]
    parts = {part: stored.parts[part] for part in GRID_PARTS if part in stored.parts}
    stored_dtype = file_scale_dtype(spec)
    if stored_dtype is not None:
        if scale.dtype != stored_dtype:
            raise ValueError(f"{where}: grid={spec.grid!r} stores {stored_dtype} scales, the file has "
                             f"{scale.dtype}: the data is corrupt or was written by another tool")
        if isinstance(own_weight, torch.Tensor) and own_weight.is_floating_point():
            held = _scale_dtype(own_weight.dtype, spec)  # as convert holds it
            scale = widened.setdefault(id(scale), scale.to(held))
            if parts.get("offset") is not None and parts["offset"].is_floating_point():  # float16 mins too
                parts["offset"] = widened.setdefault(id(parts["offset"]), parts["offset"].to(held))
    if entry.get("codes_nbytes") != codes.numel() * codes.element_size() or \
            entry.get("scale_nbytes") != scale_nbytes(spec, scale):
        raise ValueError(f"{where}: the manifest's codes_nbytes/scale_nbytes disagree with the tensors")
    return codes, scale, parts


def _stored_kind(stored, where):
    try:
        return kind_named(stored.kind)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: the manifest entry is incomplete or invalid ({err!r})") from None


def _build_layer(entry, tensors, module, source, widened):
    """The quantized module for one manifest layer, checked against the skeleton's module.

    Float16-stored scales come back in the skeleton weight's dtype, one copy per stored tensor
    (``widened``: id of the file's tensor -> its copy), so tied layers still share it."""
    where = f"{source}: layer {entry.get('path')!r}"
    stored = read_layer(entry, tensors, source)  # the shared manifest and storage checks
    spec, shape, bias = stored.spec, stored.shape, stored.bias
    kind = _stored_kind(stored, where)
    if kind.assemble is not None:
        raise ValueError(f"{where}: a {kind.name} weight is saved under its module's path and weight name, "
                         f"not a module's path: the file is corrupt or was written by another tool")
    own_weight = kind.weight_of(module) if isinstance(module, kind.float_types) else None
    codes, scale, parts = _held_parts(entry, stored, own_weight, widened, where)
    if not isinstance(module, kind.float_types) or kind.stored_shape(kind.weight_of(module).shape) != shape or \
            (kind.has_bias and (kind.bias_of(module) is None) != (bias is None)):
        raise ValueError(f"{where}: the file holds a {kind.name} {list(shape)} (bias={bias is not None}), the model "
                         f"has {module!r}: pass a model built like the saved one")
    weight, own_bias = kind.weight_of(module), kind.bias_of(module)
    if scale.dtype not in (weight.dtype, _scale_dtype(weight.dtype, spec)):
        raise ValueError(f"{where}: its scales are {scale.dtype} but the model's weight is {weight.dtype}: "
                         f"pass a model built like the saved one (in {scale.dtype})")
    if bias is not None and bias.dtype != own_bias.dtype:
        raise ValueError(f"{where}: its bias is {bias.dtype} but the model's is {own_bias.dtype}: "
                         f"pass a model built like the saved one")
    extra = kind.options_of(module)
    for name, value in extra.items():
        if name not in entry or entry[name] != json.loads(json.dumps(value)):  # as the manifest holds it
            raise ValueError(f"{where}: {name}={entry.get(name, '<missing>')!r:.40} in the file but "
                             f"{name}={value!r} in the model: pass a model built like the saved one")
    extra.update({name: getattr(module, name) for name in kind.linear_children})
    if kind.has_bias:
        extra["bias"] = bias
    return kind.quantized_type(codes, scale, spec, shape, **extra, **parts, dtype=weight.dtype).train(module.training)  # MHA's path depends on it


def _fused_owner(path, modules):
    """``(module path, weight name)`` when ``path`` names a weight of a fused module, else None."""
    if not isinstance(path, str) or path in modules:
        return None
    owner, _, name = path.rpartition(".")
    module = modules.get(owner)
    return (owner, name) if module is not None and name in fused_weight_names(module) else None


def _build_fused_weight(entry, tensors, module, name, source, widened):
    """The ``QuantizedFusedWeight`` of one saved weight of fused ``module`` (the skeleton's)."""
    where = f"{source}: layer {entry.get('path')!r}"
    stored = read_layer(entry, tensors, source)
    kind = _stored_kind(stored, where)
    weight = module._parameters.get(name)
    if kind.assemble is None or not isinstance(module, kind.float_types) or weight is None or \
            kind.stored_shape(weight.shape) != stored.shape or entry.get("array_shape") != list(weight.shape):
        raise ValueError(f"{where}: the file holds a {kind.name} weight {entry.get('array_shape')!r:.40}, the model "
                         f"has {type(module).__name__}.{name} {list(getattr(weight, 'shape', []))}: pass a model "
                         f"built like the saved one")
    codes, scale, parts = _held_parts(entry, stored, weight, widened, where)
    if scale.dtype not in (weight.dtype, _scale_dtype(weight.dtype, stored.spec)):
        raise ValueError(f"{where}: its scales are {scale.dtype} but the model's weight is {weight.dtype}: "
                         f"pass a model built like the saved one (in {scale.dtype})")
    return QuantizedFusedWeight(codes, scale, stored.spec, tuple(weight.shape), kind.name, **parts)


def _fused_layers(found, modules, source):
    """``{id(module): converted module}`` of the fused modules whose weights were loaded (``found``:
    owner path -> {weight name: QuantizedFusedWeight}); each needs all its weights, with one spec."""
    out = {}
    for owner, children in found.items():
        module = modules[owner]
        missing = [n for n in fused_weight_names(module) if n not in children]
        if missing or len({child.spec for child in children.values()}) != 1:
            raise ValueError(f"{source}: the fused module {owner!r} needs all its weights {list(fused_weight_names(module))} "
                             f"with one spec, the file has {sorted(children)}: the file is corrupt or incomplete")
        out[id(module)] = loaded_fused(module, children).train(module.training)
    return out


def _owners(paths, modules, source):
    """For each saved layer path: ``(module path, weight name)`` for a weight of a fused
    experts/router module, else None; a path naming nothing in the model is refused."""
    owners = []
    for path_ in paths:
        owners.append(_fused_owner(path_, modules))
        if owners[-1] is None and (not isinstance(path_, str) or path_ not in modules):
            raise ValueError(f"{source}: the model has no module {path_!r:.80} for a saved layer: "
                             f"pass a model built like the saved one")
    return owners


def _replacements(entries, owners, tensors, modules, source):
    """``{id(module of the skeleton): its quantized module}`` for every saved layer."""
    replacements, widened, fused = {}, {}, {}
    for entry, owner in zip(entries, owners):
        if owner is not None:
            fused.setdefault(owner[0], {})[owner[1]] = _build_fused_weight(entry, tensors, modules[owner[0]],
                                                                           owner[1], source, widened)
        else:
            replacements[id(modules[entry["path"]])] = _build_layer(entry, tensors, modules[entry["path"]], source,
                                                                    widened)
    replacements.update(_fused_layers(fused, modules, source))
    return replacements


def load_quantized(path, model):
    """Load a file written by ``save_quantized`` into a copy of a float model of the same architecture.

    Everything is validated before it is used: the safetensors structure, the manifest's format
    version and sha256, each tensor's dtype, shape and sha256, each layer's spec, bits, shapes
    and code range, its scale and bias dtypes and its options (e.g. an embedding's padding_idx)
    against the model's layer, and that the tensors match the model's state_dict names, shapes
    and dtypes exactly. Tied layers come back sharing one codes+scales tensor.

    Args:
        path: a file written by ``save_quantized``.
        model: a float model built like the saved one (e.g. freshly constructed); not modified.

    Returns:
        A new model whose saved layers are QuantizedLinear / QuantizedEmbedding (fused MoE experts:
        their Quantized<class>, one saved entry per weight, at ``<module path>.<weight name>``), on the device
        of the model's first parameter.

    Raises:
        ValueError: the file is corrupt, truncated or tampered, or does not fit ``model``.

    >>> import torch, tempfile, os
    >>> from mixle.torch_backend.transforms.convert import quantize_model
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 4))
    >>> path = os.path.join(tempfile.mkdtemp(), "mlp.safetensors")
    >>> _ = save_quantized(quantize_model(net, bits=4), path)
    >>> type(load_quantized(path, torch.nn.Sequential(torch.nn.Linear(8, 4)))[0]).__name__
    'QuantizedLinear'
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"load_quantized takes the float model to fill in (a torch.nn.Module), got {type(model).__name__}")
    if any(isinstance(m, QAT_TYPES + QUANTIZED_TYPES) for m in model.modules()):
        raise ValueError("load_quantized needs a float model (no QAT or quantized layers) built like the saved one")
    source = str(path)
    with open_tensors(path, "pt") as (metadata, infos, handle):
        manifest = manifest_from(metadata, source)
        tensors = checked_tensors(manifest, infos, handle.get_tensor, _describe, source)
    device = next(iter(model.parameters()), torch.empty(0)).device
    moved = {}
    tensors = {name: moved.setdefault(id(t), t.to(device)) for name, t in tensors.items()}  # ties survive
    paths = [entry.get("path") if isinstance(entry, dict) else None for entry in manifest["layers"]]
    owners = _owners(paths, dict(model.named_modules()), source)
    new = _skeleton_copy(model, {owner[0] if owner else p for p, owner in zip(paths, owners)})
    replacements = _replacements(manifest["layers"], owners, tensors, dict(new.named_modules()), source)
    with Change() as change:
        new = change.swap(new, replacements)
    _copy_float_state(new, tensors, source)
    return new


def _copy_float_state(new, tensors, source):
    """Fill ``new``'s tensors other than its quantized layers' from the file, checking every name."""
    state = new.state_dict(keep_vars=True)
    if set(state) != set(tensors):
        raise ValueError(f"{source} does not fit this model: it lacks {sorted(set(state) - set(tensors))} and has "
                         f"extra {sorted(set(tensors) - set(state))}; pass a model built like the saved one")
    quantized = {id(t) for m in new.modules() if isinstance(m, QuantizedWeight) for t in m.buffers(recurse=False)}
    with torch.no_grad():
        for name, target in state.items():
            if id(target) in quantized:
                continue
            value = tensors[name]
            if value.dtype != target.dtype or value.shape != target.shape:
                raise ValueError(f"{source}: tensor {name!r} is {value.dtype} {list(value.shape)} in the file, "
                                 f"{target.dtype} {list(target.shape)} in the model: pass a model built like the saved one")
            target.copy_(value)
