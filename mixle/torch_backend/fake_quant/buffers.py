"""The fake-quant engine's buffer pool: dead weight-sized buffers recycled between QAT linear layers."""

import threading

import torch

__all__ = ["spare_buffers", "take_buffer"]


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


spare_buffers = _SpareBuffer()


def take_buffer(weight, dtype, fused, holding=None):
    """``(buffer shaped like weight in dtype, or None, whether it holds holding's fake-quantized weight)``:
    a recycled one where a fused kernel writes it, else a new one only where dtype is not the weight's
    (a kernel writes bfloat16 only into a given buffer; in the weight's own dtype it allocates one).

    >>> buffer, holds = take_buffer(torch.ones(2, 2), torch.bfloat16, fused=False)
    >>> buffer.dtype, holds
    (torch.bfloat16, False)
    """
    buffer, holds = spare_buffers.take(weight, holding=holding, dtype=dtype) if fused else (None, False)
    if buffer is None and dtype != weight.dtype:
        buffer = torch.empty_like(weight, dtype=dtype)
    return buffer, holds
