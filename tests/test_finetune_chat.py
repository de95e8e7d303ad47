"""The finetune job's chat answers (``mixle.lm.finetune_chat``) on a tiny Llama and a word-level tokenizer
with a Gemma-style chat template: the prompt's ids, the greedy answer against transformers' own
``generate``, the end-of-turn stop, and the refusals."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from mixle.lm.finetune_chat import answers_markdown, chat_answers, prompt_ids  # noqa: E402
from mixle.lm.finetune_config import FinetuneConfig  # noqa: E402

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
            "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
WORDS = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "user", "model", "\n"] + [f"w{i}" for i in range(25)]


def word_tokenizer(template=TEMPLATE):
    vocab = {word: i for i, word in enumerate(WORDS)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    split = tokenizers.pre_tokenizers
    backend.pre_tokenizer = split.Sequence([split.Split(" ", behavior="removed"),
                                            split.Split(tokenizers.Regex(r"<[a-z_]+>|\n"), behavior="isolated")])
    backend.add_special_tokens(["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"])
    backend.decoder = tokenizers.decoders.WordPiece()  # joins the words with spaces
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>")
    tokenizer.chat_template = template
    return tokenizer


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64)).eval()


def test_prompt_ids_are_the_template_with_the_generation_prompt():
    tokenizer = word_tokenizer()
    ids = prompt_ids(tokenizer, "w3 w4")
    words = ["<bos>", "<start_of_turn>", "user", "\n", "w3", "w4", "<end_of_turn>", "\n", "<start_of_turn>", "model",
             "\n"]
    assert ids == [WORDS.index(w) for w in words]
    plain = word_tokenizer(template=None)
    assert prompt_ids(plain, "w3 w4") == [WORDS.index("w3"), WORDS.index("w4")]


def test_answers_are_transformers_greedy_generate_and_stop_at_end_of_turn():
    tokenizer, model = word_tokenizer(), tiny_llama()
    ids = torch.tensor([prompt_ids(tokenizer, "w5 w6")])
    with torch.no_grad():
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
    stops = {WORDS.index(w) for w in ("<eos>", "<end_of_turn>")}
    expected = reference[:min([i for i, t in enumerate(reference) if t in stops] + [5])]
    (answer,) = chat_answers(model, tokenizer, ["w5 w6"], 5)
    assert answer == {"prompt": "w5 w6", "answer": tokenizer.decode(expected, skip_special_tokens=True).strip(),
                      "tokens": len(expected)}
    # The model's own end-of-sequence id (its generation config) stops the answer too: made the first greedy token.
    model.generation_config.eos_token_id = reference[0]
    assert chat_answers(model, tokenizer, ["w5 w6"], 5)[0]["tokens"] == 0
    assert model.training is False


def test_bad_prompts_and_lengths_are_refused_naming_the_argument():
    with pytest.raises(ValueError, match="answer_tokens=0"):
        chat_answers(tiny_llama(), word_tokenizer(), ["w1"], 0)
    with pytest.raises(ValueError, match="prompts="):
        chat_answers(tiny_llama(), word_tokenizer(), ["  "], 4)
    with pytest.raises(ValueError, match="prompts="):
        FinetuneConfig(model="m", out="o", prompts=("ok", ""))
    with pytest.raises(ValueError, match="answer_tokens=0"):
        FinetuneConfig(model="m", out="o", answer_tokens=0)
    assert FinetuneConfig(model="m", out="o", prompts="Who?").prompts == ("Who?",)


def test_the_model_card_lists_each_prompt_with_each_rows_answer():
    rows = [{"method": "float", "answers": [{"prompt": "Q1", "answer": "A\nB", "tokens": 2}]},
            {"method": "PTQ"}, {"method": "QAT", "answers": [{"prompt": "Q1", "answer": "C", "tokens": 1}]}]
    assert answers_markdown(rows).splitlines() == ["## Chat answers (greedy)", "", "**Q1**", "", "- float: A B",
                                                   "- QAT: C"]
    assert answers_markdown([{"method": "float"}]) == ""
