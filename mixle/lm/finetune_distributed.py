"""``mixle finetune`` past one process: the same job under ``torchrun``, sharded with FSDP2.

``processes(config)`` reads torchrun's environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``).
Without it (or with one process) the job gets ``SingleProcess``, whose every step is the plain
one. Under torchrun it starts the process group (gloo on the CPU, nccl on CUDA, each process on
``cuda:LOCAL_RANK``) and gives the job a ``TorchrunProcesses``, which:

- starts every process from rank 0's trained tensors (LoRA's adapters are drawn at random, and
  the processes' random streams need not agree), then
  shards the student after ``apply_qat`` and the teacher the same way: ``fully_shard`` on every
  decoder block (``model.base_model.layers[i]``), then on the root. The teacher, which in one
  process shares the student's frozen tensors, gets its own shards of them (each process then
  holds ``1 / world`` of both models instead of one shared whole);
- gives each process a disjoint, contiguous share of each micro-batch's windows. The windows of
  a step are the one-process run's, and each process's loss is scaled by the world size, so
  FSDP's averaged gradient is the gradient of the mean over the whole batch: the run trains on
  what the one-process run trains on, up to float32 reduction order;
- makes the processes agree on every decision: the loss (summed over processes before the
  non-finite check), the clock a ``--max-minutes`` budget reads (the slowest process's) and a
  Ctrl-C / SIGTERM that reached any process; all of them evaluate the held-out curve on the
  whole windows (the forward gathers the full weights, so all get the same numbers);
- leaves the float / PTQ evaluation before training, the files and the final (QAT) evaluation
  to rank 0, which gets the trained model whole (gathered into an unsharded copy of the student
  kept with its weights on the meta device, so it costs no memory while training).

Checkpoints hold what a one-process checkpoint holds: the trained tensors whole and AdamW's
state (``Optimizer.state_dict``'s layout, tensors whole), gathered from the shards and written
by rank 0 alone (atomically, as ever); a resume puts each process's shard back. So a checkpoint
does not depend on how many processes wrote it: a 2-process run resumes in one process or in
two, and continues what the interrupted run computed. Every process reads ``--out`` (a
filesystem they share: a resume reads the checkpoint in each of them).
"""

import atexit
import contextlib
import copy
import os

from mixle._optional import require

__all__ = ["SingleProcess", "TorchrunProcesses", "SINGLE", "processes", "check_distributed", "BACKENDS",
           "decoder_blocks"]

# The process-group backend per device type; any other device cannot run sharded here.
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
_SIGNALS = ("SIGINT", "SIGTERM")  # a stop request as a number every process can max-reduce


def _torch():
    return require("torch", extra="torch", purpose="mixle finetune")


class SingleProcess:
    """The finetune job in one process: every method is what the job does without torchrun.

    >>> SINGLE.share([3, 1]), SINGLE.total(0.5), SINGLE.world
    ([3, 1], 0.5, 1)
    """

    world, rank, main = 1, 0, True

    def device(self, device):
        """The torch device this process trains on."""
        return device

    def share(self, starts):
        """This process's windows of a micro-batch's ``starts`` (all of them)."""
        return starts

    def total(self, value):
        """The sum of a float over the processes."""
        return value

    def slowest(self, seconds):
        """The training clock every process acts on (the slowest process's)."""
        return seconds

    def stop_request(self, requested):
        """The stop request (``"SIGINT"``, ``"SIGTERM"`` or None) every process acts on."""
        return requested

    def from_main(self, compute):
        """``compute()``, run on rank 0 and its result given to every process."""
        return compute()

    def on_main(self, write):
        """``write()`` on rank 0 only; the others go on once it is done."""
        write()

    def shard(self, student, teacher):
        """``(student, teacher, notes)``: the models as the job trains them, and what to report of it."""
        return student, teacher, {}

    def gather(self, student):
        """The trained student whole, on rank 0 (None elsewhere)."""
        return student

    def finite(self, params):
        """Whether every parameter of ``params`` is finite (in every process)."""
        torch = _torch()
        return all(bool(torch.isfinite(p).all()) for p in params)

    def training_state(self, optimizer, trainable):
        """``(tensors, optimizer_state)`` of a checkpoint: the trained tensors by name and AdamW's state."""
        return {name: p.detach().cpu() for name, p in trainable}, optimizer.state_dict()  # saved, not copied

    def load_training_state(self, optimizer, trainable, tensors, optimizer_state):
        """Put a checkpoint's ``training_state`` back into the parameters and the optimizer."""
        torch = _torch()
        with torch.no_grad():
            for name, param in trainable:
                param.copy_(tensors[name].to(param.device))
        optimizer.load_state_dict(optimizer_state)


SINGLE = SingleProcess()


def check_distributed(config, world):
    """Refuse, before anything is loaded, what ``config`` cannot do in ``world`` processes.

    Raises:
        ValueError: the option, the value and why (a device type without a backend here, an
            explicit device index, ``--lora``, fewer windows per micro-batch than processes).

    >>> from mixle.lm.finetune_config import FinetuneConfig
    >>> check_distributed(FinetuneConfig(model="m", out="o", batch_size=1), 2)
    Traceback (most recent call last):
    ...
    ValueError: --batch-size 1 under torchrun with 2 processes: each process takes its own windows of every micro-batch, so a micro-batch needs at least 2 of them; pass --batch-size 2 or more (the run trains on the same windows as one process with that --batch-size)
    """
    kind, _, index = config.device.partition(":")
    if kind not in BACKENDS:
        raise ValueError(f"--device {config.device} under torchrun: sharded training runs on {' or '.join(BACKENDS)} "
                         f"here; pass --device cpu or --device cuda")
    if index:
        raise ValueError(f"--device {config.device} under torchrun: each process trains on cuda:LOCAL_RANK, the GPU "
                         f"torchrun gives it; pass --device cuda")
    if config.lora is not None:
        raise ValueError(f"--lora {config.lora} under torchrun: sharded LoRA training does not reproduce the one-process "
                         f"run yet (3 steps of a tiny Llama: held-out loss 5.6409 with 2 processes, 5.6392 with one), "
                         f"so it is refused rather than trained differently; run --lora in one process, or leave "
                         f"--lora out to train the quantized matrices sharded")
    if config.batch_size < world:
        raise ValueError(f"--batch-size {config.batch_size} under torchrun with {world} processes: each process takes "
                         f"its own windows of every micro-batch, so a micro-batch needs at least {world} of them; pass "
                         f"--batch-size {world} or more (the run trains on the same windows as one process with that "
                         f"--batch-size)")


@contextlib.contextmanager
def processes(config):
    """The job's processes: ``SINGLE``, or under torchrun the started process group's ``TorchrunProcesses``.

    A process group already started (by the caller, or by an earlier run in this process) is used;
    one started here is destroyed when the process exits.

    >>> from mixle.lm.finetune_config import FinetuneConfig
    >>> with processes(FinetuneConfig(model="m", out="o")) as ranks:  # no torchrun here
    ...     ranks.world
    1
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        yield SINGLE
        return
    check_distributed(config, world)
    torch = _torch()
    dist = torch.distributed
    if not dist.is_available():
        raise ValueError(f"torchrun started {world} processes, but this torch build has no torch.distributed: run one "
                         f"process, or install a torch with distributed support")
    kind = config.device.partition(":")[0]
    device = "cpu"
    if kind == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(BACKENDS[kind])
        # Kept for the process's life: a second run in it reuses the group (torch cannot start the
        # default group again under the same torchrun rendezvous once it was destroyed).
        atexit.register(dist.destroy_process_group)
    yield TorchrunProcesses(torch, device)


def decoder_blocks(model):
    """The decoder blocks of a transformers causal LM (``model.base_model.layers``): FSDP2's units.

    Raises:
        ValueError: the model has no such list.

    >>> decoder_blocks(object())
    Traceback (most recent call last):
    ...
    ValueError: sharded training needs the decoder blocks at model.base_model.layers, which a object lacks
    """
    blocks = getattr(getattr(model, "base_model", None), "layers", None)
    if blocks is None:
        raise ValueError(f"sharded training needs the decoder blocks at model.base_model.layers, which a "
                         f"{type(model).__name__} lacks")
    return list(blocks)


def _whole(param):
    """A parameter's full value (all processes must call it for a sharded one)."""
    full = getattr(param, "full_tensor", None)
    return (full() if full is not None else param).detach()


def _meta_copy(model):
    """A copy of ``model`` whose parameters are on the meta device (no memory); buffers are copied."""
    torch = _torch()
    memo = {id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in model.parameters()}
    return copy.deepcopy(model, memo)


class TorchrunProcesses(SingleProcess):
    """The finetune job over torchrun's processes (see the module docstring).

    Args:
        torch: the torch module (its process group started).
        device: this process's device (``cpu`` or ``cuda:LOCAL_RANK``).

    >>> issubclass(TorchrunProcesses, SingleProcess)
    True
    """

    def __init__(self, torch, device):
        self.torch, self._device, self.dist = torch, device, torch.distributed
        self.world, self.rank = self.dist.get_world_size(), self.dist.get_rank()
        self.main = self.rank == 0
        self._skeleton = None

    def device(self, device):
        return self._device

    def share(self, starts):
        """This process's contiguous share of a micro-batch's ``starts``: ``torch.tensor_split``'s part ``rank``."""
        return self.torch.tensor_split(starts, self.world)[self.rank]

    def _reduce(self, values, op):
        tensor = self.torch.tensor(values, dtype=self.torch.float64, device=self._device)
        self.dist.all_reduce(tensor, op=op)
        return tensor.tolist()

    def total(self, value):
        return self._reduce([value], self.dist.ReduceOp.SUM)[0]

    def slowest(self, seconds):
        return self._reduce([seconds], self.dist.ReduceOp.MAX)[0]

    def stop_request(self, requested):
        code = self._reduce([0 if requested is None else 1 + _SIGNALS.index(requested)], self.dist.ReduceOp.MAX)[0]
        return None if code == 0 else _SIGNALS[int(code) - 1]

    def from_main(self, compute):
        self.dist.barrier()  # every process has passed its checks of the inputs before rank 0 writes anything
        result = [compute() if self.main else None]
        self.dist.broadcast_object_list(result, src=0)
        return result[0]

    def on_main(self, write):
        if self.main:
            write()
        self.dist.barrier()  # a file rank 0 writes (the checkpoint) is on disk when any process goes on

    def shard(self, student, teacher):
        from torch.distributed.fsdp import fully_shard

        with self.torch.no_grad():  # every process starts from rank 0's values (LoRA's random init included)
            for param in student.parameters():
                if param.requires_grad:
                    self.dist.broadcast(param.data, src=0)
        self._skeleton = _meta_copy(student) if self.main else None
        for model in (student, teacher):
            if model is not None:
                for block in decoder_blocks(model):
                    fully_shard(block)
                fully_shard(model)
        notes = {"processes": self.world, "sharding": "FSDP2: fully_shard per decoder block, then the root"}
        if teacher is not None:  # each model now holds its own shards: nothing is shared any more
            own = sum(p.numel() * p.element_size() for p in teacher.parameters())
            notes.update(teacher_shared_bytes=0, teacher_own_bytes=own)
        return student, teacher, notes

    def gather(self, student):
        from mixle.torch_backend.fake_quant import invalidate_caches

        whole = {name: _whole(p).cpu() for name, p in student.named_parameters()}
        if not self.main:
            return None
        skeleton, self._skeleton = self._skeleton, None
        placed = {}  # by the meta parameter: tied parameters (embedding and head) stay one
        for name, meta in list(skeleton.named_parameters(remove_duplicate=False)):
            if id(meta) not in placed:
                placed[id(meta)] = self.torch.nn.Parameter(whole[name], requires_grad=meta.requires_grad)
            owner, _, leaf = name.rpartition(".")
            skeleton.get_submodule(owner)._parameters[leaf] = placed[id(meta)]
        invalidate_caches()
        return skeleton.to(self._device)

    def finite(self, params):
        torch = self.torch
        local = [getattr(p, "to_local", lambda p=p: p)() for p in params]
        bad = sum(0 if bool(torch.isfinite(p).all()) else 1 for p in local)
        return self.total(float(bad)) == 0

    def training_state(self, optimizer, trainable):
        tensors = {name: _whole(p).cpu() for name, p in trainable}
        saved = optimizer.state_dict()
        saved["state"] = {index: {key: _whole(value).cpu() if isinstance(value, self.torch.Tensor) else value
                                  for key, value in entry.items()} for index, entry in saved["state"].items()}
        return (tensors, saved) if self.main else ({}, {})

    def load_training_state(self, optimizer, trainable, tensors, optimizer_state):
        from torch.distributed.tensor import DTensor, distribute_tensor

        from mixle.torch_backend.fake_quant import invalidate_caches

        def local(full, param):  # this process's shard of a whole tensor every process holds
            if not isinstance(param, DTensor) or full.dim() == 0:
                return full
            return distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)

        params = [p for group in optimizer.param_groups for p in group["params"]]
        state = dict(optimizer_state)
        state["state"] = {index: {key: local(value, params[int(index)]) if isinstance(value, self.torch.Tensor)
                                  else value for key, value in entry.items()}
                          for index, entry in optimizer_state["state"].items()}
        with self.torch.no_grad():
            for name, param in trainable:
                param.copy_(local(tensors[name], param))
        optimizer.load_state_dict(state)
        invalidate_caches()


def scaled(loss, ranks):
    """``loss`` as each process backpropagates it: FSDP averages the gradients over the processes,
    so the sum of the processes' shares of the batch mean is multiplied by their number.

    >>> scaled(2.0, SINGLE)
    2.0
    """
    return loss if ranks.world == 1 else loss * ranks.world

