"""Training Flax NNX models with QAT under nnx.jit + optax, and QAT beating PTQ at int4 on the corpus."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
pytest.importorskip("qwix")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from mixle.models.qat import apply_qat, get_qat_report, set_fake_quant_enabled  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def cross_entropy(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


@nnx.jit
def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(cross_entropy)(model, x, y)
    optimizer.update(model, grads)
    return loss, grads


@nnx.jit
def evaluate(model, x, y):
    return cross_entropy(model, x, y)


def kernel_grads(grads):
    """{path: max |grad|} for every parameter with two or more axes except biases."""
    return {".".join(map(str, p)): float(jnp.abs(v.get_value()).max())
            for p, v in nnx.to_flat_state(nnx.state(grads, nnx.Param))
            if v.get_value().ndim >= 2 and p[-1] != "bias"}


def assert_float32_params(model):
    dtypes = {v.get_value().dtype for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert dtypes == {jnp.dtype(jnp.float32)}


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(12, 32, rngs=rngs)
        self.fc2 = nnx.Linear(32, 32, rngs=rngs)
        self.head = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.gelu(self.fc2(jax.nn.gelu(self.fc1(x)))))


def test_nnx_mlp_trains_with_qat_under_jit_with_an_optimizer_built_before_apply_qat():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((128, 12)), jnp.float32)
    y = jnp.asarray(np.argmax(np.asarray(x)[:, :4] + 0.5 * np.asarray(x)[:, 4:8], axis=1))
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)  # before apply_qat: still valid
    apply_qat(model, bits=4, group_size=4, example_inputs=(x[:2],))
    assert get_qat_report(model).wrapped == ["fc1.kernel", "fc2.kernel", "head.kernel"]
    losses = []
    for step in range(30):
        loss, grads = train_step(model, optimizer, x, y)
        losses.append(float(loss))
        if step == 0:
            assert all(g > 0 for g in kernel_grads(grads).values()) and len(kernel_grads(grads)) == 3
    assert losses[-1] < 0.5 * losses[0], losses
    assert_float32_params(model)
    assert int(optimizer.step[...]) == 30


# ------------------------------------------------------------------------------- corpus LM

SEQ, WIDTH = 32, 32


class Block(nnx.Module):
    def __init__(self, d, rngs):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=d, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class TinyLM(nnx.Module):
    """Token + learned position embeddings, one block, and a head tied to the token embedding."""

    def __init__(self, vocab, rngs):
        self.emb = nnx.Embed(vocab, WIDTH, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (SEQ, WIDTH)))
        self.block = Block(WIDTH, rngs)
        self.ln = nnx.LayerNorm(WIDTH, rngs=rngs)

    def __call__(self, ids):
        x = self.emb(ids) + self.pos[...][: ids.shape[1]]
        return self.emb.attend(self.ln(self.block(x, nnx.make_causal_mask(ids))))


def windows(ids, count, batch, seed, length=SEQ):
    """``count`` batches of (inputs, next-token targets) at random offsets of a token stream."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        starts = rng.integers(0, len(ids) - length - 1, batch)
        index = starts[:, None] + np.arange(length)
        yield jnp.asarray(ids[index]), jnp.asarray(ids[index + 1])


@pytest.fixture(scope="module")
def corpus():
    from mixle.lm.data import load_splits

    return load_splits()


def test_transformer_with_tied_head_trains_with_qat(corpus):
    train, held, tokenizer = corpus
    held_x, held_y = next(windows(held, 1, 128, seed=99))
    model = TinyLM(tokenizer.vocab_size, nnx.Rngs(0))
    apply_qat(model, bits=4, example_inputs=(held_x[:2],))
    report = get_qat_report(model)
    assert report["emb.embedding"].action == "wrapped" and "tied" in report["emb.embedding"].note
    assert report.skipped == ["pos"]  # added, never multiplied: reported with the reason
    assert len(report.wrapped) == 7  # query, key, value, out, up, down and the tied head
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
    before = float(evaluate(model, held_x, held_y))
    losses = []
    for step, (x, y) in enumerate(windows(train, 30, 16, seed=0)):
        loss, grads = train_step(model, optimizer, x, y)
        losses.append(float(loss))
        if step == 0:
            first = kernel_grads(grads)
    assert set(first) == {d.path for d in report.decisions}
    assert all(g > 0 for g in first.values()), first
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses
    assert float(evaluate(model, held_x, held_y)) < before - 0.5
    assert_float32_params(model)


CONTEXT = 8


class MLPLM(nnx.Module):
    """Next character from the previous eight: embedding, one hidden layer, output layer."""

    def __init__(self, vocab, rngs, width=16, hidden=256):
        self.emb = nnx.Embed(vocab, width, rngs=rngs)
        self.fc = nnx.Linear(CONTEXT * width, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, vocab, rngs=rngs)

    def __call__(self, ids):
        return self.out(jax.nn.gelu(self.fc(self.emb(ids).reshape(ids.shape[0], -1))))


def last_token(batches):
    for x, y in batches:
        yield x, y[:, -1]


PRETRAIN, FINETUNE = 300, 100
SPEC = dict(bits=4, granularity="tensor")  # int4 with one scale per tensor, where PTQ hurts most


def test_qat_beats_ptq_at_int4_on_the_embedded_corpus(corpus):
    """Float pretraining, then 100 more steps either in float (then PTQ) or with QAT.

    Both fine-tunings use the same batches and a cosine decay to zero; PTQ and QAT use the same
    grid. Measured here (seed 0): float 2.015, PTQ 2.061, float fine-tuned 1.890 -> PTQ 1.942,
    QAT 1.915; seed 1 gave the same ordering (QAT ahead of PTQ by 0.025).
    """
    train, held, tokenizer = corpus
    held_x, held_y = next(last_token(windows(held, 1, 4096, seed=99, length=CONTEXT)))
    model = MLPLM(tokenizer.vocab_size, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    for x, y in last_token(windows(train, PRETRAIN, 128, seed=0, length=CONTEXT)):
        train_step(model, optimizer, x, y)
    loss = {"float": float(evaluate(model, held_x, held_y))}

    optimizer = nnx.Optimizer(model, optax.adam(optax.cosine_decay_schedule(3e-3, FINETUNE)), wrt=nnx.Param)
    longer, longer_optimizer = nnx.clone(model), nnx.clone(optimizer)
    for x, y in last_token(windows(train, FINETUNE, 128, seed=1, length=CONTEXT)):
        train_step(longer, longer_optimizer, x, y)
    loss["float_finetuned"] = float(evaluate(longer, held_x, held_y))
    apply_qat(longer, **SPEC, example_inputs=(held_x[:2],))
    loss["ptq_finetuned"] = float(evaluate(longer, held_x, held_y))

    apply_qat(model, **SPEC, example_inputs=(held_x[:2],))
    loss["ptq"] = float(evaluate(model, held_x, held_y))
    for step, (x, y) in enumerate(last_token(windows(train, FINETUNE, 128, seed=1, length=CONTEXT))):
        _, grads = train_step(model, optimizer, x, y)
        if step == 0:
            assert all(g > 0 for g in kernel_grads(grads).values()) and len(kernel_grads(grads)) == 3
    loss["qat"] = float(evaluate(model, held_x, held_y))
    assert_float32_params(model)

    assert loss["ptq"] > loss["float"] + 0.02, loss  # int4 costs held-out loss ...
    assert loss["ptq_finetuned"] > loss["float_finetuned"] + 0.02, loss
    assert loss["qat"] < loss["ptq_finetuned"] - 0.01, loss  # ... and QAT recovers more of it than PTQ
    assert loss["qat"] < loss["ptq"] - 0.1, loss
