"""The finetune job's distillation KL, forward and backward, over a large vocabulary: the fused
``chunked_kl_tokens`` beside the generic ``chunked_tokens`` (which runs the loss again in backward),
side by side in one process, with their bit identity.

    python benchmarks/distill_loss.py [--vocab 262144] [--tokens 512] [--threads 2] [--repeat 5]
"""

import argparse
import functools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mixle.lm.chunked_loss import chunked_kl_tokens, chunked_tokens  # noqa: E402
from mixle.lm.finetune_train import rows_of_tokens, token_loss  # noqa: E402
from machine import cpu_name  # noqa: E402  (benchmarks/machine.py, beside this script)


def fused(student, teacher, targets, temperature):
    return chunked_kl_tokens(student, teacher, temperature)


def generic(student, teacher, targets, temperature):
    loss = functools.partial(token_loss, temperature=temperature, weight=1.0)
    return chunked_tokens(loss, student, teacher, targets, grad_into_teacher=True)


def timed(loss, logits, teacher, targets, temperature):
    """``(seconds, rows, gradient)`` of one forward and backward on fresh copies of the inputs."""
    leaf = logits.clone().requires_grad_(True)
    student, own_teacher = leaf * 1.0, teacher.clone()  # the model's logits: not a leaf, consumed by the loss
    start = time.perf_counter()
    rows = rows_of_tokens(loss(student, own_teacher, targets, temperature), temperature, 1.0)
    rows.sum().backward()
    return time.perf_counter() - start, rows.detach(), leaf.grad


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=262144, help="vocabulary (default: Gemma 3's 262,144)")
    parser.add_argument("--tokens", type=int, default=512, help="predicted tokens (default: 4 x 128)")
    parser.add_argument("--temperature", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    shape = (1, args.tokens, args.vocab)
    logits, teacher = 3 * torch.randn(shape, generator=generator), 3 * torch.randn(shape, generator=generator)
    targets = torch.zeros(shape[:2], dtype=torch.long)
    times = {"generic": [], "fused": []}
    results = {}
    for _ in range(args.repeat + 1):  # interleaved, so both see the same machine; the first round warms up
        for name, loss in (("generic", generic), ("fused", fused)):
            seconds, rows, grad = timed(loss, logits, teacher, targets, args.temperature)
            times[name].append(seconds)
            results[name] = rows, grad
    times = {name: values[1:] for name, values in times.items()}
    same = all(torch.equal(a, b) for a, b in zip(results["generic"], results["fused"]))
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"logits {shape} float32, T {args.temperature}, torch {torch.__version__}, {args.threads} threads, "
          f"CPU {cpu_name(isa=True)}, median of {args.repeat}")
    for name, seconds in medians.items():
        print(f"{name:8s} forward + backward {seconds * 1e3:8.1f} ms")
    print(f"fused / generic {medians['fused'] / medians['generic']:.3f}; loss and gradient bit for bit equal: {same}")


if __name__ == "__main__":
    main()
