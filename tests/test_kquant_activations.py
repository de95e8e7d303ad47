"""act_bits=8 on llama.cpp's other block grids: the input of each product as ggml's CPU path rounds it.

K-quant products read Q8_K blocks of 256 (``quantize_row_q8_K``, checked against a numpy transcription
of ggml's reference loop: gguf-py has no Q8_K); Q4_1 / Q5_1 products read Q8_1 blocks, whose values are
Q8_0's (checked against gguf-py's Q8_0). A QAT model on these grids with act_bits=8 computes exactly
``linear(activation rounding of x, dequantized weight)``, and convert gives the same.
"""

import numpy as np
import pytest
import torch

import mixle
from mixle.core.numerics import quantize_dequantize_array
from mixle.core.spec import QuantSpec
from mixle.torch_backend.layers.activations import quantize_dequantize_activations

pytest.importorskip("gguf")
from tests.test_gguf_grids import gguf_round_trip  # noqa: E402

K_GRIDS = ("q4_k", "q5_k", "q6_k")
BITS = {"q4_k": 4, "q5_k": 5, "q6_k": 6, "q4_1": 4, "q5_1": 5}


def np_q8_k(x):
    """ggml's quantize_row_q8_K_ref then its dequantization, one block of 256 at a time."""
    blocks = np.asarray(x, np.float32).reshape(-1, 256)
    out = np.zeros_like(blocks)
    for i, block in enumerate(blocks):
        amax, top = np.float32(0), np.float32(0)
        for v in block:  # the first value of largest magnitude, as ggml's strict '>'
            if abs(v) > amax:
                amax, top = abs(v), v
        if amax == 0:
            continue
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            iscale = np.float32(-127.0) / top
            d = np.float32(1.0) / iscale
            codes = np.minimum(127, np.rint(block * iscale))  # nearest_int: ties to even
            out[i] = 0 if d == 0 else codes * d
    return out.reshape(np.shape(x))


def np_q8_0(x):
    """gguf-py's Q8_0 quantize and dequantize of each token's inputs (``test_gguf_grids``' oracle)."""
    x = np.asarray(x, np.float32)
    return gguf_round_trip(x.reshape(-1, x.shape[-1]), "q8_0").reshape(x.shape)


def _tokens():
    rng = np.random.default_rng(3)
    ties = np.zeros(256, np.float32)
    ties[:253] = np.concatenate([[-127.0], np.arange(-126, 126) + 0.5])  # the max -127: scale 1, the halves tie
    flipped = -ties  # max +127: inverse -1
    late = np.full(256, 0.25, np.float32)
    late[[9, 200]] = [-3.0, 3.0]  # two of largest magnitude: the first one's sign sets the scale
    zeros = np.zeros(256, np.float32)
    tiny = np.full(256, 1e-39, np.float32)  # -127 / max overflows: ggml's d = 0
    random = rng.standard_normal((6, 256)).astype(np.float32) * rng.choice([1e-3, 1.0, 30.0], (6, 1))
    return np.concatenate([np.stack([ties, flipped, late, zeros, tiny]), random]).astype(np.float32)


@pytest.mark.parametrize("grid", K_GRIDS)
def test_k_quant_activations_are_q8_k_blocks_bit_for_bit(grid):
    x = np.concatenate([_tokens(), _tokens()[::-1]], axis=1)  # two blocks per token
    spec = QuantSpec(grid=grid, bits=BITS[grid], act_bits=8)
    got = quantize_dequantize_activations(torch.from_numpy(x), spec).numpy()
    want = np_q8_k(x)
    np.testing.assert_array_equal(got, want)
    assert spec.grid_record.activation_grid == "q8_k"  # data on the grid record
    assert np.array_equal(want[0, :256], np.minimum(127, np.rint(x[0, :256])))  # ties went to even
    bf16 = torch.from_numpy(x).to(torch.bfloat16)  # quantized in float32, cast back
    np.testing.assert_array_equal(quantize_dequantize_activations(bf16, spec).float().numpy(),
                                  torch.from_numpy(np_q8_k(bf16.float().numpy())).to(torch.bfloat16).float().numpy())


@pytest.mark.parametrize("grid", ("q4_1", "q5_1"))
def test_q4_1_and_q5_1_activations_are_q8_0_blocks_bit_for_bit(grid):
    x = _tokens()[5:]  # finite scales for float16
    spec = QuantSpec(grid=grid, bits=BITS[grid], act_bits=8)
    got = quantize_dequantize_activations(torch.from_numpy(x), spec).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), np_q8_0(x).view(np.uint32))


@pytest.mark.parametrize("grid", K_GRIDS + ("q4_1",))
def test_act8_qat_forward_and_convert_equal_the_reference(grid, tmp_path):
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    model.load_state_dict(plain.state_dict())
    mixle.apply_qat(model, grid=grid, act_bits=8)
    activations = np_q8_k if grid in K_GRIDS else np_q8_0
    x = torch.randn(5, 256) * 3
    deq = [quantize_dequantize_array(layer.weight.detach(), grid=grid) for layer in (plain[0], plain[2])]
    hidden = torch.relu(torch.nn.functional.linear(torch.from_numpy(activations(x.numpy())), deq[0], plain[0].bias))
    want = torch.nn.functional.linear(torch.from_numpy(activations(hidden.detach().numpy())), deq[1], plain[2].bias)
    got = model(x)
    assert torch.equal(got, want)
    with torch.no_grad():
        assert torch.equal(mixle.convert(model)(x), got)


def test_act_bits_is_refused_only_where_no_llama_cpp_product_reads_the_grid():
    with pytest.raises(ValueError, match=r"act_bits=8 with grid='nf4'.*no llama.cpp product.*leave act_bits=None"):
        QuantSpec(grid="nf4", act_bits=8)
    with pytest.raises(ValueError, match=r"act_bits=4 with grid='q4_k'.*grid 'q8_k'.*use act_bits=8"):
        mixle.apply_qat(torch.nn.Linear(256, 8), grid="q4_k", act_bits=4)
    with pytest.raises(ValueError, match=r"unknown"):
        QuantSpec(grid="q8_k")  # a grid of activations only: no weight is quantized on it


def test_a_mix_takes_act_bits_for_every_layer_and_nothing_else(tmp_path):
    from tests.test_gguf_mixes import MODEL_CASES, read_tensors, sha

    build = MODEL_CASES["llama_h256"][0]
    qat = mixle.apply_qat(build(0), gguf_mix="Q4_K_M", act_bits=8)
    specs = mixle.gguf_mix_specs(build(0), "Q4_K_M")
    patterns = [(path.replace(".", r"\."), None if s is None else s.replace(act_bits=8)) for path, s in specs.items()]
    by_hand = mixle.apply_qat(build(0), patterns=patterns, opt_in=("embedding",))
    tokens = torch.arange(12).reshape(1, 12) % 64
    with torch.no_grad():
        assert torch.equal(qat(tokens).logits, by_hand(tokens).logits)
    grids = {m.spec.grid for m in qat.modules() if getattr(m, "spec", None) is not None}
    assert {"q4_k", "q6_k", "q5_0"} <= grids
    assert all(m.spec.act_bits == 8 for m in qat.modules() if getattr(m, "spec", None) is not None)
    mixle.save_gguf(qat, tmp_path / "a.gguf", float_matrices="f16")  # the same weights: act_bits stores nothing
    mixle.save_gguf(mixle.apply_qat(build(0), gguf_mix="Q4_K_M"), tmp_path / "w.gguf", float_matrices="f16")
    tensors = [{name: (t, sha(data)) for name, (t, _, data) in read_tensors(tmp_path / f"{file}.gguf").items()}
               for file in ("a", "w")]
    assert tensors[0] == tensors[1]
    with pytest.raises(ValueError, match=r"cannot be combined with \['bits'\]"):
        mixle.apply_qat(build(0), gguf_mix="Q4_K_M", act_bits=8, bits=4)


def test_live_llama_cpp_computes_the_act8_forward_of_a_q4_k_m_file(tmp_path):
    """llama.cpp runs the file of a Q4_K_M QAT model: with act_bits=8 its logits are those of mixle's
    forward up to float32 sums in another order (measured 0.015 at |logit| ~4 on AMD EPYC, AVX-512),
    without it ten times further off (0.14): the Q8_K / Q8_0 rounding of each product's input."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from tests.gguf_parity_cases import IDS
    from tests.test_gguf_mixes import MODEL_CASES

    def difference(**act):
        qat = mixle.apply_qat(MODEL_CASES["llama_h256"][0](0), gguf_mix="Q4_K_M", **act)
        mixle.save_gguf(qat, tmp_path / "m.gguf", float_matrices="f16")
        llm = llama_cpp.Llama(model_path=str(tmp_path / "m.gguf"), n_ctx=16, logits_all=True, n_threads=1,
                              type_k=0, type_v=0, verbose=False)
        llm.eval(IDS)
        theirs = np.array(llm.scores[: len(IDS)], dtype=np.float32)
        with torch.no_grad():
            return float(np.abs(theirs - qat(torch.tensor([IDS])).logits[0].numpy()).max())

    with_act, without = difference(act_bits=8), difference()
    assert with_act < 0.03 and with_act < without / 4, (with_act, without)
