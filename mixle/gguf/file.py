"""Reading GGUF files: gguf-py's ``GGUFReader``, after every tensor is checked against the file's layout.

gguf-py trusts the header: a tensor's bytes are computed from its declared type and shape and read
from its declared offset, whatever lies there. llama.cpp's loader (``gguf_init_from_file``) is
stricter, and ``open_gguf`` refuses what it refuses: each tensor's data starts where the previous
tensor's data, padded to the file's alignment (``general.alignment``, default 32), ends, the first
at offset 0 of the data section, so offsets are aligned, increasing and non-overlapping, and the
bytes a tensor's declared type and shape need are exactly the gap to the next tensor. The last
tensor must fit the file, and the file must not run on past its padded end (bytes no declared
type accounts for). So a type changed in the header (F32 declared F16, Q4_K declared Q5_K) or two
tensors at one offset are refused instead of read as garbage. Every refusal names the file, the
tensor, its declared type and shape, the bytes those need and the bytes the file gives it.

Every GGUF file mixle reads goes through here: ``load_gguf_weights``, importance-matrix files
(``read_imatrix``), and ``mixle finetune --model X.gguf``.
"""

import math
import os
import struct

from mixle._optional import require

__all__ = ["open_gguf"]

_DEFAULT_ALIGNMENT = 32  # llama.cpp's GGUF_DEFAULT_ALIGNMENT
_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
# GGUF metadata value types (gguf's GGUFValueType) -> struct format; 8 is a string, 9 an array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def open_gguf(path, purpose="reading a GGUF file", name=None):
    """gguf-py's ``GGUFReader`` of ``path``, after checking every tensor against the file's own layout.

    Args:
        path: the ``.gguf`` file.
        purpose: what reads it, for the ImportError when gguf-py is missing.
        name: how refusals name the file (default: its path, quoted), e.g. ``"model='x.gguf'"``.

    Returns:
        The ``gguf.GGUFReader``.

    Raises:
        ValueError: the file is not GGUF, its header is cut short, or a tensor does not fit the
            layout (truncated data, a declared type or shape whose bytes differ from the gap to the
            next tensor, overlapping, misaligned or out-of-order offsets, an unknown type); the
            message names the file, the tensor, its declared type and the bytes needed and held.

    >>> import os, tempfile, numpy as np, gguf
    >>> path = os.path.join(tempfile.mkdtemp(), "t.gguf")
    >>> writer = gguf.GGUFWriter(path, arch="llama")
    >>> writer.add_tensor("w", np.ones((2, 8), np.float32))
    >>> writer.write_header_to_file(); writer.write_kv_data_to_file(); writer.write_tensors_to_file()
    >>> writer.close()
    >>> [(t.name, t.tensor_type.name) for t in open_gguf(path).tensors]
    [('w', 'F32')]
    """
    gguf = require("gguf", extra="gguf", purpose=purpose)
    where = f"{name or repr(str(path))} cannot be read as a GGUF file"
    try:
        reader = gguf.GGUFReader(str(path))
    except OSError:
        raise
    except Exception as err:  # gguf-py fails deep inside numpy on a truncated or corrupt file
        raise ValueError(f"{where}: {_unreadable(path, err, gguf)}") from None
    start = int(reader.data_offset)
    tensors = [(t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), int(t.data_offset) - start)
               for t in reader.tensors]
    try:
        _check_layout(tensors, int(reader.alignment), start, os.path.getsize(path), gguf)
    except ValueError as problem:
        raise ValueError(f"{where}: {problem}") from None
    return reader


def _unreadable(path, err, gguf):
    """Why gguf-py could not read ``path``, from the header read by hand: the tensor at fault if found."""
    try:
        tensors, alignment, start = _header(path)
    except ValueError as problem:
        return str(problem)
    except (EOFError, KeyError, OverflowError, MemoryError):
        return f"its header is cut short or corrupt ({err}); copy or write the file again"
    try:
        _check_layout(tensors, alignment, start, os.path.getsize(path), gguf)
    except ValueError as problem:
        return str(problem)
    return f"{type(err).__name__}: {err}; copy or write the file again"


def _check_layout(tensors, alignment, start, size, gguf):
    """Raise ValueError where ``tensors`` ((name, ggml type id, ne, data offset), header order) do not
    lie as llama.cpp lays them out in a file of ``size`` bytes whose data section starts at ``start``."""
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"its general.alignment is {alignment}, but it must be a power of two (llama.cpp refuses "
                         f"the file too)")
    seen, before = set(), None
    for name, type_id, ne, offset in tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} is listed twice in its header; the file is corrupt")
        seen.add(name)
        what, need = _declared(name, type_id, ne, gguf)
        declared = f"tensor {name!r} is declared {what}, which needs {need} bytes"
        if offset % alignment:
            raise ValueError(f"{declared}, but it starts at data offset {offset}, which is not a multiple of the "
                             f"file's alignment {alignment}; the file is corrupt: copy or write it again")
        if before is None and offset:
            raise ValueError(f"{declared}, but it is the first tensor and starts at data offset {offset}, not 0 "
                             f"(llama.cpp reads the tensors' data back to back from the start); the file is corrupt")
        if before is not None:
            _check_gap(*before, offset, f"tensor {name!r} starts", alignment)
        if start + offset + need > size:
            raise ValueError(f"tensor {name!r} needs bytes {start + offset}..{start + offset + need}, but the file "
                             f"ends at {size}: it is truncated ({what} needs {need} bytes, it has "
                             f"{max(size - start - offset, 0)}); copy or write it again")
        before = (declared, need, offset)
    if before is not None:
        _check_gap(*before, size - start, "the file ends", alignment, last=True)


def _declared(name, type_id, ne, gguf):
    """``("F16 of shape [2, 64]", 256)``: a tensor's declared type and shape, and the bytes they need."""
    try:
        ggml_type = gguf.GGMLQuantizationType(type_id)
        block, nbytes = gguf.GGML_QUANT_SIZES[ggml_type]
    except (ValueError, KeyError):
        raise ValueError(f"tensor {name!r} has the ggml type {type_id}, which gguf-py does not know: the header is "
                         f"corrupt, or the type newer than this gguf-py (pip install -U gguf)") from None
    shape = list(reversed(ne))
    if len(ne) > _MAX_DIMS:
        raise ValueError(f"tensor {name!r} ({ggml_type.name}) has {len(ne)} dimensions {shape}, but ggml tensors have "
                         f"at most {_MAX_DIMS}; the file is corrupt")
    if ne and ne[0] % block:
        raise ValueError(f"tensor {name!r} is declared {ggml_type.name} of shape {shape}, whose rows of {ne[0]} values "
                         f"{ggml_type.name} blocks of {block} do not divide; the file is corrupt")
    return f"{ggml_type.name} of shape {shape}", math.prod(ne) // block * nbytes


def _check_gap(declared, need, offset, at, there, alignment, last=False):
    """Raise ValueError unless the bytes from ``offset`` to ``at`` (where ``there``) are the ``need``
    bytes of the tensor ``declared``, padded to ``alignment`` (the last one's padding may be cut)."""
    has, padded = at - offset, need + (-need % alignment)
    if has == padded or (last and need <= has <= padded):
        return
    refused = "" if last else " (llama.cpp refuses it too)"
    if has < 0:
        raise ValueError(f"{declared} from data offset {offset}, but {there} at data offset {at}, before it: data "
                         f"offsets must increase in the header's order; the file is corrupt{refused}: copy or write it "
                         f"again")
    why = ("the two tensors' bytes overlap" if has < need else
           "its declared type or shape does not account for all of them (a changed type or shape?)")
    pad = f" ({padded} padded to the file's {alignment}-byte alignment)" if padded != need else ""
    raise ValueError(f"{declared}{pad}, but it has {has}: {there} at data offset {at}; {why}. The file is corrupt"
                     f"{refused}: copy or write it again")


def _header(path):
    """``([(name, ggml type id, ne, data offset)], alignment, data start)`` of a GGUF file's header,
    read by hand, never allocating more than the file holds; EOFError where the header ends early."""
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size

        def take(fmt):
            raw = file.read(struct.calcsize("<" + fmt))
            if len(raw) < struct.calcsize("<" + fmt):
                raise EOFError
            return struct.unpack("<" + fmt, raw)

        def text():
            length = take("Q")[0]
            if length > size - file.tell():
                raise EOFError
            return file.read(length).decode("utf-8", "replace")

        def skip(kind):
            if kind == 8:
                text()
            elif kind == 9:
                sub, count = take("IQ")
                if sub in _GGUF_SCALARS:  # skipped whole: a bogus count must not loop or allocate
                    file.seek(file.tell() + count * struct.calcsize("<" + _GGUF_SCALARS[sub]))
                    if file.tell() > size:
                        raise EOFError
                else:
                    for _ in range(count):
                        skip(sub)
            else:
                take(_GGUF_SCALARS[kind])

        magic, _, n_tensors, n_kv = take("4sIQQ")
        if magic != b"GGUF":
            raise ValueError(f"its first bytes are {magic!r}, not GGUF's magic b'GGUF'")
        alignment = _DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            key, kind = text(), take("I")[0]
            if key == "general.alignment" and kind != 4:
                raise ValueError(f"its general.alignment has value type {kind}, not uint32 (llama.cpp refuses it too)")
            if key == "general.alignment":
                alignment = take("I")[0]
            else:
                skip(kind)
        tensors = []
        for _ in range(n_tensors):
            tensor, dims = text(), take("I")[0]
            if dims > _MAX_DIMS:
                raise ValueError(f"tensor {tensor!r} has {dims} dimensions, but ggml tensors have at most {_MAX_DIMS}; "
                                 f"the file is corrupt")
            ne = take("Q" * dims)
            ggml_type, offset = take("IQ")
            tensors.append((tensor, ggml_type, ne, offset))
        start = file.tell()
    return tensors, alignment, start + (-start % alignment) if alignment > 0 else start
