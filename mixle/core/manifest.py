"""The manifest of mixle's quantized file, built and checked once for both backends (framework-free).

A backend saving a model lists its quantized layers (``layer_entry``) and describes each stored
tensor as ``(dtype, shape, sha256)``; ``build_manifest`` adds the format, the versions and the
manifest's own sha256, and ``manifest_metadata`` is the safetensors ``__metadata__`` holding it.
Loading, ``checked_tensors`` compares every tensor with the manifest (dtype, shape, sha256) and
resolves the aliases of shared tensors, and ``read_layer`` turns one layer entry into its spec,
shape and tensors, validated by ``mixle.core.stored.check_stored``.

``save_arrays`` / ``load_arrays`` store bare ``QuantizedArray`` records (and float arrays) in the
same format, without a model: the layers are of kind ``"array"``.
"""

import dataclasses
import hashlib
import json

import numpy as np

from mixle._version import __version__
from mixle.core.fileformat import (FORMAT, FORMAT_VERSION, MANIFEST_KEY, ModelBytes, add_aliases, canonical_manifest,
                                   check_listed, describe_array, manifest_from, open_tensors, write_safetensors)
from mixle.core.spec import QuantSpec
from mixle.core.stored import STORED_PARTS, QuantizedArray, check_stored

__all__ = ["build_manifest", "manifest_metadata", "layer_entry", "checked_tensors", "read_layer", "StoredLayer",
           "save_arrays", "load_arrays", "ARRAY_KIND"]

ARRAY_KIND = "array"


def build_manifest(layers, tensors, aliases, nbytes):
    """The manifest of a file: format, versions, layers, tensors, aliases, byte counts, own sha256.

    Args:
        layers: the layer entries (``layer_entry``).
        tensors: ``{name: (safetensors dtype, shape, sha256)}`` of every stored tensor.
        aliases: ``{name: stored name}`` of names sharing a stored tensor.
        nbytes: the ``ModelBytes`` of what is stored.

    >>> manifest = build_manifest([], {"w": ("F32", (2,), "00")}, {}, ModelBytes(float_bytes=8))
    >>> manifest["tensors"], manifest["nbytes"]["total"], len(manifest["manifest_sha256"])
    ({'w': {'dtype': 'F32', 'shape': [2], 'sha256': '00'}}, 8, 64)
    """
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "mixle_version": __version__,
        "layers": layers,
        "tensors": {name: {"dtype": dtype, "shape": list(shape), "sha256": sha256}
                    for name, (dtype, shape, sha256) in tensors.items()},
        "aliases": aliases,
        "nbytes": nbytes.as_dict(),
    }
    manifest["manifest_sha256"] = hashlib.sha256(canonical_manifest(manifest)).hexdigest()
    return manifest


def manifest_metadata(manifest):
    """The safetensors ``__metadata__`` that holds ``manifest``.

    >>> sorted(manifest_metadata({"format": "x"}))
    ['mixle_manifest']
    """
    return {MANIFEST_KEY: json.dumps(manifest, sort_keys=True)}


def layer_entry(path, kind, spec, weight_shape, names, nbytes, **options):
    """One quantized layer of the manifest.

    Args:
        path: the module path (torch's names).
        kind: the layer kind (``"linear"``, ``"embedding"``, ``ARRAY_KIND``, ...).
        spec: its QuantSpec.
        weight_shape: the 2-D weight shape.
        names: ``{part: stored tensor name}`` for the parts of ``STORED_PARTS`` it stores.
        nbytes: ``(codes bytes, scale bytes)`` as stored.
        **options: the kind's other fields (``bias``, an embedding's ``padding_idx``, ...).

    >>> entry = layer_entry("fc", "linear", QuantSpec(bits=4), (2, 4), {"codes": "fc.codes", "scale": "fc.scale"}, (4, 8))
    >>> entry["bits"], entry["codes"], entry["scale_nbytes"]
    (4, 'fc.codes', 8)
    """
    entry = {"path": path, "kind": kind, "bits": spec.bits, "spec": dataclasses.asdict(spec),
             "weight_shape": [int(d) for d in weight_shape]}
    entry.update({part: names[part] for part in STORED_PARTS if part in names})
    entry["codes_nbytes"], entry["scale_nbytes"] = (int(n) for n in nbytes)
    entry.update(options)
    return entry


def checked_tensors(manifest, infos, read, describe, source):
    """``{name: tensor}`` of a file (aliases share one tensor), each compared with the manifest.

    Args:
        manifest: the file's manifest (``manifest_from``).
        infos: its header (``read_header``).
        read: ``read(name)`` gives a tensor of the file.
        describe: ``describe(tensor, name)`` gives its ``(safetensors dtype, shape, sha256)``.
        source: the file, for messages.

    Raises:
        ValueError: the file's tensors are not the manifest's, or one fails its sha256 check.

    >>> import os, tempfile
    >>> q = QuantizedArray(np.array([[1, -1]], np.int8), np.ones((1, 1, 1), np.float32), QuantSpec(bits=4))
    >>> path = os.path.join(tempfile.mkdtemp(), "a.safetensors")
    >>> _ = save_arrays(path, {"w": q})
    >>> with open_tensors(path) as (metadata, infos, handle):
    ...     tensors = checked_tensors(manifest_from(metadata, path), infos, handle.get_tensor, describe_array, path)
    >>> sorted(tensors)
    ['w.codes', 'w.scale']
    """
    check_listed(manifest, infos, source)
    tensors = {}
    for name, info in infos.items():
        tensor = read(name)
        dtype, shape, sha256 = describe(tensor, name)
        if (dtype, tuple(shape)) != (info.dtype, info.shape):
            raise ValueError(f"{source}: tensor {name!r} reads as {dtype} {list(shape)}, its header says "
                             f"{info.dtype} {list(info.shape)}")
        if sha256 != manifest["tensors"][name].get("sha256"):
            raise ValueError(f"{source}: tensor {name!r} fails its sha256 check: the file is corrupt")
        tensors[name] = tensor
    return add_aliases(manifest, tensors, source)


@dataclasses.dataclass(frozen=True)
class StoredLayer:
    """One manifest layer read back: its entry, spec, kind, weight shape, stored parts and bias."""

    entry: dict
    spec: QuantSpec
    kind: str
    shape: tuple
    parts: dict
    bias: object = None


def read_layer(entry, tensors, source):
    """The ``StoredLayer`` of one manifest entry, its tensors validated (``check_stored``).

    Args:
        entry: the layer's manifest entry.
        tensors: ``{name: tensor}`` of the file (``checked_tensors``), numpy arrays or torch tensors.
        source: the file, for messages.

    Raises:
        ValueError: the entry is incomplete, disagrees with its spec, or its tensors are not
            what the spec stores; the message names the file and the layer.

    >>> entry = layer_entry("w", ARRAY_KIND, QuantSpec(bits=8), (1, 2), {"codes": "c", "scale": "s"}, (2, 4))
    >>> tensors = {"c": np.array([[3, -3]], np.int8), "s": np.ones((1, 1, 1), np.float32)}
    >>> layer = read_layer(entry, tensors, "a.safetensors")
    >>> layer.kind, layer.shape, sorted(layer.parts)
    ('array', (1, 2), ['codes', 'scale'])
    """
    where = f"{source}: layer {entry.get('path')!r}"
    try:
        spec, kind, bits = QuantSpec(**entry["spec"]), entry["kind"], entry["bits"]
        shape = entry["weight_shape"]
        if not (isinstance(shape, list) and len(shape) == 2 and all(type(d) is int for d in shape)):
            raise ValueError(f"weight_shape must be [rows, cols], got {shape!r:.80}")
        parts = {part: tensors[entry[part]] for part in STORED_PARTS if entry.get(part) is not None}
        bias = tensors[entry["bias"]] if entry.get("bias") is not None else None
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{where}: the manifest entry is incomplete or invalid ({err!r})") from None
    if bits != spec.bits:
        raise ValueError(f"{where}: bits={bits!r} disagrees with its spec's bits={spec.bits}")
    check_stored(parts.get("codes"), parts.get("scale"), spec, shape, offset=parts.get("offset"),
                 sub_scales=parts.get("sub_scales"), sub_offsets=parts.get("sub_offsets"), name=where,
                 tensor_names={part: entry[part] for part in parts})
    return StoredLayer(entry, spec, kind, tuple(shape), parts, bias)


# ----------------------------------------------------------------------------------------------
# Bare quantized arrays in the same format.


def _numpy(array, name):
    if type(array).__module__.startswith("torch"):
        raise TypeError(f"save_arrays stores numpy arrays; {name!r} is a torch tensor: pass .numpy() of it")
    return np.asarray(array)


def save_arrays(path, arrays):
    """Save ``{name: QuantizedArray or float array}`` (numpy) in mixle's file format.

    Each QuantizedArray is one layer of kind ``ARRAY_KIND``, its parts stored as
    ``QuantizedArray.stored`` gives them under ``"<name>.<part>"``; it is validated first.

    Returns:
        The manifest, as stored in the file.

    >>> import os, tempfile
    >>> q = QuantizedArray(np.array([[1, -1]], np.int8), np.ones((1, 1, 1), np.float32), QuantSpec(bits=4))
    >>> path = os.path.join(tempfile.mkdtemp(), "a.safetensors")
    >>> save_arrays(path, {"w": q})["layers"][0]["codes"]
    'w.codes'
    """
    stored, layers, counts = {}, [], {"float_bytes": 0, "int4_code_bytes": 0, "int8_code_bytes": 0, "scale_bytes": 0}
    for name, value in arrays.items():
        if not isinstance(value, QuantizedArray):
            stored[name] = _numpy(value, name)
            counts["float_bytes"] += stored[name].nbytes
            continue
        if len(value.shape) != 2 or value.batch_ndim != 0 or value.out_ndim not in (None, 1):
            raise ValueError(f"array {name!r}: save_arrays stores 2-D (rows, cols) arrays, got shape {value.shape}")
        value.check(name=f"array {name!r}")
        parts = {part: _numpy(array, name) for part, array in value.stored().items()}
        names = {part: f"{name}.{part}" for part in parts}
        stored.update({names[part]: array for part, array in parts.items()})
        other = sum(array.nbytes for part, array in parts.items() if part != "codes")
        layers.append(layer_entry(name, ARRAY_KIND, value.spec, value.shape, names, (parts["codes"].nbytes, other)))
        counts["int4_code_bytes" if value.spec.bits == 4 else "int8_code_bytes"] += parts["codes"].nbytes
        counts["scale_bytes"] += other
    described = {name: describe_array(array, name) for name, array in stored.items()}
    manifest = build_manifest(layers, described, {}, ModelBytes(**counts))
    write_safetensors(path, stored, manifest_metadata(manifest))
    return manifest


def load_arrays(path):
    """``{name: QuantizedArray or float array}`` of a file written by ``save_arrays``, all validated.

    >>> import os, tempfile
    >>> q = QuantizedArray(np.array([[1, -1]], np.int8), np.ones((1, 1, 1), np.float32), QuantSpec(bits=4))
    >>> path = os.path.join(tempfile.mkdtemp(), "a.safetensors")
    >>> _ = save_arrays(path, {"w": q})
    >>> load_arrays(path)["w"].codes.tolist()
    [[1, -1]]
    """
    source = str(path)
    with open_tensors(path, "numpy") as (metadata, infos, handle):
        manifest = manifest_from(metadata, source)
        tensors = checked_tensors(manifest, infos, handle.get_tensor, describe_array, source)
    out, used = {}, set()
    for entry in manifest["layers"]:
        if not isinstance(entry, dict) or entry.get("kind") != ARRAY_KIND or not isinstance(entry.get("path"), str):
            raise ValueError(f"{source}: layer {entry!r:.80} is not a stored array: load model files with "
                             f"load_quantized(path, model)")
        layer = read_layer(entry, tensors, source)
        names = {part: entry[part] for part in layer.parts}
        if entry.get("codes_nbytes") != layer.parts["codes"].nbytes:
            raise ValueError(f"{source}: layer {layer.entry['path']!r}: codes_nbytes disagrees with its codes")
        out[entry["path"]] = QuantizedArray.from_stored(layer.parts, layer.spec, layer.shape,
                                                        name=f"{source}: layer {entry['path']!r}")
        used |= set(names.values())
    out.update({name: tensor for name, tensor in tensors.items() if name not in used})
    return out
