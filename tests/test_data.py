"""Corpus loading, the train/validation split, random-window batches and the char tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gptlab.training.data import embedded_corpus, get_batch, load_text, split_train_val
from gptlab.tokenizers.char import CharTokenizer, Tokenizer, load_tokenizer, tokenizer_from_dict


def test_embedded_corpus_is_python_reference_text():
    text = load_text()
    assert text == embedded_corpus()
    assert 300_000 < len(text) < 2_000_000
    assert "lambda" in text


def test_load_text_reads_utf8(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("héllo wörld\n", encoding="utf-8")
    assert load_text(path) == "héllo wörld\n"
    assert load_text(str(path)) == "héllo wörld\n"


def test_missing_file_is_oserror_naming_the_path(tmp_path):
    path = tmp_path / "nope.txt"
    with pytest.raises(OSError, match="nope.txt"):
        load_text(path)


@pytest.mark.parametrize("content, message", [
    (b"", "no text"),
    (b" \n\t\n", "no text"),
    (b"abc\x00def", "NUL"),
    (b"abc\xff\xfedef", "UTF-8"),
])  # fmt: skip
def test_bad_files_are_valueerrors_naming_the_path(tmp_path, content, message):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message) as err:
        load_text(path)
    assert "bad.txt" in str(err.value)


def test_split_keeps_the_last_tenth_for_validation():
    ids = np.arange(100)
    train, val = split_train_val(ids, block_size=8)
    assert train.tolist() == list(range(90)) and val.tolist() == list(range(90, 100))


def test_split_too_short_for_the_context():
    with pytest.raises(ValueError, match=r"short.txt is too short.*block_size \+ 1 = 17"):
        split_train_val(np.arange(100), block_size=16, source="short.txt")
    with pytest.raises(ValueError, match="val_fraction"):
        split_train_val(np.arange(100), block_size=4, val_fraction=1.0)


def test_get_batch_shapes_and_shift():
    data = np.arange(1000) * 3  # y must be the next element of the same window
    x, y = get_batch(data, batch_size=5, block_size=7, rng=np.random.default_rng(0))
    assert x.shape == y.shape == (5, 7) and x.dtype == np.int64
    np.testing.assert_array_equal(y[:, :-1], x[:, 1:])
    np.testing.assert_array_equal(y[:, -1], x[:, -1] + 3)
    np.testing.assert_array_equal(np.diff(x, axis=1), 3)  # consecutive tokens


def test_get_batch_covers_the_last_window_and_stays_inside():
    data = np.arange(10)
    rng = np.random.default_rng(0)
    batches = [get_batch(data, 64, 9, rng) for _ in range(4)]
    assert {int(x[b, 0]) for x, _ in batches for b in range(64)} == {0}  # only window: 0..9
    x, y = get_batch(np.arange(12), 256, 9, rng)
    assert set(x[:, 0].tolist()) == {0, 1, 2} and int(y.max()) == 11


def test_get_batch_replays_from_saved_rng_state():
    data = np.arange(500)
    rng = np.random.default_rng(42)
    get_batch(data, 4, 8, rng)
    state = rng.bit_generator.state
    expected = get_batch(data, 4, 8, rng)
    rng2 = np.random.default_rng(0)
    rng2.bit_generator.state = state
    for a, b in zip(expected, get_batch(data, 4, 8, rng2)):
        np.testing.assert_array_equal(a, b)


def test_get_batch_on_torch():
    x, y = get_batch(np.arange(100), 2, 5, np.random.default_rng(0), backend="torch", device="cpu")
    assert isinstance(x, torch.Tensor) and x.dtype == torch.int64 and tuple(y.shape) == (2, 5)


def test_char_tokenizer_round_trip(tmp_path):
    text = "Hello, wörld!\n\tλx: x"
    tok = CharTokenizer.from_text(text)
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == len(set(text))
    assert tok.chars == sorted(set(text))
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode(" ") == [tok.chars.index(" ")]
    path = tmp_path / "tok.json"
    tok.save(path)
    assert json.loads(path.read_text(encoding="utf-8"))["type"] == "char"
    loaded = load_tokenizer(path)
    assert isinstance(loaded, CharTokenizer) and loaded.chars == tok.chars
    assert tokenizer_from_dict(tok.to_dict()).encode(text) == ids


def test_char_tokenizer_errors(tmp_path):
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match=r"'z' at position 2"):
        tok.encode("abzz")
    with pytest.raises(ValueError, match=r"id 3.*\[0, 3\)"):
        tok.decode([0, 3])
    with pytest.raises(ValueError, match="id -1"):
        tok.decode([-1])
    with pytest.raises(ValueError, match="sorted"):
        CharTokenizer(["b", "a"])
    with pytest.raises(ValueError, match="at least one"):
        CharTokenizer.from_text("")


def test_load_tokenizer_errors(tmp_path):
    path = tmp_path / "tok.json"
    path.write_text(json.dumps({"type": "bpe-from-the-future"}))
    with pytest.raises(ValueError, match="unknown tokenizer type 'bpe-from-the-future'"):
        load_tokenizer(path)
    path.write_bytes(b"\x00\x01 not json")
    with pytest.raises(ValueError, match="tok.json"):
        load_tokenizer(path)


def test_get_batch_without_a_generator_draws_new_batches():
    """Without a generator successive calls give different batches (each used to be the batch
    of default_rng(0), issue 33); a seeded generator still replays; a generator that is not a
    numpy Generator is refused by name."""
    data = np.arange(10_000)
    first, second = get_batch(data, 6, 8), get_batch(data, 6, 8)
    assert not np.array_equal(first[0], second[0])  # 6 offsets in 9992 alike: p < 1e-23
    for a, b in zip(get_batch(data, 6, 8, np.random.default_rng(5)),
                    get_batch(data, 6, 8, np.random.default_rng(5))):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError, match="rng must be a numpy.random.Generator"):
        get_batch(data, 6, 8, 0)
