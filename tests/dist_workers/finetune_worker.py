"""Worker: ``mixle finetune`` (its command-line entry point) under torchrun, three runs in one launch.

Launched by tests/test_finetune_distributed.py, one process per rank:
``python -m torch.distributed.run ... -m tests.dist_workers.finetune_worker OUT DEADLINE FLAG...``.

1. ``OUT/whole``: the run uninterrupted.
2. ``OUT/parted``: the same run, SIGTERM delivered to rank 0 alone during step 3 (the processes
   must agree to stop together); rank 0 then copies the stopped directory to ``OUT/parted-copy``
   (for a one-process resume in the test).
3. ``--resume OUT/parted``: the interrupted run continued.

Each rank writes its three exit statuses to ``OUT/status{rank}.json``. Every run starts and ends
its own process group (``mixle.lm.finetune_distributed.processes``), as three commands would.
"""

import json
import os
import shutil
import signal
import sys


def runs(out, flags):
    from mixle.lm import cli, finetune_train

    rank = int(os.environ["RANK"])
    statuses = [cli.main(["finetune", *flags, "--out", f"{out}/whole"])]
    step = finetune_train.FinetuneTrainer.step

    def step_then_sigterm(trainer):  # a SIGTERM that reaches rank 0 only, during step 3
        value = step(trainer)
        if trainer.state.step == 2 and rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return value

    finetune_train.FinetuneTrainer.step = step_then_sigterm
    statuses.append(cli.main(["finetune", *flags, "--out", f"{out}/parted"]))
    finetune_train.FinetuneTrainer.step = step
    if rank == 0:
        shutil.copytree(f"{out}/parted", f"{out}/parted-copy")
    statuses.append(cli.main(["finetune", "--resume", f"{out}/parted", "--no-progress"]))
    with open(f"{out}/status{rank}.json", "w") as handle:
        json.dump(statuses, handle)


def main(out, deadline, *flags):
    from tests.dist_workers.guard import bound_lifetime

    bound_lifetime(float(deadline), out)
    runs(out, flags)


if __name__ == "__main__":
    main(*sys.argv[1:])
