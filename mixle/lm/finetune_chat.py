"""The finetune job's chat answers: what each model says to a few prompts, before and after QAT.

Perplexity says how much a quantized file lost; an answer to a factual question shows it. With
``--prompts`` the job asks the float model, PTQ (and the calibrated baselines) before training and
the trained model after, each prompt as one user turn formatted by the tokenizer's chat template
(``apply_chat_template`` with the generation prompt; plain text when the tokenizer has none), and
records the greedy continuation of at most ``--answer-tokens`` tokens (stopping at the end-of-turn
token) in each row of ``results.json`` and in the model card.
"""

from mixle._optional import require

__all__ = ["chat_answers", "prompt_ids", "answers_markdown"]


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


def _stop_ids(model, tokenizer):
    """The ids that end an answer: the generation config's and the tokenizer's end-of-sequence ids."""
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


def chat_answers(model, tokenizer, prompts, max_tokens):
    """Greedy answers of ``model`` to ``prompts`` (see the module docstring).

    Each step runs the whole sequence again (no cache): the model may be a QAT or converted model
    whose layers are mixle's, and a few short answers cost little beside the evaluations.

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
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"answer_tokens={max_tokens!r} must be a positive int (tokens an answer may have)")
    bad = [p for p in prompts if not isinstance(p, str) or not p.strip()]
    if bad:
        raise ValueError(f"prompts={bad!r}: each prompt must be a non-empty string")
    if not prompts:
        return []
    torch = require("torch", extra="torch", purpose="chat answers")
    stops = _stop_ids(model, tokenizer)
    device = next(model.parameters()).device
    answers = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for prompt in prompts:
                ids = prompt_ids(tokenizer, prompt)
                new = []
                for _ in range(max_tokens):
                    logits = model(torch.tensor([ids + new], device=device)).logits[0, -1]
                    token = int(torch.argmax(logits.float()))
                    if token in stops:
                        break
                    new.append(token)
                text = tokenizer.decode(new, skip_special_tokens=True).strip()
                answers.append({"prompt": prompt, "answer": text, "tokens": len(new)})
    finally:
        model.train(was_training)
    return answers


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
