"""``mixle finetune``: from a pretrained checkpoint to a better quantized file, in one run.

The torch job (``run_finetune_torch``; ``mixle.lm.finetune_run.run_finetune`` runs each backend's):

1. checks the output directory (new or empty unless ``--overwrite``; writable, room for the files
   and the checkpoint), loads the model and its tokenizer (``mixle.lm.finetune_load``) and checks
   the target and the GGUF writer fit them, tokenizes the data (``mixle.lm.finetune_data``), all
   before any training or writing;
2. evaluates the float model and PTQ on the same target (``quantize_model``: what
   ``llama-quantize`` gives the user), on the held-out windows, in mixle and, from their GGUF
   files, in llama.cpp;
3. wraps the model with ``apply_qat`` (every decoder-block matrix; the embedding and tied head
   stay float, as PTQ leaves them; with a llama.cpp mix target such as ``Q4_K_M`` every matrix
   llama-quantize quantizes, embedding and head included, on the block type it gives it),
   optionally with LoRA adapters on a frozen base, and trains it
   distilled from the float model (``mixle.lm.finetune_train``), checkpointing as it goes;
   With ``--imatrix`` / ``--gptq`` also the calibrated baselines "PTQ imatrix" and "GPTQ"
   (``mixle.lm.finetune_baselines``: calibrated on windows of the training split only), and QAT
   then fake-quantizes with the importance matrix (the row "QAT imatrix");
4. evaluates the QAT model converted to its integer codes, writes the GGUF (the trained blocks
   as they are), for an integer grid a compressed-tensors directory and, unless
   ``--no-hf-checkpoint``, the QAT model's float32 master weights as a transformers checkpoint
   (``hf/``, ``mixle.lm.finetune_hf``: llama.cpp's converter and quantizer make the trained
   blocks from it), runs the GGUF in llama.cpp, and writes ``results.json``, ``table.txt``,
   ``finetune.png`` and ``README.md`` (``mixle.lm.finetune_report``).

Memory: the teacher is a copy of the float model that shares every tensor the student does not
train (the embedding and tied head, the norms; with LoRA all of the base) instead of copying it.
The distillation loss runs a few tokens at a time (``mixle.lm.chunked_loss``): besides the
student's and the teacher's logits no tensor of their size is made (the gradient goes into the
teacher's). After every step and phase the C heap's free pages go back to the system
(``return_free_memory``): else glibc keeps the freed layer-sized tensors of the steps resident
between long-lived ones, about 20 MB a layer of SmolLM2-135M. ``results.json`` records the peak
resident memory of each phase (``PeakMemory``).
"""

import contextlib
import copy
import dataclasses
import hashlib
import math
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

from mixle._optional import require
from mixle.lm.family import TRANSFORMERS
from mixle.lm import finetune_baselines as baselines
from mixle.lm.cpu_bfloat16 import check_bfloat16
from mixle.lm.finetune_checkpoint import CHECKPOINT, check_backend, check_new_out, read_checkpoint, write_checkpoint
from mixle.lm.finetune_config import FinetuneConfig
from mixle.lm.finetune_chat import chat_answers
from mixle.lm.finetune_data import prepare_finetune_data
from mixle.lm.finetune_generated import generated_data
from mixle.lm.finetune_distributed import processes
from mixle.lm.finetune_hf import check_hf_checkpoint, write_hf_checkpoint
from mixle.lm.finetune_load import check_vocabulary, load_model
from mixle.lm.finetune_report import (COMPRESSED_DIR, FLOAT, GGUF_FILE, GPTQ, PTQ, PTQ_IMATRIX, QAT, QAT_IMATRIX,
                                     finish_run)
from mixle.lm.finetune_train import FinetuneTrainer, return_free_memory
from mixle.lm.head_cast import head_cast_once
from mixle.lm.llama_cpp_eval import (llama_cpp_loss, llama_cpp_module, llama_cpp_skipped, llama_cpp_text_loss,
                                     window_texts)
from mixle.lm.training import held_out_loss

__all__ = ["run_finetune_torch", "check_output_room", "target_outputs", "shared_teacher", "PeakMemory", "Evaluator",
           "needed_bytes", "model_digest", "FinetuneRun"]

# What the llama_cpp_text_* numbers are (results.json's llama_cpp.text).
TEXT_EVALUATION = ("each window's text (as the model's tokenizer decodes it) tokenized by llama.cpp with the file's "
                   "tokenizer, as a user's prompt is (special tokens parsed, no BOS); llama_cpp_text_same_tokens: "
                   "windows llama.cpp split into exactly the ids the model's tokenizer makes of that text")
EXCLUDE = ("lm_head",)  # the head (tied to the embedding or not) stays float, as PTQ leaves it


def target_outputs(model, spec, float_matrices, mix=None):
    """Which files the target can be written as: ``{"gguf": bool, "compressed_tensors": bool}``.

    ``mix``: instead of ``spec``, a llama.cpp mix (``"Q4_K_M"``): a GGUF file, each matrix on the
    block type llama.cpp's quantizer gives it (``gguf_mix_specs``, which checks the model fits).

    Raises:
        ValueError: no file mixle writes stores ``spec``, or a layer's shape cannot hold it (the
            message names the layer and why).

    >>> target_outputs  # doctest: +ELLIPSIS
    <function target_outputs at ...>
    """
    from mixle.exports.compressed_tensors import weight_args
    from mixle.gguf.blocks import BLOCK, GGML_BLOCKS

    if mix is not None:
        from mixle.gguf.writer import gguf_mix_specs

        gguf_mix_specs(model, mix)
        return {"gguf": True, "compressed_tensors": False}
    outputs = {"gguf": spec.grid_record.ggml_type in GGML_BLOCKS, "compressed_tensors": True}
    try:
        weight_args(spec)
    except ValueError:
        outputs["compressed_tensors"] = False
    except ImportError:
        outputs["compressed_tensors"] = False
    torch = require("torch", extra="torch", purpose="mixle finetune")
    for path, layer in model.named_modules():
        if not isinstance(layer, torch.nn.Linear) or path in EXCLUDE:
            continue
        group = spec.group_size if spec.granularity == "group" else None
        if group and layer.in_features % group:
            why = (f"{spec.grid} stores blocks of {group} consecutive inputs" if spec.grid_record.block
                   else f"its scales cover groups of {group} inputs")
            raise ValueError(f"target={spec.short()!r} cannot be stored for this {type(model).__name__}: layer "
                             f"{path!r} has {layer.in_features} inputs and {why}, which do not divide "
                             f"{layer.in_features}; choose a target whose group divides it, e.g. int4/channel")
    hidden = model.get_input_embeddings().embedding_dim
    if outputs["gguf"] and float_matrices == "q8_0" and hidden % BLOCK:
        raise ValueError(f"float_matrices='q8_0' cannot store the token embedding of width {hidden} (Q8_0 blocks "
                         f"of {BLOCK}): pass --float-matrices f16")
    return outputs


def check_output_room(out, needed_bytes):
    """Create ``out`` and check it is writable and has ``needed_bytes`` free; ValueError otherwise.

    Also checks that matplotlib (for ``finetune.png``) is installed, so the run cannot fail at its end.

    >>> import tempfile
    >>> check_output_room(tempfile.mkdtemp(), 1)
    """
    require("matplotlib", extra="bench", purpose="the finetune plot")
    try:
        os.makedirs(out, exist_ok=True)
        handle, probe = tempfile.mkstemp(dir=out, prefix=".mixle-write-check-")
        os.close(handle)
        os.remove(probe)
    except OSError as err:
        raise ValueError(f"out={str(out)!r} is not a writable directory ({err.strerror or err}): choose a directory "
                         f"you can write") from None
    free = shutil.disk_usage(out).free
    if free < needed_bytes:
        raise ValueError(f"out={str(out)!r} has {free / 2**20:,.0f} MiB free, but this run writes about "
                         f"{needed_bytes / 2**20:,.0f} MiB (checkpoint, temporary GGUF files, outputs): free some "
                         f"space or choose another --out")


def needed_bytes(model, outputs, config):
    """About the most bytes the run has on disk at once (a generous estimate).

    >>> import torch
    >>> needed_bytes(torch.nn.Linear(4, 4), {"gguf": True, "compressed_tensors": False}, FinetuneConfig(model="m",
    ...              out="o")) > 2**20
    True
    """
    params = sum(p.numel() for p in model.parameters())
    checkpoint = 4 * params * (1 if config.lora else 3)  # trained tensors + AdamW's two moments
    quantized = params  # one byte per weight covers Q4_0 / Q8_0 / int codes and the float embedding
    files = (4 * params + 2 * quantized if outputs["gguf"] else 0) + (quantized if outputs["compressed_tensors"] else 0)
    kept = quantized * ((config.imatrix != "off") + (config.gptq != "off"))  # ptq-imatrix.gguf, the GPTQ file
    hf = 4 * params if config.hf_checkpoint else 0  # the float32 transformers checkpoint
    return int(1.1 * (checkpoint + files + kept + hf)) + 2**20


def model_digest(model):
    """The sha256 of a torch model's state dict (names and bytes): what a resumed run must load again.

    >>> import torch
    >>> len(model_digest(torch.nn.Linear(2, 2)))
    64
    """
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch_uint8()).numpy().tobytes())
    return digest.hexdigest()


def torch_uint8():
    """torch's uint8 dtype (a tensor's bytes are viewed as it for digests).

    >>> str(torch_uint8())
    'torch.uint8'
    """
    return require("torch", extra="torch", purpose="mixle finetune").uint8


def shared_teacher(model, trained, matmul_dtype=None):
    """A frozen copy of ``model`` (fake-quant off: the float model) sharing every tensor not in ``trained``.

    Args:
        model: the QAT-wrapped student before training.
        trained: the parameters training will change (the teacher gets its own copy of these).
        matmul_dtype: the autocast dtype the teacher runs under (bfloat16), or None. Its own copies
            of the linear layers' weights are then stored in it (``store_matmul_weights``): the same
            products from half their memory.

    Returns:
        The teacher, in eval mode, every parameter ``requires_grad=False``.

    >>> import torch
    >>> from mixle.api import apply_qat
    >>> net = apply_qat(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)), exclude=("1",))
    >>> teacher = shared_teacher(net, [net[0].weight, net[0].bias])
    >>> teacher[1].weight is net[1].weight, teacher[0].weight is net[0].weight
    (True, False)
    """
    from mixle.api import set_fake_quant_enabled

    trained_ids = {id(p) for p in trained}
    memo = {id(p): p for p in model.parameters() if id(p) not in trained_ids}
    shared = list(memo.values())  # deepcopy adds its copies to memo
    teacher = copy.deepcopy(model, memo)
    set_fake_quant_enabled(teacher, False)
    for param in teacher.parameters():
        if id(param) not in memo:  # the teacher's own copies; shared tensors keep the student's flags
            param.requires_grad_(False)
    if matmul_dtype is not None:
        store_matmul_weights(teacher, matmul_dtype, keep=shared)
    return teacher.eval()


def store_matmul_weights(model, dtype, keep=()):
    """Store the weights and biases of ``model``'s linear layers in ``dtype``: under autocast to
    ``dtype`` each product casts them to it anyway, so the products get the same values with no cast
    at every call. Linear layers are ``torch.nn.Linear`` and mixle's ``QATWrapper`` with fake-quant
    off (both run ``F.linear``). A tensor whose matrix products are its only use is replaced (half its
    memory); a head tied to the embedding gets its own copy in ``dtype`` and the embedding, whose
    lookups autocast leaves alone, keeps the tensor (for Gemma 3's 262,144 x 640 table that saves a
    0.34 GB cast at every call for 0.34 GB held). Other shared tensors and those in ``keep`` are left
    as they are.

    Args:
        model: a frozen model run only under autocast to ``dtype`` (a teacher).
        dtype: autocast's dtype (``torch.bfloat16``).
        keep: parameters shared with another model, frozen in both: only a tied head's copy is made of them.

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 5))
    >>> net[2].weight = net[0].weight  # a head tied to the embedding
    >>> store_matmul_weights(net, torch.bfloat16)
    >>> net[1].weight.dtype, net[2].weight.dtype, net[0].weight.dtype
    (torch.bfloat16, torch.bfloat16, torch.float32)
    """
    import torch

    from mixle.torch_backend.layers.qat import QATWrapper

    def linear(module):
        return type(module) is torch.nn.Linear or (type(module) is QATWrapper and not module.enabled)

    kept = {id(p) for p in keep}
    users = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            users.setdefault(id(param), []).append(module)
    for module in filter(linear, list(model.modules())):
        for name, param in module.named_parameters(recurse=False):
            others = [m for m in users[id(param)] if m is not module]
            sole = not others and id(param) not in kept
            tied_head = name == "weight" and others and all(isinstance(m, torch.nn.Embedding) for m in others)
            if name in ("weight", "bias") and (sole or tied_head):
                module._parameters[name] = type(param)(param.detach().to(dtype), requires_grad=False)


class Evaluator:
    """The run's evaluations: mixle's held-out loss and, from a GGUF file, llama.cpp's.

    ``loss(model, windows, batch)`` is the held-out loss of a model (default: the torch job's
    ``held_out_loss`` of a transformers model; the jax job passes its own), and ``answers(model)``
    its greedy answers to ``--prompts`` (default: ``chat_answers`` of a transformers model).

    >>> Evaluator.__name__
    'Evaluator'
    """

    def __init__(self, config, data, tokenizer, gguf_tokenizer=None, loss=None, answers=None):
        self.config, self.data, self.tokenizer = config, data, tokenizer
        self.loss = loss or (lambda model, windows, batch: held_out_loss(model, windows, batch=batch,
                                                                         family=TRANSFORMERS))
        self.answers = answers or (lambda model: chat_answers(model, tokenizer, config.prompts, config.answer_tokens))
        self.gguf_tokenizer = gguf_tokenizer  # checked before training (check_vocabulary), written into every GGUF
        self.llama_cpp = config.llama_cpp and llama_cpp_module() is not None
        self.llama_cpp_info = llama_cpp_skipped() if config.llama_cpp else None
        self.texts, self.texts_seen = {}, {}

    def mixle(self, model, row):
        batch = self.config.batch_size
        row["loss"] = self.loss(model, self.data.eval_windows, batch)
        row["perplexity"] = math.exp(row["loss"])
        if self.data.extra_windows is not None:
            row["eval_data_loss"] = self.loss(model, self.data.extra_windows, batch)
            row["eval_data_perplexity"] = math.exp(row["eval_data_loss"])
        if self.config.prompts:  # what the model says, beside how well it predicts (mixle.lm.finetune_chat)
            row["answers"] = self.answers(model)
        return row

    def from_file(self, path, row):
        """llama.cpp's losses of the GGUF ``path``: on the windows' token ids (``llama_cpp_loss``, parity
        with mixle's), and on their text tokenized by llama.cpp itself (``llama_cpp_text_loss``: what a
        user's prompt gets, the file's own tokenizer included)."""
        if not self.llama_cpp:
            return row
        for key, windows in (("", self.data.eval_windows), ("eval_data_", self.data.extra_windows)):
            if windows is not None:
                loss, info = llama_cpp_loss(path, windows, self.config.threads)
                row[f"{key}llama_cpp_loss"], row[f"{key}llama_cpp_perplexity"] = loss, math.exp(loss)
                texts, reference = self._texts(key, windows)
                text_loss, text = llama_cpp_text_loss(path, texts, self.config.threads, reference)
                row[f"{key}llama_cpp_text_loss"] = text_loss
                row[f"{key}llama_cpp_text_perplexity"] = math.exp(text_loss)
                row[f"{key}llama_cpp_text_tokens"] = text["tokens"]
                row[f"{key}llama_cpp_text_same_tokens"] = text["same_tokens"]
                self.texts_seen[key.rstrip("_") or "held_out"] = {"windows": text["texts"],
                                                                  "model_tokenizer_tokens": text["reference_tokens"]}
                self.llama_cpp_info = {**info, "text": {"what": TEXT_EVALUATION, **self.texts_seen}}
        return row

    def _texts(self, key, windows):
        """The text of each window and the model tokenizer's ids of it (computed once per set of windows)."""
        if key not in self.texts:
            texts = window_texts(self.tokenizer, windows)
            self.texts[key] = texts, [self.tokenizer.encode(text, add_special_tokens=False) for text in texts]
        return self.texts[key]

    def gguf(self, model, path, float_matrices, row, mix=None, importance=None):
        """Write ``model`` as the GGUF ``path`` (in the llama.cpp ``mix`` if given, with the types it gives
        with ``importance``), record its bytes and llama.cpp's losses."""
        from mixle.gguf.writer import save_gguf

        save_gguf(model, path, tokenizer=self.gguf_tokenizer, float_matrices=float_matrices, gguf_mix=mix,
                  importance=importance)
        row["file_bytes"] = os.path.getsize(path)
        return self.from_file(path, row)


def _evaluate_before(model, config, outputs, evaluator, scratch):
    """The float and PTQ rows (mixle, and llama.cpp from their GGUF files in ``scratch``).

    With a mix target PTQ is what ``llama-quantize`` makes of the float model: ``quantize_model``
    on the mix, whose file is ``save_gguf(model, gguf_mix=mix)``'s, bit-identical to llama.cpp's quantizer's.
    """
    from mixle.api import quantize_model

    float_row = evaluator.mixle(model, {"method": FLOAT})
    if outputs["gguf"] and evaluator.llama_cpp:
        path = os.path.join(scratch, "float.gguf")
        evaluator.gguf(model, path, "f32", float_row)
        os.remove(path)
    mix = config.mix()
    ptq = (quantize_model(model, gguf_mix=mix, **config.act_fields()) if mix
           else quantize_model(model, config.spec(), exclude=EXCLUDE))
    ptq_row = evaluator.mixle(ptq, {"method": PTQ, "spec": mix or config.spec().short()})
    if outputs["gguf"] and evaluator.llama_cpp:
        path = os.path.join(scratch, "ptq.gguf")
        evaluator.gguf(ptq, path, config.float_storage(), ptq_row, mix=mix)  # = save_gguf(model, gguf_mix=mix)
        os.remove(path)
    return [float_row, ptq_row]


def _prepare_student(model, config, importance=None, single_process=True):
    """Wrap ``model`` for QAT in place (LoRA too if asked; with the ``importance`` matrix, an
    ``Importance``, if given); returns ``(student, teacher, shares)``. Under bfloat16 autocast in one
    process the teacher's own matrices are stored in bfloat16 (``shared_teacher``); FSDP2 shards a
    block's parameters together, so there they keep the student's dtype."""
    import torch

    from mixle.api import apply_lora, apply_qat, pull_toward_stored

    mix = config.mix()
    extra = {} if importance is None else {"importance": baselines.target_importance(importance, config, EXCLUDE)}
    student = (apply_qat(model, gguf_mix=mix, **config.act_fields(), **extra) if mix
               else apply_qat(model, spec=config.spec(), exclude=EXCLUDE, **extra))
    for param in student.parameters():
        param.requires_grad_(False)
    layers = [m for m in student.modules() if getattr(m, "spec", None) is not None]
    trained = [] if config.lora else [p for m in layers for p in m.parameters(recurse=False)]
    trained += [p for m in layers for n, p in m.named_parameters(recurse=False) if n == "weight_log2_scale"]
    matmul_dtype = torch.bfloat16 if config.dtype == "bfloat16" and single_process else None
    teacher = None if config.distill_weight() == 0.0 else shared_teacher(student, trained, matmul_dtype)
    margin = pull_toward_stored(student, config.tie_margin)  # after the teacher's copy: it keeps the float weights
    for param in trained:
        param.requires_grad_(True)
    if config.lora:
        paths = [path for path, m in student.named_modules() if getattr(m, "spec", None) is not None]
        student = apply_lora(student, rank=config.lora, alpha=config.lora_alpha or 2.0 * config.lora,
                             patterns=[_exact(p) for p in paths], train_base=True, quantize_merged=True)
    return student, teacher, {**_sharing(student, teacher), "tie_margin": margin}


def _exact(path):
    import re

    return re.escape(path)


def _sharing(student, teacher):
    """Bytes of the teacher's tensors shared with the student, and of its own copies."""
    if teacher is None:
        return {"teacher": None}
    mine = {id(p) for p in student.parameters()}
    tensors = list(teacher.parameters())
    shared = sum(p.numel() * p.element_size() for p in tensors if id(p) in mine)
    own = sum(p.numel() * p.element_size() for p in tensors if id(p) not in mine)
    return {"teacher": "float model, fake-quant off", "teacher_shared_bytes": shared, "teacher_own_bytes": own}


def _evaluate_after(student, config, outputs, evaluator, out, importance=None):
    """The QAT row ("QAT imatrix" when trained with the ``importance``): the trained model converted to
    its codes; writes the GGUF / compressed-tensors files and the float checkpoint. Returns ``(row,
    {kind: file}, results.json's "hf" entry or None)``."""
    from mixle.api import convert, merge_lora

    if config.lora:
        student = merge_lora(student)
    fake = held_out_loss(student, evaluator.data.eval_windows, batch=config.batch_size, family=TRANSFORMERS)
    converted = convert(student)
    spec = config.mix() or config.spec().short()
    method = QAT if importance is None else QAT_IMATRIX
    row = evaluator.mixle(converted, {"method": method, "spec": spec, "fake_quant_loss": fake})
    files, hf = {}, None
    if outputs["gguf"]:  # the converted codes are the trained blocks: written without quantizing again
        mixed = importance.values if importance is not None and config.mix() else None  # the mix's imatrix types
        evaluator.gguf(converted, os.path.join(out, GGUF_FILE), config.float_storage(), row, mix=config.mix(),
                       importance=mixed)
        files["gguf"] = GGUF_FILE
    del converted
    if outputs["compressed_tensors"]:
        from mixle.exports.compressed_tensors import save_pretrained_compressed

        save_pretrained_compressed(student, os.path.join(out, COMPRESSED_DIR), tokenizer=evaluator.tokenizer,
                                   overwrite=True)
        files["compressed_tensors"] = COMPRESSED_DIR
    if config.hf_checkpoint:  # the master weights whose lattice QAT trained: llama-quantize's blocks of them
        hf = write_hf_checkpoint(student, config, evaluator.tokenizer, out)
        files["hf"] = hf["directory"]
    return row, files, hf


@contextlib.contextmanager
def _threads(torch, threads):
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(previous)


class PeakMemory:
    """Peak resident memory and wall time per phase of a run (Linux's VmHWM, reset between phases;
    elsewhere ``ru_maxrss`` for the whole run); with ``echo``, each phase's line goes to stderr as
    it ends (a long run shows where it is).

    >>> peaks = PeakMemory()
    >>> peaks.end("loading") > 0 and peaks.total() > 0 and peaks.seconds["loading"] >= 0
    True
    """

    def __init__(self, echo=False):
        self.phases, self.seconds, self.echo = {}, {}, echo
        self.since = time.perf_counter()

    def end(self, phase):
        """Record the peak and the seconds since the previous phase ended as ``phase``'s, and restart both."""
        now = time.perf_counter()
        self.seconds[phase], self.since = round(now - self.since, 3), now
        peak = _vm_hwm()
        if self.echo:
            print(f"{phase}: {self.seconds[phase]:.0f} s, peak memory {(peak or _ru_maxrss()) / 1e9:.2f} GB",
                  file=sys.stderr, flush=True)
        if peak is None:
            return _ru_maxrss()
        self.phases[phase] = peak
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
        except OSError:
            pass
        return peak

    def total(self):
        """The peak over every phase (the whole run)."""
        return max(list(self.phases.values()) + [_vm_hwm() or 0]) if self.phases else _ru_maxrss()


def _ru_maxrss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def _vm_hwm():
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class FinetuneRun:
    """One finetune run: the loaded model, data, evaluations and the trainer, phase by phase.

    The jax job's run (``mixle.lm.finetune_jax``) is one too, with its own source check, evaluator,
    evaluations and training.

    >>> FinetuneRun.__name__
    'FinetuneRun'
    """

    def __init__(self, config, resume, progress, ranks):
        self.config, self.resume, self.progress, self.ranks = config, resume, progress, ranks
        self.device = ranks.device(config.device)
        self.peaks = PeakMemory(echo=progress and ranks.main)
        self.out = Path(config.out)
        self.checkpoint_path = self.out / CHECKPOINT
        self.payload = read_checkpoint(self.checkpoint_path) if resume else None
        if resume:
            check_backend(self.payload, config, self.checkpoint_path)
        else:
            check_new_out(self.out, config)
        self.check_source()
        self.loaded = load_model(config.model)
        self.model = self.loaded.model
        self.outputs = target_outputs(self.model, config.spec(), config.float_storage(), config.mix())
        check_hf_checkpoint(self.model, config)
        gguf_words = check_vocabulary(self.loaded, gguf=self.outputs["gguf"], tokenizer_pre=config.tokenizer_pre)
        self.importance = self._importance_at_start()
        self.data = prepare_finetune_data(config, self.loaded.tokenizer, TRANSFORMERS.context_length(self.model))
        check_output_room(self.out, needed_bytes(self.model, self.outputs, config))
        if config.generated_tokens:
            self.peaks.end("loading")
            self.data = generated_data(self)
            self.peaks.end("sampled text")
        self.inputs_digest = {"data": self.data.digest, "model": model_digest(self.model)}
        digests = self.digests()
        if self.payload is not None and self.payload.get("digests") != digests:
            which = [k for k in digests if self.payload.get("digests", {}).get(k) != digests[k]]
            raise ValueError(f"resume: the {' and '.join(which)} differ from the interrupted run's "
                             f"({str(self.checkpoint_path)!r}): resume with the same --model, --data and --imatrix "
                             f"file")
        self.evaluator = self.make_evaluator(gguf_words)
        if not resume and config.overwrite:  # every input is checked: a checkpoint left there is another run's
            ranks.on_main(lambda: self.checkpoint_path.unlink(missing_ok=True))

    def check_source(self):
        """Refuse, before loading it, a ``--model`` this run cannot load (the torch job loads every kind)."""

    def make_evaluator(self, gguf_words):
        """The run's ``Evaluator`` (writing ``gguf_words`` into every GGUF)."""
        return Evaluator(self.config, self.data, self.loaded.tokenizer, gguf_words)

    def digests(self):
        """What a resumed run must have in common with this one: the data's, the model's and the
        importance matrix's digests."""
        imatrix = {} if self.importance is None else {"imatrix": self.importance.digest}
        return {**self.inputs_digest, **imatrix}

    def _importance_at_start(self):
        """The importance matrix known before any evaluation: a ``--imatrix`` file's (checked against the
        model before anything is written), or on resume the run's own ``imatrix.gguf``; else None."""
        mode = self.config.importance_mode()
        if mode == "off" or (mode == "calibrate" and self.payload is None):
            return None
        if mode == "file":
            return baselines.read_importance(self.config.imatrix, self.model)
        path = self.out / baselines.IMATRIX_FILE  # read back, not calibrated again: the same values bit for bit
        if not path.is_file():
            raise FileNotFoundError(f"resume: {str(path)!r} is missing: the interrupted run calibrated its importance "
                                    f"matrix into it; start the run again with another --out")
        return baselines.read_importance(path, self.model, self.payload.get("imatrix"))

    def before(self):
        """The float and PTQ rows, and the calibrated baselines asked for (from the checkpoint when resuming)."""
        if self.payload is not None:
            self.evaluator.llama_cpp_info = self.payload.get("llama_cpp")
            return self.payload["rows"]
        self.model.to(self.device)
        rows = self.ranks.from_main(self._evaluate_before)  # rank 0 evaluates; the others wait for its rows
        if self.importance is None and self.config.importance_mode() == "calibrate":  # rank 0 calibrated: its file
            self.importance = baselines.read_importance(self.out / baselines.IMATRIX_FILE, self.model)
        return rows

    def _evaluate_before(self):
        with tempfile.TemporaryDirectory(dir=self.out, prefix=".mixle-finetune-") as scratch:
            rows = _evaluate_before(self.model, self.config, self.outputs, self.evaluator, scratch)
        if self.config.importance_mode() == "calibrate":  # on the float model, from training windows only
            self.importance = baselines.calibrate(self.model, self.data, self.config, self.out)
        if self.importance is not None:
            rows.append(baselines.ptq_imatrix_row(self.model, self.config, self.importance, self.evaluator, self.out,
                                                  EXCLUDE))
        if self.config.gptq != "off":
            rows.append(baselines.gptq_row(self.model, self.data, self.config, self.outputs, self.evaluator, self.out,
                                           EXCLUDE))
        return rows

    def qat_importance(self):
        """The importance QAT fake-quantizes with (None: the reference quantizer)."""
        return self.importance if self.config.qat_imatrix else None

    def baseline_info(self, rows):
        """``(results' "imatrix" entry or None, {kind: file} of the kept baseline files)``."""
        kinds = {PTQ_IMATRIX: "ptq_imatrix", GPTQ: "gptq"}
        files = {kinds[r["method"]]: r["file"] for r in rows if r["method"] in kinds and "file" in r}
        if self.importance is None:
            return None, files
        info = {**self.importance.info, "qat": self.config.qat_imatrix}
        if self.config.importance_mode() == "calibrate":
            files["imatrix"] = baselines.IMATRIX_FILE
        return info, files

    def save(self, trainer, rows):
        """Write the checkpoint (only from finite trained tensors: a diverged state is never saved)."""
        if not trainer.weights_finite():
            return
        state = trainer.state_dict()  # under torchrun every process gives its shards; rank 0 writes
        self.ranks.on_main(lambda: write_checkpoint(self.checkpoint_path, {
            "config": dataclasses.asdict(self.config), "digests": self.digests(), "rows": rows,
            "llama_cpp": self.evaluator.llama_cpp_info, "imatrix": None if self.importance is None else
            self.importance.info, **state}))

    def train(self, rows, callback):
        """Prepare the student and teacher, continue from the checkpoint if any, and train."""
        self.model.to(self.device)
        self.peaks.end("loading and float / PTQ evaluation")
        return_free_memory()  # the evaluations' freed tensors, kept by the C heap, go back before training
        student, teacher, sharing = _prepare_student(self.model, self.config, self.qat_importance(),
                                                     single_process=self.ranks.world == 1)
        student, teacher, sharded = self.ranks.shard(student, teacher)  # FSDP2 under torchrun
        trainer = FinetuneTrainer(student, teacher, TRANSFORMERS, self.data, self.config, self.ranks)
        if self.payload is not None:
            trainer.load_state_dict(self.payload, self.checkpoint_path)
            self.payload = None  # its tensors are in the model now
        else:
            self.save(trainer, rows)  # before the first step: a full disk shows here, not at the end
        bfloat16 = require("torch", extra="torch", purpose="mixle finetune").bfloat16
        with head_cast_once(student, bfloat16 if self.config.dtype == "bfloat16" and self.ranks.world == 1 else None):
            state = trainer.train(lambda: self.save(trainer, rows), progress=self.progress, callback=callback)
        trained = sum(p.numel() for _, p in trainer.trainable)
        trainer.release()  # AdamW's state and the teacher go before the files are written
        return_free_memory()
        student = self.ranks.gather(student)  # under torchrun: the whole model on rank 0, None elsewhere
        self.peaks.end("training")
        return student, state, {"trained_parameters": trained, **sharing, **sharded}


def run_finetune_torch(config, *, resume=False, progress=True, callback=None):
    """Run the torch finetune job of ``config`` (see the module docstring); returns the results dict.

    Args:
        config: a ``FinetuneConfig``.
        resume: continue the interrupted run whose checkpoint is in ``config.out``.
        progress: show a tqdm bar with tokens/s, ETA and the loss.
        callback: ``f(trainer)`` after every step (e.g. for tests).

    Raises:
        FileNotFoundError, ValueError: bad model, data, target or output directory (before training).
        mixle.lm.finetune_train.Stopped: Ctrl-C or SIGTERM; the checkpoint is written.
        NonFiniteLossError: training diverged; the last checkpoint is kept.

    Under ``torchrun`` (``mixle.lm.finetune_distributed``) every process trains its shards of the
    model; rank 0 writes the files and returns the results, the other processes return None.
    ``mixle.lm.finetune_run.run_finetune`` runs this for ``backend="torch"``.

    >>> run_finetune_torch(FinetuneConfig(model="/no/such/model", out="/tmp/x"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    FileNotFoundError: model='/no/such/model' does not exist: ...
    """
    if not isinstance(config, FinetuneConfig):
        raise TypeError(f"config must be a FinetuneConfig, got {type(config).__name__}")
    if config.backend != "torch":
        raise ValueError(f"backend={config.backend!r}: run_finetune_torch runs the torch job; "
                         f"call mixle.lm.finetune_run.run_finetune, which runs each backend's")
    torch = require("torch", extra="torch", purpose="mixle finetune")
    began = time.perf_counter()
    with _threads(torch, config.threads) as threads, processes(config) as ranks:
        bfloat16 = check_bfloat16(torch, config, echo=ranks.main)
        run = FinetuneRun(config, resume, progress, ranks)
        rows = run.before()
        student, state, model_info = run.train(rows, callback)
        if student is None:  # not rank 0 under torchrun: rank 0 evaluates the gathered model and writes
            return None
        row, files, hf = _evaluate_after(student, config, run.outputs, run.evaluator, run.out, run.qat_importance())
        run.peaks.end("QAT evaluation and files")
    environment = {"python": platform.python_version(), "torch": torch.__version__, "threads": threads,
                   "device": config.device, "platform": platform.platform(), **bfloat16}
    return finish_run(config, run, rows, row, files, state, model_info, environment, began, hf=hf)
