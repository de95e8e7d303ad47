"""The fake-quant engine: the torch straight-through fake-quant op, its per-Parameter cache and memory-light saving.

Its rooms: ``dispatch`` (which numerics quantize a weight, and rebuilding it), ``cache`` (the
per-weight cache and the optimizer hooks it installs), ``buffers`` (the buffer pool) and ``autograd``
(the straight-through node and the QAT linear). This face re-exports what the layers use.

The numerics are ``mixle.core.numerics``'s (block view, scales, rounding, dequantize); this
module only decides when they run, and on contiguous float32/float64/bfloat16 CPU weights runs them as
``kernels.fused_cpu``'s kernels (one pass per block, bit-identical; the tests run both paths). The
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
q5_0, q5_1, q4_k, q5_k, q6_k, mxfp4) and nf4 float32 and bfloat16 CPU weights run ``fused_ggml``'s kernels
(bit for bit the numpy numerics); their entry keeps nothing until a version is reused (a rebuild
runs the kernel again), then the codes and one scale (and offset) per sub-block; the K-quants
always keep them, since their rebuild would repeat the scale search. Without the kernels, q4_0 /
q8_0 keep two scales per block (the unrounded one the codes are rounded with and the float16
one they are multiplied by) and the other block grids run ``BLOCK_NUMERICS``. With an
importance matrix entry (``QATWrapper(importance=)``) a weight is fake-quantized by ggml's
importance-weighted search, bit for bit ``quantize_array(w, spec, importance=)`` (``fused_ggml``'s
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

from mixle.torch_backend.fake_quant.autograd import fake_quantize, fake_quantized_weight, linear
from mixle.torch_backend.fake_quant.cache import install_optimizer_hooks, invalidate_caches
from mixle.torch_backend.fake_quant.dispatch import BLOCK_NUMERICS, numerics_input

__all__ = ["fake_quantize", "fake_quantized_weight", "linear", "invalidate_caches", "install_optimizer_hooks",
           "BLOCK_NUMERICS", "numerics_input"]
