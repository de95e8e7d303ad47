"""The model, data, optimizer and loss shared by the distributed torch workers and their reference."""

import torch
import torch.nn.functional as F

from mixle.models.qat import apply_qat
from mixle.models.transformer import build_causal_lm

MODEL = dict(vocab=48, d_model=32, n_layer=2, n_head=4, block=16)
GLOBAL_BATCH = 8
# Fake quant per training step: switched off for one step and on again, under the engine.
QAT_SCHEDULE = (True, True, False, True)


def make_model(qat=True):
    """The same initial weights in every process (seeded CPU RNG); int4 QAT unless ``qat=False``."""
    torch.manual_seed(0)
    model = build_causal_lm(**MODEL)
    return apply_qat(model, bits=4) if qat else model


def make_batches():
    """Token batches ``(steps, GLOBAL_BATCH, block + 1)``; rank r trains on its slice of rows."""
    generator = torch.Generator().manual_seed(1)
    shape = (len(QAT_SCHEDULE), GLOBAL_BATCH, MODEL["block"] + 1)
    return torch.randint(0, MODEL["vocab"], shape, generator=generator)


def probe_batch():
    """Held-out inputs for comparing outputs after training."""
    generator = torch.Generator().manual_seed(2)
    return torch.randint(0, MODEL["vocab"], (3, MODEL["block"]), generator=generator)


def make_optimizer(params):
    # SGD with momentum, not Adam: Adam divides by sqrt(v), which turns float32 reduction-order
    # noise in near-zero gradients into lr-sized differences and would hide real mismatches.
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def loss_fn(model, tokens):
    """Mean next-token cross-entropy; called through ``model(...)`` so DDP/FSDP hooks run."""
    logits = model(tokens[:, :-1], all_positions=True)
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
