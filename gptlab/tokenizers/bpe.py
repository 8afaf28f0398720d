"""Byte-level byte-pair encoding (BPE): the tokenizer of GPT-2.

Text is first cut into pre-tokens by GPT-2's regular expression (words with their leading
space, numbers, runs of punctuation, whitespace), and each pre-token is written as its UTF-8
bytes. Training starts from the 256 single bytes and repeatedly merges the most frequent
adjacent pair of tokens into a new token, until the vocabulary has ``vocab_size`` entries.
Encoding replays the learned merges, lowest rank (earliest learned) first, inside each
pre-token. Because every string is a sequence of bytes, every string can be encoded, and
``decode(encode(s)) == s`` exactly.

Tokens are stored as printable strings: GPT-2's ``bytes_to_unicode`` table gives each byte a
visible character (the space becomes ``"Ġ"``, the newline ``"Ċ"``), so the vocabulary and
the merge list read well in a JSON file.

Training counts the pairs once, over the distinct pre-tokens weighted by their frequency;
after each merge it recounts only the pre-tokens that held the merged pair. It matches Hugging
Face ``tokenizers`` (``BpeTrainer`` with the ``ByteLevel`` pre-tokenizer, no prefix space):
the same merges in the same order and the same ids. Special tokens take the first ids, then
come the 256 bytes in the code-point order of their printable characters (``"!"`` first),
then one id per merge. When two pairs are equally frequent, the pair with the smaller ids
(first id, then second id) is merged first. Special-token strings in the training text are cut
out here; Hugging Face trains on them as ordinary text, and agrees with us when given the
documents between them as a list.

GPT-2's own files load and save: ``from_gpt2_files(vocab_path, merges_path)`` reads the
``vocab.json`` and ``merges.txt`` of any GPT-2 checkpoint (ids in any order, ``<|endoftext|>``
among the vocabulary), ``save_gpt2_files(directory)`` writes the bytes Hugging Face writes.
``encode_iterable(chunks)`` encodes a stream with the ids of the joined text (see
``encode_final`` for what it holds back).

One known difference from Hugging Face, outside our control: both use GPT-2's pattern, but the
``regex`` package follows a newer Unicode version than Hugging Face's regex engine. A character
that only the newer version assigns (a letter or digit to us, unassigned to Hugging Face)
pre-tokenizes differently: "a" + U+0558 + "b" is one pre-token here and three there. With
``regex`` 2026.11.15 and ``tokenizers`` 0.23.3 that is 17,480 code points, all of them
unassigned in Python's own tables (``unicodedata``, Unicode 14.0 on Python 3.11); on every
character Python assigns, the two agree (``tests/test_tokenizer_gpt2_files.py`` checks both).
"""

from __future__ import annotations

import heapq
import json
import math
import operator
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

import regex

from .base import Tokenizer, split_on_special

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_LOOKAHEAD = 3  # characters GPT2_PATTERN may read from a pre-token's start: 'll, 're, 've
ENDOFTEXT = "<|endoftext|>"
GPT2_MERGES_HEADER = "#version: 0.2"  # the first line of GPT-2's merges.txt
CACHE_SIZE = 100_000  # pre-tokens remembered by ``encode`` before the cache is cleared

Pair = tuple[int, int]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table byte -> printable character.

    The printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, the space,
    the soft hyphen) get the characters U+0100, U+0101, ... in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + len(table) - len(printable))
    return table


BYTE_TO_CHAR = bytes_to_unicode()
CHAR_TO_BYTE = {ch: b for b, ch in BYTE_TO_CHAR.items()}
TO_LATIN1 = str.maketrans({ch: chr(b) for ch, b in CHAR_TO_BYTE.items()})  # then encode latin-1
FROM_LATIN1 = str.maketrans({chr(b): ch for b, ch in BYTE_TO_CHAR.items()})  # after decoding it


def token_bytes(token: str) -> bytes:
    """A token in ``bytes_to_unicode`` characters -> its bytes ("Ġa" -> b" a")."""
    return token.translate(TO_LATIN1).encode("latin-1")


def token_string(data: bytes) -> str:
    """Bytes -> the token in ``bytes_to_unicode`` characters (b" a" -> "Ġa")."""
    return data.decode("latin-1").translate(FROM_LATIN1)


def count_words(text: str, pattern: str, special_tokens: Collection[str]) -> Counter[str]:
    """How often each pre-token occurs in ``text``; special tokens are cut out, never counted."""
    pretokenize = regex.compile(pattern).findall
    chunks = split_on_special(text, special_tokens)[::2]
    return Counter(word for chunk in chunks for word in pretokenize(chunk))


def count_pairs(words: list[list[int]],
                freqs: list[int]) -> tuple[Counter[Pair], dict[Pair, set[int]]]:
    """Count every adjacent pair once: pair -> total count, and pair -> indices of its words."""
    counts: Counter[Pair] = Counter()
    where: dict[Pair, set[int]] = defaultdict(set)
    for i, (word, freq) in enumerate(zip(words, freqs)):
        for pair in zip(word, word[1:]):
            counts[pair] += freq
            where[pair].add(i)
    return counts, where


def merge_pair(word: list[int], pair: Pair, new_id: int) -> list[int]:
    """Replace each occurrence of ``pair`` in ``word``, scanning left to right, by ``new_id``."""
    a, b = pair
    merged, i = [], 0
    while i < len(word):
        if word[i] == a and i + 1 < len(word) and word[i + 1] == b:
            merged.append(new_id)
            i += 2
        else:
            merged.append(word[i])
            i += 1
    return merged


def pop_best_pair(heap: list, counts: Counter[Pair], min_frequency: int) -> Pair | None:
    """The most frequent pair (ties: smallest ids); None if none occurs ``min_frequency`` times.

    The heap holds ``(-count, pair)`` entries that may be stale: a count only drops after its
    entry was pushed, so a stale entry is pushed back with its current count and the next one
    is tried.
    """
    while heap:
        neg_count, pair = heapq.heappop(heap)
        count = counts[pair]
        if -neg_count != count:
            if count > 0:
                heapq.heappush(heap, (-count, pair))
            continue
        return pair if count >= min_frequency else None
    return None


def apply_merge(pair: Pair, new_id: int, words: list[list[int]], freqs: list[int],
                counts: Counter[Pair], where: dict[Pair, set[int]]) -> set[Pair]:
    """Merge ``pair`` into ``new_id`` in the words that hold it and update only their pair counts.

    Returns the pairs that contain ``new_id``: the only pairs whose counts went up.
    """
    new_pairs = set()
    for i in where.pop(pair):
        word, freq = words[i], freqs[i]
        merged = merge_pair(word, pair, new_id)
        if len(merged) == len(word):  # an earlier merge took this word's occurrences
            continue
        for old in zip(word, word[1:]):
            counts[old] -= freq
        for new in zip(merged, merged[1:]):
            counts[new] += freq
            if new_id in new:
                where[new].add(i)
                new_pairs.add(new)
        words[i] = merged
    return new_pairs


def learn_merges(words: list[list[int]], freqs: list[int], vocab: dict[str, int],
                 n_merges: int, min_frequency: int) -> list[Pair]:
    """Merge the most frequent pair ``n_merges`` times or until none occurs ``min_frequency`` times.

    ``words`` (pre-tokens as token ids, with their frequencies ``freqs``) and ``vocab`` (token
    string -> id) are updated in place: each merge adds its token with the next free id.
    """
    id_to_token = {i: token for token, i in vocab.items()}
    first_new_id = max(id_to_token) + 1
    counts, where = count_pairs(words, freqs)
    heap = [(-count, pair) for pair, count in counts.items()]
    heapq.heapify(heap)
    merges = []
    while len(merges) < n_merges:
        pair = pop_best_pair(heap, counts, min_frequency)
        if pair is None:
            break
        new_id = first_new_id + len(merges)
        id_to_token[new_id] = id_to_token[pair[0]] + id_to_token[pair[1]]
        vocab[id_to_token[new_id]] = new_id
        merges.append(pair)
        for new_pair in apply_merge(pair, new_id, words, freqs, counts, where):
            heapq.heappush(heap, (-counts[new_pair], new_pair))
    return merges


class ByteBPETokenizer(Tokenizer):
    """GPT-2's byte-level BPE: ``vocab`` (printable token string -> id), ``merges`` in rank
    order, ``special_tokens`` (string -> id) and the pre-tokenization ``pattern``.

    Train one with ``ByteBPETokenizer.train(text, vocab_size)``, or read GPT-2's own files with
    ``ByteBPETokenizer.from_gpt2_files(vocab_path, merges_path)``. The ids of ``vocab`` and
    ``special_tokens`` together are 0, 1, ..., V-1 in any order (``train`` gives the special
    tokens the first ids; GPT-2 gives ``<|endoftext|>`` the last, 50256).

    Special tokens: ``encode(text)`` and ``encode_iterable(chunks)`` treat a special token's
    string as ordinary text (its bytes); naming it in ``allowed_special`` (or ``"all"``) gives
    its id. ``decode`` writes a special token's id as its string.
    """

    type = "bpe"

    def __init__(self, vocab: dict[str, int], merges: Iterable[tuple[str, str]],
                 special_tokens: dict[str, int], pattern: str = GPT2_PATTERN):
        self.vocab = dict(vocab)
        self.merges = [tuple(merge) for merge in merges]
        self.special_tokens = dict(special_tokens)
        self.pattern = pattern
        self._check_vocab()
        try:
            self._pretokenizer = regex.compile(pattern)
        except (regex.error, TypeError) as err:
            raise ValueError(f"pattern {pattern!r} is not a regular expression ({err})") from None
        self._byte_ids = [self.vocab[BYTE_TO_CHAR[b]] for b in range(256)]
        self._id_to_bytes = [b""] * self.vocab_size
        for token, i in self.vocab.items():
            self._id_to_bytes[i] = token_bytes(token)
        for token, i in self.special_tokens.items():
            self._id_to_bytes[i] = token.encode("utf-8")
        pairs = [(self.vocab[a], self.vocab[b]) for a, b in self.merges]
        self._ranks = {pair: rank for rank, pair in enumerate(pairs)}  # (id, id) -> rank
        self._merged_ids = {pair: self.vocab[a + b] for pair, (a, b) in zip(pairs, self.merges)}
        self._cache: dict[str, list[int]] = {}

    def _check_vocab(self) -> None:
        """ValueError unless the ids are 0..V-1, the tokens are byte strings that include every
        single byte, the special tokens are non-empty and every merge uses and makes tokens of
        the vocabulary. A token that no merge makes is allowed: only its id reaches it (GPT-2's
        vocab.json lists ``<|endoftext|>`` so). Each check is one pass over sets, at C speed;
        only a failed one looks for the culprit to name."""
        ids = [*self.vocab.values(), *self.special_tokens.values()]
        if not (all(type(i) is int for i in ids) and set(ids) == set(range(len(ids)))):
            self._explain_ids(ids)
        all_chars = set().union(*self.vocab) if self.vocab else set()  # every character used
        if "" in self.vocab or not all_chars <= CHAR_TO_BYTE.keys():
            not_bytes = [t for t in self.vocab if not t or not set(t) <= CHAR_TO_BYTE.keys()]
            raise ValueError(f"vocab token {not_bytes[0]!r} is not a string of byte characters "
                             f"(see bytes_to_unicode)")
        if not all(self.special_tokens):
            raise ValueError("special tokens must be non-empty strings")
        missing = [b for b in range(256) if BYTE_TO_CHAR[b] not in self.vocab]
        if missing:
            raise ValueError(f"the vocabulary lacks {len(missing)} single-byte tokens, "
                             f"e.g. byte {missing[0]}")
        used = {token for merge in self.merges for token in merge}
        made = {a + b for a, b in self.merges}
        if not (used <= self.vocab.keys() and made <= self.vocab.keys()):
            for a, b in self.merges:
                if a not in self.vocab or b not in self.vocab or a + b not in self.vocab:
                    raise ValueError(f"merge {[a, b]} uses or makes a token missing from the "
                                     "vocabulary")

    @staticmethod
    def _explain_ids(ids: list) -> None:
        """The ValueError for ids that are not 0, 1, ..., V-1 each once, naming one culprit."""
        not_int = [i for i in ids if type(i) is not int]
        out_of_range = [i for i in ids if type(i) is int and not 0 <= i < len(ids)]
        twice = [i for i, n in Counter(ids).items() if n > 1]  # V ids in 0..V-1 not all once
        problem = (f"{not_int[0]!r} is not an integer" if not_int else
                   f"{out_of_range[0]} is out of range" if out_of_range else
                   f"{twice[0]} occurs {ids.count(twice[0])} times")
        raise ValueError(f"the ids of vocab and special_tokens must be 0, 1, ..., V-1 = "
                         f"{len(ids) - 1}, each once: id {problem}")

    @classmethod
    def train(cls, text: str, vocab_size: int, special_tokens: Iterable[str] = (ENDOFTEXT,),
              min_frequency: int = 1, pattern: str = GPT2_PATTERN) -> ByteBPETokenizer:
        """Learn merges on ``text`` until the vocabulary (special tokens included) has
        ``vocab_size`` tokens, or until no pair occurs ``min_frequency`` times."""
        special_tokens = list(dict.fromkeys(special_tokens))
        n_base = len(special_tokens) + 256
        if vocab_size < n_base:
            raise ValueError(f"vocab_size must be at least {n_base} (256 bytes + "
                             f"{len(special_tokens)} special tokens), got {vocab_size}")
        # ids: special tokens, then the bytes in code-point order of their characters
        alphabet = sorted(BYTE_TO_CHAR.values())
        vocab = {ch: len(special_tokens) + i for i, ch in enumerate(alphabet)}
        word_counts = count_words(text, pattern, special_tokens)
        words = [[vocab[BYTE_TO_CHAR[b]] for b in word.encode("utf-8")] for word in word_counts]
        freqs = list(word_counts.values())
        merges = learn_merges(words, freqs, vocab, vocab_size - n_base, min_frequency)
        id_to_token = {i: token for token, i in vocab.items()}
        return cls(vocab, [(id_to_token[a], id_to_token[b]) for a, b in merges],
                   {token: i for i, token in enumerate(special_tokens)}, pattern)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab) + len(self.special_tokens)

    def encode_ordinary(self, text: str) -> list[int]:
        """text -> token ids, pre-token by pre-token, with no special tokens (see ``encode``)."""
        require_utf8(text)
        pieces = self._pretokenizer.findall(text)
        if sum(map(len, pieces)) != len(text):
            self._explain_uncovered(text)
        return [i for piece in pieces for i in self._encode_pretoken(piece)]

    def _explain_uncovered(self, text: str) -> None:
        """The ValueError for a text that the pattern's pre-tokens do not cover: naming the
        first character it would drop."""
        end = 0
        for match in self._pretokenizer.finditer(text):
            if match.start() > end:
                break
            end = match.end()
        raise ValueError(f"cannot encode {text[end]!r} at position {end}: the pre-tokenization "
                         f"pattern {self.pattern!r} does not match it, so it would be lost "
                         "(a pattern must cover every character, as GPT2_PATTERN does)")

    def encode_final(self, text: str) -> tuple[int, list[int]]:
        """(n, ids): the pre-tokens that no continuation of ``text`` can change, n characters.

        With GPT-2's pattern a pre-token is final once another follows it and it starts at least
        ``GPT2_LOOKAHEAD`` characters before the end of the text. The last pre-token may still
        grow (a longer word or number, a longer run of spaces) or shrink (``\\s+(?!\\S)`` hands
        a run's last space to a word that follows), and one that starts within 3 characters of
        the end may still become a contraction: ``"'l"`` is two pre-tokens, ``"'ll"`` one. So
        ``encode_iterable`` holds back the last pre-token and any that starts among the last 2
        characters: at most the longer of the last pre-token and 2 characters.
        """
        self._require_gpt2_pattern("encode_final")
        require_utf8(text)
        n, ids = 0, []
        for match in self._pretokenizer.finditer(text):
            if match.end() == len(text) or match.start() > len(text) - GPT2_LOOKAHEAD:
                break
            n = match.end()
            ids += self._encode_pretoken(match.group())
        return n, ids

    def encode_iterable(self, chunks: Iterable[str],
                        allowed_special: Collection[str] | str = ()) -> Iterator[int]:
        """``Tokenizer.encode_iterable``: the ids of ``encode("".join(chunks), allowed_special)``,
        lazily, with memory bounded by the longest pre-token. Only with ``GPT2_PATTERN``, whose
        lookahead ``encode_final`` knows."""
        self._require_gpt2_pattern("encode_iterable")
        return super().encode_iterable(chunks, allowed_special)

    def _require_gpt2_pattern(self, what: str) -> None:
        if self.pattern != GPT2_PATTERN:
            raise ValueError(f"{what} works with GPT2_PATTERN only; this tokenizer pre-tokenizes "
                             f"with {self.pattern!r}")

    def _encode_pretoken(self, piece: str) -> list[int]:
        """One pre-token -> ids: merge the lowest-ranked pair present until none applies."""
        if piece in self._cache:
            return self._cache[piece]
        ids = [self._byte_ids[b] for b in piece.encode("utf-8")]
        while len(ids) > 1:
            pair = min(zip(ids, ids[1:]), key=lambda p: self._ranks.get(p, math.inf))
            if pair not in self._ranks:
                break
            ids = merge_pair(ids, pair, self._merged_ids[pair])
        if len(self._cache) >= CACHE_SIZE:
            self._cache.clear()
        self._cache[piece] = ids
        return ids

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """ids -> the bytes they stand for (a special token stands for its UTF-8 string)."""
        ids = [operator.index(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"cannot decode id {bad[0]}: ids must be in [0, {self.vocab_size}) "
                             f"for this vocabulary of size {self.vocab_size} "
                             f"({len(bad)} out of range)")
        return b"".join(self._id_to_bytes[i] for i in ids)

    def decode(self, ids: Iterable[int]) -> str:
        """ids -> text. ``decode(encode(s)) == s`` for every string; an arbitrary id sequence can
        cut a character's UTF-8 bytes apart, and each invalid byte sequence becomes U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def to_dict(self) -> dict:
        return {"type": self.type, "pattern": self.pattern,
                "special_tokens": dict(self.special_tokens),
                "vocab": dict(sorted(self.vocab.items(), key=lambda item: item[1])),
                "merges": [list(merge) for merge in self.merges]}

    @classmethod
    def from_dict(cls, data: dict) -> ByteBPETokenizer:
        kinds = {"vocab": dict, "merges": list, "special_tokens": dict, "pattern": str}
        kind_names = {dict: "a JSON object", list: "a JSON list", str: "a string"}
        if not (isinstance(data, dict) and data.get("type") == cls.type
                and all(key in data for key in kinds)):
            kind = data.get("type") if isinstance(data, dict) else None
            raise ValueError(f"not a byte-level BPE tokenizer: expected type {cls.type!r} and "
                             f"the fields {list(kinds)}, got type {kind!r}")
        for key, kind in kinds.items():
            if not isinstance(data[key], kind):
                raise ValueError(f'"{key}" must be {kind_names[kind]}, got {data[key]!r:.60}')
        for merge in data["merges"]:
            if not (isinstance(merge, list) and len(merge) == 2
                    and all(isinstance(token, str) for token in merge)):
                raise ValueError(f"every merge must be a pair of token strings, got {merge!r:.60}")
        return cls(data["vocab"], data["merges"], data["special_tokens"], data["pattern"])

    @classmethod
    def from_bytes(cls, vocab: dict[int, bytes], merges: Iterable[tuple[bytes, bytes]],
                   special_tokens: Iterable[str] = (), pattern: str = GPT2_PATTERN
                   ) -> ByteBPETokenizer:  # fmt: skip
        """The tokenizer of a bytes-level vocabulary, the form of tiktoken and other courses:
        ``vocab`` {id: token bytes}, ``merges`` [(bytes, bytes), ...] in rank order.

        ``special_tokens`` (strings): one whose UTF-8 bytes are in ``vocab`` keeps that id,
        any other is added with the next free id. ValueError naming the culprit for ids that
        are not 0..V-1, two ids with the same bytes, and a merge whose parts or result are not
        in ``vocab``; TypeError for entries that are not bytes.
        """
        if not isinstance(vocab, dict):
            raise TypeError(f"vocab must be a dict {{id: bytes}}, got {type(vocab).__name__}")
        for i, token in vocab.items():
            if not isinstance(token, (bytes, bytearray)):
                raise TypeError(f"vocab[{i!r}] must be bytes, got {type(token).__name__}")
        merges = [tuple(merge) for merge in merges]
        for rank, merge in enumerate(merges):
            if len(merge) != 2 or not all(isinstance(t, (bytes, bytearray)) for t in merge):
                raise TypeError(f"merge {rank} must be a pair of bytes, got {merge!r:.60}")
        ids_of = {bytes(token): i for i, token in vocab.items()}
        if len(ids_of) < len(vocab):
            seen = {}
            for i, token in vocab.items():
                if bytes(token) in seen:
                    raise ValueError(f"ids {seen[bytes(token)]} and {i} both have the bytes "
                                     f"{bytes(token)!r}: each token needs one id")  # fmt: skip
                seen[bytes(token)] = i
        for a, b in merges:
            if a not in ids_of or b not in ids_of or a + b not in ids_of:
                absent = next(t for t in (a, b, a + b) if t not in ids_of)
                raise ValueError(f"merge ({a!r}, {b!r}): {absent!r} is not in the vocabulary")
        specials = {}
        for token in dict.fromkeys(special_tokens):
            data = token.encode("utf-8")
            specials[token] = ids_of.pop(data) if data in ids_of else len(vocab) + len(specials)
        return cls({token_string(data): i for data, i in ids_of.items()},
                   [(token_string(a), token_string(b)) for a, b in merges], specials, pattern)

    def vocab_bytes(self) -> dict[int, bytes]:
        """{id: bytes} of every token, special tokens as their UTF-8 strings (``from_bytes``'s
        form, tiktoken's)."""
        return dict(enumerate(self._id_to_bytes))

    def merges_bytes(self) -> list[tuple[bytes, bytes]]:
        """The merges as pairs of bytes, in rank order."""
        return [(token_bytes(a), token_bytes(b)) for a, b in self.merges]

    @classmethod
    def from_gpt2_files(cls, vocab_path, merges_path,
                        special_tokens: Iterable[str] = (ENDOFTEXT,)) -> ByteBPETokenizer:
        """Read GPT-2's own tokenizer files, as every GPT-2 checkpoint ships them (and as
        ``save_gpt2_files`` or Hugging Face's ``save_model`` write them).

        ``vocab.json`` maps each token, spelled in ``bytes_to_unicode`` characters, to its id,
        special tokens included; ``merges.txt`` holds an optional first line ``#version: 0.2``,
        then one merge ``a b`` per line in rank order. Special tokens are recognised by name:
        they are the entries named in ``special_tokens`` (by default GPT-2's only one,
        ``<|endoftext|>``; pass ``()`` for files without any). Each must be in vocab.json. An
        entry no merge makes and not named special (``<|endoftext|>`` with ``()``) is a plain
        token, reached by its id only. The pattern is ``GPT2_PATTERN``: the files do not record
        one.
        """
        vocab, merges = read_gpt2_vocab(vocab_path), read_gpt2_merges(merges_path)
        special_tokens = list(dict.fromkeys(special_tokens))
        missing = [token for token in special_tokens if token not in vocab]
        if missing:
            raise ValueError(f"{vocab_path}: no special token {missing[0]!r} in the vocabulary; "
                             f"special_tokens must name those it holds (() for none)")
        try:
            return cls({token: i for token, i in vocab.items() if token not in special_tokens},
                       merges, {token: vocab[token] for token in special_tokens})
        except ValueError as err:
            raise ValueError(f"{vocab_path} with {merges_path}: {err}") from err

    def save_gpt2_files(self, directory) -> tuple[Path, Path]:
        """Write ``vocab.json`` and ``merges.txt`` in GPT-2's format into ``directory`` (made if
        missing), special tokens in vocab.json with their ids; return the two paths.

        The bytes are those Hugging Face's ``save_model`` writes: compact JSON in id order with
        non-ASCII characters as they are, and ``#version: 0.2`` above the merges. The files have
        no place for a pattern, so the tokenizer's must be ``GPT2_PATTERN``.
        """
        self._require_gpt2_pattern("save_gpt2_files")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tokens = {**self.vocab, **self.special_tokens}
        vocab = dict(sorted(tokens.items(), key=lambda item: item[1]))  # in id order
        lines = [GPT2_MERGES_HEADER, *(f"{a} {b}" for a, b in self.merges)]
        vocab_path, merges_path = directory / "vocab.json", directory / "merges.txt"
        vocab_path.write_text(json.dumps(vocab, ensure_ascii=False, separators=(",", ":")),
                              encoding="utf-8")
        merges_path.write_text("".join(line + "\n" for line in lines), encoding="utf-8",
                               newline="\n")
        return vocab_path, merges_path

    def __repr__(self) -> str:
        return (f"ByteBPETokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)}, "
                f"special_tokens={list(self.special_tokens)})")


def require_utf8(text: str) -> None:
    """ValueError naming the first character of ``text`` that UTF-8 cannot encode (a surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"cannot encode {text[err.start]!r} at position {err.start}: "
                         f"{err.reason}") from None


def read_gpt2_vocab(path) -> dict[str, int]:
    """GPT-2's vocab.json -> {token: id}; ValueError naming the file if it is not a JSON object
    of integer ids."""
    try:
        vocab = json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a JSON vocabulary ({err})") from err
    if not (isinstance(vocab, dict) and all(type(i) is int for i in vocab.values())):
        raise ValueError(f"{path}: expected a JSON object mapping each token to an integer id")
    return vocab


def read_gpt2_merges(path) -> list[tuple[str, str]]:
    """GPT-2's merges.txt -> [(a, b), ...] in rank order; a malformed line is a ValueError that
    names the file and the line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text ({err})") from err
    if lines[-1] == "":  # the newline that ends the last line
        lines.pop()
    merges = []
    for number, line in enumerate(lines, start=1):
        if number == 1 and line.startswith("#version"):
            continue
        merge = tuple(line.split(" "))
        if len(merge) != 2 or not all(merge):
            raise ValueError(f"{path}, line {number}: expected a merge 'a b' (two tokens, one "
                             f"space between), got {line!r}")
        merges.append(merge)
    return merges


__all__ = ["ByteBPETokenizer", "GPT2_PATTERN", "GPT2_LOOKAHEAD", "ENDOFTEXT", "BYTE_TO_CHAR",
           "CHAR_TO_BYTE", "bytes_to_unicode", "split_on_special", "count_words", "count_pairs",
           "merge_pair", "pop_best_pair", "apply_merge", "learn_merges", "read_gpt2_vocab",
           "read_gpt2_merges", "token_bytes", "token_string"]
