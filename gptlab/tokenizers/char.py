"""Tokenizers: text <-> integer ids.

``CharTokenizer`` maps each character of the training text to its rank in the sorted set of
characters: the smallest vocabulary that covers the text, and the one the book trains first.
Every tokenizer is a ``Tokenizer`` (``gptlab.tokenizers.base``: ``encode``, ``encode_iterable``,
``decode``, ``vocab_size``, ``to_dict``, and the special-token policy) and saves to a JSON file
whose ``"type"`` field names its class, so ``load_tokenizer`` can read any of them back
(``tokenizer_types`` lists the classes: characters here, byte-level BPE in ``tokenizers/bpe.py``).

The modules import downwards only: ``tokenizer_base`` <- ``bpe`` <- ``tokenizer``.
"""

from __future__ import annotations

from collections.abc import Iterable

from .base import Tokenizer, read_tokenizer_file
from .bpe import ByteBPETokenizer


class CharTokenizer(Tokenizer):
    """One token per character: id = rank of the character in the sorted vocabulary.

    It has no special tokens: ``encode(text, allowed_special)`` accepts ``()`` and ``"all"``
    (both mean none) and rejects any name, as every tokenizer does for a name it lacks.
    """

    type = "char"

    def __init__(self, chars: Iterable[str]):
        chars = list(chars)
        if not chars:
            raise ValueError("a CharTokenizer needs at least one character")
        if any(not isinstance(ch, str) or len(ch) != 1 for ch in chars):
            raise ValueError("a CharTokenizer vocabulary must be single characters")
        if len(set(chars)) != len(chars) or chars != sorted(chars):
            raise ValueError("a CharTokenizer vocabulary must be sorted and free of duplicates")
        self.chars = chars
        self.ids = {ch: i for i, ch in enumerate(chars)}
        self.special_tokens = {}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """The vocabulary of ``text``: its distinct characters, sorted."""
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode_ordinary(self, text: str) -> list[int]:
        """text -> one id per character; ValueError naming the characters outside the vocabulary."""
        unknown = sorted(set(text) - self.ids.keys())
        if unknown:
            first = text.index(unknown[0])
            raise ValueError(
                f"cannot encode {len(unknown)} character(s) outside the vocabulary, e.g. "
                f"{unknown[0]!r} at position {first}: {unknown[:10]!r}"
            )
        return [self.ids[ch] for ch in text]

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(
                f"cannot decode id {bad[0]}: ids must be in [0, {self.vocab_size}) "
                f"({len(bad)} out of range)"
            )
        return "".join(self.chars[i] for i in ids)

    def to_dict(self) -> dict:
        return {"type": self.type, "chars": self.chars}

    @classmethod
    def from_dict(cls, data: dict) -> CharTokenizer:
        if not (isinstance(data, dict) and data.get("type") == cls.type
                and isinstance(data.get("chars"), list)):
            kind = data.get("type") if isinstance(data, dict) else None
            raise ValueError(f"not a char tokenizer: expected type {cls.type!r} and a 'chars' "
                             f"list, got type {kind!r}")
        return cls(data["chars"])

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


def tokenizer_types() -> dict[str, type[Tokenizer]]:
    """Every tokenizer class by the ``"type"`` name of its JSON files."""
    return {CharTokenizer.type: CharTokenizer, ByteBPETokenizer.type: ByteBPETokenizer}


def tokenizer_from_dict(data: dict) -> Tokenizer:
    """The tokenizer saved as ``data``, picked by its ``"type"`` field."""
    types = tokenizer_types()
    kind = data.get("type") if isinstance(data, dict) else None
    if kind not in types:
        raise ValueError(f"unknown tokenizer type {kind!r}: expected one of {sorted(types)}")
    return types[kind].from_dict(data)


def load_tokenizer(path) -> Tokenizer:
    """Read a tokenizer JSON file written by ``Tokenizer.save``, of any kind."""
    return read_tokenizer_file(path, tokenizer_from_dict)


__all__ = ["Tokenizer", "CharTokenizer", "tokenizer_types", "tokenizer_from_dict", "load_tokenizer"]
