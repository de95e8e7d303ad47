"""mixle's quantized-model file: safetensors with a validated JSON manifest (framework-free).

File format: a standard safetensors file (8-byte little-endian header length, a JSON header
giving each tensor's dtype, shape and data offsets, then the raw little-endian tensor bytes),
written here with numpy alone, never pickle. Its ``__metadata__`` holds one JSON manifest under
the key ``"mixle_manifest"``: format and mixle versions, every quantized layer (path, kind,
spec, bits, weight shape, tensor names, byte counts), every stored tensor's dtype, shape and
sha256, the names that alias a shared (tied) tensor, ``model_nbytes`` and ``manifest_sha256``,
the sha256 of the manifest itself serialized as
``json.dumps(manifest_without_that_key, sort_keys=True, separators=(",", ":"))``.
"""

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

__all__ = ["ModelBytes", "read_manifest", "write_safetensors", "read_safetensors", "write_raw", "parse_raw",
           "Raw", "canonical_manifest", "manifest_from", "FORMAT", "FORMAT_VERSION", "MANIFEST_KEY"]

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


# ----------------------------------------------------------------------------------------------
# The safetensors format, with numpy


@dataclass(frozen=True)
class Raw:
    """One tensor as safetensors stores it: dtype name, shape and little-endian bytes."""

    dtype: str
    shape: tuple
    data: bytes


def raw_from_numpy(array, name):
    array = np.asarray(array)
    for st_name, np_name in _NUMPY_OF.items():
        if st_name != "BF16" and np.dtype(np_name) == array.dtype.newbyteorder("<"):
            little = np.ascontiguousarray(array).astype(np.dtype(np_name), copy=False)
            return Raw(st_name, tuple(array.shape), little.tobytes())
    raise TypeError(f"tensor {name!r} has dtype {array.dtype}, which safetensors cannot store here: "
                    f"use one of float16/32/64, (u)int8/16/32/64 or bool")


def write_raw(path, raws, metadata):
    """Write ``{name: Raw}`` (in order of decreasing item size, keeping 8-byte alignment)."""
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


def parse_raw(data, source):
    """``(metadata, {name: Raw})`` from the bytes of a safetensors file; ValueError if malformed."""
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
        raws[name] = Raw(entry["dtype"], tuple(entry["shape"]), bytes(buffer[begin:stop]))
    return metadata, raws


def numpy_from_raw(raw):
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
    write_raw(path, {name: raw_from_numpy(a, name) for name, a in arrays.items()}, metadata)


def read_safetensors(path):
    """``({name: numpy array}, metadata)`` from a safetensors file, validating its structure.

    BF16 tensors are returned as their raw int16 bit patterns (numpy has no bfloat16).

    Raises:
        ValueError: the file is truncated or its header is malformed.
    """
    metadata, raws = parse_raw(Path(path).read_bytes(), str(path))
    return {name: numpy_from_raw(raw) for name, raw in raws.items()}, metadata


def canonical_manifest(manifest):
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")


def manifest_from(metadata, source):
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
    if manifest.get("manifest_sha256") != hashlib.sha256(canonical_manifest(manifest)).hexdigest():
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
    metadata, _ = parse_raw(Path(path).read_bytes(), source)
    return manifest_from(metadata, source)
