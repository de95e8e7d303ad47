"""Every GGUF file mixle reads is checked against its own layout, as llama.cpp's loader checks it.

Tiny files are written with gguf-py's GGUFWriter, then their header is changed with gguf-py's own
reader opened for writing (``GGUFReader(path, "r+")``): a tensor's type, or its data offset. The
bytes each type needs are ggml's (F32 4 bytes a value, F16 2, Q4_K 144 per 256 values, Q5_K 176),
written out here by hand; every reader must refuse the file naming it, the tensor, the declared
type and shape, and the bytes needed against the bytes the file gives.
"""

import re

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

from mixle.core.numerics import quantize_array  # noqa: E402
from mixle.gguf.writer import load_gguf_weights, save_gguf  # noqa: E402
from mixle.gguf.file import open_gguf  # noqa: E402
from mixle.gguf.imatrix_file import read_imatrix  # noqa: E402
from mixle.models.transformer import build_causal_lm  # noqa: E402

T = gguf.GGMLQuantizationType


def _write(path, tensors, arch="llama", kv=()):
    """A GGUF file of ``[(name, array, raw ggml type or None)]`` written by gguf-py."""
    writer = gguf.GGUFWriter(str(path), arch=arch)
    for key, value in kv:
        writer.add_string(key, value)
    for name, array, raw_dtype in tensors:
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tiny(path):
    """Three tensors, each more than one 32-byte alignment step long: data offsets 0, 512, 1088."""
    rng = np.random.default_rng(0)
    return _write(path, [("a.weight", rng.standard_normal((2, 64)).astype(np.float32), None),  # 512 bytes
                         ("b.weight", np.zeros((4, 144), np.uint8), T.Q4_K),  # 4 rows of one block: 576 bytes
                         ("c.weight", rng.standard_normal((3, 32)).astype(np.float32), None)])  # 384 bytes


def _retype(path, tensor, ggml_type):
    reader = gguf.GGUFReader(str(path), "r+")
    next(t for t in reader.tensors if t.name == tensor).field.parts[4][0] = ggml_type
    reader.data.flush()


def _move(path, tensor, offset):
    """Give ``tensor`` the data offset ``offset`` (relative to the data section, as the header holds it)."""
    reader = gguf.GGUFReader(str(path), "r+")
    next(t for t in reader.tensors if t.name == tensor).field.parts[5][0] = offset
    reader.data.flush()


def _data_offset(path, tensor):
    reader = gguf.GGUFReader(str(path))
    return next(t for t in reader.tensors if t.name == tensor).data_offset - reader.data_offset


def _truncate(path, keep):
    path.write_bytes(path.read_bytes()[:keep])


def _file_starts(path):
    return re.escape(str(path)) + r"' cannot be read as a GGUF file: "


CORRUPTIONS = {
    "f32 declared f16": (lambda p: _retype(p, "a.weight", T.F16),
                         r"tensor 'a.weight' is declared F16 of shape \[2, 64\], which needs 256 bytes, but it has "
                         r"512: tensor 'b.weight' starts at data offset 512; its declared type or shape does not "),
    "q4_k declared q5_k": (lambda p: _retype(p, "b.weight", T.Q5_K),
                           r"tensor 'b.weight' is declared Q5_K of shape \[4, 256\], which needs 704 bytes, but it has "
                           r"576: tensor 'c.weight' starts at data offset 1088; the two tensors' bytes overlap"),
    "two tensors at one offset": (lambda p: _move(p, "c.weight", 512),
                                  r"tensor 'b.weight' is declared Q4_K of shape \[4, 256\], which needs 576 bytes, "
                                  r"but it has 0: tensor 'c.weight' starts at data offset 512; the two tensors' bytes "
                                  r"overlap"),
    "offsets out of order": (lambda p: _move(p, "c.weight", 0),
                             r"tensor 'b.weight' is declared Q4_K of shape \[4, 256\], which needs 576 bytes from "
                             r"data offset 512, but tensor 'c.weight' starts at data offset 0, before it: data offsets "
                             r"must increase in the header's order"),
    "misaligned offset": (lambda p: _move(p, "c.weight", 1092),
                          r"tensor 'c.weight' is declared F32 of shape \[3, 32\], which needs 384 bytes, but it starts "
                          r"at data offset 1092, which is not a multiple of the file's alignment 32"),
    "last f32 declared f16": (lambda p: _retype(p, "c.weight", T.F16),
                              r"tensor 'c.weight' is declared F16 of shape \[3, 32\], which needs 192 bytes, but it "
                              r"has 384: the file ends at data offset 1472; its declared type or shape does not "),
    "truncated": (lambda p: _truncate(p, gguf.GGUFReader(str(p)).data_offset + 1088 + 100),
                  r"tensor 'c.weight' needs bytes \d+\.\.\d+, but the file ends at \d+: it is truncated \(F32 of shape "
                  r"\[3, 32\] needs 384 bytes, it has 100\)"),
    "unknown type": (lambda p: _retype(p, "a.weight", 99), r"tensor 'a.weight' has the ggml type 99, which gguf-py "
                                                           r"does not know"),
}


def _load_model(path):
    pytest.importorskip("transformers")
    from mixle.lm.finetune_load import load_model

    return load_model(str(path))


READERS = {
    "open_gguf": open_gguf,
    "load_gguf_weights": lambda path: load_gguf_weights(build_causal_lm(40, 32, 1, 2, 8, activation="gelu_tanh"), path),
    "read_imatrix": read_imatrix,
    "finetune load_model": _load_model,
}


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_every_reader_refuses_a_file_that_does_not_fit_its_layout(corruption, reader, tmp_path):
    path = _tiny(tmp_path / "tiny.gguf")
    open_gguf(path)  # as written, the layout holds
    change, message = CORRUPTIONS[corruption]
    change(path)
    with pytest.raises(ValueError, match=_file_starts(path) + message):
        READERS[reader](path)


def test_a_norm_weight_declared_f16_no_longer_loads_as_garbage(tmp_path):
    """Issue case 1: before, ``blk.0.attn_norm.weight``'s float32 ones read as float16 [0, 1.875, 0, ...]."""
    lm = build_causal_lm(40, 32, 1, 2, 8, activation="gelu_tanh")
    path = tmp_path / "lm.gguf"
    save_gguf(lm, path)
    _retype(path, "blk.0.attn_norm.weight", T.F16)
    with pytest.raises(ValueError, match=_file_starts(path) + r"tensor 'blk.0.attn_norm.weight' is declared F16 of "
                                         r"shape \[32\], which needs 64 bytes, but it has 128: tensor '.*' starts at "):
        load_gguf_weights(lm, path)


def test_two_tensors_at_one_offset_no_longer_load(tmp_path):
    """Issue case 2: before, the norm bias silently took the norm weight's bytes."""
    lm = build_causal_lm(40, 32, 1, 2, 8, activation="gelu_tanh")
    save_gguf(lm, tmp_path / "lm.gguf")
    path = tmp_path / "lm.gguf"
    names = [t.name for t in gguf.GGUFReader(str(path)).tensors]
    first, second = names[names.index("blk.0.attn_norm.weight")], names[names.index("blk.0.attn_norm.weight") + 1]
    _move(path, second, _data_offset(path, first))
    with pytest.raises(ValueError, match=_file_starts(path) + rf"tensor '{first}' is declared F32 of shape \[32\], "
                                         rf"which needs 128 bytes, but it has 0: tensor '{second}' starts at data "
                                         rf"offset \d+; the two tensors' bytes overlap"):
        load_gguf_weights(lm, path)


def test_q4_k_declared_q5_k_is_refused_by_its_size_not_by_luck(tmp_path):
    """Issue case 3: before, refused only where the Q5_K reading happened to give a NaN float16 scale."""
    lm = build_causal_lm(40, 64, 2, 2, 8, activation="gelu_tanh")  # ffn_down: 64 rows of 256 values, one block each
    quantized = {"blocks.0.out": quantize_array(lm.blocks[0].out.weight.detach(), grid="q4_k")}
    path = tmp_path / "lm.gguf"
    save_gguf(lm, path, quantized=quantized)
    assert {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}["blk.0.ffn_down.weight"] == "Q4_K"
    _retype(path, "blk.0.ffn_down.weight", T.Q5_K)
    with pytest.raises(ValueError, match=_file_starts(path) + r"tensor 'blk.0.ffn_down.weight' is declared Q5_K of "
                                         r"shape \[64, 256\], which needs 11264 bytes, but it has 9216: "):
        load_gguf_weights(lm, path)


def _imatrix_file(path):
    """A llama.cpp importance-matrix GGUF (no architecture) of one 256-column matrix, by gguf-py's writer."""
    writer = gguf.GGUFWriter(str(path), arch="")
    writer.kv_data[0].pop("general.architecture", None)
    writer.add_string("general.type", "imatrix")
    writer.add_array("imatrix.datasets", ["t"])
    writer.add_uint32("imatrix.chunk_count", 1)
    writer.add_uint32("imatrix.chunk_size", 32)
    writer.add_tensor("blk.0.ffn_up.weight.counts", np.full((1, 1), 32, np.float32))
    writer.add_tensor("blk.0.ffn_up.weight.in_sum2", np.arange(256, dtype=np.float32).reshape(1, 256))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_truncated_importance_matrix_names_the_file_and_tensor(tmp_path):
    """Issue case 4: before, "cannot reshape array of size 116 into shape (1,256)", naming neither."""
    path = _imatrix_file(tmp_path / "m.imatrix.gguf")
    assert read_imatrix(path).sums["blk.0.ffn_up.weight"].tolist() == [list(range(256))]
    start = gguf.GGUFReader(str(path)).tensors[-1].data_offset
    _truncate(path, start + 116 * 4)
    with pytest.raises(ValueError, match=_file_starts(path) + rf"tensor 'blk.0.ffn_up.weight.in_sum2' needs bytes "
                                         rf"{start}\.\.{start + 1024}, but the file ends at {start + 464}: it is "
                                         rf"truncated \(F32 of shape \[1, 256\] needs 1024 bytes, it has 464\)"):
        read_imatrix(path)


def test_importance_matrix_tensors_at_one_offset_are_refused(tmp_path):
    path = _imatrix_file(tmp_path / "m.imatrix.gguf")
    _move(path, "blk.0.ffn_up.weight.in_sum2", 0)
    with pytest.raises(ValueError, match=_file_starts(path) + r"tensor 'blk.0.ffn_up.weight.counts' is declared F32 "
                                         r"of shape \[1, 1\], which needs 4 bytes \(32 padded to the file's 32-byte "
                                         r"alignment\), but it has 0"):
        read_imatrix(path)


def test_a_file_with_another_alignment_is_read_by_its_own(tmp_path):
    """general.alignment = 64: tensors padded to 64 bytes read; the 32-byte padding would be refused."""
    writer = gguf.GGUFWriter(str(tmp_path / "a64.gguf"), arch="llama")
    writer.data_alignment = 64
    writer.add_custom_alignment(64)
    writer.add_tensor("a.weight", np.ones((1, 40), np.float32))  # 160 bytes: 192 padded to 64
    writer.add_tensor("b.weight", np.ones((1, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = open_gguf(tmp_path / "a64.gguf")
    assert int(reader.alignment) == 64 and _data_offset(tmp_path / "a64.gguf", "b.weight") == 192
    _move(tmp_path / "a64.gguf", "b.weight", 160)
    with pytest.raises(ValueError, match=r"tensor 'b.weight' is declared F32 of shape \[1, 8\], which needs 32 bytes, "
                                         r"but it starts at data offset 160, which is not a multiple of the file's "
                                         r"alignment 64"):
        open_gguf(tmp_path / "a64.gguf")
