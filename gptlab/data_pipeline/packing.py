"""From documents to training rows: a weighted mixture of sources with epochs per source,
tokenization with an end-of-text id after each document, packing into rows of fixed length, and
the document-aware attention mask.

Mixture arithmetic (Brown et al. 2020, Table 2.2): a source of n_s tokens with weight w_s in a
run of N training tokens is seen

    epochs_s = w_s * N / n_s

times; GPT-3 saw Wikipedia 3.4 times and its filtered Common Crawl 0.44 times in 300B tokens.

Packing (Brown et al. 2020, Appendix B): every sequence is a full context of T tokens; the
documents are concatenated, each followed by <|endoftext|>, and the stream is cut into rows. GPT-3
did not mask across documents. ``document_mask`` is the option of doing so: query i sees key j
when j <= i and both lie in the same document (the end-of-text token closes its document), a
block-diagonal causal mask. ``document_ids`` and ``document_positions`` are what
``gpt_forward`` takes for packed rows (``documents=``, ``positions=``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np

from ..backend import array_device, array_namespace
from ..checks import require_int, require_ndim_at_least
from ..tokenizers.base import Tokenizer
from ..tokenizers.bpe import ENDOFTEXT
from .documents import require_positive_int

# Brown et al. (2020), Table 2.2: tokens, weight in the training mix, epochs in 300B tokens
GPT3_TRAINING_TOKENS = 300e9
GPT3_MIXTURE = {
    "Common Crawl (filtered)": (410e9, 0.60, 0.44),
    "WebText2": (19e9, 0.22, 2.9),
    "Books1": (12e9, 0.08, 1.9),
    "Books2": (55e9, 0.08, 0.43),
    "Wikipedia": (3e9, 0.03, 3.4),
}


def mixture_epochs(source_tokens: Mapping[str, float], weights: Mapping[str, float],
                   total_tokens: float) -> dict[str, float]:
    """{source: w_s * N / n_s}, the epochs each source is seen in ``total_tokens`` tokens."""
    _check_weights(source_tokens, weights)
    if not total_tokens > 0:
        raise ValueError(f"total_tokens must be positive, got {total_tokens!r}")
    return {name: weights[name] * total_tokens / n for name, n in source_tokens.items()}


def _check_weights(sources: Mapping, weights: Mapping[str, float]) -> None:
    if set(sources) != set(weights):
        raise ValueError(f"weights name the sources {sorted(weights)} but the sources are "
                         f"{sorted(sources)}")  # fmt: skip
    if not sources:
        raise ValueError("a mixture needs at least one source")
    bad = {name: w for name, w in weights.items() if not w > 0}
    if bad:
        raise ValueError(f"weights must be positive, got {bad}")


def mix_sources(sources: Mapping[str, Iterable[Sequence[int]]], weights: Mapping[str, float],
                total_tokens: int, seed: int = 0) -> Iterator[tuple[str, Sequence[int]]]:
    """(source name, document) pairs until ``total_tokens`` tokens, each source taking the share
    w_s / sum(w) of the tokens: the next document comes from the source furthest behind its share
    (tokens taken / w_s smallest; ties in the order of ``sources``). A source that runs out starts
    a new epoch; a list (any Sequence) is visited in a new seeded order each epoch, any other
    iterable (a file reader) in its own order, so it must be iterable again. Token shares match
    the weights to within one document."""
    _check_weights(sources, weights)
    require_positive_int("total_tokens", total_tokens)
    rng = np.random.default_rng(seed)
    streams = {name: _epochs(src, rng, name) for name, src in sources.items()}
    taken = dict.fromkeys(sources, 0)
    while sum(taken.values()) < total_tokens:
        name = min(sources, key=lambda s: taken[s] / weights[s])
        document = next(streams[name])
        taken[name] += len(document)
        yield name, document


def _epochs(source, rng: np.random.Generator, name: str) -> Iterator[Sequence[int]]:
    """The documents of ``source``, epoch after epoch (reshuffled when it is a Sequence)."""
    while True:
        order = rng.permutation(len(source)) if isinstance(source, Sequence) else None
        documents = (source[k] for k in order) if order is not None else iter(source)
        n_tokens = 0
        for document in documents:
            n_tokens += len(document)
            yield document
        if n_tokens == 0:
            raise ValueError(f"source {name!r} gave no tokens in an epoch: it is empty, or an "
                             "iterator that cannot be iterated again (pass a list or a reader)")


def end_of_text_id(tokenizer: Tokenizer) -> int:
    """The id of ``<|endoftext|>`` in ``tokenizer``; ValueError when it has none."""
    if ENDOFTEXT not in tokenizer.special_tokens:
        raise ValueError(f"this {type(tokenizer).__name__} has no {ENDOFTEXT} token; pass "
                         f"eot_id yourself (e.g. vocab_size = {tokenizer.vocab_size}, one id past "
                         "its vocabulary, which the model then needs room for)")  # fmt: skip
    return tokenizer.special_tokens[ENDOFTEXT]


def encode_documents(documents: Iterable[str], tokenizer: Tokenizer) -> Iterator[list[int]]:
    """The ids of each document. A literal "<|endoftext|>" inside a document stays ordinary text
    (``encode`` with no special tokens allowed), so a document cannot forge a boundary."""
    for document in documents:
        yield tokenizer.encode(document)


def pack_documents(documents: Iterable[Sequence[int]], row_len: int,
                   eot_id: int) -> Iterator[np.ndarray]:
    """Rows (row_len,) int64 of the stream doc_0, eot, doc_1, eot, ...: every row full, a
    document cut wherever a row ends and continued in the next. The tokens after the last full
    row (fewer than ``row_len``) are dropped. Memory: one row plus one document."""
    require_positive_int("row_len", row_len)
    if isinstance(eot_id, bool) or not isinstance(eot_id, (int, np.integer)) or eot_id < 0:
        raise ValueError(f"eot_id must be a non-negative integer token id, got {eot_id!r}")
    row = np.empty(row_len, dtype=np.int64)  # (row_len,)
    filled = 0
    for document in documents:
        ids = np.append(np.asarray(document, dtype=np.int64), eot_id)  # (n + 1,)
        while len(ids):
            take = min(row_len - filled, len(ids))
            row[filled : filled + take] = ids[:take]
            filled, ids = filled + take, ids[take:]
            if filled == row_len:
                yield row.copy()
                filled = 0


def document_ids(rows, eot_id: int):
    """rows (B, T) token ids -> (B, T): per row, how many end-of-text tokens come strictly before
    each position, i.e. which document of the row it belongs to (an eot closes its own one)."""
    xp = array_namespace(rows)
    require_int("rows", rows)
    require_ndim_at_least("rows", rows, 1)
    is_eot = xp.astype(rows == eot_id, xp.int64)  # (B, T)
    return xp.cumulative_sum(is_eot, axis=-1) - is_eot  # (B, T)


def document_mask(rows, eot_id: int):
    """rows (B, T) -> (B, T, T) bool, True where query i may attend key j: j <= i and both in
    the same document. ``mask[:, None]`` is the mask of ``sdpa_forward`` for q (B, NH, T, hs)."""
    xp = array_namespace(rows)
    doc = document_ids(rows, eot_id)  # (B, T)
    T = rows.shape[-1]
    positions = xp.arange(T, device=array_device(rows))  # (T,)
    causal = positions[None, :] <= positions[:, None]  # (T, T) key j <= query i
    same = doc[..., :, None] == doc[..., None, :]  # (B, T, T)
    return xp.logical_and(same, causal)  # (B, T, T)


def document_positions(rows, eot_id: int):
    """rows (B, T) -> (B, T) int: the position of each token within its own document, 0 at each
    document's first token (the token after an end-of-text), counting the earlier tokens of the
    same document that ``document_mask`` lets it see."""
    xp = array_namespace(rows)
    return xp.sum(xp.astype(document_mask(rows, eot_id), xp.int64), axis=-1) - 1  # (B, T)
