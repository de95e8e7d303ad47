"""A model as llama.cpp sees it: evaluated from its GGUF file's weights, and run by llama.cpp itself.

``gguf_loss`` writes a model with ``save_gguf``, reads the file back with gguf-py into a float
copy of a template model (``load_gguf_weights``: gguf's own dequantization) and evaluates that
copy with the model's own forward. ``llama_cpp_loss`` runs the file in llama.cpp (through
llama-cpp-python, the optional ``llama`` extra) on the same windows and scores its logits: token-id
parity. ``llama_cpp_text_loss`` gives llama.cpp the windows' text instead, which it tokenizes
itself with the file's tokenizer, as it does a user's prompt: what a user of the file gets.
"""

import collections
import contextlib
import dataclasses
import functools
import io
import os
import signal
import subprocess
import sys
import warnings
from dataclasses import dataclass

import numpy as np

from mixle._optional import is_available, require
from mixle.lm.training import held_out_loss

__all__ = ["llama_cpp_module", "llama_cpp_problem", "llama_cpp_skipped", "require_llama_cpp", "quiet_stderr",
           "llama_cpp_loss", "llama_cpp_text_loss", "window_texts", "gguf_loss", "GGUFLoss"]


# What the subprocess of llama_cpp_problem runs.
PROBE = "from mixle.lm.llama_cpp_eval import _probe; _probe()"
# llama.cpp built for an AMX CPU's other instruction sets, without its AMX kernels (see llama_cpp_problem).
REBUILD = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON '
           '-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF '
           '-DGGML_AMX_BF16=OFF" pip install --force-reinstall --no-cache-dir --no-deps llama-cpp-python==0.3.36')


def llama_cpp_module():
    """llama-cpp-python if installed (the ``llama`` extra) and llama.cpp runs here, else None (with a
    warning saying why, when it is installed but crashes): llama.cpp's column is optional.

    >>> llama_cpp_module() is None or hasattr(llama_cpp_module(), "Llama")
    True
    """
    if not is_available("llama_cpp"):
        return None
    problem = llama_cpp_problem()
    if problem is not None:
        warnings.warn(problem, RuntimeWarning, stacklevel=2)
        return None
    import llama_cpp

    return llama_cpp


@functools.cache
def llama_cpp_problem():
    """Why the installed llama-cpp-python cannot run here, or None (it ran, or it is not installed).

    llama.cpp runs a tiny Q4_0 file once per process, in a subprocess (``_probe``), so a
    crash of its native code cannot take the caller down with it. One known crash: llama-cpp-python
    0.3.36 built with ``-march=native`` on an Intel Xeon with AMX and AVX10.1, where the first
    ``ldtilecfg`` of llama.cpp's AMX kernels takes a general-protection fault.

    >>> llama_cpp_problem() is None or "llama.cpp" in llama_cpp_problem()
    True
    """
    if not is_available("llama_cpp"):
        return None
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=600)
    except subprocess.TimeoutExpired:
        return "llama.cpp did not finish a tiny Q4_0 file within 600 s in a subprocess; its columns are left out"
    if done.returncode == 0:
        return None
    last = (done.stderr.strip().splitlines() or [""])[-1][:300]
    problem = ("llama-cpp-python is installed but llama.cpp "
               + (f"crashed ({_signal_name(-done.returncode)})" if done.returncode < 0
                  else f"failed (exit status {done.returncode})")
               + " running a tiny Q4_0 file in a subprocess" + (f" ({last})" if last else "")
               + "; its columns are left out.")
    if done.returncode < 0:
        problem += (" llama.cpp's AMX kernels are one known cause (they fault on some Xeons); rebuild it "
                    f"without them: {REBUILD}")
    return problem


def llama_cpp_skipped():
    """``{"skipped": why}`` for a run's results while llama-cpp-python is installed but cannot run
    here (``llama_cpp_problem``), else None.

    >>> llama_cpp_skipped() is None or "skipped" in llama_cpp_skipped()
    True
    """
    problem = llama_cpp_problem()
    return None if problem is None else {"skipped": problem}


def require_llama_cpp(purpose):
    """llama-cpp-python, for ``purpose`` that cannot do without it: ``require``'s ImportError when it
    is not installed, a RuntimeError saying why when it cannot run here.

    >>> require_llama_cpp("a check") is llama_cpp_module() if llama_cpp_module() else True
    True
    """
    llama_cpp = llama_cpp_module()
    if llama_cpp is not None:
        return llama_cpp
    problem = llama_cpp_problem()
    if problem is not None:
        raise RuntimeError(f"{purpose} needs llama.cpp: {problem}")
    return require("llama_cpp", extra="llama", purpose=purpose)


def _signal_name(number):
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _probe():
    """Run a tiny Q4_0 model in llama.cpp: what ``llama_cpp_problem``'s subprocess runs."""
    import tempfile

    import torch

    from mixle.api import apply_qat
    from mixle.gguf.writer import save_gguf
    from mixle.lm.transformer import build_causal_lm

    torch.manual_seed(0)
    lm = build_causal_lm(vocab=48, d_model=64, n_layer=1, n_head=2, block=16, activation="gelu_tanh")
    model = apply_qat(lm, grid="q4_0")
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "probe.gguf")
        save_gguf(model, path)
        import llama_cpp

        with quiet_stderr():
            llm = llama_cpp.Llama(model_path=path, n_ctx=16, logits_all=True, n_threads=1, verbose=False)
            llm.eval([1, 2, 3, 4])
            llm.close()


@contextlib.contextmanager
def quiet_stderr():
    """Silence stderr meanwhile: what C code writes to file descriptor 2 and what Python prints to
    ``sys.stderr`` (llama-cpp-python's log callback).

    >>> import sys
    >>> with quiet_stderr():
    ...     print("not shown", file=sys.stderr)
    >>> print("shown")
    shown
    """
    try:
        saved = os.dup(2)
    except OSError:
        saved = None
    try:
        with open(os.devnull, "w") as null, contextlib.redirect_stderr(io.StringIO()):
            if saved is not None:
                os.dup2(null.fileno(), 2)
            yield
    finally:
        if saved is not None:
            os.dup2(saved, 2)
            os.close(saved)


def _window_nll(llm, window, block):
    """llama.cpp's summed next-token negative log-likelihood of one window (float64 softmax)."""
    llm.reset()
    llm.eval(window[:-1].tolist())
    logits = np.asarray(llm.scores[:block], dtype=np.float64)
    top = logits.max(-1, keepdims=True)
    logz = np.log(np.exp(logits - top).sum(-1)) + top[:, 0]
    return float((logz - logits[np.arange(block), window[1:]]).sum())


def llama_cpp_loss(path, windows, threads=None):
    """``(held-out loss, info)`` of the GGUF file run by llama.cpp (F32 KV cache), or None without
    llama-cpp-python.

    Args:
        path: a GGUF file.
        windows: int token windows, shape ``(count, length)``; the context is ``length - 1``.
        threads: llama.cpp's threads (default: torch's).

    >>> import os, tempfile, torch
    >>> from mixle.gguf.writer import save_gguf
    >>> from mixle.lm.transformer import build_causal_lm
    >>> path = os.path.join(tempfile.mkdtemp(), "lm.gguf")
    >>> _ = save_gguf(build_causal_lm(40, 32, 1, 2, 8, activation="gelu_tanh"), path, float_matrices="f32")
    >>> result = llama_cpp_loss(path, np.zeros((2, 9), dtype=np.int64), threads=1)
    >>> result is None or result[0] > 0
    True
    """
    llama_cpp = llama_cpp_module()
    if llama_cpp is None:
        return None
    block = windows.shape[1] - 1
    threads = threads or require("torch", extra="torch", purpose="llama_cpp_loss").get_num_threads()
    total = 0.0
    with quiet_stderr():  # llama.cpp notes that it pads the context to 256 tokens: nothing to act on
        llm = llama_cpp.Llama(model_path=os.fspath(path), n_ctx=block, logits_all=True, n_threads=threads,
                              n_threads_batch=threads, type_k=0, type_v=0, verbose=False)
        for window in windows:
            total += _window_nll(llm, window, block)
        llm.close()
        del llm
    info = {"llama_cpp_python": llama_cpp.__version__, "kv_cache": "f32", "threads": threads}
    return total / (windows.shape[0] * block), info


def window_texts(tokenizer, windows):
    """The text of each token window, as the model's transformers ``tokenizer`` decodes it (special
    tokens spelled out, no clean-up of spaces).

    >>> from tokenizers import Tokenizer, models, pre_tokenizers
    >>> from transformers import PreTrainedTokenizerFast
    >>> backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    >>> backend.pre_tokenizer = pre_tokenizers.Whitespace()
    >>> window_texts(PreTrainedTokenizerFast(tokenizer_object=backend), np.array([[0, 1], [1, 1]]))
    ['a b', 'b b']
    """
    return [tokenizer.decode([int(i) for i in window], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            for window in windows]


def llama_cpp_text_loss(path, texts, threads=None, reference=None):
    """``(held-out loss, info)`` of the GGUF file run by llama.cpp on its own tokens of ``texts``, or
    None without llama-cpp-python.

    llama.cpp tokenizes each text with the file's tokenizer, as it does a user's prompt (special
    tokens such as ``<|im_end|>`` parsed; no BOS, as the texts are cut from running text like the
    token-id windows of ``llama_cpp_loss``), and predicts every token after the first from the ones
    before it (F32 KV cache). A file whose tokenizer differs from the model's (another pre-tokenizer,
    say) splits the same text into other tokens, which this loss sees and ``llama_cpp_loss`` cannot.

    Args:
        path: a GGUF file.
        texts: the texts (str), e.g. ``window_texts`` of the held-out windows.
        threads: llama.cpp's threads (default: torch's).
        reference: optional ids of each text as the model's own tokenizer makes them, e.g.
            ``tokenizer.encode(text, add_special_tokens=False)``: compared with llama.cpp's.

    Returns:
        ``(loss, info)``: the mean negative log-likelihood per predicted llama.cpp token, and
        ``info`` with ``tokens`` (llama.cpp's tokens of all texts), ``predicted``, ``texts`` and,
        with ``reference``, ``reference_tokens`` and ``same_tokens`` (texts llama.cpp split into
        exactly the reference's ids).

    >>> import os, tempfile, torch
    >>> from mixle.gguf.writer import save_gguf
    >>> from mixle.lm.transformer import build_causal_lm
    >>> path = os.path.join(tempfile.mkdtemp(), "lm.gguf")
    >>> lm = build_causal_lm(40, 32, 1, 2, 8, activation="gelu_tanh")
    >>> _ = save_gguf(lm, path, vocab=[chr(97 + i) for i in range(40)])
    >>> result = llama_cpp_text_loss(path, ["abcdefgh", "hgfedcba"], threads=1)
    >>> result is None or (result[0] > 0 and result[1]["predicted"] == result[1]["tokens"] - 2)
    True
    """
    llama_cpp = llama_cpp_module()
    if llama_cpp is None:
        return None
    threads = threads or require("torch", extra="torch", purpose="llama_cpp_text_loss").get_num_threads()
    with quiet_stderr():
        vocab = llama_cpp.Llama(model_path=os.fspath(path), vocab_only=True, verbose=False)
        ids = [vocab.tokenize(text.encode("utf-8"), add_bos=False, special=True) for text in texts]
        vocab.close()
    scored = [np.asarray(i, dtype=np.int64) for i in ids if len(i) > 1]
    if not scored:
        raise ValueError(f"llama.cpp split none of the {len(texts)} texts into two tokens or more: nothing to predict")
    context = max(len(i) for i in scored) - 1
    total = 0.0
    with quiet_stderr():
        llm = llama_cpp.Llama(model_path=os.fspath(path), n_ctx=context, logits_all=True, n_threads=threads,
                              n_threads_batch=threads, type_k=0, type_v=0, verbose=False)
        for window in scored:
            total += _window_nll(llm, window, len(window) - 1)
        llm.close()
        del llm
    predicted = sum(len(i) - 1 for i in scored)
    info = {"tokens": sum(len(i) for i in ids), "predicted": predicted, "texts": len(texts)}
    if reference is not None:
        reference = [[int(t) for t in r] for r in reference]
        info.update(reference_tokens=sum(len(r) for r in reference),
                    same_tokens=sum(list(a) == b for a, b in zip(ids, reference)))
    return total / predicted, info


@dataclass(frozen=True)
class GGUFLoss:
    """``gguf_loss``'s result: the held-out loss of the file's weights, the file's tensor bytes and
    ``{ggml type: tensor count}`` of its quantized tensors (F32 / F16 ones left out)."""

    loss: float
    nbytes: int
    types: dict = dataclasses.field(default_factory=dict)


def gguf_loss(model, template, path, windows, *, tokenizer=None, gguf_mix=None, importance=None):
    """Write ``model`` as the GGUF file ``path`` and evaluate the weights read back from it.

    Args:
        model: a model ``save_gguf`` writes (float, QAT-wrapped or converted).
        template: a float model of the same architecture and shapes, e.g. ``model`` before QAT;
            the file's weights are loaded into a copy of it (``load_gguf_weights``).
        path: the ``.gguf`` file to write.
        windows: held-out token windows, shape ``(count, length)``.
        tokenizer: written into the file (``save_gguf(tokenizer=...)``).
        gguf_mix: ``save_gguf``'s: a llama.cpp mix (``"Q4_K_M"``), in which a float ``model`` is
            written as ``llama-quantize`` writes it (and a QAT model must be trained on the mix).
        importance: with ``gguf_mix``, ``save_gguf``'s: the importance matrix the model was quantized
            or QAT-trained with (the mix's types with an imatrix; a float model is written as
            ``llama-quantize --imatrix`` writes it).

    Returns:
        ``GGUFLoss(loss, nbytes, types)``: ``held_out_loss`` of the read-back model, the bytes of
        the file's tensor data and the count of each quantized block type in it.

    >>> import os, tempfile, torch
    >>> from mixle.api import apply_qat
    >>> from mixle.lm.transformer import build_causal_lm
    >>> base = build_causal_lm(40, 32, 1, 2, 8, activation="gelu_tanh")
    >>> qat = apply_qat(build_causal_lm(40, 32, 1, 2, 8, activation="gelu_tanh"), grid="q4_0")
    >>> windows = np.zeros((2, 9), dtype=np.int64)
    >>> result = gguf_loss(qat, base, os.path.join(tempfile.mkdtemp(), "qat.gguf"), windows)
    >>> abs(result.loss - held_out_loss(qat, windows)) < 1e-5, result.nbytes > 0
    (True, True)
    """
    from mixle.gguf.writer import load_gguf_weights, save_gguf
    from mixle.gguf.file import open_gguf

    save_gguf(model, path, tokenizer=tokenizer, gguf_mix=gguf_mix, importance=importance)
    from_file = load_gguf_weights(template, path)
    tensors = open_gguf(path, purpose="evaluating a model from its GGUF file").tensors
    nbytes = sum(int(t.n_bytes) for t in tensors)
    types = collections.Counter(t.tensor_type.name for t in tensors if t.tensor_type.name not in ("F32", "F16"))
    return GGUFLoss(held_out_loss(from_file, windows), nbytes, dict(sorted(types.items())))
