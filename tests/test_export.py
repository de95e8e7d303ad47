"""Real byte counts, and save/load of quantized models: bit-exact, tie-preserving, tamper-evident."""

import hashlib
import json
import math
import os
import re
import stat
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from torch import nn

from mixle.models.qat import apply_qat
from mixle.torch_backend.kernels import packed_linear
from mixle.core.fileformat import MANIFEST_KEY, read_manifest, read_safetensors, write_safetensors
from mixle.task.quantize import (
    QuantizedEmbedding,
    QuantizedLinear,
    QuantSpec,
    convert,
    load_quantized,
    model_nbytes,
    quantize_model,
    save_quantized,
)
from tests.test_ptq_convert import TinyCausalLM, lm_batch, make_lm, make_mlp, mlp_batch


def float_weight_bytes(model, names):
    return sum(model.get_submodule(n).weight.numel() * 4 for n in names)


MLP_LAYERS = ("0", "2")
LM_LAYERS = ("q", "k", "v", "o", "fc1", "fc2", "head")  # head is tied to tok: one table


# ----------------------------------------------------------------------------------------------
# model_nbytes


def test_model_nbytes_of_a_float_model_counts_every_tensor_once():
    model = make_lm()
    unique = {id(p): p for p in model.parameters()}
    assert model_nbytes(model).float_bytes == sum(p.numel() * 4 for p in unique.values())
    assert model_nbytes(model).total == model_nbytes(model).float_bytes


@pytest.mark.parametrize("kind", ["mlp", "lm"])
def test_int4_weights_are_an_eighth_of_fp32_plus_scales(kind):
    model, layers = (make_mlp(), MLP_LAYERS) if kind == "mlp" else (make_lm(), LM_LAYERS)
    quantized = quantize_model(model, bits=4)
    nb = model_nbytes(quantized)
    shapes = [tuple(model.get_submodule(n).weight.shape) for n in layers]
    assert nb.int4_code_bytes == sum(math.ceil(o * i / 2) for o, i in shapes)
    assert nb.scale_bytes == sum(o * 4 for o, _ in shapes)  # one fp32 scale per output channel
    assert nb.int8_code_bytes == 0
    target = float_weight_bytes(model, layers) / 8 + nb.scale_bytes
    assert abs(nb.int4_code_bytes + nb.scale_bytes - target) <= 0.02 * target
    # Everything else stays fp32: biases, norms, the untied position table.
    quantized_weights = {id(model.get_submodule(n).weight) for n in layers}
    rest = {id(p): p for p in model.parameters() if id(p) not in quantized_weights}
    assert nb.float_bytes == sum(p.numel() * 4 for p in rest.values())


def test_int8_and_group_scales_are_counted():
    model = make_mlp()
    nb = model_nbytes(quantize_model(model, bits=8, group_size=16))
    assert nb.int8_code_bytes == 32 * 64 + 64 * 10
    assert nb.scale_bytes == (32 * 64 + 64 * 10) // 16 * 4
    assert nb.as_dict()["total"] == nb.total == nb.float_bytes + nb.int8_code_bytes + nb.scale_bytes


def test_model_nbytes_refuses_non_modules():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        model_nbytes({"w": torch.zeros(2)})


# ----------------------------------------------------------------------------------------------
# save -> load


def assert_same_model(a, b):
    sa, sb = a.state_dict(keep_vars=True), b.state_dict(keep_vars=True)
    assert list(sa) == list(sb)
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key
    assert [type(m) for m in a.modules()] == [type(m) for m in b.modules()]
    for (_, ma), (_, mb) in zip(a.named_modules(), b.named_modules()):
        if isinstance(ma, (QuantizedLinear, QuantizedEmbedding)):
            assert ma.spec == mb.spec and ma.weight_shape == mb.weight_shape


@pytest.fixture
def lm_file(tmp_path):
    model = quantize_model(make_lm(), bits=4, group_size=8)
    path = tmp_path / "lm.safetensors"
    manifest = save_quantized(model, path)
    return model, path, manifest


def test_save_load_round_trip_is_bit_exact_and_keeps_the_tie(lm_file):
    model, path, manifest = lm_file
    loaded = load_quantized(path, make_lm(seed=7))
    assert_same_model(model, loaded)
    assert loaded.head.codes is loaded.tok.codes and loaded.head.scale is loaded.tok.scale
    with torch.no_grad():
        assert torch.equal(loaded(lm_batch()), model(lm_batch()))
    assert manifest["aliases"] == {"head.codes": "tok.codes", "head.scale": "tok.scale"}
    assert manifest["nbytes"] == model_nbytes(model).as_dict() == model_nbytes(loaded).as_dict()


@pytest.mark.parametrize(
    "spec_args",
    [dict(bits=8), dict(bits=4, grid="qwix", clip_percentile=99.5), dict(bits=4, granularity="tensor"),
     dict(bits=4, patterns=(("fc1", QuantSpec(bits=8)), ".*"), exclude=("head",))],
    ids=["int8", "qwix-p99.5", "tensor", "mixed-bits-float-head"],
)
def test_round_trip_for_other_specs(tmp_path, spec_args):
    model = make_lm()
    quantized = quantize_model(model, **spec_args)
    save_quantized(quantized, tmp_path / "m.safetensors")
    loaded = load_quantized(tmp_path / "m.safetensors", make_lm(seed=3))
    assert_same_model(quantized, loaded)
    with torch.no_grad():
        assert torch.equal(loaded(lm_batch()), quantized(lm_batch()))
    if "exclude" in spec_args:
        assert loaded.head.weight is loaded.tok.weight  # the float tie is the skeleton's, values loaded


def test_convert_after_qat_round_trips_a_wrapped_mlp(tmp_path):
    qat = apply_qat(make_mlp(), bits=4, group_size=8).eval()
    converted = convert(qat)
    save_quantized(converted, tmp_path / "mlp.safetensors")
    loaded = load_quantized(tmp_path / "mlp.safetensors", make_mlp(seed=5))
    with torch.no_grad(), packed_linear.switched_off():  # the exact path: same float ops, same order
        assert torch.equal(loaded(mlp_batch()), qat(mlp_batch()))


def test_bfloat16_models_round_trip(tmp_path):
    model = make_mlp().to(torch.bfloat16)
    quantized = quantize_model(model, bits=4)
    # The float32 copy's scales, so that each value is rounded once to bf16, as the QAT forward's.
    assert quantized[0].scale.dtype == torch.float32 and quantized[0].float_dtype == torch.bfloat16
    save_quantized(quantized, tmp_path / "bf16.safetensors")
    loaded = load_quantized(tmp_path / "bf16.safetensors", make_mlp().to(torch.bfloat16))
    assert_same_model(quantized, loaded)
    theirs = safetensors.torch.load_file(tmp_path / "bf16.safetensors")
    assert theirs["0.scale"].dtype == torch.float32 and torch.equal(theirs["0.scale"], quantized[0].scale)
    x = mlp_batch().to(torch.bfloat16)
    with torch.no_grad():
        assert loaded(x).dtype == torch.bfloat16 and torch.equal(loaded(x), quantized(x))
        # model.to(bfloat16) leaves the float32 scales as they are (a bf16 copy would round values twice).
        assert torch.equal(loaded.to(torch.bfloat16)(x), quantized(x)) and loaded[0].scale.dtype == torch.float32


def test_load_leaves_the_skeleton_untouched(lm_file):
    _, path, _ = lm_file
    skeleton = make_lm(seed=9)
    before = {k: v.clone() for k, v in skeleton.state_dict().items()}
    load_quantized(path, skeleton)
    assert isinstance(skeleton.fc1, nn.Linear) and not isinstance(skeleton.fc1, QuantizedLinear)
    assert all(torch.equal(before[k], v) for k, v in skeleton.state_dict().items())


def test_the_safetensors_package_reads_the_file_identically(lm_file):
    model, path, manifest = lm_file
    mine, metadata = read_safetensors(path)
    theirs = safetensors.numpy.load_file(path)
    assert sorted(mine) == sorted(theirs) == sorted(manifest["tensors"])
    for name, array in theirs.items():
        assert array.dtype == mine[name].dtype and array.shape == mine[name].shape
        assert array.tobytes() == mine[name].tobytes()
        assert hashlib.sha256(array.tobytes()).hexdigest() == manifest["tensors"][name]["sha256"]
    state = model.state_dict()
    for name, tensor in safetensors.torch.load_file(path).items():
        assert tensor.dtype == state[name].dtype and torch.equal(tensor, state[name])
    with safetensors.safe_open(path, "np") as handle:
        assert json.loads(handle.metadata()[MANIFEST_KEY]) == manifest == json.loads(metadata[MANIFEST_KEY])
    # The data section holds exactly the model's bytes: no pickle, nothing duplicated for the tie.
    raw = path.read_bytes()
    (header_size,) = struct.unpack("<Q", raw[:8])
    assert len(raw) - 8 - header_size == model_nbytes(model).total
    assert b"\x80\x04" not in raw[:2] and raw[8:9] == b"{"


def test_numpy_writer_and_package_writer_agree(tmp_path):
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([-1, 7], np.int8),
              "c": np.array(3.5, np.float64), "d": np.array([True, False])}
    write_safetensors(tmp_path / "mine.safetensors", arrays, {"k": "v"})
    theirs = safetensors.numpy.load_file(tmp_path / "mine.safetensors")
    safetensors.numpy.save_file(arrays, tmp_path / "theirs.safetensors", metadata={"k": "v"})
    mine, metadata = read_safetensors(tmp_path / "theirs.safetensors")
    assert metadata == {"k": "v"}
    for name, array in arrays.items():
        for other in (theirs[name], mine[name]):
            assert other.dtype == array.dtype and other.shape == array.shape
            np.testing.assert_array_equal(other, array)


# ----------------------------------------------------------------------------------------------
# Corrupt, truncated and tampered files


def test_every_flipped_bit_is_rejected(tmp_path):
    model = quantize_model(nn.Sequential(nn.Linear(6, 3), nn.ReLU(), nn.Linear(3, 2)), bits=4)
    path = tmp_path / "small.safetensors"
    save_quantized(model, path)
    good = path.read_bytes()
    skeleton = nn.Sequential(nn.Linear(6, 3), nn.ReLU(), nn.Linear(3, 2))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(good)
    accepted = []
    with open(bad, "r+b") as handle:  # flip in place: reopening the file each time is the slow part
        for position in range(len(good)):
            for bit in (0x01, 0x80):
                handle.seek(position)
                handle.write(bytes([good[position] ^ bit]))
                handle.flush()
                try:
                    load_quantized(bad, skeleton)
                    accepted.append((position, bit))
                except ValueError:
                    pass
            handle.seek(position)
            handle.write(good[position : position + 1])
    assert accepted == []
    assert_same_model(model, load_quantized(path, skeleton))


def test_a_flipped_data_byte_names_the_tensor(lm_file):
    _, path, manifest = lm_file
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="fails its sha256 check: the file is corrupt"):
        load_quantized(path, make_lm())


def test_truncated_files_are_rejected(lm_file, tmp_path):
    _, path, _ = lm_file
    good = path.read_bytes()
    (header_size,) = struct.unpack("<Q", good[:8])
    cut = tmp_path / "cut.safetensors"
    for length in (0, 5, 8, 9, 8 + header_size // 2, 8 + header_size, 8 + header_size + 3, len(good) - 1):
        cut.write_bytes(good[:length])
        with pytest.raises(ValueError, match="truncated"):
            load_quantized(cut, make_lm())
    cut.write_bytes(good + b"\0")
    with pytest.raises(ValueError, match="unexpected bytes"):
        load_quantized(cut, make_lm())


def resign(path, edit_manifest=None, edit_tensors=None):
    """Rewrite a file with the safetensors package, after edits, with valid hashes everywhere.

    This is what a buggy or malicious writer could produce: every checksum agrees, so only the
    structural checks of load_quantized stand between the file and a wrong model.
    """
    tensors = safetensors.numpy.load_file(path)
    with safetensors.safe_open(path, "np") as handle:
        manifest = json.loads(handle.metadata()[MANIFEST_KEY])
    if edit_tensors:
        edit_tensors(tensors)
    if edit_manifest:
        edit_manifest(manifest)
    for name, array in tensors.items():
        manifest["tensors"][name]["sha256"] = hashlib.sha256(array.tobytes()).hexdigest()
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    manifest["manifest_sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    safetensors.numpy.save_file(tensors, path, metadata={MANIFEST_KEY: json.dumps(manifest)})


def layer(manifest, path):
    return next(entry for entry in manifest["layers"] if entry["path"] == path)


def test_resigning_an_unchanged_file_still_loads(lm_file):
    model, path, _ = lm_file
    resign(path)  # the package's writer, our checksums: proves the tampering tests below are fair
    assert_same_model(model, load_quantized(path, make_lm()))


def test_an_edited_manifest_without_a_new_hash_is_rejected(lm_file):
    _, path, _ = lm_file
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b'\\"bits\\": 4', b'\\"bits\\": 8', 1))
    with pytest.raises(ValueError, match="manifest fails its sha256 check"):
        load_quantized(path, make_lm())


@pytest.mark.parametrize(
    "edit,words",
    [
        (lambda m: layer(m, "fc1").update(weight_shape=[64, 32]), r"layer 'fc1'.*needs torch.uint8 codes of shape \[1024\]"),
        (lambda m: layer(m, "fc1").update(bits=8, spec={**layer(m, "fc1")["spec"], "bits": 8}),
         r"layer 'fc1'.*bits=8 .*needs torch.int8 codes of shape \[128, 32\], got torch.uint8"),
        (lambda m: layer(m, "q").update(bits=8), r"layer 'q'.*bits=8 disagrees with its spec's bits=4"),
        (lambda m: m.update(format_version=2), "format_version 2 is not the version 1"),
        (lambda m: layer(m, "q").update(spec={**layer(m, "q")["spec"], "group_size": 5}), "layer 'q'.*group_size=5 does not divide"),
        (lambda m: m["aliases"].update({"head.codes": "q.codes"}), r"layer 'head'.*needs torch.uint8 codes of shape \[1536\]"),
        (lambda m: m["layers"].pop(), "does not fit this model"),
    ],
    ids=["shape", "bits-and-spec", "bits-only", "version", "group-size", "alias", "missing-layer"],
)
def test_a_manifest_that_disagrees_with_the_tensors_is_rejected(lm_file, edit, words):
    _, path, _ = lm_file
    resign(path, edit_manifest=edit)
    with pytest.raises(ValueError, match=words):
        load_quantized(path, make_lm())


def test_a_manifest_tensor_shape_that_disagrees_with_the_header_is_rejected(lm_file):
    _, path, _ = lm_file
    resign(path, edit_manifest=lambda m: m["tensors"]["fc1.codes"].update(shape=[32, 32]))
    with pytest.raises(ValueError, match=r"tensor 'fc1.codes' is U8 \[2048\] in the file but U8 \[32, 32\] in the manifest"):
        load_quantized(path, make_lm())


def set_first_byte(name, value):
    def edit(tensors):
        tensors[name] = tensors[name].copy()
        tensors[name].reshape(-1).view(np.uint8)[0] = value
    return edit


@pytest.mark.parametrize(
    "spec,tensor,value,words",
    [
        (QuantSpec(bits=4), "fc1.codes", 0x08, r"codes span \[-8, .*outside the int4/channel/symmetric grid \[-7, 7\]"),
        (QuantSpec(bits=4), "fc1.codes", 0x80, r"outside the int4/channel/symmetric grid"),
        (QuantSpec(bits=8), "fc1.codes", 0x80, r"codes span \[-128, .*outside the int8/channel/symmetric grid \[-127, 127\]"),
    ],
)
def test_out_of_range_codes_are_rejected(tmp_path, spec, tensor, value, words):
    path = tmp_path / "m.safetensors"
    save_quantized(quantize_model(make_lm(), spec), path)
    resign(path, edit_tensors=set_first_byte(tensor, value))
    with pytest.raises(ValueError, match=words):
        load_quantized(path, make_lm())


def test_qwix_grid_allows_minus_eight(tmp_path):
    path = tmp_path / "m.safetensors"
    save_quantized(quantize_model(make_lm(), bits=4, grid="qwix"), path)
    resign(path, edit_tensors=set_first_byte("fc1.codes", 0x88))
    assert int(load_quantized(path, make_lm()).fc1.quantized_array().codes[0, 0]) == -8


def test_odd_int4_count_needs_a_zero_pad_nibble(tmp_path):
    path = tmp_path / "m.safetensors"
    save_quantized(quantize_model(nn.Sequential(nn.Linear(3, 3)), bits=4), path)  # 9 codes, 5 bytes
    def edit(tensors):
        tensors["0.codes"] = tensors["0.codes"].copy()
        tensors["0.codes"][-1] |= 0x10
    resign(path, edit_tensors=edit)
    with pytest.raises(ValueError, match="pad nibble"):
        load_quantized(path, nn.Sequential(nn.Linear(3, 3)))


def test_a_bad_scale_is_rejected(lm_file):
    _, path, _ = lm_file
    resign(path, edit_tensors=lambda t: t.__setitem__("q.scale", -t["q.scale"]))
    with pytest.raises(ValueError, match="scales must be finite and positive"):
        load_quantized(path, make_lm())


@pytest.mark.parametrize(
    "skeleton,words",
    [
        (lambda: TinyCausalLM(dim=16), r"layer 'tok'|fc1"),
        (lambda: nn.Sequential(nn.Linear(32, 64)), "has no module"),
        (lambda: make_lm().to(torch.float64), "float32 but the model's weight is torch.float64"),
    ],
    ids=["other-sizes", "other-architecture", "other-dtype"],
)
def test_a_model_of_another_architecture_is_rejected(lm_file, skeleton, words):
    _, path, _ = lm_file
    with pytest.raises(ValueError, match=words):
        load_quantized(path, skeleton())


def test_save_and_load_refuse_the_wrong_models(tmp_path, lm_file):
    with pytest.raises(ValueError, match="still has QAT layers: save convert"):
        save_quantized(apply_qat(make_mlp(), bits=4), tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="no quantized layer"):
        save_quantized(make_mlp(), tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="needs a float model"):
        load_quantized(lm_file[1], quantize_model(make_lm()))
    assert not (tmp_path / "x.safetensors").exists()


def test_a_plain_safetensors_file_is_not_a_quantized_model(tmp_path):
    safetensors.numpy.save_file({"w": np.zeros(2, np.float32)}, tmp_path / "plain.safetensors")
    with pytest.raises(ValueError, match="not written by save_quantized"):
        read_manifest(tmp_path / "plain.safetensors")


def test_the_package_causal_lm_converts_saves_and_loads_exactly(tmp_path):
    transformer = pytest.importorskip("mixle.models.transformer")
    build = lambda: transformer.build_causal_lm(vocab=64, d_model=32, n_layer=1, n_head=2, block=16)
    torch.manual_seed(0)
    qat = apply_qat(build(), bits=4, group_size=16).eval()
    converted = convert(qat)
    ids = lm_batch(vocab=64)  # 48 rows: on the default path the packed panel GEMM would run
    with torch.no_grad(), packed_linear.switched_off():  # the exact path: same float ops, same order
        assert torch.equal(converted(ids, all_positions=True), qat(ids, all_positions=True))
    save_quantized(converted, tmp_path / "lm.safetensors")
    loaded = load_quantized(tmp_path / "lm.safetensors", build())
    assert loaded.head.codes is loaded.tok.codes
    with torch.no_grad(), packed_linear.switched_off():
        assert torch.equal(loaded(ids, all_positions=True), qat(ids, all_positions=True))
    nb = model_nbytes(loaded)
    names = [path for path, m in qat.named_modules() if isinstance(m, nn.Linear)]
    fp32 = float_weight_bytes(qat, names)
    assert abs(nb.int4_code_bytes + nb.scale_bytes - (fp32 / 8 + nb.scale_bytes)) <= 0.02 * (fp32 / 8 + nb.scale_bytes)


# ----------------------------------------------------------------------------------------------
# Hostile headers: only the documented ValueError, naming the file and the field


def _tensor(dtype="F32", shape=(1,), offsets=(0, 4)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def _header_file(header, data=b"\0" * 4):
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


HOSTILE_HEADERS = {
    "huge-length": (struct.pack("<Q", 2**63) + b"{}", "header length field claims 9223372036854775808"),
    "length-past-end": (struct.pack("<Q", 1000) + b"{}", "header length field claims 1000"),
    "short": (b"\1\0\0", "truncated to 3 bytes"),
    "nested-lists": (_header_file(b"[" * 100_000 + b"]" * 100_000), "nested too deeply"),
    "nested-objects": (_header_file(b'{"a":' * 100_000 + b"1" + b"}" * 100_000), "nested too deeply"),
    "not-utf8": (_header_file(b'{"\xff": 1}'), "does not parse"),
    "huge-integer": (_header_file(b'{"w": {"dtype": "F32", "shape": [1' + b"0" * 5000 + b'], "data_offsets": [0, 4]}}'),
                     "does not parse"),
    "not-an-object": (_header_file([1, 2]), "header is a JSON list, not an object"),
    "duplicate-field": (_header_file(b'{"w": ' + json.dumps(_tensor()).encode() + b', "w": '
                                     + json.dumps(_tensor()).encode() + b"}"), "field 'w' appears more than once"),
    "metadata-list": (_header_file({"__metadata__": [1]}, b""), "field '__metadata__' must map strings to strings"),
    "metadata-number": (_header_file({"__metadata__": {"k": 1}}, b""), "field '__metadata__'.'k' must be a string"),
    "metadata-object": (_header_file({"__metadata__": {"k": {"a": "b"}}}, b""), "field '__metadata__'.'k' must be a string"),
    "entry-number": (_header_file({"w": 5}), "field 'w' needs exactly dtype, shape and data_offsets"),
    "entry-extra-field": (_header_file({"w": {**_tensor(), "x": 1}}), "field 'w' needs exactly"),
    "dtype-number": (_header_file({"w": _tensor(dtype=5)}), "field 'w'.dtype 5 is not one"),
    "dtype-unknown": (_header_file({"w": _tensor(dtype="Q4")}), "field 'w'.dtype 'Q4' is not one"),
    "shape-string": (_header_file({"w": {**_tensor(), "shape": "abc"}}), "field 'w'.shape must be a list"),
    "shape-negative": (_header_file({"w": _tensor(shape=(-1,))}), "field 'w'.shape"),
    "shape-float": (_header_file({"w": _tensor(shape=(1.0,))}), "field 'w'.shape"),
    "shape-bool": (_header_file({"w": _tensor(shape=(True,))}), "field 'w'.shape"),
    "shape-huge": (_header_file({"w": _tensor(shape=(2**62, 2**62))}), r"field 'w': F32 \[4611686018427387904"),
    "offsets-string": (_header_file({"w": {**_tensor(), "data_offsets": "0:4"}}), "field 'w'.data_offsets must be"),
    "offsets-reversed": (_header_file({"w": _tensor(shape=(0,), offsets=(4, 0))}), "field 'w'.data_offsets must be"),
    "offsets-three": (_header_file({"w": {**_tensor(), "data_offsets": [0, 2, 4]}}), "field 'w'.data_offsets must be"),
    "offsets-float": (_header_file({"w": _tensor(offsets=(0.0, 4.0))}), "field 'w'.data_offsets must be"),
    "overlapping": (_header_file({"w": _tensor(), "v": _tensor(offsets=(2, 6))}, b"\0" * 6),
                    "field 'v'.data_offsets starts at byte 2, expected 4"),
    "gap": (_header_file({"w": _tensor(), "v": _tensor(offsets=(8, 12))}, b"\0" * 12),
            "field 'v'.data_offsets starts at byte 8, expected 4"),
    "past-the-data": (_header_file({"w": _tensor(shape=(4,), offsets=(0, 16))}), "truncated"),
    "manifest-nested": (_header_file({"__metadata__": {MANIFEST_KEY: "[" * 100_000 + "]" * 100_000}}, b""),
                        "manifest's JSON is nested too deeply"),
    "manifest-not-json": (_header_file({"__metadata__": {MANIFEST_KEY: "{"}}, b""), "manifest is not valid JSON"),
}


@pytest.mark.parametrize("reader", ["read_manifest", "read_safetensors", "load_quantized"])
@pytest.mark.parametrize("case", list(HOSTILE_HEADERS))
def test_a_hostile_header_yields_only_a_value_error_naming_the_file_and_field(tmp_path, case, reader):
    content, words = HOSTILE_HEADERS[case]
    if reader == "read_safetensors" and case.startswith("manifest"):
        pytest.skip("a plain safetensors reader does not parse the manifest")
    path = tmp_path / f"hostile-{case}.safetensors"
    path.write_bytes(content)
    call = {"read_manifest": read_manifest, "read_safetensors": read_safetensors,
            "load_quantized": lambda p: load_quantized(p, make_mlp())}[reader]
    with pytest.raises(ValueError) as error:
        call(path)
    assert str(path) in str(error.value)
    assert re.search(words, str(error.value)), str(error.value)


def _resigned_with(lm_file, edit):
    _, path, _ = lm_file
    resign(path, edit_manifest=edit)
    return path


@pytest.mark.parametrize(
    "edit,words",
    [
        (lambda m: m["aliases"].update({"head.codes": ["tok.codes"]}), r"alias 'head.codes' -> \['tok.codes'\]"),
        (lambda m: layer(m, "fc1").update(path=["fc1"]), r"no module \['fc1'\]"),
        (lambda m: m["layers"].append(7), "no module None"),
        (lambda m: m["tensors"]["fc1.codes"].update(dtype=["U8"]), r"tensor 'fc1.codes' is U8 \[2048\] in the file but \['U8'\]"),
        (lambda m: layer(m, "fc1").update(spec=[1, 2]), r"layer 'fc1'.*manifest entry is incomplete or invalid"),
        (lambda m: layer(m, "fc1").update(weight_shape=5), r"layer 'fc1'.*manifest entry is incomplete or invalid"),
        (lambda m: layer(m, "fc1").update(codes=["fc1.codes"]), r"layer 'fc1'.*manifest entry is incomplete or invalid"),
    ],
    ids=["alias-list", "path-list", "layer-number", "tensor-string", "spec-list", "shape-number", "codes-list"],
)
def test_a_signed_manifest_with_wrong_field_types_is_a_value_error(lm_file, edit, words):
    path = _resigned_with(lm_file, edit)
    with pytest.raises(ValueError, match=words):
        load_quantized(path, make_lm())


PEAK_MEMORY = """
    import json, os, resource, sys, torch
    from torch import nn
    from mixle.task.quantize import load_quantized, model_nbytes
    torch.set_num_threads(1)
    skeleton = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(20)])
    def rss(field):
        return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1]) * 1024
    before = rss("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak (VmHWM) to the current RSS
    loaded = load_quantized(sys.argv[1], skeleton)
    print(json.dumps({"extra": rss("VmHWM:") - before, "model": model_nbytes(loaded).total}))
"""


def test_load_quantized_peak_memory_stays_near_the_models_size(tmp_path):
    # 20 int8 layers of 1024x1024: a 20 MiB model (+ 80 KiB scales) loaded into an 80 MiB skeleton.
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(20)])
    path = tmp_path / "big.safetensors"
    save_quantized(quantize_model(model, bits=8), path)
    del model
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(PEAK_MEMORY), str(path)], capture_output=True,
                          text=True, timeout=240, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr
    numbers = json.loads(done.stdout.splitlines()[-1])
    assert numbers["model"] == 20 * (1024 * 1024 + 1024 * 4)
    assert numbers["extra"] < 2.5 * numbers["model"], numbers


# ----------------------------------------------------------------------------------------------
# Saving over a file keeps its mode; a symlinked path is written through


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o600])
def test_saving_over_a_file_keeps_its_mode(tmp_path, mode):
    path = tmp_path / "m.safetensors"
    path.write_bytes(b"old")
    path.chmod(mode)
    save_quantized(quantize_model(make_mlp(), bits=4), path)
    assert stat.S_IMODE(path.stat().st_mode) == mode
    write_safetensors(path, {"w": np.zeros(2, np.float32)})
    assert stat.S_IMODE(path.stat().st_mode) == mode


def test_a_new_file_gets_the_umask_default(tmp_path):
    old = os.umask(0o027)
    try:
        save_quantized(quantize_model(make_mlp(), bits=4), tmp_path / "m.safetensors")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "m.safetensors").stat().st_mode) == 0o640


def test_saving_to_a_symlink_writes_through_it(tmp_path):
    (tmp_path / "store").mkdir()
    target = tmp_path / "store" / "real.safetensors"
    target.write_bytes(b"old")
    target.chmod(0o644)
    link = tmp_path / "link.safetensors"
    link.symlink_to(target)
    model = quantize_model(make_mlp(), bits=4)
    save_quantized(model, link)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert_same_model(model, load_quantized(target, make_mlp()))
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["real.safetensors"]  # no temporary left


# ----------------------------------------------------------------------------------------------
# Load-time checks against the target model: dtypes of every tensor, every layer option


def test_a_float32_file_into_a_float64_model_is_refused_at_load(tmp_path):
    # No float tensor outside the quantized layer: only the scale's dtype tells the two apart.
    path = tmp_path / "m.safetensors"
    save_quantized(quantize_model(nn.Sequential(nn.Linear(8, 4, bias=False)), bits=4), path)
    with pytest.raises(ValueError, match=r"layer '0'.*scales are torch.float32 but the model's weight is torch.float64"):
        load_quantized(path, nn.Sequential(nn.Linear(8, 4, bias=False)).double())


def _cast(name, dtype):
    def edit(tensors):
        tensors[name] = tensors[name].astype(dtype)
    return edit


@pytest.mark.parametrize(
    "tensor,dtype,st_dtype,words",
    [("q.scale", np.float16, "F16", r"layer 'q'.*scales are torch.float16 but the model's weight is torch.float32"),
     ("q.scale", np.float64, "F64", r"layer 'q'.*scales are torch.float64"),
     ("q.bias", np.float16, "F16", r"layer 'q'.*bias is torch.float16 but the model's is torch.float32")],
    ids=["scale-f16", "scale-f64", "bias-f16"],
)
def test_a_self_consistent_file_with_other_dtypes_is_refused_at_load(lm_file, tensor, dtype, st_dtype, words):
    _, path, _ = lm_file

    def edit_manifest(m):
        m["tensors"][tensor]["dtype"] = st_dtype
        if tensor.endswith("scale"):
            layer(m, "q")["scale_nbytes"] = 32 * 4 * np.dtype(dtype).itemsize  # 32 rows x 4 groups of 8

    resign(path, edit_manifest=edit_manifest, edit_tensors=_cast(tensor, dtype))
    with pytest.raises(ValueError, match=words):
        load_quantized(path, make_lm())


@pytest.mark.parametrize(
    "option,value",
    [("padding_idx", 3), ("max_norm", 1.0), ("norm_type", 1.0), ("scale_grad_by_freq", True)],
)
def test_forged_embedding_options_are_refused(lm_file, option, value):
    _, path, _ = lm_file
    resign(path, edit_manifest=lambda m: layer(m, "tok").update({option: value}))
    with pytest.raises(ValueError, match=rf"layer 'tok'.*{option}={value!r} in the file but {option}=.* in the model"):
        load_quantized(path, make_lm())


def test_embedding_options_of_the_model_are_kept(tmp_path):
    def build():
        model = make_lm()
        model.tok.padding_idx = 0
        return model

    path = tmp_path / "m.safetensors"
    save_quantized(quantize_model(build(), bits=4), path)
    assert load_quantized(path, build()).tok.padding_idx == 0
    with pytest.raises(ValueError, match=r"layer 'tok'.*padding_idx=0 in the file but padding_idx=None in the model"):
        load_quantized(path, make_lm())
