"""Model families: what the LM jobs need of a causal LM, as one small adapter per kind of model.

The training loop, the evaluator and the llama.cpp evaluation (``mixle.lm.training``,
``mixle.lm.llama_cpp_eval``) never look inside a model; they ask its family for

* the next-token logits of a batch of token ids (and from them the log-probability of windows),
* the model's context length,
* the llama.cpp architecture its GGUF file is written as,
* its tokenizer, as a ``Tokenizer`` (``encode`` text to int64 ids, ``decode`` ids to text).

Two families are known, tried in this order by ``family_of``:

* ``MIXLE``: mixle's ``build_causal_lm`` (float, QAT-wrapped or converted: anything with its
  ``sequence_log_prob(tokens)`` and ``block``), written as llama.cpp's ``gpt2``; its tokenizers
  are ``mixle.lm.data``'s ``CharTokenizer`` / ``ByteTokenizer`` as they are.
* ``TRANSFORMERS``: a transformers causal LM (``AutoModelForCausalLM``: logits from
  ``model(input_ids).logits``), written as its ``config.model_type`` (``llama``, ``qwen2``: the
  names llama.cpp uses); its tokenizer is wrapped by ``TransformersTokenizer``.

Adding a family is one ``ModelFamily`` record and its entry in ``FAMILIES``.
"""

import sys
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

__all__ = ["Tokenizer", "ModelFamily", "TransformersTokenizer", "MIXLE", "TRANSFORMERS", "FAMILIES",
           "family_of", "log_prob_from_logits"]


class Tokenizer(Protocol):
    """What the LM jobs need of a tokenizer: its vocabulary size, ``encode`` and ``decode``."""

    vocab_size: int

    def encode(self, text):
        """The int64 ids (a numpy array) of ``text``."""

    def decode(self, ids):
        """The text of ``ids``."""


def log_prob_from_logits(logits, targets):
    """Log-probability of each row's targets: ``sum_t log softmax(logits[:, t])[targets[:, t]]``.

    Args:
        logits: float ``(batch, length, vocab)``, the prediction of each target.
        targets: int64 ``(batch, length)``.

    Returns:
        float tensor of shape ``(batch,)``.

    >>> import torch
    >>> round(log_prob_from_logits(torch.zeros(1, 2, 4), torch.tensor([[0, 3]])).item(), 4)  # 2 * log(1/4)
    -2.7726
    """
    import torch.nn.functional as F

    nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return -nll.view(targets.shape[0], -1).sum(dim=1)


@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    """How the LM jobs use one kind of causal LM; every function takes the model first.

    Attributes:
        name: the family's name (``"mixle"``, ``"transformers"``).
        member: ``f(model) -> bool``: is ``model`` of this family?
        logits: ``f(model, ids) -> logits``: ids int64 ``(batch, length)``, logits float
            ``(batch, length, vocab)``, position ``t`` predicting the token after ``ids[:, t]``.
        context_length: ``f(model) -> int``, the longest sequence of ids the model accepts.
        gguf_architecture: ``f(model) -> str``, llama.cpp's name of the model's architecture.
        tokenizer: ``f(native) -> Tokenizer``: the family's own tokenizer as a ``Tokenizer``.
        own_log_prob: ``f(model, tokens) -> (batch,)`` when the model computes
            ``sequence_log_prob`` itself; None derives it from ``logits``.
    """

    name: str
    member: Callable[[Any], bool]
    logits: Callable[[Any, Any], Any]
    context_length: Callable[[Any], int]
    gguf_architecture: Callable[[Any], str]
    tokenizer: Callable[[Any], Tokenizer]
    own_log_prob: Callable[[Any, Any], Any] | None = None

    def sequence_log_prob(self, model, tokens):
        """Log-probability of each row's tokens after its first: ``sum_t log p(x_t | x_<t)``.

        Args:
            model: a model of this family.
            tokens: int64 ids, shape ``(batch, length)``, ``2 <= length <= context + 1``.

        Returns:
            float tensor of shape ``(batch,)``.

        >>> import torch
        >>> from mixle.lm.transformer import build_causal_lm
        >>> lm = build_causal_lm(vocab=10, d_model=8, n_layer=1, n_head=2, block=4)
        >>> MIXLE.sequence_log_prob(lm, torch.zeros(3, 5, dtype=torch.long)).shape
        torch.Size([3])
        """
        if self.own_log_prob is not None:
            return self.own_log_prob(model, tokens)
        return log_prob_from_logits(self.logits(model, tokens[:, :-1]), tokens[:, 1:])


class TransformersTokenizer:
    """A transformers tokenizer as a ``Tokenizer``: ids without special tokens, as int64 numpy.

    Attributes:
        native: the wrapped tokenizer (what ``save_gguf(tokenizer=...)`` takes).

    >>> from tokenizers import Tokenizer as Backend, models
    >>> from transformers import PreTrainedTokenizerFast
    >>> backend = Backend(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    >>> tokenizer = TransformersTokenizer(PreTrainedTokenizerFast(tokenizer_object=backend))
    >>> tokenizer.encode("hi").tolist(), tokenizer.decode([1]), tokenizer.vocab_size
    ([1], 'hi', 2)
    """

    kind = "transformers"

    def __init__(self, native):
        self.native = native

    @property
    def vocab_size(self):
        return len(self.native)

    def encode(self, text):
        """The ids of ``text`` (no BOS/EOS added), an int64 numpy array."""
        return np.asarray(self.native.encode(text, add_special_tokens=False), dtype=np.int64)

    def decode(self, ids):
        """The text of ``ids``."""
        return self.native.decode([int(i) for i in ids])


def _is_mixle(model):
    return callable(getattr(model, "sequence_log_prob", None)) and isinstance(getattr(model, "block", None), int)


def _is_transformers(model):
    # A transformers model exists only once transformers is imported: nothing to import here.
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def _hf_context(model):
    config = model.config
    return getattr(config, "max_position_embeddings", None) or config.n_positions


def _as_is(tokenizer):
    return tokenizer


MIXLE = ModelFamily(
    name="mixle",
    member=_is_mixle,
    logits=lambda model, ids: model(ids, all_positions=True),
    context_length=lambda model: model.block,
    gguf_architecture=lambda model: "gpt2",
    tokenizer=_as_is,
    own_log_prob=lambda model, tokens: model.sequence_log_prob(tokens),
)

TRANSFORMERS = ModelFamily(
    name="transformers",
    member=_is_transformers,
    logits=lambda model, ids: model(input_ids=ids, use_cache=False).logits,
    context_length=_hf_context,
    gguf_architecture=lambda model: model.config.model_type,
    tokenizer=TransformersTokenizer,
)

FAMILIES = (MIXLE, TRANSFORMERS)


def family_of(model):
    """The ``ModelFamily`` of ``model`` (the first of ``FAMILIES`` it is a member of).

    Raises:
        TypeError: ``model`` is of no known family.

    >>> from mixle.lm.transformer import build_causal_lm
    >>> family_of(build_causal_lm(vocab=10, d_model=8, n_layer=1, n_head=2, block=4)).name
    'mixle'
    """
    for family in FAMILIES:
        if family.member(model):
            return family
    raise TypeError(f"{type(model).__name__} is not a causal LM the LM jobs know: use mixle's build_causal_lm "
                    f"or a transformers causal LM (AutoModelForCausalLM)")
