"""llama.cpp's importance-matrix files: read and write them, and map their names to a model's layers.

The format of the llama.cpp vendored by llama-cpp-python 0.3.36 (``tools/imatrix/imatrix.cpp``,
``common/imatrix-loader.cpp``) is a GGUF file without an architecture: ``general.type``
``"imatrix"``, ``imatrix.datasets`` (strings), ``imatrix.chunk_count`` and ``imatrix.chunk_size``
(uint32; ``llama-quantize`` refuses a file without all three), and per matrix two F32 tensors,
``<name>.in_sum2`` (ggml shape ``[columns, n_mat]``: the summed squared inputs) and ``<name>.counts``
(``[1, n_mat]``: the input rows summed), names sorted. The legacy binary format (``--output-format
dat``: int32 entry count; per entry int32 name length, the name, int32 call count, int32 value count,
float32 values already divided by the count per call; optionally int32 chunk count and a dataset
name) is still read by llama.cpp, and here. gguf-py reads and writes the GGUF form.

Files from outside are validated before use (``read_imatrix``: tensor pairs, dtypes, shapes;
``check_entries``: the model's names and column counts, finite non-negative sums, enough tokens).
"""

from pathlib import Path

import numpy as np

from mixle._optional import require
from mixle.core.grids import GRIDS
from mixle.core.imatrix import Imatrix, check_entries
from mixle.gguf.mixes import grid_of_type
from mixle.gguf.file import open_gguf

__all__ = ["read_imatrix", "write_imatrix", "model_imatrix_names", "save_imatrix", "load_imatrix",
           "importance_by_layer", "importance_by_tensor", "require_entry"]

_SUMS, _COUNTS = ".in_sum2", ".counts"


def write_imatrix(path, imatrix):
    """Write an ``Imatrix`` keyed by GGUF tensor names as llama.cpp's GGUF imatrix file.

    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "m.imatrix.gguf")
    >>> write_imatrix(path, Imatrix({"blk.0.ffn_up.weight": np.ones((1, 32), np.float32)},
    ...                             {"blk.0.ffn_up.weight": np.array([64])}, ("text",), 2, 32))
    >>> read_imatrix(path).counts["blk.0.ffn_up.weight"].tolist()
    [64]
    """
    gguf = require("gguf", extra="gguf", purpose="write_imatrix")
    if not imatrix.datasets:  # gguf-py writes no empty array, and llama-quantize refuses a file without the key
        raise ValueError("write_imatrix: the Imatrix names no calibration dataset (Imatrix.datasets is empty), but "
                         "llama-quantize refuses an imatrix file without imatrix.datasets: set datasets=('name',)")
    writer = gguf.GGUFWriter(str(path), arch="")
    writer.kv_data[0].pop("general.architecture", None)  # llama.cpp's imatrix files have none
    try:
        writer.add_string("general.type", "imatrix")
        writer.add_array("imatrix.datasets", [str(d) for d in imatrix.datasets])
        writer.add_uint32("imatrix.chunk_count", int(imatrix.chunk_count))
        writer.add_uint32("imatrix.chunk_size", int(imatrix.chunk_size))
        for name in sorted(imatrix.sums):
            sums = np.ascontiguousarray(np.asarray(imatrix.sums[name], np.float32))
            counts = np.asarray(imatrix.counts[name], np.float32).reshape(sums.shape[0], 1)
            writer.add_tensor(name + _SUMS, sums.reshape(sums.shape[0], -1))
            writer.add_tensor(name + _COUNTS, np.ascontiguousarray(counts))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def read_imatrix(path):
    """An ``Imatrix`` (GGUF tensor names) from a llama.cpp imatrix file, GGUF or legacy.

    Raises:
        ValueError: a file that is neither, a GGUF whose tensors do not fit its layout (truncated,
            a changed type, overlapping offsets: ``mixle.gguf.file.open_gguf``), a
            ``.in_sum2`` without its ``.counts`` (or the other way), a tensor not F32, or counts that
            do not fit the sums; the message names the file and the tensor.
    """
    path = Path(path)
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic == b"GGUF":
        return _read_gguf(path)
    return _read_legacy(path)


def _read_gguf(path):
    gguf = require("gguf", extra="gguf", purpose="read_imatrix")
    reader = open_gguf(path, purpose="read_imatrix")  # every tensor checked against the file's layout
    pairs = {}
    for tensor in reader.tensors:
        for suffix, slot in ((_SUMS, 0), (_COUNTS, 1)):
            if tensor.name.endswith(suffix):
                if tensor.tensor_type != gguf.GGMLQuantizationType.F32:
                    raise ValueError(f"{path}: tensor {tensor.name!r} is {tensor.tensor_type.name}, not F32")
                ne = [int(d) for d in tensor.shape]
                values = np.asarray(tensor.data, np.float32).reshape(ne[1] if len(ne) > 1 else 1, ne[0])
                pairs.setdefault(tensor.name[: -len(suffix)], [None, None])[slot] = values
    sums, counts = {}, {}
    for name, (s, c) in pairs.items():
        if s is None or c is None:
            raise ValueError(f"{path}: tensor {name!r} has {'no .in_sum2' if s is None else 'no .counts'} (llama.cpp "
                             f"refuses the file too)")
        if c.shape != (s.shape[0], 1):
            raise ValueError(f"{path}: tensor {name!r} has {c.size} counts for {s.shape[0]} sum rows")
        sums[name], counts[name] = s, np.rint(c[:, 0]).astype(np.int64)  # std::lround
    if not sums:
        raise ValueError(f"{path}: no imatrix entries (.in_sum2 / .counts tensors)")
    fields = reader.fields

    def value(key):
        return int(fields[key].contents()) if key in fields else 0

    datasets = tuple(fields["imatrix.datasets"].contents()) if "imatrix.datasets" in fields else ()
    return Imatrix(sums, counts, datasets, value("imatrix.chunk_count"), value("imatrix.chunk_size"))


def _read_legacy(path):
    data = path.read_bytes()
    at = 0

    def take(fmt_dtype, count=1):
        nonlocal at
        size = np.dtype(fmt_dtype).itemsize * count
        if at + size > len(data):
            raise ValueError(f"{path}: not a llama.cpp imatrix file (GGUF or legacy): it ends inside an entry")
        out = np.frombuffer(data, dtype=fmt_dtype, count=count, offset=at)
        at += size
        return out

    n_entries = int(take("<i4")[0])
    if n_entries < 1:
        raise ValueError(f"{path}: not a llama.cpp imatrix file (no GGUF magic, {n_entries} legacy entries)")
    sums, counts = {}, {}
    for _ in range(n_entries):
        length = int(take("<i4")[0])
        if not 0 < length < 4096:
            raise ValueError(f"{path}: not a llama.cpp imatrix file (an entry name of {length} bytes)")
        name = take("u1", length).tobytes().decode("utf-8", "replace")
        ncall, nval = (int(v) for v in take("<i4", 2))
        if nval < 1:
            raise ValueError(f"{path}: entry {name!r} has {nval} values")
        sums[name] = take("<f4", nval).astype(np.float32)[None]
        counts[name] = np.array([ncall], np.int64)
    chunk_count, datasets = 0, ()
    if at + 8 <= len(data):
        chunk_count, length = (int(v) for v in take("<i4", 2))
        if 0 < length and at + length <= len(data):
            datasets = (take("u1", length).tobytes().decode("utf-8", "replace"),)
    return Imatrix(sums, counts, datasets, chunk_count, 0, legacy=True)


def model_imatrix_names(model):
    """``{model layer path: [gguf tensor names]}`` of the matrices ``save_gguf`` writes that an imatrix
    has entries for (``blk.*`` and ``output.weight``; one path gives two names where a fused weight is
    split, e.g. gate and up rows: their input is one). ``model``: a torch model or its ``ModelPlan``.

    >>> from mixle.models.transformer import build_causal_lm
    >>> model_imatrix_names(build_causal_lm(vocab=40, d_model=32, n_layer=1, n_head=2, block=8))["blocks.0.qkv"]
    ['blk.0.attn_qkv.weight']
    """
    return _plan(model, "model_imatrix_names").imatrix_names


def _plan(model, purpose="imatrix files"):
    from mixle.gguf.plan import plan_of  # torch: only for a model's names

    return plan_of(model, purpose)


def save_imatrix(model, imatrix, path):
    """Write an ``Imatrix`` keyed by ``model``'s layer paths (``calibrate_importance``'s) as llama.cpp's
    imatrix file of ``save_gguf(model)``'s tensor names, for ``llama-quantize --imatrix``.

    Raises:
        ValueError: a path that is no matrix ``save_gguf`` writes, or sums that do not fit it.
    """
    plan = _plan(model)
    names = plan.imatrix_names
    unknown = sorted(set(imatrix.sums) - set(names))
    if unknown:
        raise ValueError(f"imatrix entries {unknown[:4]} are not layers save_gguf writes (those are e.g. "
                         f"{sorted(names)[:4]})")
    sums = {n: imatrix.sums[p] for p in imatrix.sums for n in names[p]}
    counts = {n: imatrix.counts[p] for p in imatrix.sums for n in names[p]}
    out = Imatrix(sums, counts, imatrix.datasets, imatrix.chunk_count, imatrix.chunk_size)
    check_entries(out, plan.matrix_shapes, min_tokens=0, what="save_imatrix")
    write_imatrix(path, out)


def importance_by_layer(model, importance, *, min_tokens=1):
    """``{layer path: float32 importance}`` from what ``quantize_model(..., importance=)`` takes: a
    llama.cpp imatrix file's path, an ``Imatrix`` (keyed by layer paths, as ``calibrate_importance``
    makes it, or by GGUF names, as read from a file), or such a dict already.

    Raises:
        ValueError, TypeError: names that fit neither, or entries that do not fit the model.
    """
    plan = _plan(model)  # walks nothing until a question needs the layout
    if isinstance(importance, dict):
        return dict(importance)
    what, from_file = "importance", isinstance(importance, (str, Path))
    if from_file:  # keyed by GGUF names
        importance, what = read_imatrix(importance), str(importance)
    elif not isinstance(importance, Imatrix):
        raise TypeError(f"importance must be an imatrix file's path, an Imatrix (calibrate_importance) or "
                        f"{{layer path: values}}, got {type(importance).__name__}")
    names = plan.imatrix_names
    if from_file or not set(importance.sums) <= set(names):  # keyed by GGUF names
        return _by_layer(importance, plan, min_tokens, what)
    shapes = {path: plan.matrix_shapes[gguf_names[0]] for path, gguf_names in names.items()}
    check_entries(importance, shapes, min_tokens=min_tokens, what="importance")
    return importance.importance()


def importance_by_tensor(model, importance, *, min_tokens=1):
    """``{gguf tensor name: float32 importance}`` of ``save_gguf(model)``'s matrices from any form
    ``importance_by_layer`` takes (a layer path of a split weight gives each of its tensors).

    Raises:
        ValueError, TypeError: as ``importance_by_layer``, or an entry for a path that is no matrix
            ``save_gguf`` writes (the message names it).

    >>> from mixle.models.transformer import build_causal_lm
    >>> lm = build_causal_lm(vocab=40, d_model=32, n_layer=1, n_head=2, block=8)
    >>> importance_by_tensor(lm, {"blocks.0.fc": np.ones(32, np.float32)})["blk.0.ffn_up.weight"].shape
    (32,)
    """
    plan = _plan(model)
    by_layer = importance_by_layer(plan, importance, min_tokens=min_tokens)
    names = plan.imatrix_names
    unknown = sorted(set(by_layer) - set(names))
    if unknown:
        raise ValueError(f"importance has entries for {unknown[:4]}, which are not matrices save_gguf writes (those "
                         f"are e.g. {sorted(names)[:4]}): the importance matrix was computed for another model")
    return {name: np.asarray(values, np.float32) for path, values in by_layer.items() for name in names[path]}


def require_entry(name, ggml_type, by_tensor, what="importance"):
    """Refuse quantizing tensor ``name`` on ``ggml_type`` with an importance matrix lacking its entry.

    llama-imatrix collects every ``blk.*`` matrix, so such a gap means the importance was made for
    another model (or from part of it); ``output.weight`` (collected only with ``--process-output``)
    and the token embedding (never) may be absent, and get the reference quantizer, as in llama-quantize.
    Types on which ggml ignores an importance (Q8_0, MXFP4, float) need none.

    >>> require_entry("output.weight", "Q4_0", {})
    >>> require_entry("blk.0.ffn_up.weight", "Q8_0", {})
    """
    if name in by_tensor or not name.startswith("blk.") or ggml_type in (None, "F32", "F16"):
        return
    if GRIDS[grid_of_type(ggml_type)].weighted is not None:
        raise ValueError(f"{what} has no entry for tensor {name!r}, which the mix quantizes on {ggml_type} by a weighted "
                         f"search: the importance matrix covers other tensors (another model, or only some layers); "
                         f"calibrate_importance on this model, or give the file llama-imatrix made of it")


def load_imatrix(path, model, *, min_tokens=1):
    """``{model layer path: float32 importance}`` (what ``quantize_model(..., importance=)`` takes)
    from a llama.cpp imatrix file, validated against ``model``'s GGUF tensors.

    Entries llama.cpp does not quantize with (a matrix without one keeps the reference
    quantizer, as in llama-quantize) are simply absent.

    Raises:
        ValueError: names not in the model, wrong column counts, non-finite or negative sums, too
            few tokens (``min_tokens``), or a split weight whose parts disagree; naming the tensor.
    """
    plan = _plan(model)
    return _by_layer(read_imatrix(path), plan, min_tokens, str(path))


def _by_layer(imatrix, plan, min_tokens, what):
    """``{layer path: importance}`` of an ``Imatrix`` keyed by GGUF names, checked against the plan's model."""
    check_entries(imatrix, plan.matrix_shapes, min_tokens=min_tokens, what=what)
    means = imatrix.importance()
    out = {}
    for layer, gguf_names in plan.imatrix_names.items():
        found = [means[n] for n in gguf_names if n in means]
        if found and (len(found) != len(gguf_names) or any(not np.array_equal(found[0], f) for f in found[1:])):
            raise ValueError(f"{what}: the tensors {gguf_names} of layer {layer!r} share one input but have different "
                             f"importance: write them as one layer's entry")
        if found:
            out[layer] = found[0]
    return out
