"""Importance matrices of mixtures of experts: ``calibrate_importance`` collects, per expert, what
``llama-imatrix`` collects for ``MUL_MAT_ID`` (``ffn_gate_exps`` / ``ffn_up_exps``: the hidden
states routed to each expert; ``ffn_down_exps``: each expert's ``act(gate) * up``; counts per
expert), and ``quantize_model`` / ``save_gguf`` quantize each expert with its own importance, as
``llama-quantize --imatrix``.

Oracles: a numpy loop over the experts (from the experts module's own inputs), llama.cpp's
``llama-imatrix`` and ``llama-quantize --imatrix`` on the seeded Qwen3-MoE (``MOE_IMATRIX_CASE``)
stored in ``tests/fixtures/imatrix_reference.npz`` by ``benchmarks/make_imatrix_fixtures.py``, and
the live tools when a build is found (``MIXLE_LLAMA_CPP_BUILD`` or ``/tmp/llbuild``).
"""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

import mixle  # noqa: E402
from mixle.core.imatrix import Imatrix  # noqa: E402
from mixle.gguf.imatrix_file import model_imatrix_names, read_imatrix  # noqa: E402
from tests.gguf_parity_cases import moe_model  # noqa: E402
from tests.test_gguf_mixes import read_tensors, sha  # noqa: E402
from tests.test_imatrix import (MOE_FTYPES, MOE_IMATRIX_CASE, VOCAB, build_dir, calibration_text,  # noqa: E402, F401
                                fixture_imatrix, llama_imatrix, llama_quantize_imatrix, reference, seeded_model)

EXPERTS = "model.layers.{}.mlp.experts"


def _tokens(words=600, seed=3, chunks=8, size=32):
    ids = [VOCAB.index(c) for c in calibration_text(words, seed) if c in VOCAB][: chunks * size]
    return torch.tensor(ids).reshape(chunks, size)


def _expert_inputs(model, batches):
    """``{layer: (hidden (T, H), top-k indices (T, k))}`` each experts module was called with."""
    seen, handles = {}, []
    for index, layer in enumerate(model.model.layers):
        def hook(_module, args, _output, index=index):
            seen.setdefault(index, []).append((args[0].detach().numpy().astype(np.float64), args[1].numpy()))
        handles.append(layer.mlp.experts.register_forward_hook(hook))
    with torch.no_grad():
        for batch in batches:
            model(batch)
    for handle in handles:
        handle.remove()
    return {i: (np.concatenate([h for h, _ in v]), np.concatenate([k for _, k in v])) for i, v in seen.items()}


def test_expert_sums_and_counts_equal_a_numpy_loop(family="qwen3moe"):
    """Per expert: the squared routed hidden states (gate_up) and squared act(gate)*up (down) in
    numpy, at any batch size (8 tokens: llama-imatrix collects MUL_MAT_ID below 16 rows too)."""
    model = moe_model(family)
    batches = [torch.randint(0, 48, (1, 8)), torch.randint(0, 48, (2, 8))]
    paths = [f"{EXPERTS.format(i)}.{attr}" for i in range(2) for attr in ("gate_up_proj", "down_proj")]
    m = mixle.calibrate_importance(model, batches, layers=paths)
    for index, (hidden, top_k) in _expert_inputs(model, batches).items():
        experts = model.model.layers[index].mlp.experts
        gate_up, down = (getattr(experts, a).detach().numpy().astype(np.float64) for a in ("gate_up_proj", "down_proj"))
        rows = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            x = hidden[(top_k == e).any(-1)]
            g, u = x @ gate_up[e, :rows].T, x @ gate_up[e, rows:].T
            h = g / (1 + np.exp(-g)) * u  # SiLU(gate) * up
            prefix = EXPERTS.format(index)
            assert m.counts[f"{prefix}.gate_up_proj"][e] == m.counts[f"{prefix}.down_proj"][e] == (top_k == e).sum()
            np.testing.assert_allclose(m.sums[f"{prefix}.gate_up_proj"][e], (x * x).sum(0), rtol=1e-5)
            np.testing.assert_allclose(m.sums[f"{prefix}.down_proj"][e], (h * h).sum(0), rtol=1e-4, atol=1e-6)
    assert m.counts[paths[0]].sum() == 24 * 2  # every token goes to top-2 experts


def test_qat_experts_are_calibrated_on_the_fake_quantized_weights():
    """A QAT model's down inputs come from the weights its forward multiplies with."""
    model = mixle.apply_qat(moe_model("qwen3moe"), grid="q4_0")
    batches = [torch.randint(0, 48, (2, 8))]
    path = f"{EXPERTS.format(0)}.down_proj"
    m = mixle.calibrate_importance(model, batches, layers=[path])
    hidden, top_k = _expert_inputs(model, batches)[0]
    gate_up = model.model.layers[0].mlp.experts.quantized_weights()["gate_up_proj"].detach().numpy().astype(np.float64)
    x = hidden[(top_k == 1).any(-1)]
    g, u = x @ gate_up[1, :64].T, x @ gate_up[1, 64:].T
    np.testing.assert_allclose(m.sums[path][1], ((g / (1 + np.exp(-g)) * u) ** 2).sum(0), rtol=1e-4, atol=1e-6)
    float_m = mixle.calibrate_importance(moe_model("qwen3moe"), batches, layers=[path])
    assert not np.allclose(float_m.sums[path][1], m.sums[path][1], rtol=1e-6, atol=0)


def test_calibrate_importance_agrees_with_llama_imatrix_on_moe(reference):
    """The 8 chunks of 32 tokens llama-imatrix ran: every entry (experts, routers, attention), the
    same per-expert counts, sums within ggml's forward's rounding (float32 sums in another order, the same with an F32
    KV cache; measured at most 4.7e-4 of each entry's largest sum)."""
    _, arrays = reference
    ref = fixture_imatrix(arrays, MOE_IMATRIX_CASE, "llama_imatrix")
    model = seeded_model(MOE_IMATRIX_CASE)
    m = mixle.calibrate_importance(model, [_tokens()])
    names = model_imatrix_names(model)
    assert sorted(n for ns in names.values() for n in ns) == sorted(ref.sums)
    for path, gguf_names in names.items():
        for name in gguf_names:
            assert m.counts[path].tolist() == ref.counts[name].tolist(), name
            assert m.sums[path].shape == ref.sums[name].shape and ref.sums[name].shape[0] == (4 if "exps" in name else 1)
            scale = np.abs(ref.sums[name]).max()
            np.testing.assert_allclose(m.sums[path], ref.sums[name], rtol=0, atol=5e-3 * scale, err_msg=name)
    assert ref.counts["blk.0.ffn_down_exps.weight"].sum() == 2 * 256 and ref.counts["blk.0.attn_q.weight"] == 256


def test_moe_ptq_with_importance_is_llama_quantizes_file(reference, tmp_path):
    """quantize_model(gguf_mix="Q4_0", importance=) + save_gguf, and save_gguf of the float model
    with Q4_K_M (whose experts layer gets two types: quantize_model refuses it, see
    test_gguf_moe), against llama-quantize --imatrix with llama-imatrix's file: bit for bit."""
    meta, arrays = reference
    imatrix = fixture_imatrix(arrays, MOE_IMATRIX_CASE, "llama_imatrix")
    record = meta["cases"][MOE_IMATRIX_CASE]["imatrix"]["llama_imatrix"]["ftypes"]
    model = seeded_model(MOE_IMATRIX_CASE)
    ptq = mixle.quantize_model(model, gguf_mix="Q4_0", importance=imatrix)
    assert type(ptq.model.layers[0].mlp.experts).__name__ == "QuantizedQwen3MoeExperts"
    files = {"Q4_0": mixle.save_gguf(ptq, tmp_path / "Q4_0.gguf", gguf_mix="Q4_0", importance=imatrix),
             "Q4_K_M": mixle.save_gguf(model, tmp_path / "Q4_K_M.gguf", gguf_mix="Q4_K_M", importance=imatrix)}
    for ftype in MOE_FTYPES:
        want, got = record[ftype], read_tensors(tmp_path / f"{ftype}.gguf")
        assert files[ftype] == {n: t for n, (t, _) in want.items()}, ftype
        bad = [n for n, (_, digest) in want.items() if sha(got[n][2]) != digest]
        assert not bad, f"{ftype}: {bad[:4]} differ from llama-quantize --imatrix"
    mixle.save_gguf(model, tmp_path / "plain.gguf", gguf_mix="Q4_0")
    plain = read_tensors(tmp_path / "plain.gguf")
    changed = [n for n in plain if "exps" in n and sha(plain[n][2]) != record["Q4_0"][n][1]]
    assert len(changed) == 9  # the importance changes every expert tensor's blocks


def test_moe_imatrix_file_round_trip_and_refusals(tmp_path):
    model = moe_model("mixtral")
    m = mixle.calibrate_importance(model, [torch.randint(0, 48, (2, 16))])
    mixle.save_imatrix(model, m, tmp_path / "m.imatrix.gguf")
    raw = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "m.imatrix.gguf")).tensors}
    key = f"{EXPERTS.format(1)}.gate_up_proj"
    for name in ("blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight"):
        assert [int(d) for d in raw[name + ".in_sum2"].shape] == [64, 4]  # ggml ne: [columns, experts]
        assert [int(d) for d in raw[name + ".counts"].shape] == [1, 4]
        np.testing.assert_array_equal(np.asarray(raw[name + ".in_sum2"].data).reshape(4, 64), m.sums[key])
        np.testing.assert_array_equal(np.asarray(raw[name + ".counts"].data).ravel(), m.counts[key])
    back = read_imatrix(tmp_path / "m.imatrix.gguf")
    loaded = mixle.load_imatrix(tmp_path / "m.imatrix.gguf", model)
    np.testing.assert_array_equal(loaded[key], m.importance()[key])
    assert back.counts["blk.1.ffn_down_exps.weight"].tolist() == m.counts[f"{EXPERTS.format(1)}.down_proj"].tolist()
    # an expert no token reached (count 0) is allowed, as llama.cpp writes and reads it (importance 1)
    sums, counts = dict(back.sums), dict(back.counts)
    counts["blk.0.ffn_down_exps.weight"] = np.array([0, 5, 5, 5])
    sums["blk.0.ffn_down_exps.weight"] = sums["blk.0.ffn_down_exps.weight"] * np.array([[0.0], [1], [1], [1]], np.float32)
    ptq = mixle.quantize_model(model, gguf_mix="Q4_0", importance=Imatrix(sums, counts))
    weight = model.model.layers[0].mlp.experts.down_proj.detach()
    want = mixle.quantize_array(weight[0], grid="q4_0", importance=np.ones(64, np.float32)).dequantize()
    got = ptq.model.layers[0].mlp.experts.down_proj.stacked_array().dequantize()[0]
    assert np.array_equal(np.asarray(got), np.asarray(want))  # the unseen expert: importance 1, as llama-quantize
    three = Imatrix({**sums, "blk.0.ffn_down_exps.weight": sums["blk.0.ffn_down_exps.weight"][:3]},
                    {**counts, "blk.0.ffn_down_exps.weight": counts["blk.0.ffn_down_exps.weight"][:3]})
    with pytest.raises(ValueError, match=r"tensor 'blk.0.ffn_down_exps.weight' has sums of shape \(3, 64\) .* "
                                         r"needs \(4, 64\) .*computed for another model"):
        mixle.save_gguf(model, tmp_path / "q.gguf", gguf_mix="Q4_0", importance=three)
    assert not (tmp_path / "q.gguf").exists()


@pytest.mark.skipif(build_dir("llama-imatrix") is None,
                    reason="no llama.cpp build with llama-imatrix (MIXLE_LLAMA_CPP_BUILD)")
def test_live_llama_imatrix_and_quantize_on_moe(tmp_path):
    """Fresh text: llama-imatrix on save_gguf's F32 file against calibrate_importance (on this text
    one token of layer 1 is routed to another expert by llama.cpp: its counts move by one), then
    llama-quantize --imatrix of it against mixle's PTQ with that file, Q4_0 and Q4_K_M; and
    llama-quantize --imatrix with mixle's own file (save_imatrix) against quantize_model with it."""
    model, build = seeded_model(MOE_IMATRIX_CASE), build_dir("llama-imatrix")
    mixle.save_gguf(model, tmp_path / "f32.gguf", float_matrices="f32", vocab=VOCAB)
    (tmp_path / "t.txt").write_text(calibration_text(words=600, seed=11))
    llama_imatrix(build, str(tmp_path / "f32.gguf"), str(tmp_path / "t.txt"), str(tmp_path / "m.imatrix.gguf"))
    ref = read_imatrix(tmp_path / "m.imatrix.gguf")
    m = mixle.calibrate_importance(model, [_tokens(seed=11)])
    flipped = []  # blocks where a token went to another expert
    for path, gguf_names in sorted(model_imatrix_names(model).items(), key=lambda item: int(item[1][0].split(".")[1])):
        for name in gguf_names:
            ours, theirs, block = m.counts[path], ref.counts[name], int(name.split(".")[1])
            # a token whose 2nd and 3rd router probabilities are closer than the two forwards' rounding
            # (gaps down to 1e-4 on this text) may go to another expert in llama.cpp; from that block
            # on, its hidden state differs too, so sums are compared only before the first such block
            assert ours.sum() == theirs.sum() and np.abs(ours - theirs).sum() <= 4, (name, ours, theirs)
            if (ours != theirs).any():
                flipped.append(block)
            if not flipped or block < min(flipped):
                np.testing.assert_allclose(m.sums[path], ref.sums[name], rtol=0,
                                           atol=5e-3 * np.abs(ref.sums[name]).max(), err_msg=name)
    assert len(set(flipped)) <= 1, flipped
    imatrix = str(tmp_path / "m.imatrix.gguf")
    for ftype in MOE_FTYPES:
        llama_quantize_imatrix(build, str(tmp_path / "f32.gguf"), str(tmp_path / f"{ftype}.gguf"), ftype, imatrix)
        mixle.save_gguf(model, tmp_path / f"mine_{ftype}.gguf", gguf_mix=ftype, importance=imatrix)
        theirs, mine = read_tensors(tmp_path / f"{ftype}.gguf"), read_tensors(tmp_path / f"mine_{ftype}.gguf")
        assert {n: (t, sha(d)) for n, (t, _, d) in theirs.items()} == {n: (t, sha(d)) for n, (t, _, d) in mine.items()}
    # mixle's own file of its calibration, through llama-quantize, against quantize_model with it
    mixle.save_imatrix(model, m, tmp_path / "mixle.imatrix.gguf")
    llama_quantize_imatrix(build, str(tmp_path / "f32.gguf"), str(tmp_path / "theirs.gguf"), "Q4_0",
                           str(tmp_path / "mixle.imatrix.gguf"))
    ptq = mixle.quantize_model(model, gguf_mix="Q4_0", importance=m)
    mixle.save_gguf(ptq, tmp_path / "ptq.gguf", gguf_mix="Q4_0", importance=m)
    theirs, mine = read_tensors(tmp_path / "theirs.gguf"), read_tensors(tmp_path / "ptq.gguf")
    assert {n: (t, sha(d)) for n, (t, _, d) in theirs.items()} == {n: (t, sha(d)) for n, (t, _, d) in mine.items()}


def test_check_entries_allows_an_unrouted_expert_but_not_an_unrouted_layer():
    from mixle.core.imatrix import check_entries

    name, shapes = "blk.0.ffn_up_exps.weight", {"blk.0.ffn_up_exps.weight": (4, 8, 32)}
    check_entries(Imatrix({name: np.ones((4, 32), np.float32)}, {name: np.array([0, 3, 5, 9])}), shapes, min_tokens=3)
    for counts, message in (([0, 0, 0, 0], "summed over 0 input rows"), ([0, 2, 5, 9], "summed over 2 input rows")):
        with pytest.raises(ValueError, match=f"tensor '{name}' was {message}, fewer than min_tokens=3"):
            check_entries(Imatrix({name: np.ones((4, 32), np.float32)}, {name: np.array(counts)}), shapes, min_tokens=3)
