"""One public face: ``import mixle`` offers the user API by name; the older paths are aliases of it."""

import importlib

import numpy as np
import pytest

import mixle
from tests.test_optional_imports import BLOCK, run_python

OLD_PATHS = {
    "mixle.api": ("apply_qat", "set_fake_quant_enabled", "get_qat_report", "fake_quantize", "convert",
                  "quantize_model", "save_quantized", "load_quantized", "model_nbytes", "QATWrapper", "apply_lora"),
    "mixle.models.qat": ("apply_qat", "set_fake_quant_enabled", "get_qat_report", "fake_quantize",
                         "fake_quantize_int4", "QuantSpec", "QATWrapper", "invalidate_fake_quant_caches"),
    "mixle.task.quantize": ("convert", "quantize_model", "save_quantized", "load_quantized", "model_nbytes",
                            "save_gguf", "load_gguf_weights", "save_pretrained_compressed",
                            "load_pretrained_compressed", "quantize_dequantize_array", "QuantizedArray", "pack_int4"),
    "mixle.experimental.program.lora": ("apply_lora", "merge_lora", "get_lora_report", "lora_parameters",
                                        "LoRASpec"),
    "mixle.models.transformer": ("build_causal_lm",),
    "mixle.models.grad_leaf": ("GradLeaf",),
}


def test_dir_lists_the_user_api():
    expected = {"apply_qat", "set_fake_quant_enabled", "get_qat_report", "QuantSpec", "fake_quantize", "convert",
                "quantize_model", "save_quantized", "load_quantized", "save_gguf", "load_gguf_weights",
                "save_pretrained_compressed", "load_pretrained_compressed", "apply_lora", "merge_lora",
                "model_nbytes", "LoRASpec", "QATWrapper", "GGUF_MIXES", "gguf_mix_types", "gguf_mix_specs"}
    assert expected <= set(dir(mixle))
    assert set(mixle.__all__) == set(dir(mixle))
    with pytest.raises(AttributeError, match="no attribute 'apply_qta'"):
        mixle.apply_qta  # noqa: B018


@pytest.mark.parametrize("module", sorted(OLD_PATHS))
def test_old_paths_are_aliases_of_the_face(module):
    pytest.importorskip("torch")
    old = importlib.import_module(module)
    for name in OLD_PATHS[module]:
        assert getattr(old, name) is getattr(mixle, name), f"{module}.{name}"


def test_every_face_name_resolves_with_everything_installed():
    pytest.importorskip("torch")
    for name in mixle.__all__:
        assert getattr(mixle, name) is not None
    x = np.array([0.7, -0.1, 0.04], np.float32)
    # The face's function is the numerics: 0.7 / 7 per step on the default symmetric int4 grid.
    assert mixle.fake_quantize(x, bits=4).tolist() == (np.round(x / np.float32(0.1)) * np.float32(0.1)).tolist()


def test_face_without_torch_lists_everything_and_explains_on_use():
    out = run_python(BLOCK + """
import numpy as np, mixle
print(len(dir(mixle)) == len(mixle.__all__))
print(mixle.quantize_dequantize_array(np.array([0.7, 0.1], np.float32), bits=4).tolist())
for name in ("save_gguf", "QATWrapper", "build_causal_lm", "load_pretrained_compressed"):
    try:
        getattr(mixle, name)(None)
    except ImportError as err:
        print(name, "pip install mixle[torch]" in str(err))
print(sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "jax", "flax", "qwix"}))
""")
    assert out.splitlines() == ["True", "[0.699999988079071, 0.10000000149011612]", "save_gguf True",
                                "QATWrapper True", "build_causal_lm True", "load_pretrained_compressed True", "[]"]
