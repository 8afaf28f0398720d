"""Streaming: ``encode_iterable(chunks)`` gives exactly ``encode("".join(chunks))`` wherever the
chunks are cut, yields ids before the input ends, and holds back only about one pre-token.

The pieces the texts are drawn from are the places where a cut is dangerous: runs of spaces and
newlines (``\\s+(?!\\S)`` hands a space to the next word), apostrophes and the letters of the
contractions (``'`` + ``ll`` is one pre-token), digits, punctuation, multi-byte characters, and
special tokens and their fragments (one may be cut in two, or be the start of a longer one).
"""

from __future__ import annotations

import itertools

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from gptlab.tokenizers.bpe import ENDOFTEXT, GPT2_LOOKAHEAD, GPT2_PATTERN, ByteBPETokenizer
from gptlab.training.data import embedded_corpus
from gptlab.tokenizers.char import CharTokenizer

CORPUS = embedded_corpus()
# "<|end" is a special token and the start of another one: the stream must wait to tell them apart
SPECIAL = [ENDOFTEXT, "<|end", "<pad>"]
PIECES = [" ", "  ", "\n", "\n\n", "\t", "\r\n", "\u00a0", "\u3000", *["'"] * 6, "s", "t",
          "re", "ve", "m", "l", "ll", "d", "a", "It", "word", "1", "23", ".", ",", "!?", "-", "é",
          "中", "🙂", "\u0301", *SPECIAL, "<|", "|>", "endoftext", "<pa", "d>"]

tricky_text = st.lists(st.sampled_from(PIECES), max_size=30).map("".join)
allowed_options = st.sampled_from([(), "all", ENDOFTEXT, {"<|end"}, {ENDOFTEXT, "<pad>"}])


def fast(max_examples: int):
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None)


def cut(text: str, cuts: list[int]) -> list[str]:
    """``text`` cut at the positions ``cuts`` (any order, repeats give empty chunks)."""
    bounds = [0, *sorted(min(c, len(text)) for c in cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def pretokens(text: str) -> list[str]:
    return regex.findall(GPT2_PATTERN, text)


@pytest.fixture(scope="module")
def bpe() -> ByteBPETokenizer:
    """Trained with blank lines and contractions, so that ``\\n\\n``, ``'ll``, ``'re`` ... are
    tokens and a wrong cut shows in the ids too."""
    extra = "we'll they're you've I'm he'd it's don't.\n\n " * 200
    return ByteBPETokenizer.train(CORPUS[:60_000] + extra, 500, special_tokens=SPECIAL)


@pytest.fixture(scope="module")
def chars() -> CharTokenizer:
    return CharTokenizer.from_text("".join(PIECES) + "".join(SPECIAL))


# --- exactly encode(whole text), wherever the cuts fall ------------------------------------------

@fast(300)
@given(text=tricky_text, cuts=st.lists(st.integers(0, 400), max_size=8), allowed=allowed_options)
def test_bpe_stream_equals_whole_text(bpe, text, cuts, allowed):
    whole = bpe.encode(text, allowed)
    assert list(bpe.encode_iterable(cut(text, cuts), allowed)) == whole
    for k in range(len(text) + 1):  # and every cut in two
        assert list(bpe.encode_iterable([text[:k], text[k:]], allowed)) == whole


@fast(100)
@given(text=tricky_text, allowed=allowed_options)
def test_bpe_stream_of_single_characters(bpe, text, allowed):
    assert list(bpe.encode_iterable(list(text), allowed)) == bpe.encode(text, allowed)


@fast(100)
@given(text=tricky_text, cuts=st.lists(st.integers(0, 400), max_size=8),
       allowed=st.sampled_from([(), "all"]))
def test_char_stream_equals_whole_text(chars, text, cuts, allowed):
    assert list(chars.encode_iterable(cut(text, cuts), allowed)) == chars.encode(text, allowed)


@fast(300)
@given(text=tricky_text)
def test_final_pretokens_never_change(bpe, text):
    """For every beginning of ``text``, what ``encode_final`` calls final are the first
    pre-tokens and ids of the whole text, and what it holds back is at most the last pre-token,
    or the last GPT2_LOOKAHEAD - 1 characters."""
    whole_pretokens, whole_ids = pretokens(text), bpe.encode(text)
    for k in range(len(text) + 1):
        start = text[:k]
        n, ids = bpe.encode_final(start)
        final = [m.group() for m in regex.finditer(GPT2_PATTERN, start) if m.end() <= n]
        assert "".join(final) == start[:n]
        assert whole_pretokens[:len(final)] == final
        assert whole_ids[:len(ids)] == ids == [i for p in final for i in bpe.encode(p)]
        last = pretokens(start)[-1] if start else ""
        assert len(start) - n <= max(len(last), GPT2_LOOKAHEAD - 1)


# --- the cuts that break a naive line-by-line or chunk-by-chunk encoder --------------------------

def test_blank_line_cut_into_lines(bpe):
    text = "a\n\n b\n"
    assert pretokens(text) == ["a", "\n\n", " b", "\n"]
    assert len(bpe.encode("\n\n")) == 1  # one token for the blank line, as GPT-2's 628
    whole = bpe.encode(text)
    assert whole == [i for piece in pretokens(text) for i in bpe.encode(piece)]
    lines = text.splitlines(keepends=True)  # ["a\n", "\n", " b\n"]
    assert [i for line in lines for i in bpe.encode(line)] != whole  # the naive way differs
    assert list(bpe.encode_iterable(lines)) == whole


@pytest.mark.parametrize("chunks", [["it'", "ll"], ["it'l", "l"], ["x'", "r", "e"], ["x  ", "y"],
                                    ["x ", " ", "y"], ["12", "34"], ["wo", "rd"], ["中", "文"]])
def test_cuts_inside_a_pretoken(bpe, chunks):
    text = "".join(chunks)
    assert list(bpe.encode_iterable(chunks)) == bpe.encode(text)


def test_not_only_the_last_pretoken_may_change(bpe):
    """``"x'l"`` ends in two pre-tokens that may still change: ``"x'll"`` is ``x`` + ``'ll``."""
    assert pretokens("x'l") == ["x", "'", "l"] and pretokens("x'll") == ["x", "'ll"]
    assert bpe.encode_final("x'l") == (1, bpe.encode("x"))


@pytest.mark.parametrize("allowed", ["all", {ENDOFTEXT}])
def test_special_token_cut_in_two(bpe, allowed):
    chunks = ["one<|end", "oftext|>two"]
    ids = list(bpe.encode_iterable(chunks, allowed))
    assert ids == [*bpe.encode("one"), bpe.special_tokens[ENDOFTEXT], *bpe.encode("two")]


def test_special_token_that_starts_a_longer_one_waits(bpe):
    eot, end = bpe.special_tokens[ENDOFTEXT], bpe.special_tokens["<|end"]
    assert list(bpe.encode_iterable(["<|end", "oftext|>"], "all")) == [eot]
    assert list(bpe.encode_iterable(["<|end", "!"], "all")) == [end, *bpe.encode("!")]
    assert list(bpe.encode_iterable(["<|end", "oftext|>"], "<|end")) == \
        [end, *bpe.encode("oftext|>")]
    assert list(bpe.encode_iterable(["<|end", "oftext|>"])) == bpe.encode(ENDOFTEXT)


# --- lazy and bounded ----------------------------------------------------------------------------

def test_ids_come_before_an_endless_input_ends(bpe, chars):
    for tok in (bpe, chars):
        read = []

        def endless():
            for k in itertools.count():
                read.append(k)
                yield "a word, "

        ids = list(itertools.islice(tok.encode_iterable(endless()), 50))
        assert len(read) <= 50  # an encoder that waited for the end would never return
        assert ids == tok.encode("a word, " * len(read))[:50]


def test_held_text_stays_about_one_pretoken(bpe):
    """At every id, the bytes read but not yet encoded stay below a bound set by the longest
    pre-token and the longest chunk (the stream rescans once the held text has doubled)."""
    text = CORPUS[:20_000]
    sizes = itertools.cycle([1, 7, 2, 30, 3])
    chunks, start = [], 0
    while start < len(text):
        chunks.append(text[start:start + next(sizes)])
        start += len(chunks[-1])
    read = 0

    def counted():
        nonlocal read
        for chunk in chunks:
            read += len(chunk.encode())
            yield chunk

    longest = max(len(piece.encode()) for piece in pretokens(text))
    bound = 3 * (longest + GPT2_LOOKAHEAD) + max(len(chunk.encode()) for chunk in chunks)
    done, ids = 0, []
    for i in bpe.encode_iterable(counted()):
        assert read - done <= bound
        ids.append(i)
        done += len(bpe.decode_bytes([i]))
    assert ids == bpe.encode(text) and bound < len(text) // 100


# --- errors --------------------------------------------------------------------------------------

def test_errors_come_at_the_call(bpe, chars):
    for tok in (bpe, chars):
        with pytest.raises(ValueError, match=r"not special tokens of this tokenizer: \['<x>'\]"):
            tok.encode_iterable(iter(()), allowed_special={"<x>"})
    other = ByteBPETokenizer.train("ab ab", 260, pattern=r" ?\S+|\s+")
    with pytest.raises(ValueError, match="encode_iterable works with GPT2_PATTERN only"):
        other.encode_iterable(["ab"])


def test_chunks_must_be_text(bpe, chars):
    for tok in (bpe, chars):
        with pytest.raises(TypeError, match="chunks of text \\(str\\), got bytes"):
            list(tok.encode_iterable(["a", b"bytes"]))


def test_char_stream_rejects_unknown_characters(chars):
    with pytest.raises(ValueError, match="outside the vocabulary, e.g. 'Z'"):
        list(chars.encode_iterable(["a", "dZ"]))
