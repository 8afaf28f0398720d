"""The byte-level BPE tokenizer in the form other courses and tiktoken hand it over: a bytes
vocabulary {id: bytes} and merges [(bytes, bytes)], and GPT-2 files whose vocab.json lists
entries that no merge makes (``<|endoftext|>`` not declared special)."""

import json

import pytest
from test_bpe import TRAIN
from test_tokenizer_gpt2_files import TEXTS

from gptlab.tokenizers.bpe import ENDOFTEXT, ByteBPETokenizer, token_bytes, token_string


@pytest.fixture(scope="module")
def tok() -> ByteBPETokenizer:
    return ByteBPETokenizer.train(TRAIN, 420)


def without_specials(tok) -> dict:
    """tok's bytes vocabulary without its special tokens, renumbered 0..V-1 in id order."""
    kept = [b for i, b in sorted(tok.vocab_bytes().items()) if i not in tok.special_tokens.values()]
    return dict(enumerate(kept))


def test_token_bytes_and_strings_are_inverse():
    every = bytes(range(256))
    assert token_bytes(token_string(every)) == every
    assert token_string(b" a\n") == "Ġa\u010a" and token_bytes("Ġa") == b" a"


def test_from_bytes_is_the_same_tokenizer(tok):
    """The bytes form (special tokens inside the vocab, by their UTF-8 bytes) gives back the
    same vocabulary, merges, special tokens and ids on every text."""
    vocab, merges = tok.vocab_bytes(), tok.merges_bytes()
    assert vocab[tok.special_tokens[ENDOFTEXT]] == ENDOFTEXT.encode()
    assert all(isinstance(a, bytes) and isinstance(b, bytes) for a, b in merges)
    again = ByteBPETokenizer.from_bytes(vocab, merges, special_tokens=[ENDOFTEXT])
    assert again.to_dict() == tok.to_dict()
    for text in TEXTS:
        assert again.encode(text, allowed_special="all") == tok.encode(text, allowed_special="all")


def test_from_bytes_appends_special_tokens_it_lacks(tok):
    vocab = without_specials(tok)
    again = ByteBPETokenizer.from_bytes(vocab, tok.merges_bytes(), ["<|pad|>", ENDOFTEXT])
    assert again.special_tokens == {"<|pad|>": len(vocab), ENDOFTEXT: len(vocab) + 1}
    assert again.encode(f"a{ENDOFTEXT}", allowed_special="all")[-1] == len(vocab) + 1


def test_from_bytes_without_special_tokens_keeps_unmade_entries_plain(tok):
    """Without special_tokens, b"<|endoftext|>" is a plain entry: its id decodes to its bytes,
    and the text "<|endoftext|>" is encoded as ordinary bytes, never as that id."""
    vocab = tok.vocab_bytes()
    plain = ByteBPETokenizer.from_bytes(vocab, tok.merges_bytes())
    eot = tok.special_tokens[ENDOFTEXT]
    assert plain.special_tokens == {} and plain.vocab_size == tok.vocab_size
    assert plain.decode([eot]) == ENDOFTEXT
    assert eot not in plain.encode(ENDOFTEXT)
    assert plain.decode(plain.encode(ENDOFTEXT)) == ENDOFTEXT


@pytest.mark.parametrize("change, error, message", [
    (lambda v, m: ([(0, b"a")], m), TypeError, "vocab must be a dict"),
    (lambda v, m: ({**v, 0: "!"}, m), TypeError, r"vocab\[0\] must be bytes, got str"),
    (lambda v, m: (v, [*m, (b"a", "b")]), TypeError, "must be a pair of bytes"),
    (lambda v, m: (v, [*m, (b"a", b"b", b"c")]), TypeError, "must be a pair of bytes"),
    (lambda v, m: ({**v, len(v): v[0]}, m), ValueError, "ids 0 and .* both have the bytes"),
    (lambda v, m: (v, [*m, (b"qz", b"x")]), ValueError, r"b'qz' is not in the vocabulary"),
    (lambda v, m: (v, [*m, (b"q", b"\xff")]), ValueError, r"b'q\\xff' is not in the vocabulary"),
    (lambda v, m: ({i + 1: b for i, b in v.items()}, m), ValueError, "out of range"),
    (lambda v, m: ({**v, len(v) + 3: b"zzzq"}, m), ValueError, "0, 1, ..., V-1"),
    (lambda v, m: (dict(enumerate(b for b in v.values() if b != b"!")),
                   [(a, b) for a, b in m if b"!" not in a + b]), ValueError, "lacks 1 single-byte"),
])  # fmt: skip
def test_from_bytes_names_inconsistent_input(tok, change, error, message):
    vocab, merges = change(without_specials(tok), tok.merges_bytes())
    with pytest.raises(error, match=message):
        ByteBPETokenizer.from_bytes(vocab, merges)


def test_gpt2_files_accept_entries_no_merge_makes(tok, tmp_path):
    """GPT-2's vocab.json read with special_tokens=(): <|endoftext|> and any other unmade entry
    ("<pad>") are plain vocabulary, decoded from their ids; the default still makes
    <|endoftext|> special."""
    vocab_path, merges_path = tok.save_gpt2_files(tmp_path)
    vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
    vocab["<pad>"] = len(vocab)
    vocab_path.write_text(json.dumps(vocab), encoding="utf-8")
    plain = ByteBPETokenizer.from_gpt2_files(vocab_path, merges_path, special_tokens=())
    assert plain.special_tokens == {} and plain.vocab_size == len(vocab)
    assert plain.decode([vocab[ENDOFTEXT], vocab["<pad>"]]) == ENDOFTEXT + "<pad>"
    assert plain.encode("<pad>") == tok.encode("<pad>")  # text never becomes an unmade entry
    special = ByteBPETokenizer.from_gpt2_files(vocab_path, merges_path)
    assert special.special_tokens == {ENDOFTEXT: vocab[ENDOFTEXT]}
    assert special.vocab["<pad>"] == len(vocab) - 1
