"""Export of quantized models: real byte counts, and safetensors files with a validated manifest.

File format: a standard safetensors file (8-byte little-endian header length, a JSON header
giving each tensor's dtype, shape and data offsets, then the raw little-endian tensor bytes),
written here with numpy alone, never pickle. Its ``__metadata__`` holds one JSON manifest under
the key ``"mixle_manifest"``: format and mixle versions, every quantized layer (path, kind,
spec, bits, weight shape, tensor names, byte counts), every stored tensor's dtype, shape and
sha256, the names that alias a shared (tied) tensor, ``model_nbytes`` and ``manifest_sha256``,
the sha256 of the manifest itself serialized as
``json.dumps(manifest_without_that_key, sort_keys=True, separators=(",", ":"))``.
"""

import copy
import dataclasses
import hashlib
import json
import math
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["ModelBytes", "model_nbytes", "save_quantized", "load_quantized", "read_manifest",
           "write_safetensors", "read_safetensors", "FORMAT", "FORMAT_VERSION", "MANIFEST_KEY"]

FORMAT = "mixle.quantized"
FORMAT_VERSION = 1
MANIFEST_KEY = "mixle_manifest"
_MAX_HEADER_BYTES = 100 * 2**20

# safetensors dtype name -> little-endian numpy dtype (BF16 travels as its raw 16-bit pattern).
_NUMPY_OF = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<i2", "I64": "<i8", "I32": "<i4",
             "I16": "<i2", "I8": "i1", "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?"}
_ITEMSIZE = {name: np.dtype(dt).itemsize for name, dt in _NUMPY_OF.items()}


# ----------------------------------------------------------------------------------------------
# Byte counts


@dataclass(frozen=True)
class ModelBytes:
    """Real storage bytes of a model, each shared (tied) tensor counted once.

    Attributes:
        float_bytes: float parameters and buffers (weights left in float, biases, norms).
        int8_code_bytes: int8 codes of 8-bit quantized layers.
        int4_code_bytes: packed int4 codes (two per byte) of 4-bit quantized layers.
        scale_bytes: the scales of quantized layers.
        other_bytes: any other buffers (e.g. integer position ids).
    """

    float_bytes: int = 0
    int8_code_bytes: int = 0
    int4_code_bytes: int = 0
    scale_bytes: int = 0
    other_bytes: int = 0

    @property
    def total(self):
        """All bytes together."""
        return sum(dataclasses.astuple(self))

    def as_dict(self):
        """The breakdown and the total as a plain dict (what the manifest stores)."""
        return {**dataclasses.asdict(self), "total": self.total}

    def __str__(self):
        rows = [f"{name:<16} {value:>12,d}" for name, value in self.as_dict().items()]
        return "\n".join(rows)


def model_nbytes(model):
    """Count a torch model's real storage bytes by kind (fp32 vs int8 vs packed int4 vs scales).

    Args:
        model: a torch model, float, QAT-wrapped (counted as float) or quantized.

    Returns:
        ModelBytes.

    >>> import torch
    >>> from mixle.task.quantize import quantize_model
    >>> nb = model_nbytes(quantize_model(torch.nn.Linear(64, 32, bias=False), bits=4))
    >>> nb.int4_code_bytes, nb.scale_bytes, nb.total  # 64*32/2 code bytes, 32 fp32 scales
    (1024, 128, 1152)
    """
    torch = _torch("model_nbytes")
    from mixle.task.ptq import _QuantizedWeight

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
            if isinstance(module, _QuantizedWeight) and name == "codes":
                kind = "int4_code_bytes" if module.spec.bits == 4 else "int8_code_bytes"
            elif isinstance(module, _QuantizedWeight) and name == "scale":
                kind = "scale_bytes"
            elif tensor.is_floating_point():
                kind = "float_bytes"
            else:
                kind = "other_bytes"
            counts[kind] += size
    return ModelBytes(**counts)


# ----------------------------------------------------------------------------------------------
# The safetensors format, with numpy


@dataclass(frozen=True)
class _Raw:
    """One tensor as safetensors stores it: dtype name, shape and little-endian bytes."""

    dtype: str
    shape: tuple
    data: bytes


def _raw_from_numpy(array, name):
    array = np.asarray(array)
    for st_name, np_name in _NUMPY_OF.items():
        if st_name != "BF16" and np.dtype(np_name) == array.dtype.newbyteorder("<"):
            little = np.ascontiguousarray(array).astype(np.dtype(np_name), copy=False)
            return _Raw(st_name, tuple(array.shape), little.tobytes())
    raise TypeError(f"tensor {name!r} has dtype {array.dtype}, which safetensors cannot store here: "
                    f"use one of float16/32/64, (u)int8/16/32/64 or bool")


def _write_raw(path, raws, metadata):
    """Write ``{name: _Raw}`` (in order of decreasing item size, keeping 8-byte alignment)."""
    order = sorted(raws, key=lambda name: -_ITEMSIZE[raws[name].dtype])
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = metadata
    for name in order:
        raw = raws[name]
        header[name] = {"dtype": raw.dtype, "shape": list(raw.shape), "data_offsets": [offset, offset + len(raw.data)]}
        offset += len(raw.data)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    path = Path(path)
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(struct.pack("<Q", len(text)))
            out.write(text)
            for name in order:
                out.write(raws[name].data)
        os.replace(tmp, path)  # atomic: a crash never leaves a half-written file under `path`
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _parse_raw(data, source):
    """``(metadata, {name: _Raw})`` from the bytes of a safetensors file; ValueError if malformed."""
    def bad(why):
        return ValueError(f"{source} is not a valid safetensors file: {why}")

    if len(data) < 8:
        raise bad(f"it is truncated to {len(data)} bytes, shorter than the 8-byte header length")
    (size,) = struct.unpack("<Q", data[:8])
    if size > _MAX_HEADER_BYTES or 8 + size > len(data):
        raise bad(f"the header claims {size} bytes but the file has {len(data) - 8} after the length field "
                  f"(truncated or corrupt)")
    try:
        header = json.loads(data[8 : 8 + size].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise bad(f"its JSON header does not parse ({err}); the file is corrupt") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise bad("__metadata__ must map strings to strings")
    buffer = memoryview(data)[8 + size :]
    spans, raws = [], {}
    for name, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"tensor {name!r} needs exactly dtype, shape and data_offsets, got {entry!r:.120}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in _NUMPY_OF:
            raise bad(f"tensor {name!r} has unsupported dtype {dtype!r}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise bad(f"tensor {name!r} has an invalid shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise bad(f"tensor {name!r} has invalid data_offsets {offsets!r}")
        if offsets[1] - offsets[0] != math.prod(shape) * _ITEMSIZE[dtype]:
            raise bad(f"tensor {name!r} of {dtype} {shape} needs {math.prod(shape) * _ITEMSIZE[dtype]} bytes, "
                      f"its data_offsets span {offsets[1] - offsets[0]}")
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise bad(f"tensor {name!r} starts at byte {begin}, expected {end}: tensors must be contiguous")
        end = stop
    if end != len(buffer):
        state = "truncated" if end > len(buffer) else "followed by unexpected bytes"
        raise bad(f"the header describes {end} bytes of tensor data, the file holds {len(buffer)} ({state})")
    for begin, stop, name in spans:
        entry = header[name]
        raws[name] = _Raw(entry["dtype"], tuple(entry["shape"]), bytes(buffer[begin:stop]))
    return metadata, raws


def _numpy_from_raw(raw):
    return np.frombuffer(raw.data, dtype=_NUMPY_OF[raw.dtype]).reshape(raw.shape)


def write_safetensors(path, arrays, metadata=None):
    """Write numpy arrays to a safetensors file (no pickle; readable by the ``safetensors`` package).

    Args:
        path: the file to write (replaced atomically).
        arrays: ``{name: numpy array}``.
        metadata: optional ``{str: str}`` stored as ``__metadata__``.

    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
    >>> write_safetensors(path, {"w": np.arange(3, dtype=np.int8)}, {"note": "hi"})
    >>> read_safetensors(path)
    ({'w': array([0, 1, 2], dtype=int8)}, {'note': 'hi'})
    """
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError("metadata must map strings to strings")
    _write_raw(path, {name: _raw_from_numpy(a, name) for name, a in arrays.items()}, metadata)


def read_safetensors(path):
    """``({name: numpy array}, metadata)`` from a safetensors file, validating its structure.

    BF16 tensors are returned as their raw int16 bit patterns (numpy has no bfloat16).

    Raises:
        ValueError: the file is truncated or its header is malformed.
    """
    metadata, raws = _parse_raw(Path(path).read_bytes(), str(path))
    return {name: _numpy_from_raw(raw) for name, raw in raws.items()}, metadata


# ----------------------------------------------------------------------------------------------
# Quantized models


def _torch(purpose):
    from mixle._optional import require

    return require("torch", extra="torch", purpose=purpose)


def _st_dtype(torch, dtype):
    names = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}
    return names.get(dtype)


def _raw_from_torch(torch, tensor, name):
    tensor = tensor.detach().cpu().contiguous()
    st_dtype = _st_dtype(torch, tensor.dtype)
    if st_dtype is None:
        raise TypeError(f"tensor {name!r} has dtype {tensor.dtype}, which save_quantized cannot store: "
                        f"cast that module to float32 first")
    array = tensor.view(torch.int16).numpy() if st_dtype == "BF16" else tensor.numpy()
    raw = _raw_from_numpy(array, name)
    return _Raw(st_dtype, tuple(tensor.shape), raw.data)


def _torch_from_raw(torch, raw):
    array = _numpy_from_raw(raw)
    array = array.astype(array.dtype.newbyteorder("="))  # a native-order, writable copy
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if raw.dtype == "BF16" else tensor


def _canonical(manifest):
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _layer_entry(path, module, names):
    from mixle.task.ptq import QuantizedEmbedding

    entry = {
        "path": path,
        "kind": "embedding" if isinstance(module, QuantizedEmbedding) else "linear",
        "bits": module.spec.bits,
        "spec": dataclasses.asdict(module.spec),
        "weight_shape": list(module.weight_shape),
        "codes": names["codes"],
        "scale": names["scale"],
        "codes_nbytes": module.codes.numel() * module.codes.element_size(),
        "scale_nbytes": module.scale.numel() * module.scale.element_size(),
    }
    if entry["kind"] == "linear":
        entry["bias"] = names.get("bias")
    else:
        entry.update(padding_idx=module.padding_idx, max_norm=module.max_norm, norm_type=module.norm_type,
                     scale_grad_by_freq=module.scale_grad_by_freq)
    return entry


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
    >>> from mixle.task.quantize import quantize_model
    >>> path = os.path.join(tempfile.mkdtemp(), "mlp.safetensors")
    >>> manifest = save_quantized(quantize_model(torch.nn.Sequential(torch.nn.Linear(8, 4)), bits=4), path)
    >>> manifest["layers"][0]["path"], manifest["nbytes"]["int4_code_bytes"]
    ('0', 16)
    """
    torch = _torch("save_quantized")
    import mixle
    from mixle.models._qat_torch import QATEmbedding, QATWrapper
    from mixle.task.ptq import _QuantizedWeight

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"save_quantized takes a torch.nn.Module, got {type(model).__name__}")
    if any(isinstance(m, (QATWrapper, QATEmbedding)) for m in model.modules()):
        raise ValueError("the model still has QAT layers: save convert(model), the model with real int weights")
    if not any(isinstance(m, _QuantizedWeight) for m in model.modules()):
        raise ValueError("the model has no quantized layer: make one with quantize_model(model) or convert(qat_model)")

    state = model.state_dict(keep_vars=True)
    first_name, aliases, raws = {}, {}, {}
    for name, tensor in state.items():
        if id(tensor) in first_name:
            aliases[name] = first_name[id(tensor)]
            continue
        first_name[id(tensor)] = name
        raws[name] = _raw_from_torch(torch, tensor, name)
    layers = []
    for path_, module in model.named_modules():
        if isinstance(module, _QuantizedWeight):
            prefix = f"{path_}." if path_ else ""
            names = {key: f"{prefix}{key}" for key, t in module.named_buffers(recurse=False) if t is not None}
            missing = [n for n in names.values() if n not in state]
            if missing:
                raise ValueError(f"layer {path_!r}: buffers {missing} are not in the model's state_dict")
            layers.append(_layer_entry(path_, module, names))
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "mixle_version": mixle.__version__,
        "layers": layers,
        "tensors": {name: {"dtype": raw.dtype, "shape": list(raw.shape),
                           "sha256": hashlib.sha256(raw.data).hexdigest()} for name, raw in raws.items()},
        "aliases": aliases,
        "nbytes": model_nbytes(model).as_dict(),
    }
    manifest["manifest_sha256"] = hashlib.sha256(_canonical(manifest)).hexdigest()
    _write_raw(path, raws, {MANIFEST_KEY: json.dumps(manifest, sort_keys=True)})
    return manifest


def _manifest_from(metadata, source):
    def bad(why):
        return ValueError(f"{source}: {why}")

    if MANIFEST_KEY not in metadata:
        raise bad(f"no {MANIFEST_KEY!r} in the safetensors metadata: it was not written by save_quantized")
    try:
        manifest = json.loads(metadata[MANIFEST_KEY])
    except json.JSONDecodeError as err:
        raise bad(f"the manifest is not valid JSON ({err}); the file is corrupt") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise bad(f"the manifest's format is not {FORMAT!r}: not a mixle quantized model")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise bad(f"format_version {version!r} is not the version {FORMAT_VERSION} this mixle reads: "
                  f"load it with the mixle that wrote it ({manifest.get('mixle_version')!r}) or upgrade mixle")
    if manifest.get("manifest_sha256") != hashlib.sha256(_canonical(manifest)).hexdigest():
        raise bad("the manifest fails its sha256 check: it was edited or corrupted")
    for key, kind in (("layers", list), ("tensors", dict), ("aliases", dict)):
        if not isinstance(manifest.get(key), kind):
            raise bad(f"the manifest's {key!r} must be a {kind.__name__}")
    return manifest


def read_manifest(path):
    """The manifest dict of a file written by ``save_quantized``, after checking its own hash.

    Raises:
        ValueError: not a (valid) mixle quantized safetensors file.
    """
    source = str(path)
    metadata, _ = _parse_raw(Path(path).read_bytes(), source)
    return _manifest_from(metadata, source)


def _checked_tensors(torch, manifest, raws, source):
    """``{state_dict name: tensor}`` (aliases share one tensor) after dtype/shape/sha256 checks."""
    listed = manifest["tensors"]
    if set(listed) != set(raws):
        raise ValueError(f"{source}: the manifest lists tensors {sorted(set(listed) - set(raws))} missing from the "
                         f"file and the file has unlisted tensors {sorted(set(raws) - set(listed))}")
    tensors = {}
    for name, raw in raws.items():
        info = listed[name]
        if not isinstance(info, dict) or info.get("dtype") != raw.dtype or info.get("shape") != list(raw.shape):
            raise ValueError(f"{source}: tensor {name!r} is {raw.dtype} {list(raw.shape)} in the file but "
                             f"{info.get('dtype') if isinstance(info, dict) else info} "
                             f"{info.get('shape') if isinstance(info, dict) else ''} in the manifest")
        if hashlib.sha256(raw.data).hexdigest() != info.get("sha256"):
            raise ValueError(f"{source}: tensor {name!r} fails its sha256 check: the file is corrupt")
        tensors[name] = _torch_from_raw(torch, raw)
    for alias, target in manifest["aliases"].items():
        if alias in tensors or target not in tensors:
            raise ValueError(f"{source}: alias {alias!r} -> {target!r} does not name one stored tensor")
        tensors[alias] = tensors[target]
    return tensors


def _build_layer(entry, tensors, module, source):
    """The quantized module for one manifest layer, checked against the skeleton's module."""
    from torch import nn

    from mixle.task.ptq import QuantizedEmbedding, QuantizedLinear, check_quantized_storage
    from mixle.task.spec import QuantSpec

    where = f"{source}: layer {entry.get('path')!r}"
    try:
        spec = QuantSpec(**entry["spec"])
        kind, bits, shape = entry["kind"], entry["bits"], tuple(entry["weight_shape"])
        codes, scale = tensors[entry["codes"]], tensors[entry["scale"]]
        bias = tensors[entry["bias"]] if entry.get("bias") is not None else None
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{where}: the manifest entry is incomplete or invalid ({err!r})") from None
    if bits != spec.bits:
        raise ValueError(f"{where}: bits={bits!r} disagrees with its spec's bits={spec.bits}")
    check_quantized_storage(codes, scale, spec, shape, name=where)
    if entry.get("codes_nbytes") != codes.numel() * codes.element_size() or \
            entry.get("scale_nbytes") != scale.numel() * scale.element_size():
        raise ValueError(f"{where}: the manifest's codes_nbytes/scale_nbytes disagree with the tensors")
    if kind == "linear":
        if not isinstance(module, nn.Linear) or tuple(module.weight.shape) != shape or (module.bias is None) != (bias is None):
            raise ValueError(f"{where}: the file holds a Linear {list(shape)} (bias={bias is not None}), the model has "
                             f"{module!r}: pass a model built like the saved one")
        return QuantizedLinear(codes, scale, spec, shape, bias)
    if kind == "embedding":
        if not isinstance(module, nn.Embedding) or tuple(module.weight.shape) != shape:
            raise ValueError(f"{where}: the file holds an Embedding {list(shape)}, the model has {module!r}: "
                             f"pass a model built like the saved one")
        return QuantizedEmbedding(codes, scale, spec, shape, entry.get("padding_idx"), entry.get("max_norm"),
                                  entry.get("norm_type", 2.0), bool(entry.get("scale_grad_by_freq", False)))
    raise ValueError(f"{where}: unknown layer kind {kind!r}")


def load_quantized(path, model):
    """Load a file written by ``save_quantized`` into a copy of a float model of the same architecture.

    Everything is validated before it is used: the safetensors structure, the manifest's format
    version and sha256, each tensor's dtype, shape and sha256, each layer's spec, bits, shapes
    and code range, and that the tensors match the model's state_dict names, shapes and dtypes
    exactly. Tied layers come back sharing one codes+scales tensor.

    Args:
        path: a file written by ``save_quantized``.
        model: a float model built like the saved one (e.g. freshly constructed); not modified.

    Returns:
        A new model whose saved layers are QuantizedLinear / QuantizedEmbedding, on the device
        of the model's first parameter.

    Raises:
        ValueError: the file is corrupt, truncated or tampered, or does not fit ``model``.

    >>> import torch, tempfile, os
    >>> from mixle.task.quantize import quantize_model
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 4))
    >>> path = os.path.join(tempfile.mkdtemp(), "mlp.safetensors")
    >>> _ = save_quantized(quantize_model(net, bits=4), path)
    >>> type(load_quantized(path, torch.nn.Sequential(torch.nn.Linear(8, 4)))[0]).__name__
    'QuantizedLinear'
    """
    torch = _torch("load_quantized")
    from mixle.models._qat_torch import QATEmbedding, QATWrapper
    from mixle.task.ptq import _QuantizedWeight

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"load_quantized takes the float model to fill in (a torch.nn.Module), got {type(model).__name__}")
    if any(isinstance(m, (QATWrapper, QATEmbedding, _QuantizedWeight)) for m in model.modules()):
        raise ValueError("load_quantized needs a float model (no QAT or quantized layers) built like the saved one")
    source = str(path)
    metadata, raws = _parse_raw(Path(path).read_bytes(), source)
    manifest = _manifest_from(metadata, source)
    tensors = _checked_tensors(torch, manifest, raws, source)
    device = next(iter(model.parameters()), torch.empty(0)).device
    moved = {}
    tensors = {name: moved.setdefault(id(t), t.to(device)) for name, t in tensors.items()}  # ties survive

    new = copy.deepcopy(model)
    modules = dict(new.named_modules())
    replacements = {}
    for entry in manifest["layers"]:
        path_ = entry.get("path") if isinstance(entry, dict) else None
        if path_ not in modules:
            raise ValueError(f"{source}: the model has no module {path_!r} for a saved layer: "
                             f"pass a model built like the saved one")
        replacements[id(modules[path_])] = _build_layer(entry, tensors, modules[path_], source)
    for module in list(new.modules()):
        for name, child in list(module.named_children()):
            if id(child) in replacements:
                setattr(module, name, replacements[id(child)])
    new = replacements.get(id(new), new)

    state = new.state_dict(keep_vars=True)
    if set(state) != set(tensors):
        raise ValueError(f"{source} does not fit this model: it lacks {sorted(set(state) - set(tensors))} and has "
                         f"extra {sorted(set(tensors) - set(state))}; pass a model built like the saved one")
    quantized = {id(t) for m in new.modules() if isinstance(m, _QuantizedWeight) for t in m.buffers(recurse=False)}
    with torch.no_grad():
        for name, target in state.items():
            if id(target) in quantized:
                continue
            value = tensors[name]
            if value.dtype != target.dtype or value.shape != target.shape:
                raise ValueError(f"{source}: tensor {name!r} is {value.dtype} {list(value.shape)} in the file, "
                                 f"{target.dtype} {list(target.shape)} in the model: pass a model built like the saved one")
            target.copy_(value)
    return new
