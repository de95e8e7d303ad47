"""Saving and loading converted Flax NNX models in mixle's file format, the one torch writes.

One manifest, one layout: every quantized kernel is written as torch's 2-D ``(out, in)`` weight
(an ``nnx.Linear`` kernel ``(in, out)`` transposed; an ``nnx.Embed`` table as is), its codes
packed and its scales shaped exactly as ``mixle.torch_backend.export`` stores them, and every
tensor under the name the equivalent torch model's ``state_dict`` uses. A file written from
Flax therefore loads with torch's ``load_quantized`` into the equivalent torch model, and a
torch file loads here into the equivalent NNX model.

Names: a Flax module path is the torch module path unless ``names`` maps it to another
(``{"layers.1": "2"}`` for an ``nn.Sequential`` with an activation between). A tied ``Embed``
(quantized because its ``attend`` is the output head) maps to a pair ``(embedding path, head
path)``: it is written as torch's tied ``nn.Embedding`` + bias-free ``nn.Linear`` pair sharing
one codes+scales tensor.

The layer table ``LAYERS`` says, per Flax layer type, which Param is the weight, its input
axes, and the torch names of its Params; kernels of other layer types (``Einsum``, ``Conv``,
``LinearGeneral``) have no torch layer in the file format and are refused by name.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mixle.core.fileformat import describe_array, manifest_from, open_tensors, write_safetensors
from mixle.core.manifest import build_manifest, checked_tensors, layer_entry, manifest_metadata, read_layer
from mixle.core.packing import unpack_int4
from mixle.core.stored import check_stored
from mixle.flax_backend.convert import QuantizedKernel, QuantizedValue, model_nbytes, run_stored_products
from mixle.flax_backend.fake_quant import weight_layout

__all__ = ["save_quantized", "load_quantized", "LAYERS", "FlaxLayer"]


@dataclasses.dataclass(frozen=True)
class FlaxLayer:
    """How one Flax layer type is stored.

    Attributes:
        weight: the Param that can be quantized (or None).
        input_axes: that Param's input (contracting) axes.
        kind: the file's layer kind of the quantized weight.
        torch_names: ``{flax Param name: (torch name, transposed)}``; 2-D Params marked
            transposed are written as their transpose (torch's ``(out, in)``).
        options: the manifest options of the kind, with torch's defaults.
    """

    weight: str | None
    input_axes: tuple
    kind: str | None
    torch_names: dict
    options: dict = dataclasses.field(default_factory=dict)


LAYERS = {
    nnx.Linear: FlaxLayer("kernel", (0,), "linear", {"kernel": ("weight", True), "bias": ("bias", False)}),
    nnx.Embed: FlaxLayer("embedding", (1,), "embedding", {"embedding": ("weight", False)},
                         {"padding_idx": None, "max_norm": None, "norm_type": 2.0, "scale_grad_by_freq": False}),
    nnx.LayerNorm: FlaxLayer(None, (), None, {"scale": ("weight", False), "bias": ("bias", False)}),
    nnx.RMSNorm: FlaxLayer(None, (), None, {"scale": ("weight", False)}),
}
_HEAD = FlaxLayer("embedding", (1,), "linear", {})  # the head a tied Embed's attend() stands for


def _layer_of(module):
    return next((layer for cls, layer in LAYERS.items() if isinstance(module, cls)), None)


def _modules(model):
    return {".".join(str(p) for p in path): module for path, module in nnx.iter_modules(model)}


def _own_variables(module):
    return {name: v for name, v in vars(module).items() if isinstance(v, nnx.Variable) and not isinstance(v, nnx.RngState)}


def _torch_paths(path, names, tied):
    """``(path of the weight's torch module, path of a tied head or None)`` for a Flax module path."""
    target = names.get(path, path) if names else path
    if tied:
        if not (isinstance(target, tuple) and len(target) == 2):
            raise ValueError(
                f"the Embed {path!r} is quantized because its attend() is the output head: name both torch modules "
                f"it stands for, names={{{path!r}: ('<embedding path>', '<head path>')}}")
        return target
    if not isinstance(target, str):
        raise ValueError(f"names[{path!r}] must be a torch module path (a str), got {target!r}")
    return target, None


def _join(prefix, name):
    return f"{prefix}.{name}" if prefix else name


# ------------------------------------------------------------------------------------------------
# Saving


def save_quantized(model, path, *, names=None):
    """Save a converted NNX model in mixle's file format (the torch layout; never pickle).

    Args:
        model: a model from ``convert`` or ``quantize_model``.
        path: the file to write, e.g. ``"model.safetensors"`` (replaced atomically).
        names: optional ``{flax module path: torch module path}`` (a pair for a tied Embed,
            see the module docstring).

    Returns:
        The manifest (a dict), as stored in the file.

    Raises:
        ValueError: the model has no quantized kernel, a kernel belongs to a layer type the
            file format has no torch layer for, or a tied Embed has no head path in ``names``.

    >>> import tempfile, os, jax.numpy as jnp
    >>> from mixle.flax_backend.convert import quantize_model
    >>> net = quantize_model(nnx.Linear(8, 4, rngs=nnx.Rngs(0)), bits=4, example_inputs=(jnp.ones((1, 8)),))
    >>> manifest = save_quantized(net, os.path.join(tempfile.mkdtemp(), "fc.safetensors"))
    >>> manifest["layers"][0]["weight_shape"], manifest["nbytes"]["int4_code_bytes"]
    ([4, 8], 16)
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"save_quantized (Flax) takes a converted flax.nnx.Module, got {type(model).__name__}")
    from mixle.flax_backend.qat import qat_state

    if qat_state(model) is not None:
        raise ValueError("the model is still a QAT model: save convert(model), the model with stored int codes")
    if names is not None and not isinstance(names, dict):
        raise TypeError(f"names must be a dict {{flax module path: torch module path}}, got {type(names).__name__}")
    arrays, layers, aliases, used = {}, [], {}, set()
    for module_path, module in _modules(model).items():
        variables = _own_variables(module)
        if variables:
            used.add(module_path)
            _save_module(module_path, module, variables, names, arrays, layers, aliases)
    unknown = sorted(set(names or ()) - used)
    if unknown:
        raise ValueError(f"names has entries {unknown} that are not modules with variables in this model: "
                         f"use dotted Flax module paths, e.g. {sorted(used)[:4]}")
    if not layers:
        raise ValueError("the model has no quantized kernel: make one with quantize_model(model, example_inputs=...) "
                         "or convert(qat_model)")
    described = {name: describe_array(array, name) for name, array in arrays.items()}
    manifest = build_manifest(layers, described, aliases, model_nbytes(model))
    write_safetensors(path, arrays, manifest_metadata(manifest))
    return manifest


def _save_module(module_path, module, variables, names, arrays, layers, aliases):
    """Add one module's tensors to ``arrays`` and its quantized layers (and tied head) to ``layers``."""
    layer = _layer_of(module)
    quantized = {n: v for n, v in variables.items() if isinstance(v, QuantizedKernel)}
    for name in quantized:
        if layer is None or layer.weight != name:
            raise ValueError(
                f"kernel {_join(module_path, name)!r} of a {type(module).__name__} is quantized, but mixle's file format "
                f"has torch layers only for {', '.join(c.__name__ for c in LAYERS if LAYERS[c].kind)} weights: "
                f"keep this layer in float (patterns=[({module_path!r}, None), ...]) to save the model")
    tied = isinstance(module, nnx.Embed) and bool(quantized)
    torch_path, head_path = _torch_paths(module_path, names, tied)
    for name, variable in variables.items():
        if name in quantized:
            value = variable.get_raw_value()
            entry = _layer_entry(torch_path, layer, value, arrays, bias=_bias(layer, variables, torch_path))
            layers.append(entry)
            if head_path is not None:
                head = _layer_entry(head_path, _HEAD, value, {}, bias=None)
                aliases[head["codes"]], aliases[head["scale"]] = entry["codes"], entry["scale"]
                layers.append(head)
            continue
        if layer is not None and layer.weight in quantized and name == "bias":
            continue  # written with its layer
        torch_name, transposed = (layer.torch_names.get(name, (name, False)) if layer else (name, False))
        array = np.asarray(variable.get_raw_value())
        arrays[_join(torch_path, torch_name)] = array.T if transposed and array.ndim == 2 else array


def _bias(layer, variables, torch_path):
    if layer.kind != "linear" or "bias" not in variables:
        return None
    return _join(torch_path, "bias"), np.asarray(variables["bias"].get_raw_value())


def _layer_entry(torch_path, layer, value, arrays, bias):
    """One manifest layer (torch's entry) and its tensors added to ``arrays``."""
    codes, scale = value.file_codes(), value.on_host().scale_matrix()
    check_stored(codes, scale, value.spec, value.matrix_shape, name=f"layer {torch_path!r}")
    names = {"codes": _join(torch_path, "codes"), "scale": _join(torch_path, "scale")}
    arrays[names["codes"]], arrays[names["scale"]] = codes, scale
    options = {}
    if layer.kind == "linear":
        options["bias"] = None
        if bias is not None:
            options["bias"], arrays[bias[0]] = bias
    options.update(layer.options)
    return layer_entry(torch_path, layer.kind, value.spec, value.matrix_shape, names, (codes.nbytes, scale.nbytes),
                       **options)


# ------------------------------------------------------------------------------------------------
# Loading


def _quantized_value(entry, arrays, param, layer, where, source):
    """The QuantizedValue of one manifest layer, validated against the model's float Param."""
    if entry.get("kind") != layer.kind:
        raise ValueError(f"{where}: a {entry.get('kind')} layer cannot fill a {layer.kind} weight")
    stored = read_layer(entry, arrays, source)  # the shared manifest and storage checks
    rows, cols = stored.shape
    perm, out_count = weight_layout(param.ndim, layer.input_axes)
    value_shape = tuple(param.shape)
    if (rows, cols) != (value_shape[perm[0]], value_shape[perm[1]]):
        raise ValueError(f"{where}: the file holds a {[rows, cols]} weight, the model's {layer.weight} is "
                         f"{list(value_shape)} (torch layout {[value_shape[perm[0]], value_shape[perm[1]]]}): "
                         f"pass a model built like the saved one")
    codes, scale = stored.parts["codes"], stored.parts["scale"]
    if entry.get("codes_nbytes") != codes.nbytes or entry.get("scale_nbytes") != scale.nbytes:
        raise ValueError(f"{where}: the manifest's codes_nbytes/scale_nbytes disagree with the tensors")
    if stored.spec.bits == 4:
        codes = unpack_int4(codes, (rows, cols))
    return QuantizedValue.of_matrix(codes, scale, stored.spec, value_shape, perm, out_count)


def load_quantized(path, model, *, names=None):
    """Load a file written by ``save_quantized`` (Flax or torch) into a copy of a float NNX model.

    Everything is validated before it is used: the safetensors structure, the manifest's format
    version and sha256, each tensor's dtype, shape and sha256, each layer's spec, shapes, code
    range and scales, and that the file's tensors are exactly the model's (under the torch
    names, see the module docstring). A tied Embed/head pair comes back as one quantized Embed.

    Args:
        path: a file written by either backend's ``save_quantized``.
        model: a float NNX model built like the saved one; not modified.
        names: as for ``save_quantized``.

    Returns:
        A copy of ``model`` whose saved kernels are ``QuantizedKernel``s.

    Raises:
        ValueError: the file is corrupt, truncated or tampered, or does not fit ``model``.

    >>> import tempfile, os, jax.numpy as jnp
    >>> from mixle.flax_backend.convert import quantize_model
    >>> path = os.path.join(tempfile.mkdtemp(), "fc.safetensors")
    >>> _ = save_quantized(quantize_model(nnx.Linear(8, 4, rngs=nnx.Rngs(0)), example_inputs=(jnp.ones((1, 8)),)), path)
    >>> type(load_quantized(path, nnx.Linear(8, 4, rngs=nnx.Rngs(1))).kernel).__name__
    'QuantizedKernel'
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"load_quantized (Flax) takes the float flax.nnx.Module to fill in, got {type(model).__name__}")
    if names is not None and not isinstance(names, dict):
        raise TypeError(f"names must be a dict {{flax module path: torch module path}}, got {type(names).__name__}")
    source = str(path)
    manifest, arrays, entries = _read_file(path, source)
    new = nnx.clone(model)
    consumed, assigned = set(), []
    for module_path, module in _modules(new).items():
        variables = _own_variables(module)
        if variables:
            _load_module(module_path, module, variables, names, (manifest, arrays, entries, source), consumed,
                         assigned)
    extra = sorted(set(arrays) - consumed)
    if extra:
        raise ValueError(f"{source} does not fit this model: the file has {extra[:8]} that no variable of the model "
                         f"takes; pass a model built like the saved one (and names= for renamed modules)")
    for module_path, module, name, value in assigned:
        if isinstance(value, QuantizedValue):
            run_stored_products(module, module_path, name, value.spec)
            setattr(module, name, QuantizedKernel(value))
        else:
            vars(module)[name].set_raw_value(value)
    return new


def _read_file(path, source):
    """``(manifest, {name: numpy array}, {torch path: layer entry})`` of a file, all checked."""
    with open_tensors(path, "numpy") as (metadata, infos, handle):
        manifest = manifest_from(metadata, source)
        arrays = checked_tensors(manifest, infos, _reader(handle, infos, source), describe_array, source)
    entries = {}
    for entry in manifest["layers"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise ValueError(f"{source}: a manifest layer entry has no path: {entry!r:.120}")
        entries[entry["path"]] = entry
    return manifest, arrays, entries


def _reader(handle, infos, source):
    def read(name):
        if infos[name].dtype == "BF16":
            raise ValueError(f"{source}: tensor {name!r} is bfloat16, which this loader does not read yet")
        array = handle.get_tensor(name)
        return array.astype(array.dtype.newbyteorder("="))
    return read


def _load_module(module_path, module, variables, names, file, consumed, assigned):
    """Add what one module takes from the file to ``assigned`` and the tensor names to ``consumed``."""
    manifest, arrays, entries, source = file
    layer = _layer_of(module)
    target = names.get(module_path, module_path) if names else module_path
    tied = isinstance(module, nnx.Embed) and isinstance(target, tuple)
    torch_path, head_path = _torch_paths(module_path, names, tied)
    entry = entries.get(torch_path)
    quantized = entry is not None and layer is not None and layer.kind == entry.get("kind")
    if quantized:
        if isinstance(module, nnx.Embed) and head_path is None:
            raise ValueError(f"{source}: the file quantizes the embedding {torch_path!r}, which is tied to a head: "
                             f"name that head, names={{{module_path!r}: ({torch_path!r}, '<head path>')}}")
        where = f"{source}: layer {torch_path!r}"
        value = _quantized_value(entry, arrays, variables[layer.weight].get_raw_value(), layer, where, source)
        assigned.append((module_path, module, layer.weight, value))
        consumed |= {entry["codes"], entry["scale"]}
        if head_path is not None:
            consumed |= _tied_head(manifest, entries, entry, torch_path, head_path, source)
        if (entry.get("bias") is None) != ("bias" not in variables):
            raise ValueError(f"{where}: the file's layer has bias={entry.get('bias') is not None}, the model's "
                             f"{type(module).__name__} has bias={'bias' in variables}: pass a model built like "
                             f"the saved one")
        if entry.get("bias") is not None:
            consumed.add(entry["bias"])
            bias = _float(arrays, entry["bias"], variables.get("bias"), False, where)
            assigned.append((module_path, module, "bias", bias))
    elif head_path is not None:
        raise ValueError(f"{source}: names maps {module_path!r} to a tied pair, but the file has no embedding layer "
                         f"{torch_path!r}")
    for name, variable in variables.items():
        if quantized and name in (layer.weight, "bias"):
            continue
        torch_name, transposed = layer.torch_names.get(name, (name, False)) if layer else (name, False)
        key = _join(torch_path, torch_name)
        value = _float(arrays, key, variable, transposed, f"{source}: tensor {key!r}")
        assigned.append((module_path, module, name, value))
        consumed.add(key)


def _tied_head(manifest, entries, entry, torch_path, head_path, source):
    """The tensor names of the head layer sharing ``entry``'s codes; ValueError if there is none."""
    head = entries.get(head_path)
    aliases = manifest["aliases"]
    if head is None or aliases.get(head.get("codes"), head.get("codes")) != aliases.get(entry["codes"], entry["codes"]):
        raise ValueError(f"{source}: {head_path!r} is not a head sharing the codes of {torch_path!r}: "
                         f"the file's layers are {sorted(entries)}")
    return {head["codes"], head["scale"]}


def _float(arrays, key, variable, transposed, where):
    if key not in arrays:
        raise ValueError(f"{where}: the file has no tensor {key!r} for this variable; pass a model built like the "
                         f"saved one (and names= for renamed modules)")
    array = arrays[key]
    array = array.T if transposed and array.ndim == 2 else array
    current = variable.get_raw_value()
    if tuple(array.shape) != tuple(current.shape) or array.dtype != current.dtype:
        raise ValueError(f"{where}: {array.dtype} {list(array.shape)} in the file (in the model's layout), "
                         f"{current.dtype} {list(current.shape)} in the model: pass a model built like the saved one")
    return jnp.asarray(array)
