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
(first id, then second id) is merged first. Two differences, both deliberate or outside our
control: special-token strings in the training text are cut out here (Hugging Face trains on
them as ordinary text; it agrees with us when given the documents between them as a list),
and the ``regex`` package may know newer Unicode characters than Hugging Face's regex engine,
which then pre-tokenizes them differently (characters assigned in Python's own Unicode tables
agree).
"""

from __future__ import annotations

import heapq
import math
import operator
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable

import regex

from .tokenizer import Tokenizer, load_tokenizer

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
ENDOFTEXT = "<|endoftext|>"
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


def split_on_special(text: str, special_tokens: Collection[str]) -> list[str]:
    """text -> [text, special, text, ..., special, text]: special tokens at the odd positions."""
    if not special_tokens:
        return [text]
    longest_first = sorted(special_tokens, key=len, reverse=True)
    return regex.split("(" + "|".join(map(regex.escape, longest_first)) + ")", text)


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

    Train one with ``ByteBPETokenizer.train(text, vocab_size)``.
    """

    type = "bpe"

    def __init__(self, vocab: dict[str, int], merges: Iterable[tuple[str, str]],
                 special_tokens: dict[str, int], pattern: str = GPT2_PATTERN):
        self.vocab = dict(vocab)
        self.merges = [tuple(merge) for merge in merges]
        self.special_tokens = dict(special_tokens)
        self.pattern = pattern
        self._check_vocab()
        self._pretokenize = regex.compile(pattern).findall
        self._byte_ids = [self.vocab[BYTE_TO_CHAR[b]] for b in range(256)]
        self._id_to_bytes = [b""] * self.vocab_size
        for token, i in self.vocab.items():
            self._id_to_bytes[i] = bytes(CHAR_TO_BYTE[ch] for ch in token)
        for token, i in self.special_tokens.items():
            self._id_to_bytes[i] = token.encode("utf-8")
        pairs = [(self.vocab[a], self.vocab[b]) for a, b in self.merges]
        self._ranks = {pair: rank for rank, pair in enumerate(pairs)}  # (id, id) -> rank
        self._merged_ids = {pair: self.vocab[a + b] for pair, (a, b) in zip(pairs, self.merges)}
        self._cache: dict[str, list[int]] = {}

    def _check_vocab(self) -> None:
        """ValueError unless the ids are 0..V-1, the tokens are byte strings that include every
        single byte, the special tokens are non-empty and every merge is known."""
        ids = sorted([*self.vocab.values(), *self.special_tokens.values()])
        if ids != list(range(len(ids))):
            raise ValueError("the ids of vocab and special_tokens must be 0, 1, ..., V-1, "
                             "each once")
        not_bytes = [token for token in self.vocab if not token or set(token) - CHAR_TO_BYTE.keys()]
        if not_bytes:
            raise ValueError(f"vocab token {not_bytes[0]!r} is not a string of byte characters "
                             f"(see bytes_to_unicode)")
        if not all(self.special_tokens):
            raise ValueError("special tokens must be non-empty strings")
        missing = [b for b in range(256) if BYTE_TO_CHAR[b] not in self.vocab]
        if missing:
            raise ValueError(f"the vocabulary lacks {len(missing)} single-byte tokens, "
                             f"e.g. byte {missing[0]}")
        for a, b in self.merges:
            if a not in self.vocab or b not in self.vocab or a + b not in self.vocab:
                raise ValueError(f"merge {[a, b]} uses or makes a token missing from the "
                                 "vocabulary")

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

    def encode(self, text: str, allowed_special: Collection[str] | str = ()) -> list[int]:
        """text -> token ids, pre-token by pre-token.

        The special tokens named in ``allowed_special`` (``"all"``: every one) become their own
        ids; by default a special token's string is ordinary text and is encoded as its bytes,
        so text from outside can never forge an end-of-text marker.
        """
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(f"cannot encode {text[err.start]!r} at position {err.start}: "
                             f"{err.reason}") from None
        ids = []
        for k, chunk in enumerate(split_on_special(text, self._allowed(allowed_special))):
            if k % 2:
                ids.append(self.special_tokens[chunk])
            else:
                for piece in self._pretokenize(chunk):
                    ids.extend(self._encode_pretoken(piece))
        return ids

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
        keys = ("vocab", "merges", "special_tokens", "pattern")
        if not (isinstance(data, dict) and data.get("type") == cls.type
                and all(key in data for key in keys)):
            raise ValueError(f"not a byte-level BPE tokenizer: expected type {cls.type!r} and "
                             f"the fields {list(keys)}")
        return cls(data["vocab"], data["merges"], data["special_tokens"], data["pattern"])

    @classmethod
    def load(cls, path) -> ByteBPETokenizer:
        """Read a tokenizer JSON file written by ``save`` (``load_tokenizer``, for BPE only)."""
        tokenizer = load_tokenizer(path)
        if not isinstance(tokenizer, cls):
            raise ValueError(f"{path}: holds a {type(tokenizer).__name__}, not a {cls.__name__}")
        return tokenizer

    def __repr__(self) -> str:
        return (f"ByteBPETokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)}, "
                f"special_tokens={list(self.special_tokens)})")


__all__ = ["ByteBPETokenizer", "GPT2_PATTERN", "ENDOFTEXT", "BYTE_TO_CHAR", "CHAR_TO_BYTE",
           "bytes_to_unicode", "split_on_special", "count_words", "count_pairs", "merge_pair",
           "pop_best_pair", "apply_merge", "learn_merges"]
