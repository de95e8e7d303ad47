"""What the finetune job reads from outside: the pretrained model and its tokenizer, and the text.

Everything read is checked before it is trusted, and refused naming the file and the fix:

* the model (``load_model``): a transformers causal-LM directory (``config.json``, safetensors
  weights, tokenizer files), a GGUF file (read by transformers' GGUF loader, dequantized to
  float) or a hub id (``owner/name``, through ``from_pretrained``). Its architecture must be one
  mixle exports (``SUPPORTED``), checked from the config before any weight is read. A truncated
  or unreadable file, weights that do not fit the architecture (missing or mis-shaped tensors)
  and non-finite values (a NaN float16 block scale dequantizes to NaN weights) are refused
  naming the tensor and the file. A tokenizer that cannot be loaded (whatever the tokenizer
  libraries raise, Rust panics included) is refused naming the file and the fix, and so is a
  compressed-tensors directory whose ``quantization_config`` does not fit the model
  (``mixle.exports.compressed_tensors.check_quantization_config``), before transformers reads it.
* the vocabulary (``check_vocabulary``): every tokenizer id has an embedding row, and the GGUF
  writer takes the tokenizer (its own checks, run before training instead of after it).
* the text (``load_texts``): UTF-8 files or directories of them; a file that is not UTF-8, is
  empty, or a directory without text files is refused naming it.
"""

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from mixle._optional import require
from mixle.gguf.architectures import SUPPORTED
from mixle.gguf.file import open_gguf
from mixle.gguf.tokenizer import split_as_llama_cpp

__all__ = ["SUPPORTED", "TEXT_SUFFIXES", "LoadedModel", "load_model", "load_texts", "check_finite", "model_kind",
           "tokens_needed", "check_vocabulary"]

# The transformers classes mixle writes as llama.cpp files and as compressed-tensors checkpoints:
# class name -> llama.cpp architecture, from the architecture records (``mixle.gguf.architectures``).
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass
class LoadedModel:
    """A float model ready to fine-tune.

    Attributes:
        model: the transformers causal LM (float32, eval mode off: as ``from_pretrained`` gives it).
        tokenizer: its transformers tokenizer.
        info: JSON-ready: ``source``, ``kind`` (``directory``, ``gguf`` or ``hub``), ``architecture``
            (llama.cpp's name), ``parameters``.
    """

    model: object
    tokenizer: object
    info: dict


def _supported_names():
    return ", ".join(f"{cls} ({arch})" for cls, arch in SUPPORTED.items())


def _refuse_architecture(found, where):
    return ValueError(f"model={where!r} is a {found}, which mixle cannot export: finetune writes "
                      f"{_supported_names()}; pass a model of one of these architectures")


def model_kind(source):
    """How ``source`` is loaded: ``"gguf"``, ``"directory"`` or ``"hub"``; FileNotFoundError when it is none.

    >>> model_kind("HuggingFaceTB/SmolLM2-135M-Instruct")
    'hub'
    """
    path = Path(source)
    if path.is_file():
        with open(path, "rb") as handle:
            magic = handle.read(4)
        if magic == b"GGUF" or path.suffix.lower() == ".gguf":
            return "gguf"
        raise ValueError(f"model={source!r} is a file but not a GGUF file: pass a .gguf file or a transformers "
                         f"model directory (config.json, safetensors weights, tokenizer)")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model={source!r} is a directory without config.json: pass a transformers causal-LM "
                             f"directory (saved with save_pretrained) or a .gguf file")
        return "directory"
    if _HUB_ID.fullmatch(str(source)) and not str(source).startswith((".", "/")) and not str(source).endswith(".gguf"):
        return "hub"
    raise FileNotFoundError(f"model={source!r} does not exist: pass a transformers model directory, a .gguf file, "
                            f"or a hub id such as HuggingFaceTB/SmolLM2-135M-Instruct")


def _quiet_transformers():
    transformers = require("transformers", extra="hf", purpose="mixle finetune")
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    return transformers


def load_model(source):
    """Load ``source`` (directory, GGUF file or hub id) as a float32 transformers model and tokenizer.

    Raises:
        FileNotFoundError: ``source`` does not exist (and is no hub id).
        ValueError: an architecture mixle cannot export, an unreadable or truncated file, a
            compressed-tensors config that does not fit the model, weights that do not fit the
            architecture, non-finite weights, no tokenizer or one that cannot be loaded.

    >>> load_model("/no/such/model")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    FileNotFoundError: model='/no/such/model' does not exist: ...
    """
    kind = model_kind(source)
    torch = require("torch", extra="torch", purpose="mixle finetune")
    transformers = _quiet_transformers()
    if kind == "gguf":
        model, tokenizer = _load_gguf(transformers, torch, Path(source))
    else:
        model, tokenizer = _load_pretrained(transformers, torch, source, kind)
    name = type(model).__name__
    if name not in SUPPORTED:
        raise _refuse_architecture(name, source)
    check_finite(model, source)
    info = {"source": str(source), "kind": kind, "architecture": SUPPORTED[name], "class": name,
            "parameters": sum(p.numel() for p in model.parameters())}
    return LoadedModel(model, tokenizer, info)


def _load_pretrained(transformers, torch, source, kind):
    """A directory or hub id: the config's architecture checked first, then weights and tokenizer."""
    if kind == "directory":
        try:
            config = json.loads((Path(source) / "config.json").read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"model={source!r}: config.json is not readable JSON ({err})") from None
        names = config.get("architectures") or [config.get("model_type", "model without 'architectures'")]
        if not any(n in SUPPORTED for n in names):
            raise _refuse_architecture(names[0], source)
        if isinstance(config.get("quantization_config"), dict):
            _check_compressed(transformers, source)
        for weights in sorted(Path(source).glob("*.safetensors")):
            _check_safetensors(weights)
    else:
        _check_hub_config(transformers, source)
    tokenizer = _load_tokenizer(transformers, source, "save the tokenizer with the model (tokenizer.save_pretrained("
                                                      "directory) writes tokenizer.json beside config.json)")
    try:
        model, loading = transformers.AutoModelForCausalLM.from_pretrained(
            source, dtype=torch.float32, output_loading_info=True)
    except (OSError, RuntimeError, ValueError) as err:
        raise ValueError(f"model={source!r} could not be loaded: {_first_line(err)}") from None
    missing = sorted(set(loading.get("missing_keys", ())) - _tied_names(model))
    bad = sorted(loading.get("mismatched_keys", ()) or ())
    if missing or bad:
        raise ValueError(f"model={source!r}: the weights do not fit its config ({'missing ' + str(missing[:3]) if missing else ''}"
                         f"{' mis-shaped ' + str(bad[:3]) if bad else ''}): the files belong to another model")
    return model, tokenizer


def _load_tokenizer(transformers, source, fix, name=None, **kwargs):
    """``AutoTokenizer.from_pretrained(source, **kwargs)``; whatever the tokenizer libraries raise
    (``tokenizers``' Rust panics are ``pyo3_runtime.PanicException``, a BaseException) becomes a
    ValueError naming the model (``name``, default ``source``) and the ``fix``; KeyboardInterrupt and
    SystemExit pass through."""
    try:
        return transformers.AutoTokenizer.from_pretrained(source, **kwargs)
    except BaseException as err:
        if not isinstance(err, Exception) and type(err).__name__ != "PanicException":
            raise
        raise ValueError(f"model={str(name or source)!r}: its tokenizer could not be loaded ({type(err).__name__}: "
                         f"{_first_line(err)}): {fix}") from None


def _check_compressed(transformers, source, config=None):
    """A compressed-tensors checkpoint's quantization_config fits the model (mixle's check, before
    transformers reads a weight)."""
    from mixle.exports.compressed_tensors import check_quantization_config

    if config is None:
        try:
            config = transformers.AutoConfig.from_pretrained(source)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"model={source!r}: config.json cannot be read by transformers ({_first_line(err)})") from None
    try:
        check_quantization_config(config, f"model={source!r}", mixle_layers=False)
    except ValueError as err:
        raise ValueError(f"{err}; pass the float model, or re-export the checkpoint") from None


def _check_hub_config(transformers, source):
    """A hub id: its config is fetched first (small) and its architecture checked before any weight."""
    try:
        config = transformers.AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise ValueError(f"model={source!r} is no local directory or file, and as a hub id it could not be fetched "
                         f"({_first_line(err)}): check the path, or the network and the id") from None
    names = getattr(config, "architectures", None) or [type(config).__name__]
    if not any(n in SUPPORTED for n in names):
        raise _refuse_architecture(names[0], source)
    if getattr(config, "quantization_config", None) is not None:
        _check_compressed(transformers, source, config)


def _tied_names(model):
    return {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()


def _first_line(err):
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _check_safetensors(path):
    """The header of a safetensors file fits the file: every tensor's bytes are there."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if not 0 < length <= min(size - 8, 100 * 2**20):
                raise ValueError(f"header length {length} does not fit a file of {size} bytes")
            header = json.loads(handle.read(length))
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{str(path)!r} is not a readable safetensors file ({err}): it may be truncated "
                         f"(an interrupted download?); fetch it again") from None
    end = max((info["data_offsets"][1] for key, info in header.items() if key != "__metadata__"), default=0)
    if 8 + length + end > size:
        raise ValueError(f"{str(path)!r} is truncated: its header lists {8 + length + end} bytes of tensors but the "
                         f"file has {size}; fetch it again")


def _load_gguf(transformers, torch, path):
    """A GGUF file: readable, of a supported architecture, then through transformers' GGUF loader."""
    reader = open_gguf(path, purpose="reading a GGUF model", name=f"model={str(path)!r}")  # its layout checked
    try:
        arch = reader.fields["general.architecture"].contents()
    except (ValueError, KeyError, IndexError) as err:
        raise ValueError(f"model={str(path)!r} is not a readable GGUF file (general.architecture: {err}): it may be "
                         f"damaged; fetch it again") from None
    if arch not in SUPPORTED.values():
        raise _refuse_architecture(f"llama.cpp {arch!r} model", str(path))
    pre = reader.fields["tokenizer.ggml.pre"].contents() if "tokenizer.ggml.pre" in reader.fields else None
    del reader
    tokenizer = _load_tokenizer(
        transformers, str(path.parent), f"transformers reads a GGUF's tokenizer from its tokenizer.ggml.* "
        f"metadata, which {path.name} lacks or holds incomplete (e.g. a GGUF written by save_gguf without "
        f"tokenizer=): pass a transformers directory with the model and its tokenizer.json instead, or a GGUF "
        f"written with its tokenizer", name=path, gguf_file=path.name)
    split_as_llama_cpp(tokenizer, pre)  # training sees the ids llama.cpp gives the same text
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32)
    except (OSError, RuntimeError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"model={str(path)!r} could not be read by transformers' GGUF loader: {_first_line(err)}") from None
    return model, tokenizer


def check_vocabulary(loaded, gguf, tokenizer_pre=None):
    """Refuse, before training, a tokenizer the run cannot use: an id without a row in the model's
    embedding, or (``gguf``: the run writes GGUF files) one the GGUF writer does not take. The
    checks are the writer's own (``mixle.gguf.vocab.check_token_ids``,
    ``mixle.gguf.tokenizer.gguf_tokenizer``), and what they return is what the run writes.

    Args:
        loaded: the ``LoadedModel``.
        gguf: whether the run writes GGUF files.
        tokenizer_pre: llama.cpp's pre-tokenizer name for a transformers tokenizer mixle cannot name
            (``--tokenizer-pre``); a ``.gguf`` model's tokenizer is copied from the file, every
            ``tokenizer.*`` key as it is (``gguf_tokenizer(source_gguf=...)``).

    Returns:
        The ``GGUFTokenizer`` every GGUF file of the run is written with (``save_gguf(tokenizer=...)``);
        None when ``gguf`` is False.

    Raises:
        ValueError: naming the model, the ids and the rows (or what the writer refuses), and the fix.

    >>> check_vocabulary  # doctest: +ELLIPSIS
    <function check_vocabulary at ...>
    """
    from mixle.gguf.tokenizer import gguf_tokenizer
    from mixle.gguf.vocab import check_token_ids

    model, tokenizer = loaded.model, loaded.tokenizer
    rows = model.get_input_embeddings().num_embeddings
    read = " (read by transformers' GGUF loader)" if loaded.info["kind"] == "gguf" else ""
    try:
        check_token_ids(tokenizer, rows)  # training looks every id up in the embedding, whatever the file
        if not gguf:
            return None
        if loaded.info["kind"] == "gguf":
            if tokenizer_pre is not None:
                raise ValueError(f"tokenizer_pre={tokenizer_pre!r}: the tokenizer of a .gguf model is copied from the "
                                 f"file, its pre-tokenizer name included; leave --tokenizer-pre out")
            return gguf_tokenizer(rows, source_gguf=loaded.info["source"])
        return gguf_tokenizer(rows, tokenizer=tokenizer, tokenizer_pre=tokenizer_pre, arch=loaded.info["architecture"],
                              config=model.config)
    except (ValueError, TypeError) as err:
        cli = ("; on the command line: --tokenizer-pre NAME, or --model a .gguf of the model"
               if "pass tokenizer_pre=" in str(err) else "")
        raise ValueError(f"model={str(loaded.info['source'])!r}{read}: {err}{cli}") from None


def check_finite(model, source):
    """Raise ValueError naming the first parameter of ``model`` holding NaN or infinity.

    >>> import torch
    >>> net = torch.nn.Linear(2, 2)
    >>> with torch.no_grad():
    ...     net.weight[0, 0] = float("nan")
    >>> check_finite(net, "net.gguf")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: tensor 'weight' read from 'net.gguf' holds 1 non-finite values (NaN or infinity) ...
    """
    torch = require("torch", extra="torch", purpose="mixle finetune")
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            count = int((~torch.isfinite(tensor)).sum())
            raise ValueError(f"tensor {name!r} read from {str(source)!r} holds {count} non-finite values (NaN or "
                             f"infinity) (e.g. a NaN float16 block scale): the file is damaged; fetch it again or "
                             f"repair the checkpoint")


def _text_files(path):
    """The text files of ``path`` (itself, or its files with a text suffix, sorted, recursively)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise ValueError(f"data directory {str(path)!r} holds no text files ({', '.join(TEXT_SUFFIXES)})")
        return files
    raise FileNotFoundError(f"data path {str(path)!r} does not exist: pass UTF-8 text files or directories of them")


def load_texts(paths):
    """``[(file name, text)]`` of UTF-8 text files or directories of them, in order.

    Raises:
        FileNotFoundError: a path does not exist.
        ValueError: a file that is not UTF-8 or holds no text, a directory without text files.

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "a.txt")
    >>> _ = open(path, "w").write("hello")
    >>> load_texts([path])[0][1]
    'hello'
    """
    texts = []
    for entry in paths:
        for file in _text_files(entry):
            data = file.read_bytes()
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"data file {str(file)!r} is not UTF-8 text ({err.reason} at byte {err.start}): "
                                 f"convert it to UTF-8 (e.g. iconv -t UTF-8) or leave it out") from None
            if not text.strip():
                raise ValueError(f"data file {str(file)!r} is empty: it needs some text to train on")
            texts.append((str(file), text))
    return texts


def tokens_needed(block, held_out_fraction):
    """The fewest tokens a text needs: one window of ``block + 1`` in training and one held out.

    >>> tokens_needed(128, 0.1)
    1290
    """
    return max(math.ceil((block + 1) / held_out_fraction), (block + 1) * 2)
