"""Parity of save_gguf files with llama.cpp: weights, logits and held-out perplexity per architecture.

For each architecture (mixle's build_causal_lm as ``gpt2``, with the tanh GELU llama.cpp's graph
computes; transformers' Llama as ``llama`` and Qwen2 as ``qwen2``, all tiny and on the embedded
corpus' characters) the model is trained in fp32, then QAT-trained on ``grid="q4_0"`` (``--grid``)
twice from that checkpoint with the same batches: weights only, and with ``act_bits=8`` (the
activations of every quantized product fake-quantized as the Q8_0 blocks of 32 llama.cpp's CPU
path makes of them, in training and evaluation). Each is written with ``save_gguf`` and:

* weights: every tensor read back with gguf-py and dequantized with gguf's code, compared bit for
  bit with what mixle's fake-quant forward multiplies with (rows of Llama's q/k put back);
* logits: the file loaded in llama.cpp (llama-cpp-python, F32 KV cache) fed the same token ids as
  mixle's fake-quant forward; max |logit difference| over the held-out windows. For the
  weights-only model also against its forward with ``act_bits=8`` switched on at evaluation
  only (how much of the gap the activation quantization explains);
* perplexity on the held-out windows, from mixle's logits and from llama.cpp's.

gpt2 also runs a third QAT with ``act_bits=8`` and ``activation="gelu_tanh_f16"`` (its GELU
through the float16 table llama.cpp's CPU backend looks it up in): then mixle's forward computes
what llama.cpp's CPU path computes, up to float32 summation order.

    pip install llama-cpp-python==0.3.36    # builds llama.cpp from source (~13 min on 2 cores)
    python benchmarks/gguf_parity.py --quick
"""

import argparse
from importlib import metadata
import math
import os
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from mixle.core.numerics import quantize_dequantize_array
from mixle.torch_backend.layers.activations import quantize_dequantize_activations
from mixle.gguf.layouts import layout_of
from mixle.lm.data import load_splits
from mixle.models.qat import apply_qat
from mixle.models.transformer import build_causal_lm
from mixle.task.quantize import save_gguf
from machine import cpu_name  # noqa: E402  (benchmarks/machine.py, beside this script)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", default="q4_0", choices=("q4_0", "q8_0"))
    p.add_argument("--steps", type=int, default=200, help="fp32 training steps per model")
    p.add_argument("--qat-steps", type=int, default=100, help="QAT steps per model (each of the two QAT runs)")
    p.add_argument("--windows", type=int, default=16, help="held-out windows evaluated")
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--archs", default="gpt2,llama,qwen2")
    p.add_argument("--float-matrices", default="q8_0", choices=("q8_0", "f16", "f32"),
                   help="save_gguf's storage of matrices left in float (qwen2's untied embedding)")
    p.add_argument("--quick", action="store_true", help="few steps and windows (a smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.qat_steps, args.windows = 20, 10, 4
    return args


def build(arch, vocab, block):
    torch.manual_seed(0)
    if arch == "gpt2":
        return build_causal_lm(vocab=vocab, d_model=128, n_layer=2, n_head=4, block=block, activation="gelu_tanh")
    import transformers

    fields = dict(vocab_size=vocab, hidden_size=128, intermediate_size=320, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=block, rms_norm_eps=1e-5,
                  tie_word_embeddings=arch == "llama")
    if arch == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**fields))


def logits_of(model, ids):
    """(batch, length, vocab) logits of any of the three models."""
    if hasattr(model, "sequence_log_prob"):
        return model(ids, all_positions=True)
    return model(ids).logits


def train(model, ids, block, steps, seed, label):
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in tqdm(range(steps), desc=label, leave=False):
        starts = torch.randint(0, len(ids) - block - 1, (16,), generator=gen)
        batch = torch.stack([ids[s : s + block + 1] for s in starts])
        loss = F.cross_entropy(logits_of(model, batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def expected_tensors(model, gguf, float_matrices):
    """What each file tensor must hold: fake-quantized weights and float vectors, in file row order."""
    from mixle.torch_backend.fake_quant import fake_quantized_weight

    out = {}
    for part in layout_of(model, gguf).parts:
        if part.module is not None and hasattr(part.module, "spec"):
            value = fake_quantized_weight(part.module.weight, part.module.spec)[0]
        elif part.module is not None and float_matrices == "q8_0":  # a float matrix, as save_gguf writes it
            value = quantize_dequantize_array(part.module.weight.detach(), bits=8, grid="q8_0")
        elif part.module is not None:
            value = part.module.weight.detach().to(getattr(torch, {"f16": "float16", "f32": "float32"}[float_matrices]))
        else:
            value = part.tensor
        value = value.detach().float().numpy()
        out[part.name] = value if part.rows is None else value[part.rows]
    return out


def weight_parity(model, path, gguf, float_matrices):
    reader = gguf.GGUFReader(path)
    want = expected_tensors(model, gguf, float_matrices)
    same = 0
    for t in reader.tensors:
        got = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(want[t.name].shape)
        same += int(np.array_equal(got.view(np.uint32), want[t.name].view(np.uint32)))
    return same, len(reader.tensors)


class ActivationQ8:
    """Evaluate a weights-only QAT model with its activations as llama.cpp's Q8_0 blocks (act_bits=8)."""

    def __init__(self, model):
        self.handles = [m.register_forward_pre_hook(self.hook) for m in model.modules()
                        if hasattr(m, "spec") and m.spec.grid in ("q4_0", "q8_0") and hasattr(m, "in_features")]

    @staticmethod
    def hook(module, args):
        return (quantize_dequantize_activations(args[0], module.spec.replace(act_bits=8)),) + args[1:]

    def remove(self):
        for handle in self.handles:
            handle.remove()


def perplexity(logits, ids):
    """exp(mean NLL) of predicting ids[1:] from logits[:-1] (numpy float64)."""
    logits = logits[:-1].astype(np.float64)
    logits = logits - logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return float(np.exp(-logp[np.arange(len(ids) - 1), ids[1:]].mean()))


def llama_cpp_logits(path, windows, args, llama_cpp, label):
    llm = llama_cpp.Llama(model_path=path, n_ctx=args.block, logits_all=True, n_threads=args.threads,
                          type_k=0, type_v=0, verbose=False)
    out = []
    for w in tqdm(windows, desc=label, leave=False):
        llm.reset()
        llm.eval(w.tolist())
        out.append(np.array(llm.scores[: len(w)], dtype=np.float32))
    return out


def mixle_logits(model, windows):
    with torch.no_grad():
        return [logits_of(model, torch.from_numpy(w)[None])[0].numpy() for w in windows]


def max_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def mean_diff(a, b):
    return float(np.mean([np.abs(x - y).mean() for x, y in zip(a, b)]))


def run_arch(arch, args, train_ids, held_ids, tokenizer, gguf, llama_cpp):
    import copy

    base = build(arch, tokenizer.vocab_size, args.block)
    train(base, train_ids, args.block, args.steps, 0, f"{arch} fp32")
    starts = np.linspace(0, len(held_ids) - args.block - 1, args.windows).astype(int)
    windows = [held_ids[s : s + args.block].numpy() for s in starts]
    ppl = lambda runs: math.exp(np.mean([math.log(perplexity(l, w)) for l, w in zip(runs, windows)]))  # noqa: E731
    rows = []
    # gpt2 also with the GELU through llama.cpp's CPU float16 table (same checkpoint, switched for QAT).
    variants = [(None, None), (8, None)] + ([(8, "gelu_tanh_f16")] if arch == "gpt2" else [])
    for act_bits, activation in variants:
        label = f"{arch} QAT {args.grid}" + (" + act Q8_0" if act_bits else "") + (f" {activation}" if activation else "")
        start = copy.deepcopy(base)
        if activation is not None:
            for block in start.blocks:
                block.activation = activation
        model = apply_qat(start, bits=4 if args.grid == "q4_0" else 8, grid=args.grid, act_bits=act_bits)
        train(model, train_ids, args.block, args.qat_steps, 1, label)  # same batches for both
        path = os.path.join(tempfile.mkdtemp(), f"{arch}.gguf")
        save_gguf(model, path, tokenizer=tokenizer, float_matrices=args.float_matrices)
        same, total = weight_parity(model, path, gguf, args.float_matrices)
        ours = mixle_logits(model, windows)
        cpp = llama_cpp_logits(path, windows, args, llama_cpp, f"{label} llama.cpp")
        row = dict(arch=arch, act=("a8" if act_bits else "-") + (" f16 GELU" if activation else ""), same=same, total=total, diff=max_diff(cpp, ours),
                   mean=mean_diff(cpp, ours),
                   scale=max(float(np.abs(m).max()) for m in ours), ppl_mixle=ppl(ours), ppl_cpp=ppl(cpp),
                   diff_emulated=None)
        if act_bits is None:
            hooks = ActivationQ8(model)
            row["diff_emulated"] = max_diff(cpp, mixle_logits(model, windows))
            hooks.remove()
        rows.append(row)
    return rows




def main(argv=None):
    args = parse_args(argv)
    import gguf

    from mixle.lm.llama_cpp_eval import require_llama_cpp

    llama_cpp = require_llama_cpp("benchmarks/gguf_parity.py")

    torch.set_num_threads(args.threads)
    train_ids, held_ids, tokenizer = load_splits(tokenizer="char")
    train_ids, held_ids = torch.as_tensor(train_ids), torch.as_tensor(held_ids)
    print(f"llama-cpp-python {llama_cpp.__version__}, gguf-py {metadata.version('gguf')}, torch {torch.__version__}, "
          f"{args.threads} thread(s), {cpu_name()}")
    print(f"grid {args.grid}, vocab {tokenizer.vocab_size} (chars), context {args.block}, {args.steps} fp32 + "
          f"{args.qat_steps} QAT steps, {args.windows} held-out windows, float matrices {args.float_matrices}; "
          f"llama.cpp with an F32 KV cache")
    rows = []
    for arch in args.archs.split(","):
        start = time.perf_counter()
        rows += run_arch(arch, args, train_ids, held_ids, tokenizer, gguf, llama_cpp)
        rows[-1]["seconds"] = time.perf_counter() - start
    print("max|dlogit| (mean): llama.cpp vs mixle's forward of the same model; 'eval a8': max for the weights-only "
          "model evaluated with act_bits=8")
    print(f"{'arch':<6} {'QAT act':<12} {'tensors bit-identical':>22} {'max|dlogit|':>12} {'mean':>9} {'eval a8':>9} "
          f"{'max|logit|':>10} {'ppl mixle':>10} {'ppl llama.cpp':>13}")
    for r in rows:
        emulated = "" if r["diff_emulated"] is None else f"{r['diff_emulated']:.4g}"
        print(f"{r['arch']:<6} {r['act']:<12} {r['same']:>12d} / {r['total']:<7d} {r['diff']:>12.4g} {r['mean']:>9.2g} {emulated:>9} "
              f"{r['scale']:>10.3g} {r['ppl_mixle']:>10.4f} {r['ppl_cpp']:>13.4f}")


if __name__ == "__main__":
    main()
