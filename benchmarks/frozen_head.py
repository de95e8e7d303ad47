"""The finetune job's bfloat16 forwards with a frozen head tied to a large embedding, side by side in
one process. The teacher's forward three ways: float32 weights (autocast casts every product's
weight at every call), ``store_matmul_weights`` with the head left tied to the float32 embedding
(cast at every call), and ``store_matmul_weights`` as the job runs it (the tied head has its own
bfloat16 copy). The student's forward and backward (decoder layers trained, embedding and head
frozen) without and with ``head_cast_once``. Logits (and the student's gradients) are compared bit
for bit.

    python benchmarks/frozen_head.py [--model DIR_OR_GGUF] [--batch 4] [--tokens 129] [--threads 2] [--repeat 7]

Without ``--model`` the model has Gemma 3 270M's shapes (18 layers, hidden 640, vocabulary 262,144,
tied head) and random weights: the time does not depend on their values.
"""

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mixle.lm.finetune import store_matmul_weights  # noqa: E402
from mixle.lm.head_cast import head_cast_once  # noqa: E402
from machine import cpu_name  # noqa: E402  (benchmarks/machine.py, beside this script)

GEMMA3_270M = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                   tie_word_embeddings=True)


def load(model):
    """The float32 model: ``model`` (a transformers directory or a GGUF file), else Gemma 3 270M's shapes."""
    if model is None:
        torch.manual_seed(0)
        return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**GEMMA3_270M)).eval()
    path = Path(model)
    if path.suffix == ".gguf":
        return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                 dtype=torch.float32).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def teachers(model):
    """name -> a frozen copy of ``model`` as each way stores it."""
    model.requires_grad_(False)
    plain, tied, own = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    store_matmul_weights(tied, torch.bfloat16)
    store_matmul_weights(own, torch.bfloat16)
    if model.get_output_embeddings().weight is model.get_input_embeddings().weight:
        tied.get_output_embeddings().weight = tied.get_input_embeddings().weight  # tied again
    else:
        print("the head is not tied: the last two ways are the same")
    return {"float32 weights": plain, "stored, head tied": tied, "stored, own head": own}


def timed(ways, run, repeat):
    """``({name: median seconds}, {name: result})`` of ``run(way)`` for every way, interleaved, so
    every way sees the same machine; the first round warms up."""
    times, results = {name: [] for name in ways}, {}
    for round_ in range(repeat + 1):
        for name, way in ways.items():
            start = time.perf_counter()
            results[name] = run(way)
            if round_:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}, results


def student_step(model, ids):
    """Logits and decoder gradients of one bfloat16 forward and backward of the student."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", torch.bfloat16):
        logits = model(ids).logits
    logits.float().square().mean().backward()
    return [logits.detach()] + [p.grad for p in model.model.layers.parameters()]


def show(title, medians, results):
    base = next(iter(medians.values()))
    print(title)
    for name, seconds in medians.items():
        print(f"  {name:24s} {seconds * 1e3:8.1f} ms  {seconds / base:.3f}x")
    first, *others = results.values()
    same = all(all(map(torch.equal, first, other)) for other in others)
    print(f"  bit for bit equal: {same}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a transformers directory or .gguf file (default: Gemma 3 270M's shapes)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=129, help="tokens a window (default: the job's 128 + 1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load(args.model)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.tokens), generator=torch.Generator().manual_seed(0))
    print(f"{type(model).__name__} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M), {args.batch} x "
          f"{args.tokens} tokens, bfloat16 autocast, torch {torch.__version__}, {args.threads} threads, "
          f"CPU {cpu_name(isa=True)}, median of {args.repeat}")

    def forward(teacher):
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            return [teacher(ids).logits]

    show("teacher forward", *timed(teachers(model), forward, args.repeat))
    del model
    students = {}
    for name in ("autocast casts the head", "head cast once"):
        students[name] = load(args.model)
        students[name].requires_grad_(False)
        students[name].model.layers.requires_grad_(True)
    with head_cast_once(students["head cast once"], torch.bfloat16):  # one copy for all its steps
        show("student forward and backward",
             *timed(students, lambda student: student_step(student, ids), args.repeat))


if __name__ == "__main__":
    main()
