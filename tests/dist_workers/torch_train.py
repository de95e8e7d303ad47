"""Worker: train the QAT causal LM under DDP or FSDP2 (gloo, CPU) and save what the tests check.

Launched by tests/test_distributed_torch.py through torchrun, one process per rank:
``python -m torch.distributed.run ... -m tests.dist_workers.torch_train {ddp,fsdp2,hang} OUT DEADLINE``.
"""

import sys


def train(mode, out):
    import torch
    import torch.distributed as dist

    from mixle.models.qat import set_fake_quant_enabled
    from tests.dist_workers.torch_setup import GLOBAL_BATCH, QAT_SCHEDULE, loss_fn, make_batches, make_model, \
        make_optimizer, probe_batch

    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        engine = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        engine = fully_shard(model)

    def full_parameters():
        # FSDP2 parameters are DTensor shards: full_tensor() gathers them (all ranks must call).
        return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for name, p in model.named_parameters()}

    optimizer = make_optimizer(engine.parameters())
    batches, rows = make_batches(), GLOBAL_BATCH // world
    result = {"losses": []}
    for step, enabled in enumerate(QAT_SCHEDULE):
        set_fake_quant_enabled(engine, enabled)
        optimizer.zero_grad()
        loss = loss_fn(engine, batches[step, rank * rows:(rank + 1) * rows])
        loss.backward()
        optimizer.step()
        result["losses"].append(loss.item())
        result[f"params/{step}"] = full_parameters()

    engine.eval()
    with torch.no_grad():
        for enabled in (True, False):
            set_fake_quant_enabled(engine, enabled)
            result[f"probe_logits/{'on' if enabled else 'off'}"] = engine(probe_batch())
    set_fake_quant_enabled(engine, True)

    from mixle.models.qat import get_qat_report
    from mixle.task.quantize import convert

    try:
        convert(engine)
    except (TypeError, ValueError) as error:
        result["convert_engine_error"] = f"{type(error).__name__}: {error}"
    if mode == "ddp":
        result["report"] = str(get_qat_report(engine))
        result["state_dict"] = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        converted = convert(engine.module)
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        result["state_dict"] = get_model_state_dict(engine, options=options)  # full on rank 0 only
        converted = None
        if rank == 0:
            unsharded = make_model()
            unsharded.load_state_dict(result["state_dict"], strict=True)
            converted = convert(unsharded)
    if converted is not None:
        from mixle.torch_backend.kernels import packed_linear

        with torch.no_grad(), packed_linear.switched_off():  # the exact path: compared bit for bit
            result["probe_logits/converted"] = converted(probe_batch())
        result["converted_state_dict"] = converted.state_dict()
    torch.save(result, f"{out}/rank{rank}.pt")


def main(mode, out, deadline):
    from tests.dist_workers.guard import bound_lifetime

    bound_lifetime(float(deadline), out)
    if mode == "hang":  # for the cleanup test: never finishes on its own
        import time

        time.sleep(3600)
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(deadline)))
    try:
        train(mode, out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
