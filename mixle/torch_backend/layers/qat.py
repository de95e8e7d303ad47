"""The PyTorch QAT layers: a fake-quantized Linear and an Embedding tied to one.

Both reuse the original module's Parameter objects, so ties, ``state_dict`` keys and optimizers
built before wrapping keep working.
"""

import torch
import torch.nn.functional as F
from torch import nn

from mixle.core.checks import ScaleOverflowError
from mixle.core.imatrix import check_importance
from mixle.core.grids import importance_grid
from mixle.core.numerics import block_shape
from mixle.core.spec import WEIGHT_FIELDS, resolve_spec
from mixle.torch_backend.kernels import fused_cpu
from mixle.torch_backend.layers import learned_scale
from mixle.torch_backend.layers.activations import ACTIVATION_FIELDS, check_activation_spec, fake_quant_activations
from mixle.torch_backend.fake_quant import fake_quantize, fake_quantized_weight, invalidate_caches, linear

BACKEND = "torch"
SPEC_FIELDS = WEIGHT_FIELDS + ACTIVATION_FIELDS + ("scale",)
_DOES = "fake-quantizes weights (fixed or learned scales) and (act_bits) per-token activations"
_HOOK_SUFFIXES = ("hooks", "hooks_with_kwargs", "always_called")
# apply_qat (and convert) record each layer's path in the model here, so run-time errors name it.
PATH_ATTRIBUTE = "_mixle_path"


def named_error(module, err):
    """``err`` (a ValueError raised in ``module``'s forward) as one that names the layer (a
    ScaleOverflowError stays one, as numpy's and jax's refusals of the same weight are).

    >>> layer = QATWrapper(nn.Linear(32, 2), grid="q4_0", bits=4)
    >>> setattr(layer, PATH_ATTRIBUTE, "blocks.0.fc")
    >>> str(named_error(layer, ValueError("a block scale does not fit float16")))
    "layer 'blocks.0.fc': a block scale does not fit float16"
    """
    path = getattr(module, PATH_ATTRIBUTE, None)
    weight = getattr(module, "weight", None)
    where = f"layer {path!r}" if path is not None else (
        f"a {type(module).__name__} with weight shape {list(weight.shape) if weight is not None else '?'} "
        f"(apply_qat names its layers)")
    return (ScaleOverflowError if isinstance(err, ScaleOverflowError) else ValueError)(f"{where}: {err}")


def check_supported(spec):
    """Refuse spec options and grids the torch backend cannot honour.

    >>> from mixle.core.spec import QuantSpec
    >>> check_supported(QuantSpec(bits=8)) is None  # accepted
    True
    >>> check_supported(QuantSpec(bits=8, bwd_bits=8))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: QuantSpec.bwd_bits=8 is not supported by the torch backend, ...: leave it at its default (None) for torch models
    """
    spec.check_backend(BACKEND, SPEC_FIELDS, _DOES)
    check_activation_spec(spec)


def _decide_kernels(weight):
    # Build or find the fused kernels now, outside any torch.compile trace; a weight on another
    # device never uses them (nor builds them).
    if weight.device.type == "cpu":
        fused_cpu.available()


def adopt(dst, src, names=()):
    """Make ``dst`` share ``src``'s ``names`` attributes (Parameters), hooks, mode and mixle marks
    (reports kept on a root module follow it when it is replaced); returns ``dst``."""
    for name in names:
        setattr(dst, name, getattr(src, name))
    for name, value in vars(src).items():
        if name.endswith(_HOOK_SUFFIXES) or name.startswith("_mixle_"):
            setattr(dst, name, value)
    dst.training = src.training
    return dst


def plain_linear(layer):
    """An ``nn.Linear`` sharing ``layer``'s Parameters and hooks (no fake-quant, no adapter).

    >>> plain_linear(QATWrapper(nn.Linear(3, 2))).__class__.__name__
    'Linear'
    """
    out = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(out)
    return adopt(out, layer, ("in_features", "out_features", "weight", "bias"))


class QATLayerMixin:
    """What every QAT layer class shares (listed before its torch base class): loading a
    checkpoint makes cached fake-quantized weights stale, and the repr names the spec and state."""

    def _load_from_state_dict(self, *args, **kwargs):
        invalidate_caches()  # loaded weights must be quantized afresh, even where FSDP2 hides the change
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, *args, **kwargs):
        # model.to(torch.bfloat16) casts every float Parameter; a learned log2 scale stays float32.
        keep = learned_scale.precise_scales(self)
        result = super()._apply(fn, *args, **kwargs)
        learned_scale.restore_precision(self, keep)
        return result

    def qat_state(self, detail=""):
        """``qat=<spec> (on|off<detail>)`` for reprs."""
        return f"qat={self.spec.short()} ({'on' if self.enabled else 'off'}{detail})"

    def extra_repr(self):
        return f"{super().extra_repr()}, {self.qat_state()}"


def checked_importance(spec, values, weight_shape, name="weight", learned=False):
    """The importance a ``QATWrapper`` holds for a weight of ``weight_shape`` on ``spec``: a float32
    tensor ``(in,)``, or None where llama.cpp ignores an importance (``q8_0``, ``mxfp4``: checked,
    then dropped, as ``quantize_array`` does).

    Raises:
        ValueError: a grid without ggml's weighted search (``importance_grid``), a learned scale
            (its scales are trained, not searched), or values that do not fit (``check_importance``).

    >>> from mixle.core.spec import QuantSpec
    >>> checked_importance(QuantSpec(grid="q4_0"), [1.0] * 32, (2, 32)).shape
    torch.Size([32])
    """
    if learned:
        raise ValueError(f"{name}: importance= needs the fixed-scale ggml search, but spec.scale={spec.scale!r} "
                         f"trains the scales: drop importance= or use scale='absmax'")
    how = importance_grid(spec.grid, name)
    values = check_importance(values, tuple(weight_shape), name=name)
    return None if how == "ignored" else torch.from_numpy(values.reshape(-1).copy())


class QATWrapper(QATLayerMixin, nn.Linear):
    """An ``nn.Linear`` whose weight is fake-quantized in the forward while enabled.

    It reuses the wrapped layer's ``weight`` and ``bias`` Parameter objects (no copies), so tied
    weights stay tied, ``state_dict()`` keys do not change and an existing optimizer keeps
    training the same tensors. Train and eval mode both fake-quantize while ``enabled``.

    Args:
        linear: the ``nn.Linear`` to wrap (not itself a QATWrapper).
        spec: QuantSpec; or pass its fields as keywords (default int4 per-channel symmetric).
        enabled: fake-quantize in the forward (False computes exactly ``nn.Linear``).
        importance: llama.cpp's importance matrix entry of the weight (one value per input column,
            fixed from calibration, e.g. ``calibrate_importance``), on a grid with ggml's weighted
            search: the forward then fake-quantizes exactly as ``llama-quantize --imatrix``
            quantizes (``quantize_array(weight, spec, importance=...)``). Held as the
            non-persistent float32 buffer ``importance`` (``state_dict`` keys do not change);
            ``set_importance`` changes it.

    >>> layer = QATWrapper(nn.Linear(4, 2), bits=8)
    >>> layer.weight.shape, layer.spec.bits
    (torch.Size([2, 4]), 8)
    """

    def __init__(self, linear, spec=None, *, enabled=True, importance=None, **spec_fields):
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"QATWrapper wraps an nn.Linear, got {type(linear).__name__}")
        if isinstance(linear, QATWrapper):
            raise TypeError("linear is already a QATWrapper: wrappers never nest; change its .spec instead")
        spec = resolve_spec(spec, spec_fields)
        check_supported(spec)
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be True or False, got {enabled!r}")
        block_shape(linear.weight.shape, spec)  # raises if group_size does not divide in_features
        nn.Module.__init__(self)
        adopt(self, linear, ("in_features", "out_features", "weight", "bias"))
        self.spec = spec
        self.enabled = enabled
        self.register_buffer("importance", None, persistent=False)
        if importance is not None:
            self.set_importance(importance)
        if learned_scale.is_learned(spec):
            learned_scale.attach(self)
        _decide_kernels(self.weight)

    def set_importance(self, values):
        """Hold ``values`` (or None: none) as this layer's importance, validated (``checked_importance``)."""
        if values is not None:
            values = checked_importance(self.spec, values, tuple(self.weight.shape), learned=learned_scale.is_learned(
                self.spec)).to(self.weight.device)
        self.importance = values
        return self

    def _apply(self, fn, *args, **kwargs):
        keep = self._buffers.get("importance")  # model.to(torch.bfloat16) must not round the importance
        result = super()._apply(fn, *args, **kwargs)
        moved = self._buffers.get("importance")
        if keep is not None and moved is not None and moved.dtype != torch.float32:
            self._buffers["importance"] = keep.to(moved.device)
        return result

    def quantized_weight(self):
        """The fake-quantized weight (with STE gradient) this layer uses while enabled.

        Computed once per version of the weight and reused until an in-place change, an
        optimizer step or ``load_state_dict`` (see ``mixle.torch_backend.fake_quant``).
        """
        if learned_scale.is_learned(self.spec):
            return learned_scale.learned_weight(self)
        return fake_quantized_weight(self.weight, self.spec, importance=self.importance)[0]

    def forward(self, x):
        if not self.enabled:
            return F.linear(x, self.weight, self.bias)
        try:  # a scale that does not fit float16 (llama.cpp's grids) or a NaN weight: name the layer
            x = fake_quant_activations(x, self.spec)
            if learned_scale.is_learned(self.spec):
                return F.linear(x, learned_scale.learned_weight(self), self.bias)
            return linear(x, self.weight, self.bias, self.spec, self.importance)
        except ValueError as err:
            raise named_error(self, err) from None


class QATEmbedding(QATLayerMixin, nn.Embedding):
    """An ``nn.Embedding`` whose table is fake-quantized per row (one scale row per token).

    ``apply_qat`` makes one for an embedding tied to a fake-quantized head (lookups then use the
    same quantized weight, which is stored once as integers after conversion) and for an untied
    embedding selected with ``opt_in=("embedding",)`` or a pattern naming it. Shares the
    Parameter like ``QATWrapper``. A lookup fake-quantizes only the rows it reads (every block
    but a per-tensor scale's lies within a row), so a step does not pass over the whole table for
    a few hundred tokens; a tied head still fake-quantizes the whole table for its product.
    """

    def __init__(self, embedding, spec, *, enabled=True):
        if embedding.sparse:
            raise ValueError("a sparse nn.Embedding cannot be fake-quantized (its gradient would be dense)")
        nn.Module.__init__(self)
        adopt(self, embedding, ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
                                "scale_grad_by_freq", "sparse", "weight"))
        self.spec = spec
        self.enabled = enabled
        if learned_scale.is_learned(spec):
            learned_scale.attach(self)  # the same scale Parameter as the tied head
        _decide_kernels(self.weight)

    def forward(self, x):
        if not self.enabled:
            weight = self.weight
        elif learned_scale.is_learned(self.spec):
            weight = learned_scale.learned_weight(self)
        elif self.max_norm is None and self.spec.granularity != "tensor" and not self.weight.is_meta:
            # Every block lies within a row, so the rows read are fake-quantized alone: bit for bit
            # the rows of the fake-quantized table, without a pass over the whole table.
            rows = F.embedding(x, self.weight, self.padding_idx, None, self.norm_type, self.scale_grad_by_freq)
            try:
                return fake_quantize(rows.reshape(-1, rows.shape[-1]), self.spec).reshape(rows.shape)
            except ValueError as err:
                raise named_error(self, err) from None
        else:
            try:  # shared: the tied head uses this weight too, so its codes are kept for that second use
                weight = fake_quantized_weight(self.weight, self.spec, shared=True)[0]
            except ValueError as err:
                raise named_error(self, err) from None
        return F.embedding(x, weight, self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)
