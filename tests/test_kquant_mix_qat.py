"""The decisive test of issue 24: QAT on a llama.cpp mix writes llama.cpp's quantizer's file.

``save_gguf(apply_qat(model, gguf_mix=mix), path, float_matrices="f16")`` (no mix at save: the
trained blocks are written as they are; the matrices the mix keeps float are F16, as llama.cpp's) gives, tensor by tensor, the ggml type and the sha256 of the bytes that
``llama_model_quantize`` wrote for the same float weights (the committed fixture, see
``tests/test_gguf_mixes.py``), for every mix and model of the fixture; and ``load_gguf_weights``
of that file reproduces the fake-quant forward exactly.
"""

import pytest
import torch

from mixle.core.numerics import quantize_dequantize_array

from tests.test_gguf_mixes import (HAS_LLAMA_CPP, MIXES, MODEL_CASES, llama_quantize, read_tensors, reference,  # noqa: F401
                                   sha, write_float_file)

pytest.importorskip("gguf")


def _trained_file(case, mix, seed, path):
    import mixle

    model = MODEL_CASES[case][0](seed)
    qat = mixle.apply_qat(MODEL_CASES[case][0](seed), gguf_mix=mix)
    mixle.save_gguf(qat, path, float_matrices="f16")  # what the mix keeps float is F16, as in llama.cpp's files
    return model, qat, {name: (t, sha(data)) for name, (t, _, data) in read_tensors(path).items()}


def _logits(model, tokens):
    with torch.no_grad():
        out = model(tokens)
    return getattr(out, "logits", out)


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_qat_on_a_mix_saves_llama_quantizes_tensors_bit_for_bit(case, reference, tmp_path):
    import mixle

    tokens = torch.arange(8).reshape(1, 8) % 40
    for mix in MIXES:
        model, qat, got = _trained_file(case, mix, 0, tmp_path / f"{mix}.gguf")
        want = {name: tuple(value) for name, value in reference["cases"][case]["mixes"][mix].items()}
        assert got == want, (mix, sorted(n for n in want if got.get(n) != want[n]))
        back = mixle.load_gguf_weights(model, tmp_path / f"{mix}.gguf")
        modules = dict(back.named_modules())
        for path, spec in mixle.gguf_mix_specs(model, mix).items():  # each trained weight, as it trained
            if spec is not None:
                want_weight = quantize_dequantize_array(dict(model.named_modules())[path].weight.detach(), spec)
                assert torch.equal(modules[path].weight, want_weight), (mix, path)
        if "F16" not in {t for t, _ in want.values()}:  # no matrix the mix keeps float (F16): the whole forward
            assert torch.equal(_logits(back, tokens), _logits(qat, tokens)), mix


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed (the llama extra)")
@pytest.mark.parametrize("case", ["llama_h256", "gpt2_h40"])
def test_live_qat_on_a_mix_equals_llama_quantize(case, tmp_path):
    """Fresh weights (another seed), llama.cpp's quantizer run here."""
    write_float_file(MODEL_CASES[case][0](7), tmp_path / "f32.gguf")
    for mix in ("Q4_K_M", "Q5_K_S", "Q6_K"):
        llama_quantize(tmp_path / "f32.gguf", tmp_path / "theirs.gguf", mix)
        theirs = {name: (t, sha(data)) for name, (t, _, data) in read_tensors(tmp_path / "theirs.gguf").items()}
        assert _trained_file(case, mix, 7, tmp_path / "mine.gguf")[2] == theirs, mix


def test_quantize_model_on_a_mix_writes_the_same_file(reference, tmp_path):
    import mixle

    case, mix = "qwen2_h64", "Q4_K_M"
    mixle.save_gguf(mixle.quantize_model(MODEL_CASES[case][0](0), gguf_mix=mix), tmp_path / "m.gguf")
    got = {name: (t, sha(data)) for name, (t, _, data) in read_tensors(tmp_path / "m.gguf").items()}
    assert got == {name: tuple(value) for name, value in reference["cases"][case]["mixes"][mix].items()}


def test_a_mix_with_other_selection_arguments_is_refused_naming_them():
    import mixle

    model = MODEL_CASES["gpt2_h64"][0](0)
    with pytest.raises(ValueError, match=r"gguf_mix='Q4_K_M' decides every layer's grid .* cannot be combined with "
                                         r"\['patterns', 'bits'\]: pass gguf_mix alone"):
        mixle.apply_qat(model, gguf_mix="Q4_K_M", patterns=("blocks.*",), bits=4)
    assert not [m for m in model.modules() if type(m).__name__ == "QATWrapper"]  # left as it was
