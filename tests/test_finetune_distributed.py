"""``mixle finetune`` under torchrun: 2 gloo processes (FSDP2) against 1 process, and resume from them.

A tiny random Llama saved with ``save_pretrained`` beside a byte-level BPE tokenizer (as in
tests/test_finetune.py) is fine-tuned by one process here, and by two processes launched with
torchrun (tests/dist_workers/finetune_worker.py: the command line's entry point, run whole, then
stopped by a SIGTERM that reaches rank 0 alone, then resumed).

Tolerance. Both runs train on the same windows in the same order; what differs is where float32
sums are split: each process sums the loss and the gradient over its window of a micro-batch,
and the two partial sums are added (FSDP's reduce-scatter, the loss's all-reduce). Reordering a
float32 sum of ``L`` terms changes it by at most ``L * eps32`` relative (per term bounded), with
``L = BATCH * BLOCK = 32`` predicted tokens per micro-batch: ``RTOL = 32 * eps32 = 3.8e-6``. The
training losses are distillation KLs, sums of ``p * (log p - log q)`` whose two parts are each
about the model's loss per token in size, so a KL far smaller than the loss changes by up to
``RTOL * loss`` absolute, not ``RTOL`` relative (measured: 1.1e-7 on a KL of 2.1e-3 on an AVX2
CPU, 5e-5 relative). The held-out losses are computed by the same float ops on weights that can
differ only through those gradient sums, which AdamW turns into updates that differ by about
``lr * RTOL`` per step, far below a q4_0 grid step: they agree to ``RTOL`` as well (measured:
bit for bit).
"""

import hashlib
import json
import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("gguf")

from mixle.lm import cli  # noqa: E402
from mixle.lm.finetune_checkpoint import read_checkpoint  # noqa: E402
from mixle.lm.finetune_config import FinetuneConfig  # noqa: E402
from mixle.lm.finetune_distributed import check_distributed, processes  # noqa: E402
from tests.dist_workers.launch import WorkersFailed, run_bounded, torchrun_command, worker_env  # noqa: E402
from tests.test_finetune import tiny_llama_run  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="this torch build has no gloo backend")

WORKER = "tests.dist_workers.finetune_worker"
DEADLINE_S = 120  # each worker exits by itself after this; the launcher kills everything at +15 s
BLOCK, BATCH = 16, 2
RTOL = BATCH * BLOCK * float(np.finfo(np.float32).eps)


def flags(assets):
    return ["--model", str(assets / "llama"), "--data", str(assets / "data.txt"), "--steps", "4", "--accumulate", "2",
            "--checkpoint-every", "2", "--block", str(BLOCK), "--batch-size", str(BATCH), "--eval-windows", "4",
            "--threads", "1", "--lr", "2e-3", "--float-matrices", "f32", "--no-llama-cpp", "--no-progress",
            "--imatrix", "calibrate", "--calibration-windows", "4"]  # rank 0 calibrates; every process trains with it


def results_of(out):
    return json.loads((out / "results.json").read_text())


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_llama_run(tmp_path_factory.mktemp("assets"))


@pytest.fixture(scope="module")
def one_process(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "run"
    assert cli.main(["finetune", *flags(assets), "--out", str(out)]) == 0
    return results_of(out)


@pytest.fixture(scope="module")
def two_processes(assets, tmp_path_factory):
    for attempt in range(2):
        workdir = tmp_path_factory.mktemp("two")
        command = torchrun_command(WORKER, 2, workdir, DEADLINE_S, *flags(assets))
        try:
            run_bounded(command, env=worker_env(), timeout=DEADLINE_S + 15, workdir=workdir)
            return workdir
        except WorkersFailed as err:
            # Seen once in five runs of the suite on a loaded 2-core machine: a worker aborted by
            # C++ ("terminate called without an active exception") after the SIGTERM stop, every
            # run's output correct until then. One relaunch; any other failure, or a second, counts.
            if attempt or "terminate called without an active exception" not in str(err):
                raise


def assert_close(got, want, atol=0.0):
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=atol)


def test_two_processes_end_with_the_one_process_perplexity(one_process, two_processes):
    two = results_of(two_processes / "whole")
    one_rows, two_rows = ({row["method"]: row for row in r["rows"]} for r in (one_process, two))
    for method in ("float", "PTQ", "PTQ imatrix"):  # rank 0 evaluates the unsharded model before training, as one process does
        assert two_rows[method] == one_rows[method]
    for key in ("loss", "perplexity", "fake_quant_loss"):
        assert_close(two_rows["QAT imatrix"][key], one_rows["QAT imatrix"][key])
    # KLs: differences of two cross-entropies of about the float model's loss each (module docstring)
    assert_close(two["curve"]["train_loss"], one_process["curve"]["train_loss"], atol=RTOL * one_rows["float"]["loss"])
    assert_close(two["curve"]["held_out_loss"], one_process["curve"]["held_out_loss"])
    # Guard: training moved the QAT loss far more than the tolerance, so a run that trained on other
    # windows (or fewer of them) could not pass.
    assert abs(one_rows["QAT imatrix"]["loss"] - one_rows["PTQ imatrix"]["loss"]) > 100 * RTOL * one_rows["PTQ"]["loss"]
    assert two["model"]["processes"] == 2 and two["model"]["teacher_shared_bytes"] == 0
    assert two["model"]["teacher_own_bytes"] == 4 * two["model"]["parameters"]
    assert math.isclose(two_rows["QAT imatrix"]["perplexity"], math.exp(two_rows["QAT imatrix"]["loss"]))


def test_resume_under_torchrun_is_the_uninterrupted_run(two_processes):
    # SIGTERM reached rank 0 only: both processes stopped after step 3 (status 130), then resumed.
    assert [json.loads((two_processes / f"status{rank}.json").read_text()) for rank in (0, 1)] == [[0, 130, 0]] * 2
    saved = read_checkpoint(two_processes / "parted-copy" / "checkpoint.pt")
    assert saved["state"]["step"] == 3 and saved["optimizer"]["state"]  # AdamW's moments, whole
    whole, resumed = results_of(two_processes / "whole"), results_of(two_processes / "parted")
    assert resumed["rows"] == whole["rows"] and resumed["curve"] == whole["curve"]
    assert digest(two_processes / "parted" / "model.gguf") == digest(two_processes / "whole" / "model.gguf")
    assert not (two_processes / "parted" / "checkpoint.pt").exists()


def test_one_process_resumes_a_two_process_checkpoint(two_processes):
    """A checkpoint holds whole tensors in one process's layout: one process continues the 2-process run."""
    parted = two_processes / "parted-copy"
    assert cli.main(["finetune", "--resume", str(parted), "--no-progress"]) == 0
    whole, resumed = results_of(two_processes / "whole"), results_of(parted)
    assert resumed["curve"]["train_loss"][:3] == whole["curve"]["train_loss"][:3]  # the steps the checkpoint holds
    assert_close(resumed["curve"]["train_loss"], whole["curve"]["train_loss"])
    assert_close(resumed["rows"][-1]["loss"], whole["rows"][-1]["loss"])


def test_what_cannot_run_sharded_is_refused_before_loading(monkeypatch, tmp_path):
    config = FinetuneConfig(model="m", out=str(tmp_path))
    for changes, message in (({"batch_size": 1}, "--batch-size 1 under torchrun with 2 processes"),
                             ({"device": "cuda:1"}, "each process trains on cuda:LOCAL_RANK"),
                             ({"device": "mps"}, "runs on cpu or cuda here"),
                             ({"lora": 4}, "sharded LoRA training does not reproduce the one-process run")):
        with pytest.raises(ValueError, match=message):
            check_distributed(config.replace(**changes), 2)
    check_distributed(config.replace(batch_size=3), 3)  # one window each
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="--batch-size 1"), processes(config.replace(batch_size=1)):
        pass
    assert not torch.distributed.is_initialized()
