"""``mixle finetune --backend jax``: the job on mixle's Flax causal LM, end to end on a tiny random Llama.

The GGUF's blocks are checked against gguf-py's quantizer of the trained weights, the loss against
torch's, a resumed run against the uninterrupted one (the same ops: exactly), and the data-parallel
mesh of two host devices against one device (in a subprocess, where XLA is given two CPU devices).
"""

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
pytest.importorskip("qwix")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import jax.numpy as jnp  # noqa: E402

from mixle.lm.finetune_run import run_finetune  # noqa: E402
from mixle.lm.finetune_checkpoint import read_checkpoint  # noqa: E402
from mixle.lm.finetune_config import FinetuneConfig  # noqa: E402
from mixle.lm.finetune_data import window_order  # noqa: E402
from mixle.lm.finetune_train import Stopped  # noqa: E402
from tests.test_finetune import finetune, greedy, results_of, tiny_llama_run  # noqa: E402

STEPS = 4


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_llama_run(tmp_path_factory.mktemp("finetune_jax"), layers=1)


def _config(llama, out, **changes):
    fields = dict(model=str(llama / "llama"), out=str(out), data=(str(llama / "data.txt"),), backend="jax",
                  target="q8_0", steps=STEPS, block=16, batch_size=2, eval_windows=4, curve_windows=2,
                  llama_cpp=False, lr=1e-2, threads=1, checkpoint_every=2, objective="mix")
    return FinetuneConfig(**{**fields, **changes})


def _trained(trainer):
    return {name: np.asarray(v) for name, v in zip(trainer.names, jax.tree.leaves(trainer.params))}


@pytest.fixture(scope="module")
def whole(llama, tmp_path_factory):
    """The uninterrupted run, and its trained kernels after the last step."""
    final = {}

    def keep(trainer):
        final.update(_trained(trainer))
        final["graphdef"] = trainer.graphdef
        if trainer.state.step == STEPS:  # the trained weights' loss on the first step's windows
            first = window_order(len(trainer.ids), 16, seed=0, epoch=0).numpy()[:2]
            final["first windows"] = float(trainer.micro_step(first)[0])

    out = tmp_path_factory.mktemp("whole")
    results = run_finetune(_config(llama, out), progress=False, callback=keep)
    return out, results, final


def test_jax_run_writes_the_files_and_its_gguf_blocks_are_ggufs_quantizer_of_the_trained_weights(whole):
    out, results, final = whole
    assert {p.name for p in out.iterdir()} == {"model.gguf", "hf", "results.json", "table.txt", "finetune.png",
                                               "README.md"}
    # the transformers checkpoint holds the trained float32 master weights, as torch's (out, in) matrices
    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "hf").state_dict()
    assert results["files"]["hf"] == "hf" and results["hf"]["directory"] == "hf"
    for module in ("self_attn.q_proj", "mlp.down_proj"):
        np.testing.assert_array_equal(hf[f"model.layers.0.{module}.weight"].numpy(),
                                      final[f"layers.0.{module}.kernel"].T, err_msg=module)
    assert results_of(out)["rows"] == results["rows"]
    assert [r["method"] for r in results["rows"]] == ["float", "PTQ", "QAT"]
    assert results["config"]["backend"] == "jax" and results["model"]["backend"] == "jax"
    assert results["training"]["steps_done"] == STEPS and results["model"]["trained_kernels"] == 7
    reader = gguf.GGUFReader(out / "model.gguf")
    tensors = {t.name: t for t in reader.tensors}
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for module, short in names.items():
        rows = final[f"layers.0.{module}.kernel"].T  # Flax (in, out): the file stores torch's (out, in) rows
        heads = {"attn_q": 4, "attn_k": 2}.get(short)
        if heads:  # llama.cpp's converter orders the rows of q and k for its RoPE: each head's halves interleaved
            rows = rows.reshape(heads, 2, rows.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(rows.shape)
        want = gguf.quants.quantize(np.ascontiguousarray(rows), gguf.GGMLQuantizationType.Q8_0)
        tensor = tensors[f"blk.0.{short}.weight"]
        assert tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0
        np.testing.assert_array_equal(np.asarray(tensor.data).reshape(want.shape), want, err_msg=short)
    assert tensors["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0  # float_matrices


def test_the_distillation_loss_decreases(whole):
    losses = whole[1]["curve"]["train_loss"]  # (1 - w) CE + w KL to the float model, per predicted token
    assert 0 < whole[2]["first windows"] < losses[0] - 0.05 and losses[-1] < losses[0]  # 2.85 -> 2.76 here


@pytest.mark.parametrize("temperature, weight", [(1.0, 1.0), (2.0, 1.0), (2.0, 0.5), (1.0, 0.0)])
def test_the_loss_per_token_is_the_torch_jobs(temperature, weight):
    from mixle.lm.finetune_jax_train import token_loss
    from mixle.lm.finetune_train import rows_of_tokens, token_loss as torch_token_loss

    rng = np.random.default_rng(0)
    s, t = (rng.standard_normal((2, 3, 11)).astype(np.float32) * 3 for _ in range(2))
    y = rng.integers(0, 11, (2, 3))
    want = rows_of_tokens(torch_token_loss(torch.tensor(s), torch.tensor(t), torch.tensor(y), temperature, weight),
                          temperature, weight).numpy()
    tokens = np.asarray(token_loss(jnp.asarray(s), jnp.asarray(t), jnp.asarray(y), temperature, weight))
    got = temperature**2 * tokens.sum(1) if weight == 1.0 else tokens.sum(1)
    # A sum of 3 tokens of 11-way softmaxes, each term one float32 rounding; a TPU's float32 exp and log are
    # accurate to about 2^-16 (../shared/notes/tpu.md: 4-5 digits), and there they are the error.
    unit = 2**-23 if jax.default_backend() == "cpu" else 2**-16
    np.testing.assert_allclose(got, want, rtol=11 * 3 * unit, atol=1e-6)


def test_resume_after_sigint_gives_the_uninterrupted_runs_weights_and_refuses_another_backend(llama, whole,
                                                                                          tmp_path, capsys):
    out = tmp_path / "parted"

    def stop(trainer):
        if trainer.state.step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: the step finishes, then the checkpoint is written

    with pytest.raises(Stopped, match="SIGINT after step 2"):
        run_finetune(_config(llama, out), progress=False, callback=stop)
    payload = read_checkpoint(out / "checkpoint.pt")
    assert payload["config"]["backend"] == "jax" and payload["state"]["step"] == 2
    with pytest.raises(ValueError, match="written by --backend jax, this run is --backend torch"):
        run_finetune(_config(llama, out, backend="torch"), resume=True, progress=False)
    with pytest.raises(SystemExit):
        finetune("--resume", str(out), "--backend", "torch")
    assert "--backend 'torch' differs from the interrupted run's 'jax'" in capsys.readouterr().err
    final = {}
    results = run_finetune(_config(llama, out), resume=True, progress=False,
                           callback=lambda t: final.update(_trained(t), graphdef=t.graphdef))
    assert final["graphdef"] is whole[2]["graphdef"]  # the same configuration: the compiled steps are reused
    for name, value in whole[2].items():
        if name in ("first windows", "graphdef"):
            continue
        np.testing.assert_array_equal(final[name], value, err_msg=name)
    assert results["rows"] == whole[1]["rows"] and results["curve"] == whole[1]["curve"]
    assert (out / "model.gguf").read_bytes() == (whole[0] / "model.gguf").read_bytes()


def test_importance_collected_on_the_flax_model_is_torchs_calibrate_importance(llama):
    from mixle.api import calibrate_importance
    from mixle.lm.finetune_jax import collect_importance
    from mixle.lm.flax_causal_lm import load_causal_lm

    torch_model = transformers.AutoModelForCausalLM.from_pretrained(llama / "llama")
    ids = np.random.default_rng(0).integers(0, torch_model.config.vocab_size, (6, 16))
    batches = [ids[i : i + 2] for i in range(0, 6, 2)] + [ids[:1, :8]]  # the last: 8 rows, skipped (< 16)
    sums, counts = collect_importance(load_causal_lm(llama / "llama"), batches)
    want = calibrate_importance(torch_model, [torch.as_tensor(b) for b in batches], layers=sorted(sums))
    assert len(sums) == 7 and set(sums) == set(want.sums)  # tied head: no lm_head
    # Each batch sums 2 x 16 squares in float32 (torch and XLA in other orders), then the batches in float64;
    # the inputs themselves differ by the rounding of the reductions behind them (at most 128 terms), doubled
    # by the square: a relative difference of at most (32 + 2 * 128) float32 roundings (8 seen here).
    for path in sums:
        assert counts[path] == int(want.counts[path][0]) == 96, path
        np.testing.assert_allclose(sums[path], want.sums[path][0], rtol=(32 + 2 * 128) * 2.0**-24, err_msg=path)


@pytest.mark.parametrize("flags, message", [
    (["--lora", "4"], "--lora with --backend jax: it trains the quantized kernels themselves"),
    (["--gptq", "one-pass"], "--gptq with --backend jax: GPTQ runs on the torch model only"),
    (["--dtype", "bfloat16"], "--dtype bfloat16 with --backend jax: it trains and evaluates in float32"),
    (["--device", "cuda"], "--device cuda with --backend jax: it runs on jax.devices()"),
])
def test_options_the_jax_backend_cannot_honour_are_refused(flags, message, capsys):
    with pytest.raises(SystemExit):
        finetune("--model", "m", "--out", "o", "--backend", "jax", *flags)
    assert message in capsys.readouterr().err


def test_jax_run_answers_prompts_and_trains_on_the_text_the_torch_job_samples(llama, tmp_path):
    """--prompts: the float row's answers are transformers' greedy generate of the same weights, the QAT
    row's those of the trained weights at gguf-py's Q8_0 values (the head, tied, stays float);
    --generated-tokens: the ids the torch job samples with the same seed, trained on."""
    from mixle.lm.finetune_generated import GENERATED_FILE, sample_tokens, start_token

    prompts = ("The capital of", "Python is")
    out = tmp_path / "run"
    results = run_finetune(_config(llama, out, steps=2, prompts=prompts, answer_tokens=4, generated_tokens=60),
                           progress=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(llama / "llama")
    rows = {row["method"]: row for row in results["rows"]}
    original = transformers.AutoModelForCausalLM.from_pretrained(llama / "llama")
    assert [a["answer"] for a in rows["float"]["answers"]] == [greedy(original, tokenizer, p, 4) for p in prompts]
    trained = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
    with torch.no_grad():
        for name, module in trained.named_modules():
            if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear):
                blocks = gguf.quants.quantize(module.weight.numpy(), gguf.GGMLQuantizationType.Q8_0)
                module.weight.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)))
    assert [a["answer"] for a in rows["QAT"]["answers"]] == [greedy(trained, tokenizer, p, 4) for p in prompts]
    assert all(len(row["answers"]) == 2 and all(a["tokens"] <= 4 for a in row["answers"]) for row in rows.values())
    assert all(a["tokens"] == 4 and a["answer"] for a in rows["float"]["answers"] + rows["QAT"]["answers"])
    assert "**Python is**" in (out / "README.md").read_text()

    ids = np.load(out / GENERATED_FILE)
    want = sample_tokens(original, 60, start=start_token(tokenizer), stop=tokenizer.eos_token_id, length=4 * 16,
                         seed=0)
    np.testing.assert_array_equal(ids, want)
    assert results["data"]["generated"] == {"tokens": len(ids), "file": GENERATED_FILE}


def test_a_gguf_model_trains_from_the_same_float_weights_as_its_directory(llama, whole, tmp_path):
    """A .gguf of the directory's model (f32, llama.cpp's q/k row order, the converter's tokenizer keys)
    gives the directory run's float row and held-out windows: the same weights after transformers'
    GGUF loader, tokenized alike; its QAT run writes the target's blocks."""
    from mixle.gguf.writer import save_gguf
    from tests.gguf_tokenizer_cases import converter_keys, with_tokenizer

    tokenizer = transformers.AutoTokenizer.from_pretrained(llama / "llama")
    plain, source = tmp_path / "plain.gguf", tmp_path / "llama.gguf"
    save_gguf(transformers.AutoModelForCausalLM.from_pretrained(llama / "llama"), plain, tokenizer=tokenizer,
              float_matrices="f32")
    with_tokenizer(plain, source, lambda writer: converter_keys(writer, tokenizer, "gpt-2", len(tokenizer)))
    results = run_finetune(_config(llama, tmp_path / "run", model=str(source), steps=1), progress=False)
    assert results["model"]["kind"] == "gguf"
    assert results["rows"][0]["method"] == "float"
    assert results["rows"][0]["loss"] == whole[1]["rows"][0]["loss"]  # the same float32 ops on the same values
    assert results["rows"][1]["loss"] == whole[1]["rows"][1]["loss"]  # PTQ: the same Q8_0 values
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "run" / "model.gguf").tensors}
    assert types["blk.0.ffn_down.weight"] == types["blk.0.attn_q.weight"] == "Q8_0"


def test_a_ptq_row_evaluated_from_its_stored_values_is_its_fake_quantized_forward(llama, tmp_path):
    """The PTQ rows beside the student run the float model holding the stored values (no quantizer
    compiled): its logits are the fake-quantized copy's, exactly (Q4_K_M: Q5_0 / Q4_K / Q6_K / Q8_0
    kernels and the quantized embedding of the mix)."""
    from mixle.lm.finetune_jax import _fake_quantized, _with_stored_values
    from mixle.lm.flax_causal_lm import load_causal_lm

    model = load_causal_lm(llama / "llama")
    quantized = _fake_quantized(model, _config(llama, tmp_path, target="Q4_K_M"))
    ids = jnp.asarray(np.arange(24).reshape(2, 12) % model.config.vocab_size)
    got = _with_stored_values(model, quantized)
    np.testing.assert_array_equal(np.asarray(got(ids)), np.asarray(quantized(ids)))
    assert not np.array_equal(np.asarray(got(ids)), np.asarray(model(ids)))


def test_act_bits_8_rounds_each_products_input_in_qat_and_the_ptq_rows(llama, tmp_path):
    """--act-bits 8 on the Q4_K_M mix (this model's rows: Q5_0 / Q8_0 kernels, a Q8_0 tied embedding):
    the PTQ and QAT rows round the input of each quantized product as llama.cpp's CPU path does (Q8_0
    blocks, as llama.cpp's x86 builds round them; the tied head's too), so their losses move and the float
    row's does not; the files hold the same block types. With llama-cpp-python, mixle's losses move onto llama.cpp's (measured: PTQ
    2.7e-6 against 6.6e-5, QAT 2e-7 against 7.7e-5)."""
    from mixle.lm.llama_cpp_eval import llama_cpp_module

    live, runs, types = llama_cpp_module() is not None, {}, {}
    for name, changes in (("act", dict(act_bits=8, act_rounding="x86")), ("plain", {})):
        results = run_finetune(_config(llama, tmp_path / name, target="Q4_K_M", llama_cpp=live, **changes),
                               progress=False)
        assert results["config"]["act_bits"] == changes.get("act_bits")
        assert results["config"]["act_rounding"] == changes.get("act_rounding", "reference")
        runs[name] = {row["method"]: row for row in results["rows"]}
        types[name] = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / name / "model.gguf").tensors}
    act, plain = runs["act"], runs["plain"]
    assert act["float"]["loss"] == plain["float"]["loss"]
    assert act["PTQ"]["loss"] != plain["PTQ"]["loss"] and act["QAT"]["loss"] != plain["QAT"]["loss"]
    assert types["act"] == types["plain"] and types["act"]["token_embd.weight"] == "Q8_0"
    if live:
        for method in ("PTQ", "QAT"):
            gap = {name: abs(rows[method]["llama_cpp_loss"] - rows[method]["loss"]) for name, rows in runs.items()}
            assert gap["act"] < gap["plain"] / 4, (method, gap)


def test_a_hub_id_is_refused_saying_why(tmp_path, capsys):
    assert finetune("--model", "owner/name", "--out", str(tmp_path / "o"), "--backend", "jax", "--no-progress") == 1
    assert "is a hub id: --backend jax downloads nothing" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_help_names_the_backend(capsys):
    with pytest.raises(SystemExit):
        finetune("--help")
    assert "torch (default: the transformers model) or jax" in " ".join(capsys.readouterr().out.split())


_MESH = textwrap.dedent("""
    import json, sys, types
    import jax, jax.numpy as jnp, numpy as np, torch
    from flax import nnx
    from mixle.lm.finetune_config import FinetuneConfig
    from mixle.lm.finetune_jax_train import JaxTrainer, data_mesh
    from mixle.lm.flax_causal_lm import CausalLM, CausalLMConfig

    assert len(jax.devices()) == 2
    lm = CausalLMConfig.from_dict({"model_type": "llama", "vocab_size": 50, "hidden_size": 32,
                                   "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2})
    ids = np.random.default_rng(0).integers(0, 50, 400)
    data = types.SimpleNamespace(train_ids=torch.as_tensor(ids), curve_windows=ids[:34].reshape(2, 17))
    config = FinetuneConfig(model="m", out="o", backend="jax", steps=3, block=16, batch_size=4, lr=1e-2, objective="ce")
    runs = []
    for devices in (jax.devices()[:1], jax.devices()):
        student = CausalLM(lm, rngs=nnx.Rngs(0))
        trained = [f"layers.0.mlp.{m}.kernel" for m in ("gate_proj", "up_proj", "down_proj")]
        trainer = JaxTrainer(student, None, data, config, trained, data_mesh(4, devices))
        state = trainer.train()
        runs.append({"devices": trainer.mesh.size, "loss": state.curve["train_loss"],
                     "held_out": state.curve["held_out_loss"],
                     "weights": [np.asarray(v).tolist() for v in jax.tree.leaves(trainer.params)],
                     "sharding": str(trainer.params["layers"][0]["mlp"]["up_proj"]["kernel"][...].sharding)})
    print(json.dumps(runs))
""")


def test_two_host_devices_train_as_one_within_float32_rounding():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", _MESH], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = __import__("json").loads(done.stdout.strip().splitlines()[-1])
    assert (one["devices"], two["devices"]) == (1, 2)
    # Each step's loss sums 4 x 16 token terms: two devices add two partial sums, a reordering worth at most
    # (terms) x float32's rounding of the total per step, compounding over the steps.
    terms, eps = 4 * 16, 2.0**-24
    np.testing.assert_allclose(two["loss"], one["loss"], rtol=len(one["loss"]) * terms * eps)
    np.testing.assert_allclose(two["held_out"], one["held_out"], rtol=len(one["loss"]) * terms * eps)
    # An AdamW step moves a weight by lr x m / (sqrt(v) + eps), at most about lr: a reordered gradient sum changes
    # that normalized step by its relative rounding, magnified where a gradient is near AdamW's eps; asked: at
    # least 10 bits of every step agree (3e-7 apart here).
    for a, b in zip(one["weights"], two["weights"]):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=len(one["loss"]) * 1e-2 * 2.0**-10)
    assert "'data': 2" in two["sharding"] and "spec=P()" in two["sharding"]  # the weights replicated on the mesh


def test_qat_on_the_weighted_search_trains_the_values_its_file_stores(llama, tmp_path):
    """``--imatrix calibrate`` (QAT on ggml's weighted search): the step quantizes the kernels by group
    (stacked, each with its own importance), and the GGUF written by numpy's numerics holds, for the
    trained weights, exactly the values the last step trained on."""
    from mixle.flax_backend.kernel_groups import quantized_state

    seen = {}

    def keep(trainer):
        seen["groups"] = trainer.groups
        seen["values"] = {".".join(map(str, path)): np.asarray(v.get_value())
                          for path, v in nnx.to_flat_state(quantized_state(trainer.groups, trainer.params))}

    results = run_finetune(_config(llama, tmp_path / "run", target="q4_0", steps=2, imatrix="calibrate",
                                   calibration_windows=4), progress=False, callback=keep)
    assert [row["method"] for row in results["rows"]] == ["float", "PTQ", "PTQ imatrix", "QAT imatrix"]
    assert all(group.importance is not None for group in seen["groups"])
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "run" / "model.gguf").tensors}
    for name, path in (("blk.0.ffn_gate.weight", "layers.0.mlp.gate_proj.kernel"),
                       ("blk.0.ffn_down.weight", "layers.0.mlp.down_proj.kernel"),
                       ("blk.0.attn_v.weight", "layers.0.self_attn.v_proj.kernel"),
                       ("blk.0.attn_output.weight", "layers.0.self_attn.o_proj.kernel")):  # stacked with q_proj
        tensor = tensors[name]
        assert tensor.tensor_type.name == "Q4_0"
        stored = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        np.testing.assert_array_equal(stored.reshape(seen["values"][path].T.shape), seen["values"][path].T)


def test_the_step_is_compiled_before_the_time_budgets_clock_starts(llama, tmp_path, monkeypatch):
    """``--max-minutes`` counts steps, not compiling: ``prepare()`` compiles the micro-step and AdamW (with
    the arguments the steps pass), so the first step compiles neither (XLA's log of its compiles, in order)."""
    import logging

    from mixle.lm.finetune_jax_train import JaxTrainer

    events = []

    class Compiles(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("Compiling "):
                events.append(record.getMessage().split(" with ")[0])

    prepare = JaxTrainer.prepare
    monkeypatch.setattr(JaxTrainer, "prepare", lambda self: (prepare(self), events.append("prepared")))
    handler, logger = Compiles(), logging.getLogger("jax._src.interpreters.pxla")
    logger.addHandler(handler)
    try:
        with jax.log_compiles(True):  # a micro-batch shape of its own: no earlier test compiled this step
            run_finetune(_config(llama, tmp_path / "run", steps=1, batch_size=3, block=12, max_minutes=5.0,
                                 eval_windows=2), progress=False, callback=lambda trainer: events.append("step"))
    finally:
        logger.removeHandler(handler)
    prepared, stepped = events.index("prepared"), events.index("step")
    assert "Compiling jit(_micro_step)" in events[:prepared]
    assert not [event for event in events[prepared:stepped] if event.split("(")[-1] in
                ("_micro_step)", "quantized_state)", "_adamw)", "_grad_norm)")]


def test_step_timing_times_qat_and_float_steps_and_changes_nothing_trained(llama, whole, tmp_path):
    """--step-timing 2: two QAT and two float steps (the float model training the same tensors), interleaved,
    their medians in results.json and the table; the run trains exactly what it trains without them."""
    out, results, _ = whole
    timed = run_finetune(_config(llama, tmp_path / "timed", step_timing=2), progress=False)
    timing = timed["training"]["step_timing"]
    assert timing["steps"] == 2 and timing["qat_ms"] > 0 and timing["float_ms"] > 0
    assert timing["ratio"] == pytest.approx(timing["qat_ms"] / timing["float_ms"], rel=1e-12)
    assert timing["tokens"] == 2 * 16 and "cpu" in timing["devices"]
    assert "step: QAT" in (tmp_path / "timed" / "table.txt").read_text()
    assert [row["loss"] for row in timed["rows"]] == [row["loss"] for row in results["rows"]]
    with pytest.raises(ValueError, match="--step-timing with --backend torch: .*benchmarks/real_model.py"):
        FinetuneConfig(model="m", out="o", step_timing=2)
