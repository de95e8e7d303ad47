"""``mixle finetune --backend jax``: the finetune job with the model trained and evaluated in JAX.

The run is the torch job's (``mixle.lm.finetune``) phase by phase, on mixle's Flax causal LM
(``mixle.lm.flax_causal_lm``) of the same model, a transformers directory or a GGUF file (the Flax
model takes the float32 weights transformers loaded, from the safetensors or dequantized by its GGUF
loader):

1. the same checks, before anything is trained or written: the output directory, the model
   (``load_model``'s checks of the directory; its transformers twin gives the target's file kinds,
   the vocabulary check and the digests a resumed run must match), the data and its windows;
2. the float and PTQ rows (PTQ: ``convert(apply_qat(copy of the Flax model, ...))``), with
   ``--imatrix calibrate`` the importance matrix collected on the Flax float model (what
   llama-imatrix sums: each matrix's squared input columns), written as ``imatrix.gguf``, and the
   row "PTQ imatrix";
3. ``apply_qat`` on the Flax model and training of its quantized kernels, distilled from the float
   model, by ``mixle.lm.finetune_jax_train.JaxTrainer`` (the torch job's loss, AdamW and schedule;
   data-parallel over ``jax.devices()``; checkpoints, Ctrl-C / SIGTERM and ``--resume`` through the
   shared loop and checkpoint file, which records ``--backend jax``);
4. the QAT row of the converted model, the GGUF and compressed-tensors files (``save_gguf`` /
   ``save_pretrained_compressed`` of the Flax model: the torch model's files for the same weights),
   ``results.json``, the table, the plot and the model card (``finish_run``).

Needs jax, flax and qwix (the ``jax`` extra) besides the torch job's packages, which still read
the tokenizer and write the files. A hub id is refused (the jax job downloads nothing), and so is a
run under torchrun.
"""

import os
import platform
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mixle.lm import finetune_baselines as baselines
from mixle.lm.finetune import Evaluator, FinetuneRun
from mixle.lm.finetune_distributed import SINGLE
from mixle.lm.finetune_hf import HF_DIR, write_hf_checkpoint
from mixle.lm.finetune_chat import greedy_answers, stop_ids
from mixle.lm.finetune_jax_train import JaxTrainer, data_mesh, greedy_next_token, held_out_loss
from mixle.lm.finetune_load import model_kind
from mixle.lm.finetune_report import (COMPRESSED_DIR, FLOAT, GGUF_FILE, PTQ, PTQ_IMATRIX, QAT, QAT_IMATRIX,
                                     finish_run)
from mixle.lm.finetune_train import return_free_memory

__all__ = ["run_finetune_jax", "JaxRun", "collect_importance", "flax_exclude"]

_EXAMPLE = (jnp.zeros((1, 4), jnp.int32),)  # apply_qat's trace of one call (shapes only)
_MIN_ROWS = 16  # llama-imatrix skips products of fewer input rows (as calibrate_importance does)


def flax_exclude(model):
    """What a grid target keeps float on the Flax model, as the torch job keeps ``lm_head``: the head
    (the embedding's ``attend`` when tied; the embedding lookup itself is never a QAT product).

    >>> flax_exclude  # doctest: +ELLIPSIS
    <function flax_exclude at ...>
    """
    return ("embed_tokens",) if model.lm_head is None else ("lm_head",)


def _qat_arguments(model, config, importance=None):
    from mixle.flax_backend.gguf_tensors import flax_path

    mix = config.mix()
    if mix:
        arguments = {"gguf_mix": mix, **config.act_fields()}
    else:
        arguments = {"spec": config.spec(), "exclude": flax_exclude(model)}
    if importance is not None:
        values = baselines.target_importance(importance, config, ("lm_head",))
        arguments["importance"] = {flax_path(path): v for path, v in values.items()}
    return arguments


def _made(model, arguments):
    """How ``apply_qat(model, **arguments)`` makes a student, hashable: the float model's graphdef and the
    arguments (the importance by its bytes' digest), for ``JaxTrainer``'s reuse of compiled steps."""
    import hashlib

    described = []
    for name, value in sorted(arguments.items()):
        if name == "importance":
            digest = hashlib.sha256()
            for path in sorted(value):
                array = np.ascontiguousarray(value[path])
                digest.update(f"{path}:{array.dtype}:{array.shape};".encode())
                digest.update(array.tobytes())
            value = digest.hexdigest()
        described.append((name, value))
    return nnx.graphdef(model), tuple(described)


def _fake_quantized(model, config, importance=None):
    """A copy of the Flax float ``model`` fake-quantized for the target (with the importance if given)."""
    from mixle.api import apply_qat

    copy = nnx.clone(model)
    apply_qat(copy, example_inputs=_EXAMPLE, **_qat_arguments(model, config, importance))
    return copy


def _with_stored_values(model, quantized):
    """A copy of the Flax float ``model`` (not wrapped) whose kernels (and embedding, if quantized) hold
    the values the fake-quantized copy ``quantized`` stores: the same forward values, evaluated by the
    float model's compiled forward instead of a graph with the quantizer in it. The values come from
    one compiled quantizer call per group of kernels (``kernel_groups``), or numpy's numerics where
    the kernels do not group; the two give the same values."""
    from mixle.flax_backend.kernel_groups import kernel_groups, quantized_state, run_wrapped_products
    from mixle.flax_backend.qat import quantized_kernels

    copy = nnx.clone(model)
    run_wrapped_products(copy, quantized)  # --act-bits rounding, group views: the wrapped forward's products
    groups = kernel_groups(quantized)
    if groups is not None:
        paths = {path for group in groups for path in group.paths}
        kernels = nnx.state(quantized, lambda path, _: ".".join(map(str, path)) in paths)
        nnx.update(copy, quantized_state(groups, kernels))
        return copy
    modules = {".".join(str(p) for p in path): module for path, module in nnx.iter_modules(copy)}
    for kernel in quantized_kernels(quantized):
        values = kernel.stored(np.asarray(kernel.param.get_raw_value(), np.float32))[1]
        getattr(modules[kernel.owner], kernel.name)[...] = jnp.asarray(values)
    return copy


def _recorder(found, path):
    """An ``nnx.Linear`` subclass adding the squared input columns of its calls to ``found[path]``."""

    class Recorder(nnx.Linear):
        def __call__(self, x):
            rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
            found[path] = found.get(path, 0.0) + jnp.sum(rows * rows, axis=0)
            return super().__call__(x)

    return Recorder


def collect_importance(model, batches):
    """llama-imatrix's sums of a Flax causal LM: ``({transformers path: float64 (in,)}, {path: rows})``
    of every ``nnx.Linear`` (the untied head included) over ``batches`` of token ids; batches of
    fewer than 16 rows add nothing, as llama-imatrix skips them.

    The squared inputs are summed in float32 on the device per batch, and the batches in float64.

    >>> collect_importance  # doctest: +ELLIPSIS
    <function collect_importance at ...>
    """
    from mixle.flax_backend.gguf_tensors import torch_path

    linears = {".".join(map(str, path)): node for path, node in nnx.iter_graph(model)
               if type(node) is nnx.Linear}
    graphdef, state = nnx.split(model)

    @jax.jit
    def squares(state, ids):
        found, copy = {}, nnx.merge(graphdef, state)
        for path, node in nnx.iter_graph(copy):
            if type(node) is nnx.Linear:
                node.__class__ = _recorder(found, ".".join(map(str, path)))
        copy(ids)
        return found

    sums = {path: np.zeros(node.in_features, np.float64) for path, node in linears.items()}
    counts = dict.fromkeys(linears, 0)
    for ids in batches:
        if ids.size < _MIN_ROWS:
            continue
        for path, value in squares(state, jnp.asarray(ids, jnp.int32)).items():
            sums[path] += np.asarray(value, np.float64)
            counts[path] += int(ids.size)
    return {torch_path(p): v for p, v in sums.items()}, {torch_path(p): c for p, c in counts.items()}


def _calibrate(model, torch_model, data, config, out):
    """``--imatrix calibrate`` on the Flax float ``model``: the sums written as ``out/imatrix.gguf`` (for the
    transformers twin's tensor names) and read back, as the torch job's ``baselines.calibrate``."""
    from mixle.core.fileformat import replace_atomically
    from mixle.core.imatrix import Imatrix
    from mixle.gguf.imatrix_file import model_imatrix_names, save_imatrix

    began = time.perf_counter()
    windows = baselines.calibration_windows(data, config)
    batches = [windows[i : i + config.batch_size] for i in range(0, len(windows), config.batch_size)]
    sums, counts = collect_importance(model, batches)
    layers = [path for path in model_imatrix_names(torch_model) if path in sums]
    empty = [path for path in layers if not counts[path]]
    if empty:
        raise ValueError(f"--imatrix calibrate: no calibration batch of {_MIN_ROWS} tokens or more reached {empty[0]!r} "
                         f"(llama-imatrix skips smaller ones): raise --batch-size or --block")
    dataset = f"mixle finetune: {len(batches)} batches of training windows of {data.info['source']}"
    imatrix = Imatrix({p: sums[p][None].astype(np.float32) for p in layers},
                      {p: np.asarray([counts[p]], np.int64) for p in layers}, (dataset,), len(batches),
                      int(windows.shape[1]))
    path = out / baselines.IMATRIX_FILE
    replace_atomically(path, lambda tmp: save_imatrix(torch_model, imatrix, tmp))
    info = {"mode": "calibrate", "file": baselines.IMATRIX_FILE, "split": "training", "windows": int(len(windows)),
            "tokens": int(windows.size), "seconds": round(time.perf_counter() - began, 3), "collected_on": "jax"}
    return baselines.read_importance(path, torch_model, info)


class JaxRun(FinetuneRun):
    """The finetune run of ``--backend jax`` (see the module docstring).

    >>> JaxRun.__name__
    'JaxRun'
    """

    def __init__(self, config, resume, progress, devices=None):
        super().__init__(config, resume, progress, SINGLE)
        from mixle.lm.flax_causal_lm import causal_lm_of

        # The Flax model takes the float32 weights transformers loaded (from a directory's safetensors,
        # or dequantized by its GGUF loader, q/k rows in transformers' order): one source of truth.
        self.flax_model = causal_lm_of(self.model.config.to_dict(),
                                       {name: t.detach().numpy() for name, t in self.model.state_dict().items()},
                                       str(config.model))
        self.mesh = data_mesh(config.batch_size, devices)
        self.stops = stop_ids(self.model, self.loaded.tokenizer)  # the twin's generation config, read while it is here
        self.peaks.end("loading")

    def check_source(self):
        """The Flax family reads a local transformers directory or GGUF file; one process (JAX spreads
        over its devices)."""
        if model_kind(self.config.model) == "hub":
            raise ValueError(f"model={self.config.model!r} is a hub id: --backend jax downloads nothing; download "
                             f"the model (e.g. huggingface-cli download) and pass its directory or .gguf file")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError("--backend jax under torchrun: the jax backend is one process training data-parallel "
                             "over jax.devices(); run it without torchrun")

    def make_evaluator(self, gguf_words):
        """The ``Evaluator`` with the JAX held-out loss (on the run's mesh)."""
        return Evaluator(self.config, self.data, self.loaded.tokenizer, gguf_words,
                         loss=lambda model, windows, batch: held_out_loss(model, windows, batch, self.mesh),
                         answers=self._answers)

    def _answers(self, model, states=None):
        """The greedy answers of the Flax ``model`` (or its split ``states``) to ``--prompts``."""
        return greedy_answers(greedy_next_token(model, self.mesh, states), self.loaded.tokenizer, self.config.prompts,
                              self.config.answer_tokens, self.stops)

    def before(self):
        """The float and PTQ rows, the importance matrix and "PTQ imatrix" (from the checkpoint when resuming).

        A PTQ row is the fake-quantized float model, whose kernels' values are those ``convert``
        stores (the same held-out loss, and ``save_gguf`` writes the same file from either): the
        student before its first step is one of them, so its compiled forward serves both. The other
        (the reference quantizer beside a QAT on the weighted search, or the weighted search beside
        QAT on the reference one) is evaluated as the float model holding its stored values.
        """
        if self.payload is not None:
            self.evaluator.llama_cpp_info = self.payload.get("llama_cpp")
            return self.payload["rows"]
        config, evaluator, mix = self.config, self.evaluator, self.config.mix()
        spec = mix or config.spec().short()
        float_model = self._float_copy()
        rows = [evaluator.mixle(self.flax_model, {"method": FLOAT})]
        with tempfile.TemporaryDirectory(dir=self.out, prefix=".mixle-finetune-") as scratch:
            if self.outputs["gguf"] and evaluator.llama_cpp:
                evaluator.gguf(self.flax_model, os.path.join(scratch, "float.gguf"), "f32", rows[0])
            self.peaks.end("float evaluation")
            if config.importance_mode() == "calibrate":  # on the float model, from training windows only
                self.importance = _calibrate(self.flax_model, self.model, self.data, config, self.out)
                self.peaks.end("importance matrix")
            student = self._student()
            self.peaks.end("wrapping the student")
            if self.qat_importance() is None:
                ptq, evaluated = student, student
            else:
                ptq = _fake_quantized(float_model, config)
                evaluated = _with_stored_values(float_model, ptq)
            rows.append(self._row(evaluated, {"method": PTQ, "spec": spec}))
            if self.outputs["gguf"] and evaluator.llama_cpp:
                evaluator.gguf(ptq, os.path.join(scratch, "ptq.gguf"), config.float_storage(), rows[-1], mix=mix)
            self.peaks.end("PTQ evaluation")
        if self.importance is not None:
            if self.qat_importance() is not None:
                weighted, evaluated = student, student
            else:
                weighted = _fake_quantized(float_model, config, self.importance)
                evaluated = _with_stored_values(float_model, weighted)
            rows.append(self._row(evaluated, {"method": PTQ_IMATRIX, "spec": spec,
                                              "file": baselines.PTQ_IMATRIX_FILE}))
            values = baselines.target_importance(self.importance, config, ("lm_head",)) if mix else None
            evaluator.gguf(weighted, os.path.join(self.out, baselines.PTQ_IMATRIX_FILE), config.float_storage(),
                           rows[-1], mix=mix, importance=values)
            self.peaks.end("PTQ imatrix evaluation")
        return rows

    def _float_copy(self):
        """A copy of the float model, made once before ``_student`` wraps ``flax_model`` in place: the
        teacher, and the source of the PTQ rows' copies (never changed itself)."""
        if getattr(self, "float_model", None) is None:
            self.float_model = nnx.clone(self.flax_model)
        return self.float_model

    def _student(self):
        """The trainer of the QAT-wrapped Flax model (made once; the teacher a copy of the float model)."""
        if getattr(self, "trainer", None) is None:
            from mixle.api import apply_qat, get_qat_report, pull_toward_stored

            student = self.flax_model
            teacher = None if self.config.distill_weight() == 0.0 else self._float_copy()
            arguments = _qat_arguments(student, self.config, self.qat_importance())
            made = _made(student, arguments)
            apply_qat(student, example_inputs=_EXAMPLE, **arguments)
            self.tie_margin = pull_toward_stored(student, self.config.tie_margin)  # the teacher keeps the float ones
            self.trainer = JaxTrainer(student, teacher, self.data, self.config, get_qat_report(student).wrapped,
                                      self.mesh, made=made,
                                      float_model=self._float_copy() if self.config.step_timing else None)
        return self.trainer.model

    def _row(self, model, row):
        """``row`` with the held-out losses of ``model`` (the trainer's compiled forward for the student)."""
        if model is self.flax_model and getattr(self, "trainer", None) is not None:
            states = self.trainer.eval_states()
            loss = lambda _, windows, batch: held_out_loss(None, windows, batch, self.mesh, states=states)  # noqa: E731
            return Evaluator(self.config, self.data, None, loss=loss,
                             answers=lambda _: self._answers(None, states)).mixle(None, row)
        return self.evaluator.mixle(model, row)

    def train(self, rows, callback):
        """Continue from the checkpoint if any, and train the student."""
        self._student()
        self.float_model = None  # the trainer holds it as its teacher, if it has one
        self.model = self.loaded.model = None  # the transformers twin's checks are done: its memory goes
        self.peaks.end("the student")  # a resumed run makes it here
        return_free_memory()
        trainer = self.trainer
        if self.payload is not None:
            trainer.load_state_dict(self.payload, self.checkpoint_path)
            self.payload = None
        else:
            self.save(trainer, rows)  # before the first step: a full disk shows here, not at the end
        state = trainer.train(lambda: self.save(trainer, rows), progress=self.progress, callback=callback)
        count = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(trainer.params))
        teacher = trainer.teacher
        student = trainer.finish()
        self.peaks.end("training")
        info = {"backend": "jax", "trained_parameters": count, "trained_kernels": len(trainer.names),
                "teacher": None if teacher is None else "float model, fake-quant off",
                "data_parallel_devices": int(self.mesh.size), "devices_available": len(jax.devices()),
                "tie_margin": self.tie_margin}
        return student, state, info

    def after(self, student):
        """The QAT row (the trained fake-quantized model: the values ``convert`` stores); the GGUF and
        compressed-tensors files, written from it as from its converted copy."""
        config, evaluator = self.config, self.evaluator
        importance = self.qat_importance()
        row = self._row(student, {"method": QAT if importance is None else QAT_IMATRIX,
                                  "spec": config.mix() or config.spec().short()})
        row = {**row, "fake_quant_loss": row["loss"]}
        files = {}
        if self.outputs["gguf"]:
            mixed = importance.values if importance is not None and config.mix() else None
            evaluator.gguf(student, os.path.join(self.out, GGUF_FILE), config.float_storage(), row,
                           mix=config.mix(), importance=mixed)
            files["gguf"] = GGUF_FILE
        if self.outputs["compressed_tensors"]:
            from mixle.exports.compressed_tensors import save_pretrained_compressed

            save_pretrained_compressed(student, os.path.join(self.out, COMPRESSED_DIR), tokenizer=evaluator.tokenizer,
                                       overwrite=True)
            files["compressed_tensors"] = COMPRESSED_DIR
        hf = None
        if config.hf_checkpoint:  # the trained float32 master weights, through the transformers twin
            from mixle.gguf.flax_twin import torch_twin

            hf = write_hf_checkpoint(torch_twin(student, "finetune")[0], config, evaluator.tokenizer, self.out)
            files["hf"] = HF_DIR
        self.peaks.end("QAT evaluation and files")
        return row, files, hf


def run_finetune_jax(config, *, resume=False, progress=True, callback=None, devices=None):
    """``mixle.lm.finetune_run.run_finetune`` of a ``FinetuneConfig`` with ``backend="jax"`` (see the module docstring).

    Args:
        config: the ``FinetuneConfig``.
        resume, progress, callback: as ``run_finetune``'s (``callback(trainer)`` gets the ``JaxTrainer``).
        devices: the JAX devices to train on (default ``jax.devices()``; the mesh takes the most of
            them dividing ``batch_size``).

    >>> run_finetune_jax  # doctest: +ELLIPSIS
    <function run_finetune_jax at ...>
    """
    import torch

    began = time.perf_counter()
    previous = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    try:
        run = JaxRun(config, resume, progress, devices)
        rows = run.before()
        student, state, model_info = run.train(rows, callback)
        row, files, hf = run.after(student)
    finally:
        torch.set_num_threads(previous)
    environment = {"python": platform.python_version(), "jax": jax.__version__, "torch": torch.__version__,
                   "threads": config.threads, "device": ", ".join(str(d) for d in run.mesh.devices.flat),
                   "platform": platform.platform()}
    return finish_run(config, run, rows, row, files, state, model_info, environment, began, hf=hf)
