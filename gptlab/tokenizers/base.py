"""The tokenizer interface: text <-> ids, one special-token policy, streaming, JSON files.

Every tokenizer (characters in ``gptlab.tokenizers.char``, byte-level BPE in
``gptlab.tokenizers.bpe``) is a ``Tokenizer``. This module sits below both, so the arrows point one
way: ``gptlab.tokenizers.bpe`` builds on it, and ``gptlab.tokenizers.char`` builds on both (it
holds ``load_tokenizer``, which knows every kind).

Special tokens, one policy for every tokenizer: a special token (``<|endoftext|>``) has its own id,
but where its string occurs in the text it is ordinary text, encoded like any other characters,
unless the caller names it in ``allowed_special`` (or passes ``"all"``). Text from outside can
then never forge an end-of-text marker. Naming a string that is not a special token of the
tokenizer is a ValueError. ``decode`` turns a special token's id back into its string.

Streaming: ``encode_iterable(chunks)`` yields exactly the ids of ``encode("".join(chunks))``,
wherever the chunks are cut, while the text is still arriving. It holds back only the text whose
ids may still change: the end of the text that more characters could join (``encode_final``
decides, per tokenizer) and a possible start of an allowed special token.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Iterator
from pathlib import Path

import regex


def special_matches(text: str, special_tokens: Collection[str]) -> Iterator[regex.Match]:
    """The special tokens in ``text``, left to right; where two start at one place, the longest."""
    if not special_tokens:
        return iter(())
    longest_first = sorted(special_tokens, key=len, reverse=True)
    return regex.finditer("|".join(map(regex.escape, longest_first)), text)


def split_on_special(text: str, special_tokens: Collection[str]) -> list[str]:
    """text -> [text, special, text, ..., special, text]: special tokens at the odd positions."""
    pieces, start = [], 0
    for match in special_matches(text, special_tokens):
        pieces += [text[start:match.start()], match.group()]
        start = match.end()
    return [*pieces, text[start:]]


def special_prefix_start(text: str, special_tokens: Collection[str], start: int = 0) -> int:
    """The first position p >= start where ``text[p:]`` is the beginning of a special token, but
    not all of it: more text could still complete it (or a longer one). ``len(text)`` if none."""
    longest = max(map(len, special_tokens), default=0)
    for p in range(max(start, len(text) - longest + 1), len(text)):
        rest = text[p:]
        if any(len(token) > len(rest) and token.startswith(rest) for token in special_tokens):
            return p
    return len(text)


class Tokenizer(ABC):
    """The interface every tokenizer implements.

    A subclass encodes text without special tokens (``encode_ordinary``), decodes, and encodes
    the part of a text that is final (``encode_final``, for streaming); ``encode`` and
    ``encode_iterable`` add the special-token policy of this module on top.
    """

    type: str  # the "type" field of the saved JSON
    special_tokens: dict[str, int]  # special token string -> id (empty when there are none)

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @abstractmethod
    def encode_ordinary(self, text: str) -> list[int]:
        """text -> ids, every character ordinary text (no special tokens)."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str: ...

    @abstractmethod
    def to_dict(self) -> dict:
        """A JSON-friendly dict with a ``"type"`` field; ``from_dict`` inverts it."""

    @classmethod
    @abstractmethod
    def from_dict(cls, data: dict) -> Tokenizer: ...

    def encode_final(self, text: str) -> tuple[int, list[int]]:
        """(n, ids): the first n characters of ``text`` have these ids whatever text follows.

        ``encode_iterable`` encodes that much as soon as it arrives and holds back the rest.
        Here: all of it, for a tokenizer that encodes each character on its own.
        """
        return len(text), self.encode_ordinary(text)

    def encode(self, text: str, allowed_special: Collection[str] | str = ()) -> list[int]:
        """text -> token ids.

        A special token's string is ordinary text unless it is named in ``allowed_special`` (one
        string, a collection, or ``"all"`` for every special token); the named ones become their
        own ids. Naming a string that is not a special token is a ValueError.
        """
        allowed = self._allowed(allowed_special)
        ids = []
        for k, piece in enumerate(split_on_special(text, allowed)):
            ids += [self.special_tokens[piece]] if k % 2 else self.encode_ordinary(piece)
        return ids

    def encode_iterable(self, chunks: Iterable[str],
                        allowed_special: Collection[str] | str = ()) -> Iterator[int]:
        """Yield the ids of ``"".join(chunks)`` lazily, as the chunks arrive.

        The ids are exactly ``encode("".join(chunks), allowed_special)``, with the same
        special-token policy, wherever the chunks are cut: a special token cut in two by a chunk
        boundary is still found. Memory stays bounded: besides the current chunk, at most twice
        the text whose ids may still change is held (for BPE the longest pre-token and a few
        characters, plus the beginning of an allowed special token).
        """
        return self._encode_stream(chunks, self._allowed(allowed_special))

    def _encode_stream(self, chunks: Iterable[str], allowed: set[str]) -> Iterator[int]:
        parts, size, held = [], 0, 0
        for chunk in chunks:
            if not isinstance(chunk, str):
                raise TypeError(f"encode_iterable takes chunks of text (str), got "
                                f"{type(chunk).__name__}")
            parts.append(chunk)
            size += len(chunk)
            if size < 2 * held:  # scan again only once the held text has doubled: linear time
                continue         # even when one pre-token spans many small chunks
            text = "".join(parts)
            n, ids = self._encode_ready(text, allowed)
            yield from ids
            parts, size, held = [text[n:]], len(text) - n, len(text) - n
        yield from self.encode("".join(parts), allowed)

    def _encode_ready(self, text: str, allowed: set[str]) -> tuple[int, list[int]]:
        """(n, ids): the first n characters of ``text`` have these ids whatever text follows,
        with the special tokens in ``allowed``.

        A special token found before any possible start of another one is final, and so is the
        text before it; after the last of them, ``encode_final`` decides, on the text up to where
        a special token may begin.
        """
        ids, start = [], 0
        for match in special_matches(text, allowed):
            if match.start() >= special_prefix_start(text, allowed, start):
                break
            ids += self.encode_ordinary(text[start:match.start()])
            ids.append(self.special_tokens[match.group()])
            start = match.end()
        n, final_ids = self.encode_final(text[start:special_prefix_start(text, allowed, start)])
        return start + n, ids + final_ids

    def _allowed(self, allowed_special: Collection[str] | str) -> set[str]:
        """``"all"``, one special token or a collection of them -> the set of special tokens."""
        if allowed_special == "all":
            return set(self.special_tokens)
        allowed = {allowed_special} if isinstance(allowed_special, str) else set(allowed_special)
        unknown = sorted(allowed - self.special_tokens.keys())
        if unknown:
            raise ValueError(f"not special tokens of this tokenizer: {unknown}; "
                             f"expected 'all' or some of {sorted(self.special_tokens)}")
        return allowed

    def to_json(self) -> str:
        """``to_dict()`` as JSON text, non-ASCII tokens kept readable."""
        return json.dumps(self.to_dict(), ensure_ascii=False)

    def save(self, path) -> None:
        """Write ``to_json()`` to ``path``."""
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def load(cls, path) -> Tokenizer:
        """Read a file written by ``save``; ValueError if it holds another kind of tokenizer."""
        return read_tokenizer_file(path, cls.from_dict)


def read_tokenizer_file(path, from_dict: Callable[[dict], Tokenizer]) -> Tokenizer:
    """``from_dict`` of the JSON in ``path``; every ValueError names the file."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a tokenizer JSON file ({err})") from err
    try:
        return from_dict(data)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err


__all__ = ["Tokenizer", "special_matches", "split_on_special", "special_prefix_start",
           "read_tokenizer_file"]
