"""The special-token policy, one for every tokenizer (``gptlab.tokenizers.base``): a special
token's string is ordinary text unless named in ``allowed_special`` (one name, a collection, or
``"all"``); a name that is not a special token of the tokenizer is a ValueError; ``decode`` turns
a special id back into its string; ``encode_iterable`` follows the same policy.
"""

from __future__ import annotations

import pytest

from gptlab.tokenizers.bpe import ENDOFTEXT, ByteBPETokenizer
from gptlab.training.data import embedded_corpus
from gptlab.tokenizers.char import CharTokenizer

PAD, END = "<pad>", "<|end"  # "<|end" is also the start of "<|endoftext|>"
TEXT = f"one{ENDOFTEXT}two{PAD}three{END}four"


@pytest.fixture(scope="module")
def bpe() -> ByteBPETokenizer:
    return ByteBPETokenizer.train(embedded_corpus()[:20_000], 400,
                                  special_tokens=[ENDOFTEXT, PAD, END])


@pytest.fixture(scope="module")
def chars() -> CharTokenizer:
    return CharTokenizer.from_text(TEXT)


def ordinary(tok, *pieces: str) -> list[int]:
    """The ids of the pieces, each encoded as ordinary text."""
    return [i for piece in pieces for i in tok.encode_ordinary(piece)]


def both(tok, text: str, allowed) -> list[int]:
    """``encode`` and ``encode_iterable`` (cut after every character) give the same ids."""
    ids = tok.encode(text, allowed)
    assert list(tok.encode_iterable(list(text), allowed)) == ids
    return ids


def test_by_default_special_strings_are_ordinary_text(bpe):
    ids = both(bpe, TEXT, ())
    assert ids == bpe.encode_ordinary(TEXT)
    assert not set(ids) & set(bpe.special_tokens.values())
    assert bpe.decode(ids) == TEXT


@pytest.mark.parametrize("allowed", [ENDOFTEXT, {ENDOFTEXT}, [ENDOFTEXT, ENDOFTEXT]])
def test_only_the_named_special_tokens_become_ids(bpe, allowed):
    eot = bpe.special_tokens[ENDOFTEXT]
    assert both(bpe, TEXT, allowed) == [*ordinary(bpe, "one"), eot,
                                        *ordinary(bpe, f"two{PAD}three{END}four")]


def test_all_special_tokens(bpe):
    ids = [bpe.special_tokens[token] for token in (ENDOFTEXT, PAD, END)]
    assert both(bpe, TEXT, "all") == [*ordinary(bpe, "one"), ids[0], *ordinary(bpe, "two"),
                                      ids[1], *ordinary(bpe, "three"), ids[2],
                                      *ordinary(bpe, "four")]
    assert both(bpe, TEXT, "all") == both(bpe, TEXT, {ENDOFTEXT, PAD, END})


def test_the_longest_allowed_special_token_wins(bpe):
    eot, end = bpe.special_tokens[ENDOFTEXT], bpe.special_tokens[END]
    assert both(bpe, ENDOFTEXT, "all") == [eot]
    assert both(bpe, ENDOFTEXT, END) == [end, *ordinary(bpe, "oftext|>")]


def test_decode_writes_special_ids_as_their_strings(bpe):
    for token, i in bpe.special_tokens.items():
        assert bpe.decode([i]) == token and bpe.decode_bytes([i]) == token.encode()
    assert bpe.decode(bpe.encode(TEXT, "all")) == TEXT


def test_char_tokenizer_has_none_and_follows_the_same_rules(chars):
    assert chars.special_tokens == {}
    ids = chars.encode_ordinary(TEXT)
    assert ids == [chars.chars.index(ch) for ch in TEXT]
    assert both(chars, TEXT, ()) == both(chars, TEXT, "all") == both(chars, TEXT, set()) == ids
    assert chars.decode(ids) == TEXT


@pytest.mark.parametrize("allowed", ["<nope>", {"<nope>"}, ["<nope>", ENDOFTEXT]])
def test_unknown_names_are_errors(bpe, chars, allowed):
    expected = r"\['<pad>', '<\|end', '<\|endoftext\|>'\]"
    with pytest.raises(ValueError, match=r"not special tokens of this tokenizer: \['<nope>'\]; "
                                         rf"expected 'all' or some of {expected}"):
        bpe.encode(TEXT, allowed)
    with pytest.raises(ValueError, match=r"not special tokens .*'<nope>'.* some of \[\]"):
        chars.encode(TEXT, allowed)
    for tok in (bpe, chars):
        with pytest.raises(ValueError, match="not special tokens of this tokenizer"):
            tok.encode_iterable([TEXT], allowed)
