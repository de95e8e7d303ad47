"""Whole models with an importance matrix: ``calibrate_importance`` against a numpy reference,
``save_imatrix`` through gguf-py, and ``quantize_model(..., gguf_mix=, importance=)`` + ``save_gguf``
against ``llama-quantize --imatrix``'s file (``tests/fixtures/imatrix_reference.npz``), tensor by tensor.
"""

import numpy as np
import pytest
import torch
from torch import nn

import mixle
from mixle.core.imatrix import Imatrix
from mixle.gguf.imatrix_file import read_imatrix, write_imatrix
from tests.test_gguf_mixes import read_tensors, sha
from tests.test_imatrix import build_dir, fixture_imatrix, reference, seeded_model  # noqa: F401  (the fixture)

gguf = pytest.importorskip("gguf")


def test_calibrate_importance_sums_squared_inputs():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    batches = [torch.randn(4, 5, 6), torch.randn(20, 6), torch.randn(3, 6)]  # the last: < 16 rows, skipped
    m = mixle.calibrate_importance(net, batches, layers=["0", "2"])
    x = np.concatenate([b.reshape(-1, 6).numpy() for b in batches[:2]]).astype(np.float64)
    hidden = np.maximum(x @ net[0].weight.detach().numpy().T.astype(np.float64) + net[0].bias.detach().numpy(), 0)
    assert m.counts["0"].tolist() == [40] and m.counts["2"].tolist() == [40]
    np.testing.assert_allclose(m.sums["0"][0], (x * x).sum(0), rtol=1e-6)
    np.testing.assert_allclose(m.sums["2"][0], (hidden * hidden).sum(0), rtol=1e-5)
    assert net.training  # the mode is restored
    with pytest.raises(ValueError, match="layer '1' is a ReLU without a 2-D weight"):
        mixle.calibrate_importance(net, batches, layers=["1"])


def test_save_imatrix_names_the_gguf_tensors(tmp_path):
    lm = mixle.build_causal_lm(vocab=40, d_model=32, n_layer=2, n_head=2, block=16)
    m = mixle.calibrate_importance(lm, [torch.randint(0, 40, (2, 16))])
    mixle.save_imatrix(lm, m, tmp_path / "lm.imatrix.gguf")
    raw = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(tmp_path / "lm.imatrix.gguf")).tensors}
    assert np.array_equal(raw["blk.1.ffn_down.weight.in_sum2"].ravel(), m.sums["blocks.1.out"].ravel())
    assert raw["blk.0.attn_qkv.weight.counts"].ravel().tolist() == [32.0]
    assert "token_embd.weight.in_sum2" not in raw  # llama-imatrix never collects the embedding
    loaded = mixle.load_imatrix(tmp_path / "lm.imatrix.gguf", lm, min_tokens=32)
    assert np.array_equal(loaded["blocks.0.fc"], m.importance()["blocks.0.fc"])
    with pytest.raises(ValueError, match="tensor .blk.0.attn_output.weight. was summed over 32 input rows, fewer than min_tokens=64"):
        mixle.load_imatrix(tmp_path / "lm.imatrix.gguf", lm, min_tokens=64)
    other = mixle.build_causal_lm(vocab=40, d_model=64, n_layer=2, n_head=2, block=16)
    with pytest.raises(ValueError, match="computed for another model"):
        mixle.load_imatrix(tmp_path / "lm.imatrix.gguf", other)


@pytest.fixture(scope="module")
def llama_model():
    return seeded_model("llama_h256")


@pytest.mark.parametrize("ftype", ["Q4_0"])  # Q4_K_M etc.: tensor by tensor in test_imatrix.py
def test_quantize_model_with_importance_writes_llama_quantize_file(ftype, reference, llama_model, tmp_path):  # noqa: F811
    meta, arrays = reference
    case, which = "llama_h256", "llama_imatrix"
    want = meta["cases"][case]["imatrix"][which]["ftypes"][ftype]
    imatrix = fixture_imatrix(arrays, case, which)
    path = tmp_path / "m.imatrix.gguf"
    write_imatrix(path, Imatrix(imatrix.sums, imatrix.counts, ("t",), 8, 32))
    model = llama_model
    ptq = mixle.quantize_model(model, gguf_mix=ftype, importance=str(path))
    types = mixle.save_gguf(ptq, tmp_path / "q.gguf", gguf_mix=ftype, importance=str(path))
    got = read_tensors(tmp_path / "q.gguf")
    assert {n: t for n, (t, _) in want.items()} == types
    bad = [n for n, (t, digest) in want.items() if sha(got[n][2]) != digest]
    assert not bad, f"{len(bad)} tensors differ from llama-quantize --imatrix: {bad[:4]}"
    assert read_imatrix(path).chunk_size == 32


def test_calibrate_importance_agrees_with_llama_imatrix(reference, llama_model):  # noqa: F811
    """The same 8 chunks of 32 tokens llama-imatrix ran (``-c 32 --chunks 8 --process-output``, no
    BOS: the one-character vocabulary has none): every entry, the same counts, sums within ggml's
    forward's rounding (its float32 sums in another order; the same with an F32 KV cache)."""
    from mixle.gguf.imatrix_file import model_imatrix_names
    from tests.test_imatrix import VOCAB, calibration_text

    _, arrays = reference
    ref = fixture_imatrix(arrays, "llama_h256", "llama_imatrix")
    ids = [VOCAB.index(c) for c in calibration_text() if c in VOCAB][: 8 * 32]
    m = mixle.calibrate_importance(llama_model, [torch.tensor(ids).reshape(8, 32)])
    names = model_imatrix_names(llama_model)
    assert sorted(n for ns in names.values() for n in ns) == sorted(ref.sums)
    for path, gguf_names in names.items():
        for name in gguf_names:
            assert m.counts[path].tolist() == ref.counts[name].tolist() == [256]
            scale = np.abs(ref.sums[name]).max()
            np.testing.assert_allclose(m.sums[path], ref.sums[name], rtol=0, atol=5e-3 * scale, err_msg=name)


@pytest.mark.skipif(build_dir() is None, reason="no llama.cpp build with llama-quantize (MIXLE_LLAMA_CPP_BUILD)")
def test_live_calibrated_file_quantizes_as_quantize_model(llama_model, tmp_path):
    """calibrate_importance -> save_imatrix -> llama-quantize --imatrix equals quantize_model(...,
    importance=) -> save_gguf, every tensor."""
    from tests.test_imatrix import VOCAB, calibration_text, llama_quantize_imatrix

    ids = [VOCAB.index(c) for c in calibration_text(words=1200, seed=9) if c in VOCAB][: 8 * 64]
    m = mixle.calibrate_importance(llama_model, [torch.tensor(ids).reshape(8, 64)], dataset="seeded words")
    mixle.save_imatrix(llama_model, m, tmp_path / "m.imatrix.gguf")
    mixle.save_gguf(llama_model, tmp_path / "f32.gguf", float_matrices="f32", vocab=VOCAB)
    llama_quantize_imatrix(build_dir(), str(tmp_path / "f32.gguf"), str(tmp_path / "q.gguf"), "Q4_0",
                           str(tmp_path / "m.imatrix.gguf"))
    mixle.save_gguf(mixle.quantize_model(llama_model, gguf_mix="Q4_0", importance=m), tmp_path / "mine.gguf")
    ref, mine = read_tensors(tmp_path / "q.gguf"), read_tensors(tmp_path / "mine.gguf")
    assert {n: t for n, (t, _, _) in ref.items()} == {n: t for n, (t, _, _) in mine.items()}
    assert [n for n in ref if sha(ref[n][2]) != sha(mine[n][2])] == []


def test_quantize_model_importance_on_a_plain_model_and_refusals(tmp_path):
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 4))
    imp = np.linspace(0, 2, 64, dtype=np.float32)
    ptq = mixle.quantize_model(net, grid="q4_0", exclude=("2",), importance={"0": imp})
    want = mixle.quantize_array(net[0].weight.detach(), grid="q4_0", importance=imp).dequantize()
    assert torch.equal(ptq[0].dequantized_weight(), want)
    with pytest.raises(ValueError, match="layer '1'"):
        mixle.quantize_model(net, grid="q4_0", exclude=("2",), importance={"1": imp})
    with pytest.raises(ValueError, match="no calibration dataset"):
        write_imatrix(tmp_path / "m.gguf", Imatrix({"a": np.ones((1, 4), np.float32)}, {"a": np.array([4])}))


@pytest.mark.parametrize("case, which, ftypes", [("llama_h256", "llama_imatrix", ("Q4_0", "Q4_K_M")),
                                                 ("qwen2_h64", "known", ("Q5_K_M", "Q6_K"))])
def test_save_gguf_of_the_float_model_with_importance_is_llama_quantizes_file(case, which, ftypes, reference,  # noqa: F811
                                                                              tmp_path):
    """save_gguf(float model, gguf_mix=, importance=) quantizes the float matrices by the weighted
    search and gives llama-quantize --imatrix's types (Q4_0: blk.0.ffn_down Q4_1): its file, tensor by tensor."""
    meta, arrays = reference
    imatrix = fixture_imatrix(arrays, case, which)  # keyed by GGUF names, as read from a file
    for ftype in ftypes:
        want = meta["cases"][case]["imatrix"][which]["ftypes"][ftype]
        types = mixle.save_gguf(seeded_model(case), tmp_path / f"{ftype}.gguf", gguf_mix=ftype, importance=imatrix)
        got = read_tensors(tmp_path / f"{ftype}.gguf")
        assert types == {n: t for n, (t, _) in want.items()}, ftype
        bad = [n for n, (_, digest) in want.items() if sha(got[n][2]) != digest]
        assert not bad, f"{ftype}: {len(bad)} tensors differ from llama-quantize --imatrix: {bad[:4]}"
    if case == "llama_h256":
        assert mixle.gguf_mix_types(seeded_model(case), "Q4_0", importance=imatrix)["blk.0.ffn_down.weight"] == "Q4_1"
        assert mixle.gguf_mix_specs(seeded_model(case), "Q4_0", importance=imatrix)["model.layers.0.mlp.down_proj"].grid \
            == "q4_1"
        assert mixle.gguf_mix_types(seeded_model(case), "Q4_0")["blk.0.ffn_down.weight"] == "Q4_0"


def test_save_gguf_refuses_an_importance_it_cannot_honour(reference, tmp_path):  # noqa: F811
    _, arrays = reference
    model, imatrix = seeded_model("qwen2_h64"), fixture_imatrix(arrays, "qwen2_h64", "known")
    partial = Imatrix({k: v for k, v in imatrix.sums.items() if k != "blk.1.attn_q.weight"}, imatrix.counts)
    cases = [({"importance": imatrix}, "pass gguf_mix= too"),
             ({"importance": partial, "gguf_mix": "Q4_K_M"}, "no entry for tensor 'blk.1.attn_q.weight'"),
             ({"importance": fixture_imatrix(arrays, "llama_h256", "known"), "gguf_mix": "Q4_0"},
              r"importance: tensor 'blk\.\d\.\w+\.weight' (is not a matrix of|has sums of shape).* computed for another "
              r"model")]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            mixle.save_gguf(model, tmp_path / "m.gguf", **kwargs)
        assert not (tmp_path / "m.gguf").exists()
    with pytest.raises(ValueError, match="no entry for tensor 'blk.1.attn_q.weight'"):
        mixle.quantize_model(model, gguf_mix="Q4_K_M", importance=partial)
