"""The fake-quant engine's per-weight cache: one entry per version of each Parameter.

An entry is keyed on the Parameter's in-place version counter, its storage, dtype, shape, the
spec (and importance) and a generation counter that every optimizer step and every
``load_state_dict`` into a QAT layer bumps (``invalidate_caches``); a reused entry is trusted only
while the weight's fingerprint matches. ``install_optimizer_hooks`` registers the optimizer-step
hooks (the generation bump and the buffer pool's release); ``cache_of`` calls it when it makes the
first cache, so it runs once, before any entry or buffer exists.
"""

import functools
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from mixle.core.array_ops import TorchOps
from mixle.torch_backend.fake_quant.buffers import spare_buffers
from mixle.torch_backend.fake_quant.dispatch import quantize, rebuild

__all__ = ["invalidate_caches", "install_optimizer_hooks", "WeightCache", "cache_of"]

_OPS = TorchOps()

# Bumped by every optimizer step and QAT-layer load_state_dict in this process. FSDP2 refills
# its gathered parameters in place while preserving their version counters (and loads into the
# sharded copies), so a version alone does not prove that a weight is unchanged.
_generation = 0


def invalidate_caches(*_):
    """Make every cached fake-quantized weight stale (e.g. after editing weights via ``.data``).

    >>> from mixle.core.spec import QuantSpec
    >>> from mixle.torch_backend.fake_quant import fake_quantized_weight
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


class WeightCache:
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
            deq, self.entry = quantize(x, spec, importance=importance)
            return deq, self.entry
        key = (_generation, x._version, x.data_ptr(), x.dtype, x.device, x.shape, x.stride(), spec,
               None if importance is None else (id(importance), importance._version, importance.data_ptr()))
        entry = self.entry
        if entry is not None and entry.key == key:
            self.uses += 1
            if _same_content(entry, x):
                return rebuild(entry, x, keep_codes=True, out=out), entry
            # The first reuse of this version, or its content changed behind the version counter
            # (a ``.data`` edit, e.g. PEFT's merge_and_unload): quantize afresh and keep the codes.
            uses, keep = self.uses, True
        else:
            uses, keep = 1, shared or self.uses > 1
        self.entry = None  # free a stale entry's codes before quantizing again
        deq, self.entry = quantize(x, spec, key, keep, out, importance)
        if keep:
            self.entry.fingerprint = _fingerprint(x)
        self.uses = uses
        return deq, self.entry


_CACHES = {}  # id(Parameter) -> WeightCache; dropped with the Parameter


def _forget(ident, ref):
    cache = _CACHES.get(ident)
    if cache is not None and cache.param is ref:
        del _CACHES[ident]


def cache_of(param):
    """The ``WeightCache`` of ``param`` (made on first use; the first one installs the optimizer hooks).

    >>> weight = torch.nn.Parameter(torch.ones(2, 2))
    >>> cache_of(weight) is cache_of(weight), cache_of(weight).entry
    (True, None)
    """
    cache = _CACHES.get(id(param))
    if cache is None or cache.param() is not param:
        install_optimizer_hooks()
        cache = _CACHES[id(param)] = WeightCache(param)
    return cache


_HOOKS = []  # the handles of the hooks install_optimizer_hooks registered


def install_optimizer_hooks():
    """Register, once per process, the optimizer-step hooks the engine relies on: every step
    makes the cached entries stale (``invalidate_caches``) and frees the pooled buffers
    (``spare_buffers.drop``). ``cache_of`` calls it before the first entry or buffer can exist,
    so no step is missed; calling it again does nothing. Returns the hooks' handles.

    >>> handles = install_optimizer_hooks()
    >>> install_optimizer_hooks() is handles, len(handles)
    (True, 2)
    """
    if not _HOOKS:
        _HOOKS.extend(register_optimizer_step_post_hook(hook) for hook in (invalidate_caches, spare_buffers.drop))
    return _HOOKS


