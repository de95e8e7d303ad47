"""QAT under PyTorch DDP and FSDP2: two real gloo processes on 127.0.0.1, checked against one process."""

import contextlib
import re
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mixle.models.qat import set_fake_quant_enabled  # noqa: E402
from tests.dist_workers.launch import WorkersFailed, alive, run_bounded, torchrun_command, worker_env  # noqa: E402
from tests.dist_workers.torch_setup import QAT_SCHEDULE, loss_fn, make_batches, make_model, make_optimizer, \
    probe_batch  # noqa: E402
from tests.test_numerics import reference_codes_scales  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="this torch build has no gloo backend")

WORKER = "tests.dist_workers.torch_train"
DEADLINE_S = 60  # each worker exits by itself after this; the launcher kills everything at +15 s
STEPS = range(len(QAT_SCHEDULE))
# Measured max |distributed - single process| over all parameters and steps: 6e-8 (DDP and FSDP2).
TOLERANCE = dict(rtol=1e-5, atol=1e-6)
# Weights fake-quantized by apply_qat in build_causal_lm: every Linear, and tok (tied to head).
QUANTIZED = re.compile(r"(blocks\.\d+\.(qkv|proj|fc|out)|head|tok)\.weight")


@contextlib.contextmanager
def one_thread():
    """Match the workers' thread count, so the same maths gives the same bits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def launch(mode, tmp_path_factory):
    workdir = tmp_path_factory.mktemp(mode)
    command = torchrun_command(WORKER, 2, mode, workdir, DEADLINE_S)
    run_bounded(command, env=worker_env(), timeout=DEADLINE_S + 15, workdir=workdir)
    return [torch.load(workdir / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]


def single_process_run(qat=True):
    """Parameters after each step of one process training on the whole (concatenated) batch."""
    with one_thread():
        model = make_model(qat=qat)
        optimizer = make_optimizer(model.parameters())
        history = []
        for step, enabled in enumerate(QAT_SCHEDULE):
            if qat:
                set_fake_quant_enabled(model, enabled)
            optimizer.zero_grad()
            loss_fn(model, make_batches()[step]).backward()
            optimizer.step()
            history.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return history


def numpy_fake_quant_state(state_dict):
    """The int4 per-channel symmetric round trip of every quantized weight, in plain numpy."""
    out = {}
    for name, value in state_dict.items():
        if QUANTIZED.fullmatch(name):
            value = torch.from_numpy(reference_codes_scales(value.numpy(), 4, "channel")[2])
        out[name] = value
    return out


def float_logits(state_dict):
    """Probe logits of a plain (never wrapped) model loaded with ``strict=True``."""
    plain = make_model(qat=False)
    plain.load_state_dict(state_dict, strict=True)
    plain.eval()
    with one_thread(), torch.no_grad():
        return plain(probe_batch())


def max_difference(history, reference):
    return max((history[step][name] - reference[step][name]).abs().max().item()
               for step in STEPS for name in reference[step])


@pytest.fixture(scope="module")
def reference():
    return single_process_run()


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return launch("ddp", tmp_path_factory)


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    return launch("fsdp2", tmp_path_factory)


def test_single_process_reference_trains_and_fake_quant_changes_it(reference):
    """Guards the comparisons below: steps move the weights far more than the tolerance, and a
    run without fake quant ends elsewhere, so a DDP/FSDP run that lost QAT could not match."""
    initial = dict(make_model().named_parameters())
    assert min((reference[0][n] - initial[n]).abs().max().item() for n in initial) > 100 * TOLERANCE["atol"]
    assert max_difference(single_process_run(qat=False), reference) > 1e-3


def test_ddp_parameters_identical_across_ranks_after_every_step(ddp):
    rank0, rank1 = ddp
    for step in STEPS:
        params0, params1 = rank0[f"params/{step}"], rank1[f"params/{step}"]
        assert params0.keys() == params1.keys()
        for name in params0:
            assert torch.equal(params0[name], params1[name]), (step, name)
    assert rank0["losses"] != rank1["losses"]  # the ranks really trained on different rows


def assert_rank_matches_reference(rank, reference):
    """Every parameter after every step equals the single-process run's, within TOLERANCE."""
    for step in STEPS:
        params = rank[f"params/{step}"]
        assert params.keys() == reference[step].keys()
        for name in params:
            torch.testing.assert_close(params[name], reference[step][name], **TOLERANCE,
                                       msg=lambda m, step=step, name=name: f"step {step}, {name}: {m}")


def assert_toggle_exact(rank0):
    """Off: the float model bit for bit. On: the numpy int4 fake-quant forward."""
    state = rank0["state_dict"]
    assert torch.equal(rank0["probe_logits/off"], float_logits(state))
    torch.testing.assert_close(rank0["probe_logits/on"], float_logits(numpy_fake_quant_state(state)),
                               rtol=0, atol=1e-6)


def test_ddp_matches_single_process_on_concatenated_batch(ddp, reference):
    assert_rank_matches_reference(ddp[0], reference)
    # The two ranks' losses average to the single-process loss on the concatenated batch.
    with one_thread():
        model = make_model()
        assert np.mean([r["losses"][0] for r in ddp]) == pytest.approx(loss_fn(model, make_batches()[0]).item(),
                                                                       rel=1e-6)


def test_ddp_toggle_off_is_the_float_model_and_on_is_the_numpy_fake_quant(ddp):
    rank0 = ddp[0]
    assert_toggle_exact(rank0)
    assert (rank0["probe_logits/on"] - rank0["probe_logits/off"]).abs().max() > 1e-3


def test_ddp_trained_model_converts_to_the_fake_quant_forward(ddp):
    rank0 = ddp[0]
    assert torch.equal(rank0["probe_logits/converted"], rank0["probe_logits/on"])
    stored = rank0["converted_state_dict"]
    assert stored["blocks.0.qkv.codes"].dtype == torch.uint8  # int4 packed two per byte
    assert "blocks.0.qkv.weight" not in stored
    # The wrapper itself is refused with the fix, not deep-copied along with its process group.
    assert rank0["convert_engine_error"].startswith("TypeError: convert got a DistributedDataParallel wrapper")
    assert "convert(model.module)" in rank0["convert_engine_error"]


def test_ddp_wrapper_reports_what_apply_qat_wrapped(ddp):
    report = ddp[0]["report"].splitlines()
    wrapped = [line.split()[0] for line in report if " wrapped " in line]
    assert sorted(wrapped) == sorted(["head", "tok"] + [f"blocks.{i}.{name}" for i in (0, 1)
                                                          for name in ("qkv", "proj", "fc", "out")])


def test_fsdp2_matches_single_process(fsdp2, reference):
    for rank in fsdp2:
        assert_rank_matches_reference(rank, reference)


def test_fsdp2_toggle_off_is_the_float_model(fsdp2):
    assert_toggle_exact(fsdp2[0])


def test_fsdp2_gathered_model_converts_and_sharded_model_is_refused(fsdp2):
    rank0 = fsdp2[0]
    torch.testing.assert_close(rank0["probe_logits/converted"], rank0["probe_logits/on"], rtol=0, atol=1e-6)
    for rank in fsdp2:
        assert rank["convert_engine_error"].startswith("ValueError: convert needs the whole model in one process")
        assert "full_state_dict=True" in rank["convert_engine_error"]


def test_fsdp2_full_state_dict_loads_strict_into_unwrapped_model(fsdp2, reference):
    state = fsdp2[0]["state_dict"]
    assert fsdp2[1]["state_dict"] == {}  # cpu_offload gathers the full dict on rank 0 only
    plain = make_model(qat=False)
    plain.load_state_dict(state, strict=True)
    assert plain.head.weight is plain.tok.weight
    for name, param in plain.named_parameters():
        torch.testing.assert_close(param, reference[-1][name], **TOLERANCE, msg=lambda m, name=name: f"{name}: {m}")


def test_hung_workers_are_killed_at_the_deadline(tmp_path):
    """A launch that never finishes fails within its timeout and leaves no process behind."""
    command = torchrun_command(WORKER, 2, "hang", tmp_path, 600)
    start = time.monotonic()
    with pytest.raises(WorkersFailed, match="deadline"):
        run_bounded(command, env=worker_env(), timeout=15, workdir=tmp_path)  # room to start under load
    assert time.monotonic() - start < 30
    pids = [int(path.stem) for path in (tmp_path / "pids").glob("*.pid")]
    assert len(pids) == 2  # both ranks had started
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids)
