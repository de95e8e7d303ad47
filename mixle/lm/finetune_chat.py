"""The finetune job's chat answers: what each model says to a few prompts, before and after QAT.

Perplexity says how much a quantized file lost; an answer to a factual question shows it. With
``--prompts`` the job asks the float model, PTQ (and the calibrated baselines) before training and
the trained model after, each prompt as one user turn formatted by the tokenizer's chat template
(``apply_chat_template`` with the generation prompt; plain text when the tokenizer has none), and
records the greedy continuation of at most ``--answer-tokens`` tokens (stopping at the end-of-turn
token) in each row of ``results.json`` and in the model card. The loop is ``greedy_answers``, given
the next token by a transformers model (``chat_answers``, the torch job) or by a Flax causal LM
(the jax job's ``finetune_jax_train.greedy_next_token``).
"""

from mixle._optional import require

__all__ = ["chat_answers", "greedy_answers", "stop_ids", "prompt_ids", "answers_markdown"]


def prompt_ids(tokenizer, prompt):
    """The token ids the model is given for ``prompt``: one user turn in the tokenizer's chat template
    with the assistant's generation prompt, or the prompt's own encoding when it has no template.

    >>> prompt_ids  # doctest: +ELLIPSIS
    <function prompt_ids at ...>
    """
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer.encode(prompt)]


def stop_ids(model, tokenizer):
    """The ids that end an answer: the end-of-sequence ids of ``model``'s generation config (a
    transformers model; None: none) and of the tokenizer, and the common end-of-turn tokens it has.

    >>> class Tokenizer:
    ...     eos_token_id = 2
    ...     def get_vocab(self): return {"<|im_end|>": 7}
    ...     def convert_tokens_to_ids(self, token): return self.get_vocab()[token]
    >>> sorted(stop_ids(None, Tokenizer()))
    [2, 7]
    """
    stops = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is None:
            continue
        stops.update(value if isinstance(value, (list, tuple)) else [value])
    for token in ("<end_of_turn>", "<|im_end|>", "<|eot_id|>"):  # end-of-turn tokens of common chat templates
        found = tokenizer.convert_tokens_to_ids(token) if token in tokenizer.get_vocab() else None
        if found is not None:
            stops.add(found)
    return stops


def _check_prompts(prompts, max_tokens):
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"answer_tokens={max_tokens!r} must be a positive int (tokens an answer may have)")
    bad = [p for p in prompts if not isinstance(p, str) or not p.strip()]
    if bad:
        raise ValueError(f"prompts={bad!r}: each prompt must be a non-empty string")


def greedy_answers(next_token, tokenizer, prompts, max_tokens, stops):
    """Greedy answers to ``prompts``, one token at a time from ``next_token`` (any framework's model).

    Args:
        next_token: ``next_token(ids) -> int``, the model's most likely token after the list ``ids``.
        tokenizer: the model's tokenizer (``prompt_ids``, and decoding the answers).
        prompts: the user turns.
        max_tokens: at most this many tokens an answer.
        stops: ids that end an answer (``stop_ids``).

    Returns:
        ``[{"prompt": str, "answer": str, "tokens": int}]`` in the order of ``prompts``.

    Raises:
        ValueError: ``max_tokens`` not a positive int, or a prompt that is not a non-empty string.

    >>> greedy_answers(lambda ids: 0, None, [], 8, set())
    []
    """
    _check_prompts(prompts, max_tokens)
    answers = []
    for prompt in prompts:
        ids = prompt_ids(tokenizer, prompt)
        new = []
        for _ in range(max_tokens):
            token = next_token(ids + new)
            if token in stops:
                break
            new.append(token)
        text = tokenizer.decode(new, skip_special_tokens=True).strip()
        answers.append({"prompt": prompt, "answer": text, "tokens": len(new)})
    return answers


def chat_answers(model, tokenizer, prompts, max_tokens):
    """Greedy answers of a transformers ``model`` to ``prompts`` (see the module docstring).

    Each step runs the whole sequence again (no cache): the model may be a QAT or converted model
    whose layers are mixle's, and a few short answers cost little beside the evaluations. The jax
    job gives ``greedy_answers`` its Flax model's ``next_token`` (``finetune_jax_train.greedy_next_token``).

    Args:
        model: a transformers causal LM (float, PTQ, QAT or converted).
        tokenizer: its tokenizer.
        prompts: the user turns.
        max_tokens: at most this many tokens an answer.

    Returns:
        ``[{"prompt": str, "answer": str, "tokens": int}]`` in the order of ``prompts``.

    Raises:
        ValueError: ``max_tokens`` not a positive int, or a prompt that is not a non-empty string.

    >>> chat_answers(None, None, [], 8)
    []
    """
    _check_prompts(prompts, max_tokens)
    if not prompts:
        return []
    torch = require("torch", extra="torch", purpose="chat answers")
    device = next(model.parameters()).device

    def next_token(ids):
        return int(torch.argmax(model(torch.tensor([ids], device=device)).logits[0, -1].float()))

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return greedy_answers(next_token, tokenizer, prompts, max_tokens, stop_ids(model, tokenizer))
    finally:
        model.train(was_training)


def answers_markdown(rows):
    """The model card's section of the rows' answers: each prompt, then each row's answer.

    >>> print(answers_markdown([{"method": "float", "answers": [{"prompt": "Hi?", "answer": "Hello.", "tokens": 2}]}]))
    ## Chat answers (greedy)
    <BLANKLINE>
    **Hi?**
    <BLANKLINE>
    - float: Hello.
    <BLANKLINE>
    """
    answered = [row for row in rows if row.get("answers")]
    if not answered:
        return ""
    lines = ["## Chat answers (greedy)", ""]
    for index, first in enumerate(answered[0]["answers"]):
        lines += [f"**{first['prompt']}**", ""]
        for row in answered:
            answer = row["answers"][index]["answer"].replace("\n", " ")
            lines.append(f"- {row['method']}: {answer}")
        lines.append("")
    return "\n".join(lines)
