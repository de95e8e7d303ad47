"""Training text sampled from the float model itself (``mixle finetune --generated-tokens N``).

QAT distils the float model on the training text, and fits that text's domain: on Gemma 3 270M
trained on the CPython documentation, the QAT file recovers 95% of Q4_0 PTQ's loss on held-out
documentation but under 80% on a legal text. Text the float model samples itself covers what the
model was pretrained on (LLM-QAT, Liu et al. 2023, distils on such "data-free" samples), so
distilling on it as well keeps the student close to the teacher away from the training domain.
On Gemma 3 270M, measured, it did not close that gap (``docs/results/gemma3.rst``).

The jax job (``--backend jax``) samples with the same transformers model it loads its Flax model's
weights from, so both jobs train on the same ids for the same ``--seed``. The samples are
ancestral: from the model's start token (BOS, or end-of-text for a model without one), every
token is drawn from the float model's full next-token distribution at temperature 1 (no top-k or
top-p truncation: the KL the job minimises is then taken on the distribution it averages over),
with a seeded ``torch.Generator``, under the run's ``--dtype``. A sample ends at
its first end-of-text token or after ``4 * --block`` tokens; samples are drawn in batches until
there are ``N`` tokens, and joined to the training text with the end-of-text token as the files of
``--data`` are. The ids are written to ``generated.npy`` in ``--out`` before training, and a
resumed run reads them back (checked: a one-dimensional integer array of ids in the vocabulary), so
it trains on exactly the same windows. The importance matrix (``--imatrix calibrate``) is calibrated
on the training split with them.
"""

import contextlib
import dataclasses
import hashlib
import inspect

import numpy as np

from mixle._optional import require

__all__ = ["GENERATED_FILE", "sample_tokens", "start_token", "with_generated_text", "read_generated", "generated_data"]

GENERATED_FILE = "generated.npy"
BATCH = 16


def start_token(tokenizer):
    """The id every sample starts from: the tokenizer's BOS, else its end-of-text token.

    Raises:
        ValueError: the tokenizer has neither.

    >>> from types import SimpleNamespace
    >>> start_token(SimpleNamespace(bos_token_id=None, eos_token_id=2))
    2
    """
    for name in ("bos_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    raise ValueError("--generated-tokens: the model's tokenizer has no BOS and no end-of-text token to start a "
                     "sample from; leave --generated-tokens out")


def sample_tokens(model, count, *, start, stop, length, seed, dtype=None, progress=False):
    """``count`` or more tokens sampled from ``model`` (see the module docstring), as one int64 array.

    Args:
        model: a transformers causal LM (its ``forward`` keeps a key-value cache).
        count: at least this many tokens are returned (whole samples, each cut at ``stop``).
        start: the id each sample starts from (not returned).
        stop: the end-of-text id: a sample ends at it; it is kept between samples, not after the last.
        length: at most this many tokens a sample.
        seed: the sampling generator's seed.
        dtype: the autocast dtype (``torch.bfloat16``) or None.
        progress: show a tqdm bar of the tokens.

    >>> sample_tokens  # doctest: +ELLIPSIS
    <function sample_tokens at ...>
    """
    torch = require("torch", extra="torch", purpose="mixle finetune --generated-tokens")
    from tqdm.auto import tqdm

    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    parts, total = [], 0
    with tqdm(total=count, unit="tok", desc="sampling", disable=not progress) as bar:
        while total < count:
            before = total
            for row in _sample_batch(torch, model, generator, (start, stop), length, dtype, bar):
                row = row[: int(np.argmax(row == stop))] if (row == stop).any() else row
                parts.append(np.append(row, stop))
                total += len(row)
            if total == before:
                raise ValueError(f"--generated-tokens: every one of {BATCH} samples ended at once (end-of-text "
                                 f"{stop} drawn first); this model does not continue from its start token {start}")
    return np.concatenate(parts)[:-1].astype(np.int64)


def _sample_batch(torch, model, generator, start_stop, length, dtype, bar):
    """``BATCH`` samples of at most ``length`` tokens (numpy rows, cut at the stop id by the caller);
    ``bar`` counts the tokens kept."""
    start, stop = start_stop
    device = next(model.parameters()).device
    autocast = torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
    tokens = torch.full((BATCH, 1), start, dtype=torch.long, device=device)
    # transformers 5.x renamed the key-value cache's argument and output from past_key_values to cache
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    drawn, past, going = [], None, torch.ones(BATCH, dtype=torch.bool, device=device)
    with torch.no_grad(), autocast:
        for _ in range(length):
            out = model(input_ids=tokens, use_cache=True, **{key: past})
            past = out[key]
            probs = torch.softmax(out.logits[:, -1].float(), dim=-1)
            tokens = torch.multinomial(probs, 1, generator=generator)
            drawn.append(tokens)
            going &= tokens[:, 0] != stop
            bar.update(int(going.sum()))
            if not going.any():
                break
    return torch.cat(drawn, dim=1).cpu().numpy()


def read_generated(path, vocab):
    """The ids of a run's ``generated.npy``, checked before they are trained on.

    Raises:
        FileNotFoundError, ValueError: missing, unreadable, not a one-dimensional integer array,
            empty, or holding an id outside ``[0, vocab)``.

    >>> read_generated  # doctest: +ELLIPSIS
    <function read_generated at ...>
    """
    if not path.is_file():
        raise FileNotFoundError(f"resume: {str(path)!r} is missing: the interrupted run trained on the text it "
                                f"sampled into it; start the run again with another --out")
    try:
        ids = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as error:
        raise ValueError(f"{str(path)!r} is not a numpy array file ({error}): start the run again with another "
                         f"--out") from error
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or not len(ids):
        raise ValueError(f"{str(path)!r} holds a {ids.dtype} array of shape {ids.shape}, not the one-dimensional "
                         f"token ids the run sampled: start the run again with another --out")
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"{str(path)!r} holds ids in [{ids.min()}, {ids.max()}], outside the model's vocabulary of "
                         f"{vocab}: start the run again with another --out")
    return ids.astype(np.int64)


def with_generated_text(data, ids, stop):
    """``data`` (a ``FinetuneData``) whose training tokens go on with ``stop`` and ``ids``.

    >>> with_generated_text  # doctest: +ELLIPSIS
    <function with_generated_text at ...>
    """
    torch = require("torch", extra="torch", purpose="mixle finetune --generated-tokens")
    train = torch.cat([data.train_ids, torch.as_tensor(np.concatenate([[stop], ids]), dtype=data.train_ids.dtype)])
    digest = hashlib.sha256(data.digest.encode() + b"|generated|" + ids.tobytes()).hexdigest()
    info = {**data.info, "train_tokens": int(len(train)),
            "generated": {"tokens": int(len(ids)), "file": GENERATED_FILE}}
    return dataclasses.replace(data, train_ids=train, digest=digest, info=info)


def generated_data(run):
    """The run's data with its generated text: sampled by the float model on a new run (rank 0; the
    file written into ``--out``), read back from ``--out`` on a resumed one.

    >>> generated_data  # doctest: +ELLIPSIS
    <function generated_data at ...>
    """
    config, tokenizer, data = run.config, run.loaded.tokenizer, run.data
    stop = getattr(tokenizer, "eos_token_id", None)
    stop = start_token(tokenizer) if stop is None else int(stop)
    path = run.out / GENERATED_FILE
    if run.payload is not None:
        ids = read_generated(path, len(tokenizer))
    else:
        torch = require("torch", extra="torch", purpose="mixle finetune --generated-tokens")
        start = start_token(tokenizer)

        def sample():
            run.model.to(run.device)
            ids = sample_tokens(run.model.eval(), config.generated_tokens, start=start, stop=stop,
                                length=4 * config.block, seed=config.seed,
                                dtype=torch.bfloat16 if config.dtype == "bfloat16" else None, progress=run.progress)
            np.save(path, ids)
            return ids

        ids = run.ranks.from_main(sample)
    return with_generated_text(data, ids, stop)
