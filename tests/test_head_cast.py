"""head_cast_once: a frozen head's bfloat16 copy made once gives autocast's logits and gradients bit for bit."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mixle.lm.head_cast import head_cast_once  # noqa: E402


def _student(seed=0):
    """A tiny Llama with its head tied to the embedding, both frozen, the decoder layers trained."""
    torch.manual_seed(seed)
    lm = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        tie_word_embeddings=True))
    lm.requires_grad_(False)
    lm.model.layers.requires_grad_(True)
    return lm


def _step(lm, ids):
    """Logits and the decoder's gradients of one bfloat16 autocast forward and backward."""
    lm.zero_grad(set_to_none=True)
    with torch.autocast("cpu", torch.bfloat16):
        logits = lm(ids).logits
    logits.float().square().mean().backward()
    return logits.detach(), [p.grad for p in lm.model.layers.parameters()]


def test_logits_and_gradients_are_autocasts_bit_for_bit_and_follow_an_in_place_change():
    lm, ids = _student(), torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    plain_logits, plain_grads = _step(lm, ids)
    with head_cast_once(lm, torch.bfloat16):
        assert "forward" in vars(lm.lm_head)
        for _ in range(2):  # the second step reuses the copy
            logits, grads = _step(lm, ids)
            assert torch.equal(logits, plain_logits) and all(map(torch.equal, grads, plain_grads))
        with torch.no_grad():
            lm.model.embed_tokens.weight.mul_(0.5)  # the tied table changed in place: the copy is made again
        halved, _ = _step(lm, ids)
        with torch.no_grad():
            float32 = lm(ids).logits  # outside autocast: the float32 product, as without the context
    assert "forward" not in vars(lm.lm_head) and lm.lm_head.weight is lm.model.embed_tokens.weight
    assert torch.equal(halved, _step(lm, ids)[0])
    assert not torch.equal(halved, plain_logits)
    with torch.no_grad():
        assert float32.dtype == torch.float32 and torch.equal(float32, lm(ids).logits)


def test_a_trained_head_runs_autocasts_own_product_and_no_dtype_changes_nothing():
    lm, ids = _student(), torch.arange(12)[None]
    with head_cast_once(lm, None):
        assert "forward" not in vars(lm.lm_head)
    lm.lm_head.weight.requires_grad_(True)  # the tied table trains: its rounding changes at every step
    plain = _step(lm, ids)[0], lm.lm_head.weight.grad
    with head_cast_once(lm, torch.bfloat16):
        logits = _step(lm, ids)[0]
    # the product is autocast's, through the trained weight (a copy would give it no gradient)
    assert torch.equal(logits, plain[0]) and torch.equal(lm.lm_head.weight.grad, plain[1])
