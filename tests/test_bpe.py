"""Byte-level BPE (gptlab.tokenizers.bpe): the pieces by hand, agreement with Hugging Face ``tokenizers``
(same merges in the same order, same vocabulary, same ids), an oracle that recounts every pair
after every merge, round trips of arbitrary Unicode text, special tokens, save/load and errors.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gptlab.tokenizers.bpe import (BYTE_TO_CHAR, ENDOFTEXT, GPT2_PATTERN, ByteBPETokenizer, count_pairs,
                        count_words, merge_pair)
from gptlab.training.data import embedded_corpus
from gptlab.tokenizers.char import CharTokenizer, Tokenizer, load_tokenizer, tokenizer_types

CORPUS = embedded_corpus()
TRAIN, HELD_OUT = CORPUS[:100_000], CORPUS[100_000:130_000]


def fast(max_examples: int = 200):
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


# Any Unicode string (surrogates cannot be UTF-8 encoded); and the characters that Python's
# Unicode tables assign, where our `regex` and Hugging Face's engine classify alike.
any_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
assigned_text = st.text(st.characters(blacklist_categories=("Cs", "Cn")), max_size=40)


@pytest.fixture(scope="module")
def tok() -> ByteBPETokenizer:
    return ByteBPETokenizer.train(TRAIN, 400)


def hf_train(texts, vocab_size, special_tokens=(ENDOFTEXT,), min_frequency=0):
    """Hugging Face's byte-level BPE trained on ``texts`` (a list of documents)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=list(special_tokens), show_progress=False)
    hf.train_from_iterator(texts, trainer=trainer)
    return hf


def hf_model(hf) -> tuple[list[tuple[str, str]], dict[str, int]]:
    model = json.loads(hf.to_str())["model"]
    return [tuple(merge) for merge in model["merges"]], model["vocab"]


@pytest.fixture(scope="module")
def hf_tok():
    return hf_train([TRAIN], 400)


# --- the pieces -------------------------------------------------------------------------------

def test_bytes_to_unicode_is_gpt2s_printable_table():
    chars = list(BYTE_TO_CHAR.values())
    assert len(set(chars)) == 256 and all(ch.isprintable() and not ch.isspace() for ch in chars)
    assert BYTE_TO_CHAR[ord("A")] == "A" and BYTE_TO_CHAR[ord(" ")] == "Ġ"
    assert BYTE_TO_CHAR[ord("\n")] == "Ċ" and BYTE_TO_CHAR[0] == "Ā"


def test_bytes_to_unicode_matches_hugging_face_alphabet():
    pre_tokenizers = pytest.importorskip("tokenizers.pre_tokenizers")
    assert sorted(BYTE_TO_CHAR.values()) == sorted(pre_tokenizers.ByteLevel.alphabet())


def test_merge_pair_scans_left_to_right():
    assert merge_pair([1, 2, 3, 1, 2], (1, 2), 9) == [9, 3, 9]
    assert merge_pair([1, 1, 1], (1, 1), 9) == [9, 1]
    assert merge_pair([1, 1, 1, 1], (1, 1), 9) == [9, 9]
    assert merge_pair([2, 1], (1, 2), 9) == [2, 1]


def test_count_pairs_weights_by_word_frequency():
    counts, where = count_pairs([[1, 2, 3], [1, 2]], [5, 2])
    assert counts == {(1, 2): 7, (2, 3): 5}
    assert where == {(1, 2): {0, 1}, (2, 3): {0}}


def test_count_words_uses_gpt2_pretokenization_and_cuts_special_tokens():
    words = count_words(f"Hello world's  end.{ENDOFTEXT}Hello 42", GPT2_PATTERN, [ENDOFTEXT])
    assert words == Counter({"Hello": 2, " world": 1, "'s": 1, " ": 1, " end": 1, ".": 1, " 42": 1})


def naive_merges(text: str, n_merges: int) -> list[tuple[str, str]]:
    """The textbook loop, the oracle for the incremental counts: recount every pair of every
    word after every merge; take the most frequent pair, ties to the smallest ids."""
    base = sorted(BYTE_TO_CHAR.values())
    id_to_token = [ENDOFTEXT, *base]
    ids = {token: i for i, token in enumerate(id_to_token)}
    words = Counter(tuple(ids[BYTE_TO_CHAR[b]] for b in word.encode())
                    for word in count_words(text, GPT2_PATTERN, []).elements())
    merges = []
    for _ in range(n_merges):
        counts = Counter()
        for word, freq in words.items():
            for pair in zip(word, word[1:]):
                counts[pair] += freq
        if not counts:
            break
        pair = min(counts, key=lambda p: (-counts[p], p))
        merges.append((id_to_token[pair[0]], id_to_token[pair[1]]))
        id_to_token.append(merges[-1][0] + merges[-1][1])
        words = Counter({tuple(merge_pair(list(w), pair, len(id_to_token) - 1)): f
                         for w, f in words.items()})
    return merges


def test_incremental_counts_match_a_full_recount_per_merge():
    text = CORPUS[:20_000]
    assert ByteBPETokenizer.train(text, 257 + 60).merges == naive_merges(text, 60)


def test_train_stops_when_no_pair_is_left():
    tok = ByteBPETokenizer.train("ab ab ab", 1000)
    assert tok.merges == [("a", "b"), ("Ġ", "ab")]
    assert tok.vocab_size == 257 + 2


# --- agreement with Hugging Face tokenizers ---------------------------------------------------

@pytest.mark.parametrize("vocab_size", [300, 512])
@pytest.mark.parametrize("start", [0, 250_000])
def test_same_merges_vocab_and_ids_as_hugging_face(vocab_size, start):
    train, held_out = CORPUS[start:start + 100_000], CORPUS[start + 100_000:start + 130_000]
    hf = hf_train([train], vocab_size)
    ours = ByteBPETokenizer.train(train, vocab_size)
    merges, vocab = hf_model(hf)
    assert ours.merges == merges  # identical, in order
    assert {**ours.vocab, **ours.special_tokens} == vocab  # identical ids
    assert ours.vocab_size == hf.get_vocab_size() == vocab_size
    assert ours.encode(held_out) == hf.encode(held_out).ids


@pytest.mark.parametrize("special_tokens, min_frequency", [((), 3), ((ENDOFTEXT, "<pad>"), 1)])
def test_same_as_hugging_face_with_options(special_tokens, min_frequency):
    text = CORPUS[:30_000]
    hf = hf_train([text], 10_000, special_tokens, min_frequency)
    ours = ByteBPETokenizer.train(text, 10_000, special_tokens, min_frequency=min_frequency)
    merges, vocab = hf_model(hf)
    assert ours.merges == merges and {**ours.vocab, **ours.special_tokens} == vocab
    assert ours.vocab_size < 10_000  # stopped early: no pair left occurring min_frequency times


def test_special_tokens_in_training_text_separate_documents():
    """We cut ``<|endoftext|>`` out of the training text; Hugging Face agrees when it is given
    the documents between the markers as a list (on the joined text it would learn merges from
    the marker's characters)."""
    docs = [CORPUS[i:i + 3000] for i in range(0, 60_000, 3000)]
    hf = hf_train(docs, 500)
    ours = ByteBPETokenizer.train(ENDOFTEXT.join(docs), 500)
    assert ours.merges == hf_model(hf)[0]
    text = ENDOFTEXT.join([HELD_OUT[:2000], HELD_OUT[2000:4000], ""])
    assert ours.encode(text, allowed_special="all") == hf.encode(text).ids


@fast(300)
@given(text=assigned_text)
def test_same_ids_as_hugging_face_for_any_text(tok, hf_tok, text):
    # Hugging Face always reads "<|endoftext|>" in text as the special token; encode() reads it
    # as ordinary text unless allowed (tokenizer_base's policy). Hypothesis draws the string from
    # the constants of the modules loaded, which depend on what ran before in the process.
    assume(ENDOFTEXT not in text)
    assert tok.encode(text) == hf_tok.encode(text).ids


@fast(100)
@given(text=st.text(st.characters(blacklist_categories=("Cs", "Cn")), min_size=1, max_size=200),
       n_merges=st.integers(1, 30))
def test_same_merges_as_hugging_face_on_any_text(text, n_merges):
    """Arbitrary text has many equally frequent pairs: a test of the tie-breaking."""
    ours = ByteBPETokenizer.train(text, 257 + n_merges)
    assert ours.merges == hf_model(hf_train([text], 257 + n_merges))[0]


# --- round trips ------------------------------------------------------------------------------

EXAMPLES = ["", " ", "\n\n\t ", "Hello, world!", "naïve café", "e\u0301\u0302\u0303",
            "日本語のテキスト", "中文", "🙂👍🏽👩‍👩‍👧", "\x00\x01\x7f\x85\u2028",
            "  two  spaces  ",
            "it's we'll 12345 3.14", ENDOFTEXT, f"a{ENDOFTEXT}b{ENDOFTEXT}", "<|endoftext"]


@pytest.mark.parametrize("text", EXAMPLES)
@pytest.mark.parametrize("allowed_special", [(), "all"])
def test_round_trip_examples(tok, text, allowed_special):
    assert tok.decode(tok.encode(text, allowed_special=allowed_special)) == text


@fast()
@given(text=any_text)
def test_round_trip_any_text(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, allowed_special="all")) == text


@fast()
@given(text=any_text)
def test_tokens_never_straddle_pretokens(tok, text):
    """Tokens never straddle pre-tokens: encoding piece by piece gives the same ids."""
    import regex

    pieces = regex.findall(GPT2_PATTERN, text)
    assert [i for piece in pieces for i in tok.encode(piece)] == tok.encode(text)


def test_learned_tokens_compress_the_text(tok):
    ids = tok.encode(HELD_OUT)
    assert len(HELD_OUT.encode()) / len(ids) > 1.5  # bytes per token (1.8 at 400 tokens)


# --- special tokens ---------------------------------------------------------------------------

def test_end_of_text_only_when_allowed(tok):
    eot = tok.special_tokens[ENDOFTEXT]
    assert eot == 0
    assert tok.encode(f"a{ENDOFTEXT}b", allowed_special="all") == [*tok.encode("a"), eot,
                                                                    *tok.encode("b")]
    assert tok.encode(ENDOFTEXT, allowed_special={ENDOFTEXT}) == [eot]
    assert tok.encode(ENDOFTEXT, allowed_special=ENDOFTEXT) == [eot]
    plain = tok.encode(ENDOFTEXT)
    assert eot not in plain and len(plain) > 1
    assert tok.decode([eot]) == ENDOFTEXT


def test_special_tokens_are_never_merge_results(tok):
    assert not set(tok.special_tokens.values()) & set(tok.vocab.values())
    assert all(a + b not in tok.special_tokens for a, b in tok.merges)


def test_unknown_allowed_special_is_an_error(tok):
    with pytest.raises(ValueError, match=r"not special tokens of this tokenizer: \['<pad>'\]"):
        tok.encode("x", allowed_special={"<pad>"})


# --- errors -----------------------------------------------------------------------------------

@fast(50)
@given(bad=st.one_of(st.integers(max_value=-1), st.integers(min_value=400)))
def test_out_of_range_ids_name_the_id_and_vocab_size(tok, bad):
    with pytest.raises(ValueError, match=rf"cannot decode id {bad}: .*\[0, 400\).*size 400"):
        tok.decode([1, bad, 2])


def test_cut_characters_decode_to_replacement_characters(tok):
    byte = tok.vocab[BYTE_TO_CHAR["é".encode()[0]]]  # the first of two UTF-8 bytes
    assert tok.decode([byte]) == "\ufffd"
    assert tok.decode_bytes([byte]) == b"\xc3"


def test_non_integer_ids_are_a_type_error(tok):
    with pytest.raises(TypeError):
        tok.decode([1.5])


def test_lone_surrogates_cannot_be_encoded(tok):
    with pytest.raises(ValueError, match=r"position 2: surrogates not allowed"):
        tok.encode("ab\ud800")


def test_vocab_size_must_hold_bytes_and_special_tokens():
    with pytest.raises(ValueError, match="vocab_size must be at least 257"):
        ByteBPETokenizer.train("abc", 256)


# --- save / load ------------------------------------------------------------------------------

def test_save_load_round_trip(tok, tmp_path):
    assert isinstance(tok, Tokenizer)
    data = tok.to_dict()
    assert data["type"] == "bpe" and data["pattern"] == GPT2_PATTERN
    assert data["special_tokens"] == {ENDOFTEXT: 0}
    assert list(data["vocab"].items())[:2] == [("!", 1), ('"', 2)]
    assert data["merges"][0] == list(tok.merges[0])
    path = tmp_path / "bpe.json"
    tok.save(path)
    loaded = ByteBPETokenizer.load(path)
    assert loaded.to_dict() == data
    assert loaded.encode(HELD_OUT[:5000]) == tok.encode(HELD_OUT[:5000])
    assert tokenizer_types()["bpe"] is ByteBPETokenizer
    assert load_tokenizer(path).to_dict() == data
    char_path = tmp_path / "char.json"
    CharTokenizer.from_text("abc").save(char_path)
    with pytest.raises(ValueError, match="char.json: not a byte-level BPE .* got type 'char'"):
        ByteBPETokenizer.load(char_path)
    (tmp_path / "junk.json").write_bytes(b"\x80\x81 not json")
    with pytest.raises(ValueError, match="junk.json: not a tokenizer JSON file"):
        ByteBPETokenizer.load(tmp_path / "junk.json")


def broken(data: dict, **changes) -> dict:
    return {**data, **changes}


def test_from_dict_rejects_broken_data(tok):
    data = tok.to_dict()
    vocab = data["vocab"]
    without_bang = {token: i for token, i in vocab.items() if token != "!"}
    cases = {
        "not a byte-level BPE tokenizer": broken(data, type="char"),
        "expected type 'bpe' and the fields": {k: v for k, v in data.items() if k != "merges"},
        r"0, 1, ..., V-1 = 399, each once: id 10000 is out of range":
            broken(data, special_tokens={ENDOFTEXT: 10_000}),
        "each once: id 1 occurs 2 times": broken(data, special_tokens={ENDOFTEXT: 1}),
        "each once: id '0' is not an integer": broken(data, special_tokens={ENDOFTEXT: "0"}),
        "lacks 1 single-byte tokens": broken(data, vocab={**without_bang, "!!": 1}),
        "not a string of byte characters": broken(data, vocab={**vocab, "\u4e2d": len(vocab) + 1}),
        "special tokens must be non-empty": broken(data, special_tokens={"": 0}),
        "uses or makes a token missing": broken(data, merges=[*data["merges"], ["x", "yz"]]),
    }
    for message, bad in cases.items():
        with pytest.raises(ValueError, match=message):
            ByteBPETokenizer.from_dict(bad)

