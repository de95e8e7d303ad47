"""A frozen output head's product under autocast, from a copy of its weight cast once.

Under bfloat16 autocast every call of a Linear casts its float32 weight to bfloat16; for a head tied to
a large embedding (Gemma 3: 262,144 x 640) that cast is a pass over the whole table at every forward.
While the head is frozen its bfloat16 rounding never changes, so ``head_cast_once`` makes it once
and the product uses it: autocast's cast is that same rounding, so logits and gradients are the same
bit for bit. The model's parameters, its tie and its state dict are untouched.
"""

import contextlib

__all__ = ["head_cast_once"]


@contextlib.contextmanager
def head_cast_once(model, dtype):
    """While active, ``model``'s output head (``get_output_embeddings()``), a plain ``torch.nn.Linear``,
    computes its product under autocast to ``dtype`` from a ``dtype`` copy of its weight and bias made
    once (again if one is replaced or changed in place) while neither trains. Outside autocast to
    ``dtype``, with a trained weight or bias, or with ``dtype`` None, it runs as before.

    Args:
        model: a transformers causal LM (or any module with ``get_output_embeddings``).
        dtype: the autocast dtype (``torch.bfloat16``), or None (nothing changes).

    >>> import torch, transformers
    >>> lm = transformers.LlamaForCausalLM(transformers.LlamaConfig(
    ...     vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    >>> _ = lm.requires_grad_(False)
    >>> ids = torch.arange(8)[None]
    >>> with torch.autocast("cpu", torch.bfloat16):
    ...     plain = lm(ids).logits
    ...     with head_cast_once(lm, torch.bfloat16):
    ...         once = lm(ids).logits
    >>> torch.equal(plain, once), "forward" in vars(lm.lm_head)
    (True, False)
    """
    import torch

    head = model.get_output_embeddings() if dtype is not None and hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear or "forward" in vars(head):
        yield
        return
    copies = {}

    def forward(x):
        tensors = [t for t in (head.weight, head.bias) if t is not None]
        device = x.device.type
        if (any(t.requires_grad for t in tensors) or not torch.is_autocast_enabled(device)
                or torch.get_autocast_dtype(device) != dtype):
            return torch.nn.Linear.forward(head, x)
        key = tuple((id(t), t.data_ptr(), t._version) for t in tensors)
        if copies.get("key") != key:
            copies.update(key=key, tensors=[t.detach().to(dtype) for t in tensors])
        weight, *bias = copies["tensors"]
        return torch.nn.functional.linear(x, weight, *bias)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward
