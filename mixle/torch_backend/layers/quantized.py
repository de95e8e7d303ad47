"""Real low-bit torch layers: QuantizedLinear and QuantizedEmbedding store integer codes and scales.

Their forward computes with ``dequantize_array(codes, scale)``, the QAT fake-quant forward of the
same spec; QuantizedLinear runs float32 CPU products straight from the packed codes
(``packed_linear``), which changes only the order of the float sums.
"""

import torch
from torch import nn
from torch.nn import functional as F

from mixle.core.array_ops import TorchOps
from mixle.core.numerics import QuantizedArray, block_shape, dequantize_array
from mixle.core.packing import pack_int4, unpack_int4
from mixle.core.spec import QuantSpec
from mixle.core.stored import check_stored
from mixle.torch_backend.kernels import packed_linear as _packed_linear
from mixle.torch_backend.layers import save_guard
from mixle.torch_backend.layers.activations import fake_quant_activations
from mixle.torch_backend.layers.qat import check_supported, named_error

__all__ = ["QuantizedLinear", "QuantizedEmbedding", "QuantizedWeight", "check_quantized_storage", "to_storage",
           "file_scale_dtype", "scale_nbytes"]

_OPS = TorchOps()


GRID_PARTS = ("offset", "sub_scales", "sub_offsets")  # a grid's parts besides codes and scale


def check_quantized_storage(codes, scale, spec, weight_shape, name="layer", **parts):
    """Validate codes and scales of one quantized weight before they are used.

    The torch backend's checks (a spec it trains, torch tensors, a 2-D weight), then
    ``mixle.core.stored.check_stored``, the validation every loader and exporter shares: the
    codes' dtype and shape for ``spec.bits``, every code on the spec's grid
    (``[code_min, code_max]``; for int4 also that an odd count's pad nibble is zero), and scales
    of the block shape, a floating dtype and the values the grid allows: finite and positive;
    zero too on grids with ``zero_scale=None`` and any sign on signed-max grids (llama.cpp's),
    whose scales must also be exact float16 values; ``parts`` are the grid's other parts
    (``offset``, ``sub_scales``, ``sub_offsets``, e.g. of ``grid="q4_k"``).

    Raises:
        TypeError: spec is not a QuantSpec, or codes/scale are not torch tensors.
        ValueError: anything above disagrees; the message names ``name``.

    >>> check_quantized_storage(torch.tensor([[7, -7]], dtype=torch.int8), torch.ones(1, 1, 1),
    ...                         QuantSpec(bits=8), (1, 2))
    >>> check_quantized_storage(torch.tensor([[-128, 7]], dtype=torch.int8), torch.ones(1, 1, 1),
    ...                         QuantSpec(bits=8), (1, 2), name="fc")
    Traceback (most recent call last):
    ValueError: fc: codes span [-128, 7], outside the int8/channel/symmetric grid [-127, 127]: the data is corrupt or was written with another spec
    """
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"{name}: spec must be a mixle QuantSpec, got {type(spec).__name__}")
    try:
        check_supported(spec)  # integer weight codes only: what the torch QAT backend trains
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None
    if not isinstance(codes, torch.Tensor) or not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name}: codes and scale must be torch tensors, got {type(codes).__name__} "
                        f"and {type(scale).__name__}")
    weight_shape = tuple(int(d) for d in weight_shape)
    if len(weight_shape) != 2 or min(weight_shape) < 1:
        raise ValueError(f"{name}: weight_shape must be (rows, cols) with positive sizes, got {weight_shape}")
    check_stored(codes, scale, spec, weight_shape, name=name, **parts)


def file_scale_dtype(spec):
    """The dtype a grid stores its scales in (``torch.float16`` for llama.cpp's grids), or None
    for grids whose scales keep the weight's dtype.

    In memory a layer's ``scale`` buffer has the weight's float dtype (float32 for a
    bfloat16/float16 weight, whose values are rounded once to its dtype), so its forward is the
    QAT forward bit for bit; for float16 grids it holds float16 values exactly, and files and
    ``model_nbytes`` count them as float16.

    >>> file_scale_dtype(QuantSpec(grid="q4_0")), file_scale_dtype(QuantSpec(bits=4))
    (torch.float16, None)
    """
    codec = spec.grid_record.codec  # E8M0 scales (mxfp4) stay float32: safetensors has no E8M0 dtype
    return None if codec is None or codec.file_dtype is None else getattr(torch, codec.file_dtype)


def scale_nbytes(spec, scale):
    """Bytes of ``scale`` as stored (2 per scale on float16 grids, else its own item size).

    >>> scale_nbytes(QuantSpec(grid="q4_0"), torch.ones(1, 4, 1))
    8
    """
    dtype = file_scale_dtype(spec)
    itemsize = scale.element_size() if dtype is None else torch.empty(0, dtype=dtype).element_size()
    return scale.numel() * itemsize


class QuantizedWeight(nn.Module):
    """Shared storage of a quantized 2-D weight: ``codes`` and ``scale`` buffers plus its spec.

    ``KIND`` names the layer kind (``mixle.torch_backend.layers.layer_kinds``) it is saved as.
    """

    def _set_storage(self, codes, scale, spec, weight_shape, dtype=None, **parts):
        """Store the buffers ``codes``, ``scale`` and the grid's ``parts`` (``GRID_PARTS``; None
        where the grid has none: such buffers are not in the state dict). ``dtype``: the float dtype
        the dequantized weight is given in, the replaced weight's (default: the scales'); a
        bfloat16/float16 weight keeps float32 scales and each value is rounded once to its dtype."""
        check_quantized_storage(codes, scale, spec, weight_shape, name=type(self).__name__, **parts)
        save_guard.install()  # transformers' save_pretrained must refuse this layer (see save_guard)
        self.spec = spec
        self.weight_shape = tuple(int(d) for d in weight_shape)
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        for part in GRID_PARTS:
            self.register_buffer(part, parts.get(part))
        self.float_dtype = dtype or scale.dtype  # the dtype the dequantized weight is given in

    def _apply(self, fn, *args, **kwargs):
        # model.to(torch.bfloat16) moves the weight's dtype (found by applying fn to an empty tensor of
        # it); float32 scales and mins stay float32 (a 16-bit copy would round every value twice).
        kept = {name: self._buffers[name] for name in ("scale", "offset")
                if self._buffers.get(name) is not None and self._buffers[name].dtype == torch.float32}
        result = super()._apply(fn, *args, **kwargs)
        self.float_dtype = fn(torch.empty(0, dtype=self.float_dtype, device=self.codes.device)).dtype
        for name, before in kept.items():
            now = self._buffers[name]
            if now.dtype in (torch.bfloat16, torch.float16):
                self._buffers[name] = before.to(now.device)
        return result

    def grid_parts(self):
        """``{part: buffer}`` of the grid's parts besides codes and scale (``GRID_PARTS``) it has."""
        return {part: getattr(self, part) for part in GRID_PARTS if getattr(self, part, None) is not None}

    def quantized_array(self):
        """The weight as a QuantizedArray of int8 codes (int4 codes unpacked), scales and parts."""
        signed = self.spec.code_min < 0
        codes = unpack_int4(self.codes, self.weight_shape, signed=signed) if self.spec.bits == 4 else self.codes
        return QuantizedArray(codes, self.scale, self.spec, 0, 1, **self.grid_parts())

    def dequantized_weight(self):
        """The float weight ``codes * scale`` through the shared numerics (``dequantize_array``), in
        ``float_dtype``."""
        weight = dequantize_array(self.quantized_array())
        return weight if weight.dtype == self.float_dtype else weight.to(self.float_dtype)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        save_guard.check(prefix)
        save_guard.install()  # for later calls, where transformers was imported after this layer was made
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _storage_repr(self):
        packing = "packed int4, 2 per byte" if self.spec.bits == 4 else "int8"
        return f"{self.spec.short()} ({packing})"


def to_storage(q):
    """``(codes, scale, parts)`` to store of a QuantizedArray: 4-bit codes packed two per byte
    (unsigned nibbles on grids with codes 0..15), others as int8; ``parts`` the grid's other
    parts (``{"offset": ..., "sub_scales": ..., "sub_offsets": ...}`` where it has them)."""
    codes = pack_int4(q.codes, signed=q.spec.code_min < 0) if q.spec.bits == 4 else q.codes
    return codes, q.scale, {part: getattr(q, part) for part in GRID_PARTS if getattr(q, part) is not None}


class QuantizedLinear(QuantizedWeight):
    """An inference ``Linear`` that stores integer codes and scales and dequantizes in its forward.

    Buffers: ``codes`` (uint8, two int4 codes per byte in the nibble order of
    ``mixle.core.packing``; or int8 codes of shape ``(out, in)``), ``scale`` (float, shape
    ``(1, S, 1)``, see ``block_shape``) and ``bias`` (float, or None). The forward computes
    ``F.linear(x, dequantize_array(codes, scale), bias)``: the QAT fake-quant forward. Float32 CPU
    inputs run it on ``packed_linear``'s kernel, straight from the codes: the same weights, the
    float sums in another order; inside ``packed_linear.switched_off()`` (and for other dtypes,
    devices, autocast or inputs needing a gradient) it is exactly the fake-quant forward, bit for bit.

    Args:
        codes: stored codes as above.
        scale: scales in the weight's float dtype (float32 for a bfloat16/float16 weight).
        spec: the QuantSpec the codes were made with.
        weight_shape: ``(out_features, in_features)``.
        bias: float bias of shape ``(out_features,)`` or None.
        parts: the grid's other parts (``GRID_PARTS``), as ``to_storage`` returns them, and ``dtype``,
            the replaced weight's float dtype (default: the scales').

    >>> from mixle.core.layer_weights import quantize_linear_weight
    >>> codes, scale, _ = to_storage(quantize_linear_weight(torch.randn(2, 4), bits=4))
    >>> layer = QuantizedLinear(codes, scale, QuantSpec(bits=4), (2, 4))
    >>> layer.codes.dtype, tuple(layer.codes.shape), tuple(layer(torch.ones(3, 4)).shape)
    (torch.uint8, (4,), (3, 2))
    """

    KIND = "linear"

    def __init__(self, codes, scale, spec, weight_shape, bias=None, **parts):
        super().__init__()
        self._set_storage(codes, scale, spec, weight_shape, **parts)
        self.out_features, self.in_features = self.weight_shape
        if bias is not None:
            if not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or tuple(bias.shape) != (self.out_features,):
                raise ValueError(f"QuantizedLinear: bias must be a float tensor of shape ({self.out_features},), got {bias!r:.80}")
            bias = bias.detach()
        self.register_buffer("bias", bias)

    def forward(self, x):
        # act_bits: activations quantized at run time, as in training (activations.py).
        try:
            x = fake_quant_activations(x, self.spec)
        except ValueError as err:
            raise named_error(self, err) from None
        if _packed_linear.applies(x, self):
            return _packed_linear.linear(x, self)  # same weights, float sums in another order
        weight = self.dequantized_weight()
        if self.spec.grid_record.numerics is not None and weight.dtype != x.dtype:
            weight = weight.to(x.dtype)  # float32 blocks, cast as the QAT forward casts them (bfloat16 models)
        return F.linear(x, weight, self.bias)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self._storage_repr()}")


class QuantizedEmbedding(QuantizedWeight):
    """An inference ``Embedding`` whose table is stored as integer codes and scales.

    ``convert`` creates one for an embedding tied to a quantized head; both modules then hold
    the *same* ``codes`` and ``scale`` tensors, so the tied weight is stored once. Lookups give
    the rows of the dequantized table bit for bit, exactly like ``QATEmbedding``'s fake-quant
    forward, but dequantize only the rows looked up (``dequantized_rows``).

    Args:
        codes, scale, spec: as for ``QuantizedLinear``; codes describe ``(num_embeddings, dim)``.
        weight_shape: ``(num_embeddings, embedding_dim)``.
        padding_idx, max_norm, norm_type, scale_grad_by_freq: as for ``nn.Embedding``.
        parts: the grid's other parts (``GRID_PARTS``), as ``to_storage`` returns them.
    """

    KIND = "embedding"

    def __init__(self, codes, scale, spec, weight_shape, padding_idx=None, max_norm=None, norm_type=2.0,
                 scale_grad_by_freq=False, **parts):
        super().__init__()
        self._set_storage(codes, scale, spec, weight_shape, **parts)
        self.num_embeddings, self.embedding_dim = self.weight_shape
        self.padding_idx = padding_idx
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.scale_grad_by_freq = scale_grad_by_freq

    def forward(self, x):
        if self.max_norm is None:
            return self.dequantized_rows(x)
        if not _OPS.readable(x):  # torch.unique would wait for the device: renormalise each row looked up
            return _renormed(self.dequantized_rows(x), self.max_norm, self.norm_type)
        # max_norm renormalises the looked-up rows of the table in place: do it on the
        # distinct rows only, each once, as F.embedding does on the whole table.
        rows, where = torch.unique(x, return_inverse=True)
        return F.embedding(where, self.dequantized_rows(rows), None, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, False)

    def dequantized_rows(self, indices):
        """Rows ``indices`` of the dequantized table, each ``code * scale`` like ``dequantized_weight()``.

        Only those rows' codes are unpacked (a lookup no longer rebuilds the whole table); every
        value is the same one float product, so the result equals ``dequantized_weight()[indices]``
        bit for bit.

        Args:
            indices: integer tensor of any shape with values in ``[0, num_embeddings)``.

        Returns:
            Float tensor of shape ``(*indices.shape, embedding_dim)`` in ``float_dtype``.

        Raises:
            IndexError: an index lies outside ``[0, num_embeddings)``.

        >>> from mixle.core.layer_weights import quantize_embedding_weight
        >>> codes, scale, _ = to_storage(quantize_embedding_weight(torch.randn(5, 4), bits=4))
        >>> table = QuantizedEmbedding(codes, scale, QuantSpec(bits=4), (5, 4))
        >>> torch.equal(table.dequantized_rows(torch.tensor([3, 0, 3])), table.dequantized_weight()[[3, 0, 3]])
        True
        """
        if not isinstance(indices, torch.Tensor) or indices.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{type(self).__name__}: indices must be an int64 or int32 tensor, got "
                            f"{getattr(indices, 'dtype', type(indices).__name__)}")
        if self.spec.grid_record.numerics is not None:  # offsets, sub-scales, tables: the whole table's numerics
            return F.embedding(indices, self.dequantized_weight())
        rows, dim = self.weight_shape
        flat = indices.reshape(-1).to(device=self.codes.device, dtype=torch.int64)
        odd_int4 = self.spec.bits == 4 and dim % 2
        if torch.compiler.is_compiling():
            if odd_int4:  # its gather below does not check the indices: keep F.embedding's check
                return F.embedding(indices, self.dequantized_weight())
        elif not _OPS.readable(flat):  # on a device: an asynchronous assert, no read back
            torch._assert_async(((flat >= 0) & (flat < rows)).all(),
                                f"{type(self).__name__}: an index lies outside the table's [0, {rows - 1}]")
        elif flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= rows):
            raise IndexError(f"{type(self).__name__}: indices span [{int(flat.min())}, {int(flat.max())}], "
                             f"outside the table's [0, {rows - 1}]")
        # F.embedding gathers whole rows of codes and scales (and checks the indices when compiled).
        if self.spec.bits != 4:
            codes = F.embedding(flat, self.codes)
        elif not odd_int4:  # rows start on a byte
            packed = F.embedding(flat, self.codes.reshape(rows, dim // 2))
            codes = unpack_int4(packed.reshape(-1), (flat.numel(), dim))
        else:  # odd rows share a byte with the next row: gather each code's byte and nibble
            at = flat.unsqueeze(-1) * dim + torch.arange(dim, device=flat.device)
            codes = _sign_extend((self.codes[at >> 1] >> ((at & 1) * 4).to(torch.uint8)) & 0xF)
        _, blocks, width = block_shape(self.weight_shape, self.spec, 0, 1)
        if blocks == 1:  # one scale for the whole table
            weights = codes.to(self.scale.dtype) * self.scale.reshape(1, 1)
        else:  # scales per row (width == dim) or per group of a row: dim // width of them per row
            scale = F.embedding(flat, self.scale.reshape(rows, dim // width)).unsqueeze(-1)
            weights = (codes.reshape(-1, dim // width, width).to(self.scale.dtype) * scale).reshape(-1, dim)
        return weights.reshape(*indices.shape, dim).to(self.float_dtype)

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.embedding_dim}, {self._storage_repr()}"


def _renormed(rows, max_norm, norm_type):
    """``rows`` scaled as ``embedding_renorm_`` scales a table's rows: by ``max_norm / (norm + 1e-7)``
    where a row's norm exceeds ``max_norm`` (a repeated row gets the same scale, so once each)."""
    norm = torch.linalg.vector_norm(rows, norm_type, dim=-1, keepdim=True)
    return torch.where(norm > max_norm, rows * (max_norm / (norm + 1e-7)), rows)


def _sign_extend(nibbles):
    """int8 codes from 4-bit two's-complement nibbles (uint8 0..15), as ``unpack_int4``."""
    return (nibbles.to(torch.int8) ^ 8) - 8
