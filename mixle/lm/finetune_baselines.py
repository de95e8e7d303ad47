"""The finetune job's calibrated baselines: PTQ with llama.cpp's importance matrix, and GPTQ.

Both are calibrated on the same ``calibration_windows`` windows of ``block`` tokens of the
TRAINING split (``calibration_windows``: evenly spread over it, run in batches of
``batch_size``); the held-out split and ``--eval-data`` are never seen.

* The importance matrix (``--imatrix calibrate``) is what ``llama-imatrix`` collects of the float
  model on those windows (``mixle.calibrate_importance``: every matrix ``save_gguf`` writes, the
  untied head included as ``--process-output`` collects it; never the token embedding, which
  llama.cpp does not collect), written as ``imatrix.gguf`` (``mixle.save_imatrix``: the file
  ``llama-quantize --imatrix`` takes) and then read back from it, so a resumed run (which reads the
  same file) quantizes with the same values bit for bit. ``--imatrix PATH`` reads a
  llama-imatrix file instead, checked against the model (names, column counts, finite sums).
* "PTQ imatrix": ``quantize_model(float model, ..., importance=)``, ggml's weighted search bit
  for bit as ``llama-quantize --imatrix`` (under a mix with the types llama-quantize gives with an
  imatrix), written as ``ptq-imatrix.gguf`` and evaluated in mixle and llama.cpp.
* QAT with the importance: ``apply_qat(..., importance=)`` on the Linear matrices that have an entry
  (the embedding a mix trains has none, as llama-quantize quantizes it by the reference quantizer).
* "GPTQ" (``--gptq``): ``mixle.gptq_quantize`` on grids it rounds onto, written as ``gptq.gguf``
  or ``gptq-compressed-tensors/``.
"""

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from mixle._optional import require
from mixle.lm.finetune_report import GPTQ, PTQ_IMATRIX
from mixle.lm.windows import held_out_windows

__all__ = ["IMATRIX_FILE", "PTQ_IMATRIX_FILE", "GPTQ_FILE", "GPTQ_DIR", "Importance", "calibration_windows",
           "calibration_batches", "read_importance", "calibrate", "target_importance", "ptq_imatrix_row", "gptq_row"]

IMATRIX_FILE = "imatrix.gguf"
PTQ_IMATRIX_FILE = "ptq-imatrix.gguf"
GPTQ_FILE = "gptq.gguf"
GPTQ_DIR = "gptq-compressed-tensors"


@dataclass
class Importance:
    """The run's importance matrix: ``{layer path: float32 values}``, the file read and its sha256."""

    values: dict
    path: str
    digest: str
    info: dict


def calibration_windows(data, config):
    """The calibration windows: ``calibration_windows`` windows of ``block`` training tokens, evenly
    spread over the training split (numpy ``(n, block)``; fewer where the split is shorter).

    >>> import numpy as np, types
    >>> data = types.SimpleNamespace(train_ids=np.arange(100))
    >>> calibration_windows(data, types.SimpleNamespace(block=8, calibration_windows=3)).shape
    (3, 8)
    """
    ids = data.train_ids
    ids = ids.numpy() if hasattr(ids, "numpy") else ids
    windows = held_out_windows(ids, config.block, config.calibration_windows)[:, :-1]
    if getattr(data, "bos", None) is not None:  # as the model sees every window: from its BOS
        windows = windows.copy()
        windows[:, 0] = data.bos
    return windows


def calibration_batches(data, config, device="cpu"):
    """The calibration windows as token-id tensors of ``batch_size`` windows each, on ``device``.

    >>> import numpy as np, types
    >>> data = types.SimpleNamespace(train_ids=np.arange(100))
    >>> [tuple(b.shape) for b in calibration_batches(data, types.SimpleNamespace(block=8, calibration_windows=3,
    ...                                                                         batch_size=2))]
    [(2, 8), (1, 8)]
    """
    torch = require("torch", extra="torch", purpose="mixle finetune")
    windows = torch.as_tensor(calibration_windows(data, config))
    return [windows[i : i + config.batch_size].to(device) for i in range(0, len(windows), config.batch_size)]


def _digest(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_importance(path, model, info=None):
    """The ``Importance`` of the llama-imatrix file ``path``, checked against ``model``.

    Raises:
        FileNotFoundError: no such file (the message names ``--imatrix``).
        ValueError: a file for another model, non-finite or negative sums (naming the tensor).

    >>> read_importance("/no/such.imatrix", None)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    FileNotFoundError: --imatrix '/no/such.imatrix' does not exist: ...
    """
    from mixle.gguf.imatrix_file import load_imatrix, model_imatrix_names, read_imatrix

    if not os.path.isfile(path):
        raise FileNotFoundError(f"--imatrix {str(path)!r} does not exist: give a llama-imatrix file (.gguf or .dat) "
                                f"of this model, or --imatrix calibrate")
    try:
        values = load_imatrix(path, model)
    except ValueError as err:
        raise ValueError(f"--imatrix {str(path)!r} does not fit the model: {err}") from None
    missing = [names[0] for layer, names in model_imatrix_names(model).items()
               if layer not in values and names[0].startswith("blk.")]
    if missing:  # llama-imatrix collects every blk.* matrix: a gap means another model, or part of this one
        raise ValueError(f"--imatrix {str(path)!r} has no entry for tensor {missing[0]!r} ({len(missing)} matrices "
                         f"missing): it was made for another model or from part of it; give llama-imatrix's file of "
                         f"this model, or --imatrix calibrate")
    file = read_imatrix(path)
    info = dict(info or {"mode": "file", "datasets": list(file.datasets), "chunk_count": int(file.chunk_count),
                         "chunk_size": int(file.chunk_size)})
    info.setdefault("file", str(path))
    info["entries"] = len(values)
    return Importance(values, str(path), _digest(path), info)


def calibrate(model, data, config, out):
    """Collect the importance matrix of ``model`` on the calibration windows, write it as
    ``out/imatrix.gguf`` (atomically) and read it back (``read_importance``).

    >>> calibrate  # doctest: +ELLIPSIS
    <function calibrate at ...>
    """
    from mixle.api import calibrate_importance
    from mixle.core.fileformat import replace_atomically
    from mixle.gguf.imatrix_file import save_imatrix

    began = time.perf_counter()
    batches = calibration_batches(data, config, next(model.parameters()).device)
    dataset = f"mixle finetune: {len(batches)} batches of training windows of {data.info['source']}"
    imatrix = calibrate_importance(model, batches, dataset=dataset)
    path = Path(out) / IMATRIX_FILE
    replace_atomically(path, lambda tmp: save_imatrix(model, imatrix, tmp))
    tokens = sum(int(b.numel()) for b in batches)
    info = {"mode": "calibrate", "file": IMATRIX_FILE, "split": "training", "windows": sum(len(b) for b in batches),
            "tokens": tokens, "seconds": round(time.perf_counter() - began, 3)}
    return read_importance(path, model, info)


def target_importance(importance, config, exclude):
    """The entries ``quantize_model`` / ``apply_qat`` take for the target: all of them under a mix
    (which keeps those it quantizes), else those of the matrices the grid target quantizes.

    >>> target_importance(Importance({"a": 1, "lm_head": 2}, "", "", {}), type("C", (), {"mix": lambda s: None})(),
    ...                   ("lm_head",))
    {'a': 1}
    """
    if config.mix() is not None:
        return importance.values
    return {path: values for path, values in importance.values.items() if path not in exclude}


def ptq_imatrix_row(model, config, importance, evaluator, out, exclude):
    """The "PTQ imatrix" row: ``quantize_model(..., importance=)`` evaluated in mixle, written as
    ``ptq-imatrix.gguf`` (``save_gguf``, under a mix with the importance: llama-quantize's file),
    and evaluated in llama.cpp from it.

    >>> ptq_imatrix_row  # doctest: +ELLIPSIS
    <function ptq_imatrix_row at ...>
    """
    from mixle.api import quantize_model

    mix, values = config.mix(), target_importance(importance, config, exclude)
    ptq = (quantize_model(model, gguf_mix=mix, importance=values, **config.act_fields()) if mix
           else quantize_model(model, config.spec(), exclude=exclude, importance=values))
    row = evaluator.mixle(ptq, {"method": PTQ_IMATRIX, "spec": mix or config.spec().short(), "file": PTQ_IMATRIX_FILE})
    evaluator.gguf(ptq, os.path.join(out, PTQ_IMATRIX_FILE), config.float_storage(), row, mix=mix,
                   importance=values if mix else None)
    return row


def gptq_row(model, data, config, outputs, evaluator, out, exclude):
    """The "GPTQ" row: ``gptq_quantize`` on the calibration windows (``config.gptq``'s mode), evaluated
    in mixle, written as ``gptq.gguf`` (evaluated in llama.cpp) or ``gptq-compressed-tensors/``.

    >>> gptq_row  # doctest: +ELLIPSIS
    <function gptq_row at ...>
    """
    from mixle.api import gptq_quantize

    began = time.perf_counter()
    batches = calibration_batches(data, config, next(model.parameters()).device)
    quantized = gptq_quantize(model, batches, config.spec(), exclude=exclude, sequential=config.gptq == "sequential")
    row = {"method": GPTQ, "spec": config.spec().short(), "mode": config.gptq,
           "calibration_tokens": sum(int(b.numel()) for b in batches), "seconds": round(time.perf_counter() - began, 3)}
    evaluator.mixle(quantized, row)
    if outputs["gguf"]:
        row["file"] = GPTQ_FILE
        evaluator.gguf(quantized, os.path.join(out, GPTQ_FILE), config.float_storage(), row)
    elif outputs["compressed_tensors"]:
        from mixle.exports.compressed_tensors import save_pretrained_compressed

        save_pretrained_compressed(quantized, os.path.join(out, GPTQ_DIR), tokenizer=evaluator.tokenizer,
                                   overwrite=True)
        row["file"] = GPTQ_DIR
    return row
