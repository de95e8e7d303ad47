"""int4 packing: the documented nibble order, exact round trips for odd and even sizes, bad input."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixle.task.quantize import pack_int4, unpack_int4


def reference_bytes(codes):
    """The documented layout, byte by byte: c[2i] low nibble, c[2i+1] high nibble, zero pad."""
    flat = [int(c) for c in np.asarray(codes).reshape(-1)]
    if len(flat) % 2:
        flat.append(0)
    return [(flat[i] & 0xF) | ((flat[i + 1] & 0xF) << 4) for i in range(0, len(flat), 2)]


shapes = st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), shape=shapes)
def test_round_trip_and_layout_numpy_and_torch(data, shape):
    n = int(np.prod(shape))
    values = data.draw(st.lists(st.integers(-8, 7), min_size=n, max_size=n))
    codes = np.array(values, np.int8).reshape(shape)

    packed = pack_int4(codes)
    assert packed.dtype == np.uint8 and packed.shape == ((n + 1) // 2,)
    assert packed.tolist() == reference_bytes(codes)
    back = unpack_int4(packed, shape)
    assert back.dtype == np.int8
    np.testing.assert_array_equal(back, codes)

    t_packed = pack_int4(torch.from_numpy(codes))
    assert t_packed.dtype == torch.uint8
    assert t_packed.tolist() == packed.tolist()  # the same bytes from torch and numpy
    t_back = unpack_int4(t_packed, shape)
    assert t_back.dtype == torch.int8
    assert torch.equal(t_back, torch.from_numpy(codes))


def test_documented_example_and_sign_extension():
    assert pack_int4(np.array([1, -1, 7], np.int8)).tolist() == [0xF1, 0x07]
    assert pack_int4(np.array([-8, 0], np.int8)).tolist() == [0x08]
    assert unpack_int4(np.array([0x8F], np.uint8), (2,)).tolist() == [-1, -8]
    every = np.arange(-8, 8, dtype=np.int8)
    assert unpack_int4(pack_int4(every), 16).tolist() == list(range(-8, 8))


def test_wider_integer_inputs_pack_like_int8():
    codes = np.array([[3, -7, 0], [7, -8, 1]])
    assert pack_int4(codes.astype(np.int64)).tolist() == pack_int4(codes.astype(np.int8)).tolist()
    assert pack_int4(torch.tensor(codes, dtype=torch.int32)).tolist() == reference_bytes(codes)


def test_empty_packs_to_no_bytes():
    assert pack_int4(np.zeros(0, np.int8)).shape == (0,)
    assert unpack_int4(np.zeros(0, np.uint8), (0, 3)).shape == (0, 3)


@pytest.mark.parametrize("bad", [8, -9, 127])
def test_out_of_range_codes_are_refused(bad):
    with pytest.raises(ValueError, match=r"outside the int4 range \[-8, 7\]"):
        pack_int4(np.array([0, bad]))
    with pytest.raises(ValueError, match="outside the int4 range"):
        pack_int4(torch.tensor([bad, 0]))


def test_bad_inputs_are_refused_with_the_fix():
    with pytest.raises(TypeError, match="integer codes"):
        pack_int4(np.array([0.5, 1.0], np.float32))
    with pytest.raises(TypeError, match="integer codes"):
        pack_int4(torch.tensor([True, False]))
    with pytest.raises(TypeError, match="uint8"):
        unpack_int4(np.array([1, 2], np.int8), (4,))
    with pytest.raises(ValueError, match="take a 1-D array of 2 bytes"):
        unpack_int4(np.zeros(3, np.uint8), (2, 2))
    with pytest.raises(ValueError, match="take a 1-D array"):
        unpack_int4(torch.zeros(2, 1, dtype=torch.uint8), (4,))
    with pytest.raises(ValueError, match="non-negative ints"):
        unpack_int4(np.zeros(1, np.uint8), (2.0,))


def test_reexports_are_lazy_and_packing_needs_no_torch():
    """`from mixle.task.quantize import ...` of the torch-backed names works lazily; packing is numpy-only."""
    code = textwrap.dedent(
        """
        import sys
        class _Blocker:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "torch":
                    raise ImportError("blocked by the test")
        sys.meta_path.insert(0, _Blocker())
        import numpy as np
        import mixle.task.quantize
        from mixle.task.quantize import pack_int4, unpack_int4, quantize_linear_weight
        print(unpack_int4(pack_int4(np.array([1, -1, 7], np.int8)), 3).tolist())
        try:
            from mixle.task.quantize import QuantizedLinear
        except ImportError as err:
            print("pip install mixle[torch]" in str(err))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[1,", "-1,", "7]", "True"]
    import mixle.task.quantize as quantize

    names = ["pack_int4", "unpack_int4", "QuantizedLinear", "QuantizedEmbedding", "quantize_model", "quantize_mlp",
             "convert", "save_quantized", "load_quantized", "model_nbytes"]
    assert all(callable(getattr(quantize, name)) for name in names)
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        quantize.nothing_here
