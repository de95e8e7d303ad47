"""The embedded corpus, the tokenizers and the deterministic train/held-out split."""

import numpy as np
import pytest

from mixle.lm.data import SEGMENT_CHARS, ByteTokenizer, CharTokenizer, check_block, default_text, load_splits, load_text


def test_default_text_is_cpythons_documentation_topics_in_key_order():
    from pydoc_data import topics

    keys = sorted(topics.topics)
    expected = "\n\n".join(topics.topics[k] for k in keys)
    assert default_text() == expected
    assert len(expected) > 300_000 and "assignment statement" in expected.lower()


def test_char_tokenizer_ids_follow_the_sorted_characters_and_round_trip():
    tok = CharTokenizer("hello world")
    assert tok.chars == [" ", "d", "e", "h", "l", "o", "r", "w"]
    assert tok.encode("world").tolist() == [7, 5, 6, 4, 1]
    assert tok.decode(tok.encode("hello")) == "hello"
    with pytest.raises(ValueError, match="'z' is not in this tokenizer's vocabulary"):
        tok.encode("z")


def test_byte_tokenizer_is_utf8():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256
    assert tok.encode("aé").tolist() == list("aé".encode("utf-8"))
    assert tok.decode(tok.encode("naïve")) == "naïve"


def _segments(text):
    return [text[i : i + SEGMENT_CHARS] for i in range(0, len(text), SEGMENT_CHARS)]


def test_split_holds_out_seeded_segments_and_keeps_every_character_once():
    text = default_text()
    train, held, tok = load_splits(held_out_fraction=0.1, seed=3)
    segments = _segments(text)
    # Independent reference of the documented rule: a seeded permutation picks the held-out segments.
    n_held = round(0.1 * len(segments))
    chosen = set(np.random.default_rng(3).permutation(len(segments))[:n_held].tolist())
    assert tok.decode(held) == "".join(s for i, s in enumerate(segments) if i in chosen)
    assert tok.decode(train) == "".join(s for i, s in enumerate(segments) if i not in chosen)
    assert train.dtype == np.int64 and held.dtype == np.int64
    assert tok.vocab_size == len(set(text))


def test_split_is_deterministic_and_the_seed_changes_it():
    a_train, a_held, _ = load_splits(seed=0)
    b_train, b_held, _ = load_splits(seed=0)
    c_train, c_held, _ = load_splits(seed=1)
    assert np.array_equal(a_train, b_train) and np.array_equal(a_held, b_held)
    assert not np.array_equal(a_held, c_held)


def test_a_users_text_file_and_byte_tokens(tmp_path):
    path = tmp_path / "corpus.txt"
    text = "".join(f"line {i}: naïve café\n" for i in range(400))
    path.write_text(text, encoding="utf-8")
    train, held, tok = load_splits(path, held_out_fraction=0.25, seed=0, tokenizer="byte")
    data = text.encode("utf-8")
    assert len(train) + len(held) == len(data)
    assert sorted(tok.decode(train) + tok.decode(held)) == sorted(text)
    assert load_text(path) == text


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt.*does not exist"):
        load_splits(missing)


@pytest.mark.parametrize("content", ["", "  \n\t "])
def test_empty_text_is_refused(tmp_path, content):
    path = tmp_path / "empty.txt"
    path.write_text(content)
    with pytest.raises(ValueError, match="empty"):
        load_splits(path)


def test_text_too_short_to_split_and_bad_arguments(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("x" * 100)
    with pytest.raises(ValueError, match="too few to split"):
        load_splits(path)
    with pytest.raises(ValueError, match="held_out_fraction=1.5"):
        load_splits(held_out_fraction=1.5)
    with pytest.raises(ValueError, match="tokenizer='word'"):
        load_splits(tokenizer="word")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00abc" * 1000)
    with pytest.raises(ValueError, match="not UTF-8"):
        load_splits(binary)


def test_block_larger_than_the_data():
    check_block(np.arange(65), 64)
    with pytest.raises(ValueError, match="block=64 is larger than the data: held has 64 tokens"):
        check_block(np.arange(64), 64, "held")
