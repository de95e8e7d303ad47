"""The torch straight-through fake-quant op, its per-Parameter cache and memory-light saving.

The numerics are ``mixle.core.numerics``'s (block view, scales, rounding, dequantize); this
module only decides when they run, and on contiguous float32/float64/bfloat16 CPU weights runs them as
``_fused_cpu``'s kernels (one pass per block, bit-identical; the tests run both paths). The
numerics of a bfloat16/float16 weight run in float32: it gets exactly the codes, scales and values
of its float32 copy, the values rounded once to its dtype. Every path refuses a weight that would
dequantize to infinity (``numerics.check_scale_range``: a ScaleOverflowError; the kernel counts
such blocks in the pass it makes anyway). On a CPU weight a version is quantized once:
the entry is keyed on the Parameter's in-place version counter, its storage, dtype, shape, the
spec and a generation counter bumped by every optimizer step and every ``load_state_dict`` into
a QAT layer, so gradient-accumulation micro-batches, eval
forwards and layers sharing a weight reuse it (a tied embedding's lookups fake-quantize only
their rows, see ``QATEmbedding``), while any optimizer step or checkpoint load makes the
next forward quantize afresh. On an accelerator every forward quantizes afresh (proving a reuse
would read a fingerprint back to the host, a synchronisation); nothing there reads a value on
the host: a NaN weight is refused by an asynchronous device assert.

Memory: the entry keeps only the per-block scales until the same version is used a second time,
then its int8 codes (a quarter of a float32 weight). On llama.cpp's grids (q4_0, q8_0, q4_1,
q5_0, q5_1, q4_k, q5_k, q6_k, mxfp4) and nf4 float32 and bfloat16 CPU weights run ``_fused_ggml``'s kernels
(bit for bit the numpy numerics); their entry keeps nothing until a version is reused (a rebuild
runs the kernel again), then the codes and one scale (and offset) per sub-block; the K-quants
always keep them, since their rebuild would repeat the scale search. Without the kernels, q4_0 /
q8_0 keep two scales per block (the unrounded one the codes are rounded with and the float16
one they are multiplied by) and the other block grids run ``BLOCK_NUMERICS``. With an
importance matrix entry (``QATWrapper(importance=)``) a weight is fake-quantized by ggml's
importance-weighted search, bit for bit ``quantize_array(w, spec, importance=)`` (``_fused_ggml``'s
weighted kernels on CPU, keeping the codes; else the torch numerics); the cache key includes the
importance tensor and its version. ``F.linear``
would save the fake-quantized float weight for its backward, a second copy of every weight alive from forward to backward;
``linear`` instead rebuilds that weight in the backward, just for the input gradient, inside the
buffer that then receives the weight gradient.

In-place edits that bypass the version counter (``param.data.add_(...)``, PEFT's
``merge_and_unload``) are caught by a fingerprint of the weight (per-row sums of its bits),
checked whenever a cached version is reused: the first reuse of a version quantizes afresh
and records it. ``mixle.models.qat.invalidate_fake_quant_caches()`` still forces a fresh start.
"""

import functools
import threading
import weakref

import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

from mixle.torch_backend import fused_cpu as _fused_cpu
from mixle.torch_backend import fused_ggml as _fused_ggml
from mixle.core.array_ops import TorchOps, array_ops
from mixle.core.checks import ScaleOverflowError, check_array, check_block_max, not_finite_error, require_finite
from mixle.core.stored import block_quantized_array, check_dequantized_range
from mixle.core.numerics import (
    NARROW_FLOATS,
    QuantizedArray,
    block_shape,
    block_stats,
    check_scale_range,
    dequantize_array,
    fake_quant_forward,
    round_codes,
    stored_scale,
)

# Bumped by every optimizer step and QAT-layer load_state_dict in this process. FSDP2 refills
# its gathered parameters in place while preserving their version counters (and loads into the
# sharded copies), so a version alone does not prove that a weight is unchanged.
_generation = 0


def invalidate_caches(*_):
    """Make every cached fake-quantized weight stale (e.g. after editing weights via ``.data``).

    >>> from mixle.core.spec import QuantSpec
    >>> weight, spec = torch.nn.Parameter(torch.tensor([[7.0, -3.0]])), QuantSpec(bits=4)
    >>> [fake_quantized_weight(weight, spec)[0].tolist() for _ in range(2)]  # codes kept on reuse
    [[[7.0, -3.0]], [[7.0, -3.0]]]
    >>> weight.data[:] = torch.tensor([[-3.0, 7.0]])  # same version and row sums: the cache cannot tell
    >>> fake_quantized_weight(weight, spec)[0].tolist()
    [[7.0, -3.0]]
    >>> invalidate_caches()
    >>> fake_quantized_weight(weight, spec)[0].tolist()
    [[-3.0, 7.0]]
    """
    global _generation
    _generation += 1


register_optimizer_step_post_hook(invalidate_caches)

_OPS = TorchOps()
# Weights whose grid numerics run in float32 (see numerics_input).
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def numerics_input(x):
    """``x`` as the grid numerics see it: bfloat16/float16 in float32, other dtypes as they are.

    >>> numerics_input(torch.ones(2, dtype=torch.bfloat16)).dtype
    torch.float32
    """
    return x.float() if x.dtype in _LOW_PRECISION else x


def _narrow(x):
    """The 16-bit dtype name x's values are rounded to from the float32 numerics, or None."""
    name = _OPS.dtype_name(x)
    return name if name in NARROW_FLOATS else None


def _check_no_bad_blocks(nonfinite, overflow, x, scale, spec):
    """The fused kernel's counts of blocks holding NaN or infinity and of blocks that would
    dequantize to infinity (``check_scale_range``'s rule, on the scales it computed) must be 0."""
    if torch.compiler.is_compiling():
        torch._assert_async(nonfinite == 0, str(not_finite_error(x, "weight")))
        torch._assert_async(overflow == 0, f"weight: on {spec.short()} a block scale times the grid's largest level "
                                           f"overflows {x.dtype}, so a finite weight would dequantize to infinity: "
                                           f"rescale the weights (e.g. halve them and double what they feed)")
    elif int(nonfinite):
        raise not_finite_error(x, "weight")
    elif int(overflow):
        check_dequantized_range(scale, spec, "weight", _narrow(x))  # raises, with the worst scale
        raise ScaleOverflowError(f"weight: on {spec.short()} {int(overflow)} block(s) would dequantize to infinity "
                                 f"in {x.dtype}: rescale the weights (e.g. halve them and double what they feed)")


class _Entry:
    """One version of one weight, quantized: scales, clip thresholds (for clip_gradient) and,
    once the version is reused, the int8 codes and the weight's fingerprint.

    ``scale`` is the scale as stored (what codes are multiplied by); ``code_scale`` the one the
    codes were rounded with, when it differs (grids whose scale is stored in float16, such as
    llama.cpp's: codes use the unrounded scale), else None."""

    __slots__ = ("key", "spec", "scale", "threshold", "codes", "code_scale", "offset", "fingerprint", "importance")

    def __init__(self, key, spec, scale, threshold, codes, code_scale=None, offset=None, importance=None):
        self.key, self.spec, self.scale, self.threshold, self.codes = key, spec, scale, threshold, codes
        self.code_scale = code_scale
        self.offset = offset  # ``_fused_ggml``'s entries: per sub-block, value = code * scale + offset
        self.fingerprint = None
        self.importance = importance  # the importance its codes were searched with (a float32 tensor), or None


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fingerprint(x):
    """``(wrapping integer sum of x's bit patterns, x's row sums)``: a reused entry is trusted
    only while both match, so ``.data`` edits, which leave the version counter alone, are seen.
    Two reads of x, paid only when a version is reused (eval forwards, micro-batches, shared
    weights), never by a plain training step. An edit that keeps both sums (two elements of a
    row swapped) is not seen.

    >>> [t.tolist() for t in _fingerprint(torch.ones(2, 3))]
    [2097152000, [3.0, 3.0]]
    """
    x = x.detach()
    bits = x.view(_BITS[x.element_size()])
    return bits.sum(dtype=torch.int64 if x.element_size() == 8 else torch.int32), x.sum(-1)


def _same_content(entry, x):
    return entry.fingerprint is not None and all(map(torch.equal, entry.fingerprint, _fingerprint(x)))


def _blocks(x, spec):
    return array_ops(x), x.reshape(block_shape(x.shape, spec))


# Functions plugged in for a grid: grid name -> fn(x in float32 or float64, spec) -> the round trip
# of x, same shape and dtype; they run instead of the grid's own numerics and kernels. A grid whose
# record has block numerics (``Grid.numerics``: offsets, second-level scales, llama.cpp's K-quants)
# and nothing plugged in runs ``_block_round_trip``. Their entries keep no scales: a rebuild runs fn again.
BLOCK_NUMERICS = {}


def _block_round_trip(x, spec):
    return fake_quant_forward(x, spec, name="weight")[0]


def _own_numerics(spec):
    """The block-numerics function that fake-quantizes on ``spec``'s grid, or None (the plain numerics)."""
    plugged = BLOCK_NUMERICS.get(spec.grid)
    if plugged is not None:
        return plugged
    return _block_round_trip if spec.grid_record.numerics is not None else None


def _ggml_fused(x, spec, importance=None):
    """Whether ``_fused_ggml``'s kernel fake-quantizes x on spec (llama.cpp's grids), with
    ``importance`` when given (its weighted search)."""
    if importance is not None and (spec.grid not in _fused_ggml.WEIGHTED or importance.device.type != "cpu"):
        return False
    return spec.grid not in BLOCK_NUMERICS and not spec.clip_gradient and _fused_ggml.applies_to(x, spec)


def _quantize_weighted(x, spec, key, importance, out):
    """``_quantize`` with an importance: ggml's weighted search (``quantize_array(x, spec,
    importance=)``, bit for bit, then cast to x's dtype), by ``_fused_ggml``'s kernel where it
    applies (its entry keeps the codes: a rebuild would repeat the search), else by the torch
    numerics (its entry keeps nothing; a rebuild runs them again)."""
    if _ggml_fused(x, spec, importance):
        deq, codes, a, b, nonfinite, overflow = _fused_ggml.fake_quant(x, spec, want_codes=True, out=out,
                                                                       importance=importance)
        if nonfinite:
            raise not_finite_error(x, "weight")
        if not overflow:
            shape = block_shape(x.shape, spec)
            shape = (shape[0], shape[1], a.numel() // (shape[0] * shape[1]))
            return deq, _Entry(key, spec, a.reshape(shape), None, codes, offset=None if b is None else b.reshape(shape),
                               importance=importance)
    check_block_max(x.detach().abs().amax(), x, "weight")  # the search would turn a NaN into codes
    q = block_quantized_array(numerics_input(x.detach()), spec, importance=importance, check=_OPS.readable(x),
                              name="weight")
    deq = q.dequantize().reshape(x.shape).to(x.dtype)
    return deq if out is None else out.copy_(deq), _Entry(key, spec, None, None, None, importance=importance)


def _quantize_ggml(x, spec, key, keep_codes, out):
    """``_quantize`` by ``_fused_ggml``'s kernel, or None where a float16 scale overflows (the torch
    numerics then run, and raise their own error)."""
    keep = keep_codes or spec.grid_record.scale_search is not None  # a rebuild would repeat the search
    deq, codes, a, b, nonfinite, overflow = _fused_ggml.fake_quant(x, spec, want_codes=keep, out=out)
    if nonfinite:
        raise not_finite_error(x, "weight")
    if overflow:
        return None
    if not keep:
        return deq, _Entry(key, spec, None, None, None)
    batch, count, width = block_shape(x.shape, spec)
    shape = (batch, count, a.numel() // (batch * count))  # per sub-block (one per block of 32 but on K-quants)
    return deq, _Entry(key, spec, a.reshape(shape), None, codes, offset=None if b is None else b.reshape(shape))


def _quantize(x, spec, key=None, keep_codes=False, out=None, importance=None):
    """``(fake-quantized x, entry)`` from scratch; the finiteness check reads the block maxima.
    The fused kernel writes into ``out`` when given (a dead buffer shaped like x). ``importance``:
    the weighted search's (``_quantize_weighted``), or None. An ``out`` in another dtype than x (bfloat16
    for a float32 x) is written by the fused kernels directly (``_writes_operand``), else copied into."""
    if out is not None and out.dtype != x.dtype and not _writes_operand(x, spec, importance):
        deq, entry = _quantize(x, spec, key, keep_codes, None, importance)
        return out.copy_(deq), entry
    if importance is not None:
        return _quantize_weighted(x, spec, key, importance, out)
    if _ggml_fused(x, spec):
        done = _quantize_ggml(x, spec, key, keep_codes, out)
        if done is not None:
            return done
    own = _own_numerics(spec)
    if own is not None:
        # The block searches would turn a NaN into codes: refuse it (a device assert off the host).
        check_block_max(x.detach().abs().amax(), x, "weight")
        deq = own(numerics_input(x), spec).to(x.dtype)
        if x.dtype == torch.float16:  # float16 scales times codes can pass float16's largest value
            require_finite(deq, ScaleOverflowError(f"weight: on grid={spec.grid!r} a block's largest level overflows "
                                                   f"float16, so a finite weight would dequantize to infinity: rescale "
                                                   f"the weights, or quantize a float32 copy"))
        return deq, _Entry(key, spec, None, None, None)
    if _fused_cpu.applies_to(x, spec):
        deq, codes, scale, threshold, nonfinite, overflow = _fused_cpu.fake_quant(
            x, spec, want_codes=keep_codes, want_threshold=spec.clip_gradient, out=out)
        _check_no_bad_blocks(nonfinite, overflow, x, scale, spec)
        return deq, _Entry(key, spec, scale, threshold, codes, None)
    ops, blocks = _blocks(numerics_input(x), spec)
    scale, threshold, block_max = block_stats(ops, blocks, spec, with_max=True)
    check_block_max(block_max, x, "weight")  # a device assert on accelerators and under torch.compile
    codes = round_codes(ops, blocks, scale, spec)
    stored = stored_scale(ops, scale, spec, "weight")
    check_scale_range(ops, stored, spec, "weight", _narrow(x))
    codes_kept = ops.to_int8(codes).reshape(x.shape) if keep_codes else None
    entry = _Entry(key, spec, stored, threshold if spec.clip_gradient else None, codes_kept,
                   None if stored is scale else scale)
    return codes.mul_(stored).reshape(x.shape).to(x.dtype), entry


def _rebuild(entry, x, keep_codes=False, out=None):
    """The fake-quantized weight of an entry: from its int8 codes, else from x and its scales;
    written into ``out`` (shaped like x; in x's dtype, or bfloat16 for a float32 x) when given."""
    fused = _fused_cpu.applies_to(x, entry.spec)
    if entry.scale is None:  # a grid of BLOCK_NUMERICS, or fused on llama.cpp's grids without codes kept
        deq = _quantize(x, entry.spec, out=out, importance=entry.importance)[0]
    elif entry.codes is not None and _is_ggml(entry):
        offset = None if entry.offset is None else entry.offset.reshape(-1)
        return _fused_ggml.dequantize(entry.codes, entry.scale.reshape(-1).float(), offset,
                                      x.dtype if out is None else out.dtype, out=out, grid=entry.spec.grid)
    elif entry.codes is not None:
        if fused:
            return _fused_cpu.dequantize(entry.codes, entry.scale, entry.spec, out=out, dtype=x.dtype,
                                         weight_dtype=x.dtype)
        deq = dequantize_array(QuantizedArray(entry.codes, entry.scale, entry.spec)).to(x.dtype)
    elif fused:  # rounded with the scale the codes were computed with (float32 for a bf16 weight)
        code_scale = entry.scale if entry.code_scale is None else entry.code_scale
        deq, entry.codes, *_ = _fused_cpu.fake_quant(x, entry.spec, scale=code_scale,
                                                     want_codes=keep_codes, out=out)
        return deq
    else:
        ops, blocks = _blocks(numerics_input(x), entry.spec)
        code_scale = entry.scale if entry.code_scale is None else entry.code_scale
        codes = round_codes(ops, blocks, code_scale, entry.spec)
        if keep_codes:
            entry.codes = ops.to_int8(codes).reshape(x.shape)
        deq = codes.mul_(entry.scale).reshape(x.shape).to(x.dtype)
    return deq if out is None or deq is out else out.copy_(deq)


def _is_ggml(entry):
    """An entry of ``_fused_ggml``'s kernel: codes times a scale per sub-block (plus an offset on
    grids with a min), rounded with no other scale (the torch path's q4_0 / q8_0 entries keep one)."""
    return entry.spec.grid_record.kernel is not None and entry.code_scale is None


def _clip_mask_grad(grad, x, spec, threshold, out=None):
    """The clip_gradient STE's gradient: ``grad`` where ``|w| <= threshold`` per block, else 0;
    the fused kernel writes it into ``out`` when given (which may be ``grad`` itself)."""
    # Under backward(create_graph=True) the product must stay differentiable: torch ops then.
    if (not torch.is_grad_enabled() and _fused_cpu.applies_to(x, spec) and grad.dtype == x.dtype
            and grad.device == x.device):
        return _fused_cpu.clip_mask_grad(grad, x, threshold, spec, out=out)
    _, blocks = _blocks(x, spec)
    return grad * (abs(blocks) <= threshold).reshape(x.shape)


class _WeightCache:
    """The fake-quantized state of one Parameter, shared by every QAT layer that uses it."""

    __slots__ = ("param", "entry", "uses", "__weakref__")

    def __init__(self, param):
        self.param = weakref.ref(param, functools.partial(_forget, id(param)))
        self.entry, self.uses = None, 0

    def lookup(self, x, spec, shared, out=None, importance=None):
        """``(fake-quantized x, entry)``, reusing the entry while x is unchanged (and the
        ``importance`` it was searched with, if any, is the same tensor, unchanged).

        The int8 codes are kept only once a version is used twice (or the weight is ``shared``
        by several layers, or the previous version was reused), so a plain training loop, which
        uses each version once, holds nothing but the scales. A weight the host cannot read
        (on an accelerator) is quantized afresh every time: no fingerprint is read back.
        """
        if not _OPS.readable(x):
            self.entry, self.uses = None, 0
            deq, self.entry = _quantize(x, spec, importance=importance)
            return deq, self.entry
        key = (_generation, x._version, x.data_ptr(), x.dtype, x.device, x.shape, x.stride(), spec,
               None if importance is None else (id(importance), importance._version, importance.data_ptr()))
        entry = self.entry
        if entry is not None and entry.key == key:
            self.uses += 1
            if _same_content(entry, x):
                return _rebuild(entry, x, keep_codes=True, out=out), entry
            # The first reuse of this version, or its content changed behind the version counter
            # (a ``.data`` edit, e.g. PEFT's merge_and_unload): quantize afresh and keep the codes.
            uses, keep = self.uses, True
        else:
            uses, keep = 1, shared or self.uses > 1
        self.entry = None  # free a stale entry's codes before quantizing again
        deq, self.entry = _quantize(x, spec, key, keep, out, importance)
        if keep:
            self.entry.fingerprint = _fingerprint(x)
        self.uses = uses
        return deq, self.entry


_CACHES = {}  # id(Parameter) -> _WeightCache; dropped with the Parameter


def _forget(ident, ref):
    cache = _CACHES.get(ident)
    if cache is not None and cache.param is ref:
        del _CACHES[ident]


def _cache_of(param):
    cache = _CACHES.get(id(param))
    if cache is None or cache.param() is not param:
        cache = _CACHES[id(param)] = _WeightCache(param)
    return cache


class _FakeQuantSTE(torch.autograd.Function):
    """Forward: quantize-dequantize. Backward: identity, or masked where percentile-clipped."""

    @staticmethod
    def forward(ctx, x, spec, cache=None, shared=False, importance=None):
        if cache is None:
            deq, entry = _quantize(x, spec, importance=importance)
        else:
            deq, entry = cache.lookup(x, spec, shared, importance=importance)
        ctx.spec = spec
        if spec.clip_gradient:
            # The mask is recomputed in backward from x (saved, no copy) and the tiny thresholds.
            ctx.save_for_backward(x)
            ctx.threshold = entry.threshold
        return deq

    @staticmethod
    def backward(ctx, grad):
        if ctx.spec.clip_gradient:
            (x,) = ctx.saved_tensors
            grad = _clip_mask_grad(grad, x, ctx.spec, ctx.threshold)
        return grad, None, None, None, None


def fake_quantize(x, spec):
    """Fake-quantize a torch tensor with the straight-through estimator.

    >>> from mixle.core.spec import QuantSpec
    >>> fake_quantize(torch.tensor([0.7, 0.1]), QuantSpec(bits=4)).tolist()
    [0.699999988079071, 0.10000000149011612]
    """
    check_array(x, finite=False)  # type and size; finiteness is read from the block maxima
    return _FakeQuantSTE.apply(x, spec)


def fake_quantized_weight(param, spec, *, shared=False, output_axis=0, importance=None):
    """``(fake-quantized param with STE gradient, entry)``, cached per version of ``param``.

    ``importance`` (a float32 tensor, one value per input column; llama.cpp's grids with a
    weighted search, see ``mixle.core.ggml_weighted``): the weight is quantized by ggml's
    importance-weighted search, bit for bit ``quantize_array(param, spec, importance=...)``.

    ``output_axis=1`` (a weight stored ``(in, out)``, e.g. transformers' Conv1D) quantizes and
    returns the ``(out, in)`` transpose. Under ``torch.compile`` the cache is bypassed (the
    compiled graph recomputes and fuses it), and for inference tensors, which have no version
    counter, and for weights on an accelerator (see ``_WeightCache.lookup``).
    """
    if param.is_meta:  # no values to quantize: shapes only, as the float layer gives
        return param, None
    check_array(param, "weight", finite=False)
    x = param.t() if output_axis == 1 else param
    if not _OPS.readable(param) or param.is_inference():  # not readable also while compiling
        return _FakeQuantSTE.apply(x, spec, None, False, importance), None
    cache = _cache_of(param)
    return _FakeQuantSTE.apply(x, spec, cache, shared, importance), cache.entry


class _SpareBuffer(threading.local):
    """Dead weight-sized buffers per thread, one of each size (four at most), recycled between QAT linear layers.

    A training step allocates a fake-quantized weight per layer in forward (dead right after
    its matmul) and a weight gradient per layer in backward. Fresh multi-megabyte buffers come
    from the OS as zeroed pages, paid for with a page fault per 4 KiB. Here each forward hands
    its dead buffer on to the next forward of a weight of the same size (a transformer's blocks
    have three or four sizes, so after the first block no forward allocates), and what is held
    when the backward starts, the last forwards' buffers, is what the backwards take as their
    weight gradients; a buffer that still holds that layer's fake-quantized weight is not
    rebuilt. At most one buffer of a size and four in all, none kept past an optimizer step.
    """

    CAPACITY = 4

    def __init__(self):
        self.held = []  # [(storage, cache entry whose fake-quantized weight it holds)], oldest first

    def take(self, like, holding=None, dtype=None):
        """``(tensor shaped like `like` (in ``dtype``, default its own) on a dead buffer of exactly its
        size, or None, whether it holds ``holding``'s fake-quantized weight)``."""
        dtype = dtype or like.dtype
        nbytes = like.numel() * dtype.itemsize
        fits = [i for i, (storage, _) in enumerate(self.held)
                if storage.nbytes() == nbytes and storage.device == like.device]
        if not fits:
            return None, False
        mine = [i for i in fits if holding is not None and self.held[i][1] is holding]
        storage, _ = self.held.pop((mine or fits)[0])
        # A fresh tensor on the storage, not a view: nothing else keeps the buffer alive.
        return torch.empty(0, dtype=dtype, device=like.device).set_(storage, 0, like.shape), bool(mine)

    def give(self, tensor, holds=None):
        """Keep ``tensor``'s buffer for reuse, if no other tensor shares its storage; ``holds``:
        the cache entry whose fake-quantized weight it is. An older buffer of its size, and the
        oldest beyond four, are freed."""
        # Only buffers this module allocated reach here (a fused kernel's output, never handed
        # to the caller or saved for backward), so no other tensor can share the storage.
        if tensor.storage_offset() == 0:
            storage = tensor.untyped_storage()
            self.held = [(kept, entry) for kept, entry in self.held
                         if kept.nbytes() != storage.nbytes() or kept.device != storage.device]
            self.held.append((storage, holds))
            del self.held[:-self.CAPACITY]

    def drop(self, *_):
        """Free the held buffers: after each optimizer step, so none outlives a training step."""
        self.held.clear()


_spare = _SpareBuffer()
register_optimizer_step_post_hook(_spare.drop)


class _QATLinear(torch.autograd.Function):
    """The training QAT linear as one autograd node: ``F.linear(x, fake_quant(weight), bias)``
    with the straight-through weight gradient, saving only x.

    ``F.linear`` on a fake-quantized weight would save that weight for backward, a second copy
    of every weight alive from forward to backward; here backward rebuilds it, just for the
    input gradient, inside the buffer that then receives the weight gradient. Under autocast
    the products run in ``dtype`` (autocast's): the forward's ``F.linear`` casts as autocast
    does, and the backward casts x and the rebuilt weight the same way; where a fused kernel
    writes that cast itself (``_operand_dtype``), the weight is fake-quantized and rebuilt
    straight into it.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, spec, cache, dtype, importance=None):
        if importance is None:
            fused = _fused_cpu.applies_to(weight, spec) or _ggml_fused(weight, spec)
        else:
            fused = _ggml_fused(weight, spec, importance)
        deq_dtype = _operand_dtype(weight, spec, dtype, importance)
        out = _take_buffer(weight, deq_dtype, fused)[0]
        deq, entry = cache.lookup(weight, spec, False, out, importance)
        x_dtype, x = x.dtype, x.to(dtype)  # autocast's cast of x, saved below as autocast saves it
        y = F.linear(x, deq, bias)  # under autocast: the bf16 cast of the fake-quantized weight
        if fused:
            _spare.give(deq, holds=entry)  # dead now: nothing saved it
        del deq
        ctx.weight, ctx.version, ctx.entry, ctx.fused = weight, weight._version, entry, fused
        ctx.dtype, ctx.x_dtype, ctx.bias_dtype = dtype, x_dtype, None if bias is None else bias.dtype
        ctx.deq_dtype = deq_dtype
        if ctx.needs_input_grad[1]:
            ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, grad):
        weight, entry, dtype = ctx.weight, ctx.entry, ctx.dtype
        if weight._version != ctx.version:
            raise RuntimeError(
                "a QAT layer's weight was modified in place between its forward and backward "
                "(one of the variables needed for gradient computation has been modified by an "
                "inplace operation): run backward before changing the weight"
            )
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        flat = grad.reshape(-1, grad.shape[-1])
        if need_w:
            (x,) = ctx.saved_tensors
            x = x.reshape(-1, x.shape[-1])
        if torch.is_grad_enabled():  # backward(create_graph=True): differentiable torch ops
            grad_x = grad.matmul(_FakeQuantSTE.apply(weight, entry.spec, None, False, entry.importance).to(dtype)) \
                if need_x else None
            grad_w = flat.t().mm(x).to(weight.dtype) if need_w else None
        else:
            grad_x, grad_w = _backward_products(ctx, grad, flat, x if need_w else None, need_x)
        if grad_w is not None and entry.spec.clip_gradient:  # grad_w is ours: masked in place
            grad_w = _clip_mask_grad(grad_w, weight.detach(), entry.spec, entry.threshold, out=grad_w)
        grad_x = None if grad_x is None else grad_x.to(ctx.x_dtype)
        grad_b = flat.sum(0).to(ctx.bias_dtype) if need_b else None
        return grad_x, grad_w, grad_b, None, None, None, None


def _backward_products(ctx, grad, flat, x, need_x):
    """``(input gradient, weight gradient)`` of ``_QATLinear``, either None where not needed.

    The weight gradient's buffer first holds the fake-quantized weight: one weight-sized
    allocation (and its first-touch page faults) less per layer and step, and no rebuild at all
    for a recycled buffer that still holds it. Where the weight is fake-quantized into autocast's
    bfloat16 (``_operand_dtype``) that buffer is the matmul's operand only, recycled after it.
    """
    weight, entry, dtype, deq_dtype = ctx.weight, ctx.entry, ctx.dtype, ctx.deq_dtype
    buffer = grad_x = grad_w = None
    if need_x:
        buffer, holds = _take_buffer(weight, deq_dtype, ctx.fused, holding=entry)
        if not holds:
            buffer = _rebuild(entry, weight.detach(), out=buffer)
        grad_x = grad.matmul(buffer.to(dtype))
        if buffer.dtype != weight.dtype:  # the matmul operand alone (autocast): dead now, recycled
            if ctx.fused:
                _spare.give(buffer)
            buffer = None
    if x is not None:
        if buffer is None:
            grad_w = flat.t().mm(x).to(weight.dtype)
        elif dtype == weight.dtype:
            grad_w = torch.mm(flat.t(), x, out=buffer)
        else:  # autocast: the product in its dtype, as F.linear's backward computes it
            grad_w = buffer.copy_(flat.t().mm(x))
    return grad_x, grad_w


def _take_buffer(weight, dtype, fused, holding=None):
    """``(buffer shaped like weight in dtype, or None, whether it holds holding's fake-quantized weight)``:
    a recycled one where a fused kernel writes it, else a new one only where dtype is not the weight's
    (a kernel writes bfloat16 only into a given buffer; in the weight's own dtype it allocates one)."""
    buffer, holds = _spare.take(weight, holding=holding, dtype=dtype) if fused else (None, False)
    if buffer is None and dtype != weight.dtype:
        buffer = torch.empty_like(weight, dtype=dtype)
    return buffer, holds


def _writes_operand(x, spec, importance=None):
    """Whether a fused kernel fake-quantizes x (float32) straight into bfloat16: llama.cpp's grids'
    (``_fused_ggml``) or the plain grids' (``_fused_cpu``), which write the values the cast would give."""
    return _ggml_fused(x, spec, importance) or (importance is None and _fused_cpu.applies_to(x, spec))


def _operand_dtype(weight, spec, dtype, importance):
    """The dtype ``_QATLinear`` fake-quantizes ``weight`` into: autocast's bfloat16 for a float32 weight
    on a kernel that writes it (``_writes_operand``: no float32 copy and cast), else the weight's own."""
    if dtype == torch.bfloat16 and weight.dtype == torch.float32 and _writes_operand(weight, spec, importance):
        return dtype
    return weight.dtype


def _matmul_dtype(x, weight, bias):
    """The dtype ``F.linear(x, weight, bias)`` multiplies in, for the mixes ``_QATLinear`` takes:
    one dtype without autocast; autocast's from float32 or its own dtype under it. Else None."""
    device = x.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        allowed = (torch.float32, dtype)
    else:
        dtype, allowed = x.dtype, (x.dtype,)
    if x.dtype in allowed and weight.dtype in allowed and (bias is None or bias.dtype in allowed):
        return dtype
    return None


def linear(x, weight, bias, spec, importance=None):
    """``F.linear`` with a fake-quantized ``weight``, keeping no float copy of it for backward.
    ``importance``: as for ``fake_quantized_weight``.

    The quantized weight comes from the per-version cache; training runs as one autograd node
    (``_QATLinear``), under autocast too (the products see autocast's cast of the fake-quantized
    weight, as ``F.linear`` would). Under torch.compile, no-grad or mixed dtypes the stock
    ``F.linear`` runs on the same fake-quantized weight (on meta tensors, which have no values,
    it gives the float layer's shapes).

    >>> from mixle.core.spec import QuantSpec
    >>> w = torch.nn.Parameter(torch.tensor([[0.7, -0.35]]))
    >>> linear(torch.ones(1, 2), w, None, QuantSpec(bits=4)).tolist()
    [[0.29999998211860657]]
    """
    if (torch.compiler.is_compiling() or weight.is_inference() or not torch.is_grad_enabled() or weight.is_meta
            or x.is_meta or (dtype := _matmul_dtype(x, weight, bias)) is None):
        return F.linear(x, fake_quantized_weight(weight, spec, importance=importance)[0], bias)
    check_array(weight, "weight", finite=False)
    return _QATLinear.apply(x, weight, bias, spec, _cache_of(weight), dtype, importance)
