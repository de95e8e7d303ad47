"""``run_finetune``: the finetune job of a ``FinetuneConfig`` on its ``--backend``.

Each backend's job lives in its own module, imported only when it runs: the torch job
(``mixle.lm.finetune.run_finetune_torch``) and the jax job (``mixle.lm.finetune_jax.run_finetune_jax``,
built on the torch job's run). This module sits above both, so neither refers to the other's caller.
"""

from mixle.lm.finetune_config import FRAMEWORKS, FinetuneConfig

__all__ = ["run_finetune", "RUNNERS"]


def _torch(config, **options):
    from mixle.lm.finetune import run_finetune_torch

    return run_finetune_torch(config, **options)


def _jax(config, **options):
    from mixle.lm.finetune_jax import run_finetune_jax

    return run_finetune_jax(config, **options)


RUNNERS = {"torch": _torch, "jax": _jax}  # --backend -> the job that runs it
assert set(RUNNERS) == set(FRAMEWORKS), "every --backend FinetuneConfig accepts has a runner"


def run_finetune(config, *, resume=False, progress=True, callback=None):
    """Run the finetune job of ``config`` on ``config.backend``; returns the results dict.

    Args:
        config: a ``FinetuneConfig``.
        resume: continue the interrupted run whose checkpoint is in ``config.out``.
        progress: show a tqdm bar with tokens/s, ETA and the loss.
        callback: ``f(trainer)`` after every step (e.g. for tests): the backend's trainer.

    Raises:
        TypeError: ``config`` is not a ``FinetuneConfig``.
        FileNotFoundError, ValueError: bad model, data, target or output directory (before training).
        mixle.lm.finetune_train.Stopped: Ctrl-C or SIGTERM; the checkpoint is written.
        NonFiniteLossError: training diverged; the last checkpoint is kept.

    Under ``torchrun`` (torch backend) rank 0 writes the files and returns the results, the other
    processes return None.

    >>> run_finetune(FinetuneConfig(model="/no/such/model", out="/tmp/x"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    FileNotFoundError: model='/no/such/model' does not exist: ...
    """
    if not isinstance(config, FinetuneConfig):
        raise TypeError(f"config must be a FinetuneConfig, got {type(config).__name__}: build one with "
                        f"FinetuneConfig(model=..., out=...)")
    return RUNNERS[config.backend](config, resume=resume, progress=progress, callback=callback)
