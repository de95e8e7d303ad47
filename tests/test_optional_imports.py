"""mixle imports and explains itself with torch, jax, flax and qwix missing."""

import subprocess
import sys
import textwrap

BLOCK = """
import sys
class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "jax", "jaxlib", "flax", "qwix", "optax"}:
            raise ImportError(f"No module named {name!r} (blocked by the test)")
        return None
sys.meta_path.insert(0, _Blocker())
"""


def run_python(code):
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_imports_work_without_optional_dependencies():
    out = run_python(
        BLOCK
        + """
import numpy as np
import mixle, mixle.models.qat, mixle.task.quantize
from mixle.models.qat import QATWrapper, apply_qat, set_fake_quant_enabled, fake_quantize, fake_quantize_int4
from mixle.task.quantize import QuantSpec, quantize_dequantize_array
print(fake_quantize_int4(np.array([0.7, 0.1], np.float32)).tolist())
print(sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "jax", "flax", "qwix"}))
"""
    )
    assert out.splitlines() == ["[0.699999988079071, 0.10000000149011612]", "[]"]


def test_torch_calls_name_the_extra_without_torch():
    out = run_python(
        BLOCK
        + """
from mixle.models.qat import QATWrapper, apply_qat, set_fake_quant_enabled
class FakeTorchModule:
    pass
FakeTorchModule.__module__ = "torch.nn.modules.linear"
class FakeFlaxModule:
    pass
FakeFlaxModule.__module__ = "flax.nnx.module"
for call in (lambda: QATWrapper(None), lambda: apply_qat(FakeTorchModule()),
             lambda: set_fake_quant_enabled(FakeTorchModule(), True), lambda: apply_qat(FakeFlaxModule())):
    try:
        call()
    except ImportError as err:
        print(err)
"""
    )
    lines = out.splitlines()
    assert len(lines) == 4
    assert all("pip install mixle[torch]" in line for line in lines[:3])
    assert "pip install mixle[jax]" in lines[3]


def test_plain_import_does_not_load_torch_or_jax_even_when_installed():
    out = run_python(
        """
import sys, mixle, mixle.models.qat, mixle.task.quantize
print(sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "jax", "flax", "qwix"}))
"""
    )
    assert out.strip() == "[]"
