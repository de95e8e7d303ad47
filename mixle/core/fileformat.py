"""mixle's quantized-model file: safetensors with a validated JSON manifest (framework-free).

File format: a standard safetensors file (8-byte little-endian header length, a JSON header
giving each tensor's dtype, shape and data offsets, then the raw little-endian tensor bytes),
read and written with the ``safetensors`` library (memory-mapped; never pickle) after mixle has
checked every header field itself. Its ``__metadata__`` holds one JSON manifest under
the key ``"mixle_manifest"``: format and mixle versions, every quantized layer (path, kind,
spec, bits, weight shape, tensor names, byte counts), every stored tensor's dtype, shape and
sha256, the names that alias a shared (tied) tensor, ``model_nbytes`` and ``manifest_sha256``,
the sha256 of the manifest itself serialized as
``json.dumps(manifest_without_that_key, sort_keys=True, separators=(",", ":"))``.
"""

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import stat
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["ModelBytes", "read_manifest", "write_safetensors", "read_safetensors", "read_header", "open_tensors", "describe_array", "check_listed", "add_aliases",
           "TensorInfo", "replace_atomically", "checked_directory", "replace_directory_atomically", "canonical_manifest", "manifest_from", "FORMAT", "FORMAT_VERSION",
           "MANIFEST_KEY", "DTYPE_ITEMSIZE"]

FORMAT = "mixle.quantized"
FORMAT_VERSION = 1
MANIFEST_KEY = "mixle_manifest"
_MAX_HEADER_BYTES = 100 * 2**20



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
# The safetensors format: the ``safetensors`` library reads and writes the tensors; mixle checks
# the header first (bounded reads, every field), so a hostile header is a ValueError naming the
# file and the field before the library maps anything.

# safetensors dtype name -> item size in bytes (the dtypes mixle stores).
DTYPE_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                  "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}


_NUMPY_DTYPE_NAMES = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32",
                      "int16": "I16", "int8": "I8", "uint64": "U64", "uint32": "U32", "uint16": "U16",
                      "uint8": "U8", "bool": "BOOL"}


def describe_array(array, name):
    """``(safetensors dtype name, shape, sha256 of its little-endian bytes)`` of a numpy array, as
    mixle's manifest lists a stored tensor (the torch backend hashes the same bytes).

    >>> describe_array(np.zeros(2, np.int8), "w")[:2]
    ('I8', (2,))
    """
    dtype = _NUMPY_DTYPE_NAMES.get(np.dtype(array.dtype).name)
    if dtype is None:
        raise TypeError(f"tensor {name!r} has dtype {array.dtype}, which mixle's file cannot store: use one of "
                        f"float16/32/64, (u)int8/16/32/64 or bool")
    little = np.ascontiguousarray(array, dtype=np.dtype(array.dtype).newbyteorder("<"))
    return dtype, tuple(array.shape), hashlib.sha256(little.view(np.uint8)).hexdigest()


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry: safetensors dtype name, shape, byte span in the data section."""

    dtype: str
    shape: tuple
    begin: int
    end: int


def _no_duplicate_keys(pairs):
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        duplicated = sorted({key for key in keys if keys.count(key) > 1})
        raise ValueError(f"field {duplicated[0]!r} appears more than once")
    return dict(pairs)


def read_header(path):
    """``(metadata, {name: TensorInfo})`` of a safetensors file, every header field checked.

    Reads only the 8-byte length and the header (at most 100 MiB), never the tensor data.

    Raises:
        ValueError: the file is truncated or its header is malformed; the message names the file
            and the field.

    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
    >>> write_safetensors(path, {"w": np.zeros((2, 3), np.float32)})
    >>> read_header(path)
    ({}, {'w': TensorInfo(dtype='F32', shape=(2, 3), begin=0, end=24)})
    """
    source = str(path)

    def bad(why):
        return ValueError(f"{source} is not a valid safetensors file: {why}")

    total, size, text = _header_bytes(path, source, bad)
    header = _header_json(text, bad)
    metadata = _header_metadata(header.pop("__metadata__", None), bad)
    infos = {name: _tensor_info(name, entry, bad) for name, entry in header.items()}
    _check_data_span(infos, total - 8 - size, bad)
    return metadata, infos


def _header_bytes(path, source, bad):
    """``(file size, header length, header bytes)``, the length field checked against the file."""
    try:
        with open(path, "rb") as handle:
            total = os.fstat(handle.fileno()).st_size
            first = handle.read(8)
            if len(first) < 8:
                raise bad(f"it is truncated to {len(first)} bytes, shorter than the 8-byte header length")
            (size,) = struct.unpack("<Q", first)
            if size > _MAX_HEADER_BYTES or 8 + size > total:
                raise bad(f"the header length field claims {size} bytes but the file has {total - 8} after it "
                          f"(truncated or corrupt; mixle reads headers up to {_MAX_HEADER_BYTES} bytes)")
            return total, size, handle.read(size)
    except OSError as error:
        raise ValueError(f"{source} cannot be read ({error})") from None


def _header_json(text, bad):
    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except RecursionError:
        raise bad("its JSON header is nested too deeply; the file is corrupt") from None
    except ValueError as err:  # undecodable bytes, bad JSON, duplicate fields, oversized numbers
        raise bad(f"its JSON header does not parse ({err}); the file is corrupt") from None
    if not isinstance(header, dict):
        raise bad(f"its header is a JSON {type(header).__name__}, not an object")
    return header


def _header_metadata(metadata, bad):
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict):
        raise bad(f"field '__metadata__' must map strings to strings, got a {type(metadata).__name__}")
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise bad(f"field '__metadata__'.{key!r} must be a string, got a {type(value).__name__}")
    return metadata


def _tensor_info(name, entry, bad):
    field = f"field {name!r}"
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise bad(f"{field} needs exactly dtype, shape and data_offsets, got {got!s:.120}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_ITEMSIZE:
        raise bad(f"{field}.dtype {dtype!r:.40} is not one of the dtypes mixle reads ({', '.join(DTYPE_ITEMSIZE)})")
    if not (isinstance(shape, list) and len(shape) <= 64 and all(type(d) is int and d >= 0 for d in shape)):
        raise bad(f"{field}.shape must be a list of at most 64 non-negative integers, got {shape!r:.80}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise bad(f"{field}.data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r:.80}")
    needed = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
    if offsets[1] - offsets[0] != needed:
        raise bad(f"{field}: {dtype} {shape} needs {needed} bytes, its data_offsets span {offsets[1] - offsets[0]}")
    return TensorInfo(dtype, tuple(shape), offsets[0], offsets[1])


def _check_data_span(infos, data, bad):
    """The tensors must tile the ``data`` bytes after the header exactly."""
    end = 0
    for name, info in sorted(infos.items(), key=lambda item: (item[1].begin, item[1].end)):
        if info.begin != end:
            raise bad(f"field {name!r}.data_offsets starts at byte {info.begin}, expected {end}: tensors must be "
                      f"contiguous and must not overlap")
        end = info.end
    if end != data:
        state = "truncated" if end > data else "followed by unexpected bytes"
        raise bad(f"the header describes {end} bytes of tensor data, the file holds {data} ({state})")


@contextlib.contextmanager
def open_tensors(path, framework="numpy"):
    """Check the header, then memory-map the file with ``safetensors.safe_open``.

    Yields ``(metadata, {name: TensorInfo}, handle)``; ``handle.get_tensor(name)`` reads one
    tensor. ``framework`` is safetensors' ("numpy", "pt", ...).

    Raises:
        ValueError: as ``read_header``, or the safetensors library refuses the file.
    """
    from safetensors import SafetensorError, safe_open

    metadata, infos = read_header(path)
    try:
        with safe_open(str(path), framework=framework) as handle:
            yield metadata, infos, handle
    except SafetensorError as error:
        raise ValueError(f"{path} is not a valid safetensors file: {error}") from None


def _umask():
    try:  # Linux states it; os.umask's set-and-restore would race with other threads
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def _fsync(path, directory=False):
    """Flush a file (errors raise: its data may be lost) or a directory (best effort: some systems
    cannot open or flush one) to disk."""
    try:
        handle = os.open(path, os.O_RDONLY)
    except OSError:
        if directory:
            return
        raise
    try:
        os.fsync(handle)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(handle)


def replace_atomically(path, write):
    """Write a file through ``write(temporary_path)`` and move it over ``path`` in one step.

    The temporary file lies in the target's directory; it is flushed to disk before the rename
    and the directory after it, so neither a failure nor a crash leaves a half-written file under
    ``path``: the previous file stays until the new one replaces it, and the temporary file is
    removed on any failure (KeyboardInterrupt too). The new file keeps the mode of the file it
    replaces (else the umask's default), and a symbolic link at ``path`` is written through: its
    target is replaced, the link stays.

    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "note.txt")
    >>> replace_atomically(path, lambda tmp: Path(tmp).write_text("hi"))
    >>> Path(path).read_text(), os.listdir(os.path.dirname(path))
    ('hi', ['note.txt'])
    """
    path = Path(os.path.realpath(path))
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.close(handle)
        write(tmp)
        os.chmod(tmp, mode)
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise
    _fsync(path.parent, directory=True)


def checked_directory(directory, overwrite):
    """``directory`` as a Path a checkpoint may be written to, after refusing a file there, or a
    non-empty directory without ``overwrite``.

    >>> import tempfile
    >>> checked_directory(tempfile.mkdtemp(), False).is_dir()
    True
    """
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a path, got {type(directory).__name__}")
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be True or False, got {overwrite!r}")
    target = Path(directory)
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"directory={str(directory)!r} is a file: pass a directory path for the checkpoint")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise FileExistsError(f"directory={str(directory)!r} exists and is not empty: pick a new path, or pass "
                              f"overwrite=True to replace it")
    return target


def replace_directory_atomically(target, write, overwrite):
    """Write a directory through ``write(temporary_directory)`` and rename it to ``target``.

    Nothing is left behind on any failure (KeyboardInterrupt too): the temporary directory is
    removed, and a previous ``target`` (replaced only with ``overwrite``) is exactly as it was. A
    previous non-empty directory is renamed aside, the new one renamed in, and the old one
    removed only once the new one is in place; if that second rename fails, the old one is
    renamed back. The new directory gets the umask's default mode (the previous one's, if any).

    Returns:
        What ``write`` returned.

    Raises:
        FileExistsError: ``target`` was filled by someone else while writing and ``overwrite`` is False.

    >>> import tempfile, os
    >>> target = Path(tempfile.mkdtemp()) / "checkpoint"
    >>> replace_directory_atomically(target, lambda tmp: (tmp / "a.txt").write_text("new"), overwrite=False)
    3
    >>> os.listdir(target), sorted(os.listdir(target.parent))
    (['a.txt'], ['checkpoint'])
    """
    target = Path(os.path.realpath(target))
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mode = 0o777 & ~_umask()
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=parent))
    try:
        result = write(staging)
        os.chmod(staging, mode)
        for root, _, files in os.walk(staging):
            for name in files:
                _fsync(os.path.join(root, name))
            _fsync(root, directory=True)
        if target.is_dir() and any(target.iterdir()):
            if not overwrite:  # appeared while writing
                raise FileExistsError(f"directory={str(target)!r} was filled while writing: nothing was replaced")
            _swap_directories(staging, target, parent)
        else:
            os.replace(staging, target)  # an empty directory is replaced atomically
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _fsync(parent, directory=True)
    return result


def _swap_directories(staging, target, parent):
    """Rename ``target`` aside, ``staging`` in, then remove the old one; restore it if the rename fails."""
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=parent))
    try:
        os.rename(target, aside / "previous")
    except BaseException:
        os.rmdir(aside)
        raise
    try:
        os.rename(staging, target)
    except BaseException as error:
        try:
            os.rename(aside / "previous", target)
        except OSError:
            raise OSError(f"replacing {str(target)!r} failed ({error!r}) and the previous directory could not be "
                          f"moved back: it is at {str(aside / 'previous')!r}") from error
        os.rmdir(aside)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def write_safetensors(path, arrays, metadata=None):
    """Write numpy arrays to a safetensors file with the ``safetensors`` library (no pickle).

    Args:
        path: the file to write (replaced atomically, see ``replace_atomically``).
        arrays: ``{name: numpy array}``.
        metadata: optional ``{str: str}`` stored as ``__metadata__``.

    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
    >>> write_safetensors(path, {"w": np.arange(3, dtype=np.int8)}, {"note": "hi"})
    >>> read_safetensors(path)
    ({'w': array([0, 1, 2], dtype=int8)}, {'note': 'hi'})
    """
    import safetensors.numpy

    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError("metadata must map strings to strings")
    arrays = {name: np.array(a, order="C", copy=not np.asarray(a).flags.c_contiguous) for name, a in arrays.items()}
    replace_atomically(path, lambda tmp: safetensors.numpy.save_file(arrays, tmp, metadata=metadata))


def read_safetensors(path):
    """``({name: numpy array}, metadata)`` from a safetensors file, its header checked first.

    BF16 tensors are returned as their raw int16 bit patterns (numpy has no bfloat16).

    Raises:
        ValueError: the file is truncated or its header is malformed.
    """
    arrays = {}
    with open_tensors(path, "numpy") as (metadata, infos, handle):
        for name, info in infos.items():
            if info.dtype != "BF16":
                arrays[name] = handle.get_tensor(name)
                continue
            with open(path, "rb") as raw:  # the library has no numpy bfloat16: read the bits
                raw.seek(8 + struct.unpack("<Q", raw.read(8))[0] + info.begin)
                arrays[name] = np.frombuffer(raw.read(info.end - info.begin), "<i2").reshape(info.shape).copy()
    return arrays, metadata


def canonical_manifest(manifest):
    """The bytes ``manifest_sha256`` hashes: the manifest without that key, as compact sorted JSON.

    >>> canonical_manifest({"b": 1, "a": [2], "manifest_sha256": "x"})
    b'{"a":[2],"b":1}'
    """
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")


def manifest_from(metadata, source):
    """The manifest in a file's safetensors ``metadata``, after its format, version and own hash.

    Raises:
        ValueError: no manifest, not mixle's format or version, or it fails its sha256 check;
            the message names ``source``.

    >>> manifest_from({}, "plain.safetensors")
    Traceback (most recent call last):
    ValueError: plain.safetensors: no 'mixle_manifest' in the safetensors metadata: it was not written by save_quantized
    """

    def bad(why):
        return ValueError(f"{source}: {why}")

    if MANIFEST_KEY not in metadata:
        raise bad(f"no {MANIFEST_KEY!r} in the safetensors metadata: it was not written by save_quantized")
    try:
        manifest = json.loads(metadata[MANIFEST_KEY])
    except RecursionError:
        raise bad("the manifest's JSON is nested too deeply; the file is corrupt") from None
    except ValueError as err:
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
    metadata, _ = read_header(path)
    return manifest_from(metadata, str(path))


def check_listed(manifest, infos, source):
    """Refuse a file whose tensors are not exactly those its manifest lists, with their dtypes and
    shapes (the hashes are each backend's to check as it reads the bytes)."""
    listed = manifest["tensors"]
    if set(listed) != set(infos):
        raise ValueError(f"{source}: the manifest lists tensors {sorted(set(listed) - set(infos))} missing from the "
                         f"file and the file has unlisted tensors {sorted(set(infos) - set(listed))}")
    for name, info in infos.items():
        entry = listed[name]
        if not isinstance(entry, dict) or entry.get("dtype") != info.dtype or entry.get("shape") != list(info.shape):
            said = f"{entry.get('dtype')} {entry.get('shape')}" if isinstance(entry, dict) else repr(entry)
            raise ValueError(f"{source}: tensor {name!r} is {info.dtype} {list(info.shape)} in the file but "
                             f"{said:.80} in the manifest")


def add_aliases(manifest, tensors, source):
    """Add each alias of the manifest to ``tensors`` ({name: tensor}) as the very tensor it names."""
    for alias, target in manifest["aliases"].items():
        if not isinstance(target, str) or alias in tensors or target not in tensors:
            raise ValueError(f"{source}: alias {alias!r} -> {target!r:.80} does not name one stored tensor")
        tensors[alias] = tensors[target]
    return tensors
