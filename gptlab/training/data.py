"""Text corpora, the train/validation split and random-window batches.

The default corpus ships with Python itself: ``pydoc_data.topics.topics``, the reference text
behind ``help("topic")`` (about 0.5 MB of English prose and code), so training needs no download.

A batch is ``batch_size`` windows of ``block_size + 1`` consecutive tokens at random offsets,
as nanoGPT samples them: x is the first ``block_size`` tokens of each window and y the same window
shifted left by one, so y[b, t] is the token that follows x[b, :t+1]. (GPT-3 did not sample
windows: it trained on full 2048-token sequences with documents packed end to end and separated
by an end-of-text token, Brown et al. 2020, Appendix B; ``gptlab.data_pipeline.pack_documents``
builds such rows.)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..backend import convert
from ..tokenizers.bpe import ByteBPETokenizer
from ..tokenizers.char import CharTokenizer, Tokenizer, load_tokenizer

EMBEDDED = "<embedded: pydoc_data.topics>"


def embedded_corpus() -> str:
    """Python's own reference text: the ``pydoc_data.topics`` entries joined in sorted key order."""
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics))


def load_text(path=None) -> str:
    """The text of a UTF-8 file at ``path``, or the embedded corpus when ``path`` is None.

    Raises OSError (a missing or unreadable file) or ValueError (not a regular file, such as
    /dev/zero, which never ends; empty, NUL bytes or not UTF-8), each naming the path.
    """
    if path is None:
        return embedded_corpus()
    path = Path(path)
    if path.exists() and not path.is_file():
        raise ValueError(f"the corpus {path} is not a regular file: expected a UTF-8 text file")
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise OSError(err.errno, f"cannot read the corpus {path}: {err.strerror}") from err
    if b"\x00" in raw:
        raise ValueError(f"{path} looks binary (it holds NUL bytes): expected a UTF-8 text file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not valid UTF-8 text ({err})") from err
    if not text.strip():
        raise ValueError(f"{path} holds no text")
    return text


def split_train_val(ids: np.ndarray, block_size: int, val_fraction: float = 0.1,
                    source: str = "the corpus") -> tuple[np.ndarray, np.ndarray]:
    """ids (N,) -> (train (N - n_val,), val (n_val,)) with the last ``val_fraction`` as validation.

    Each split must hold at least one window of ``block_size + 1`` tokens; ``source`` names the
    text in the error when it does not.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    n_val = int(round(len(ids) * val_fraction))
    train, val = ids[: len(ids) - n_val], ids[len(ids) - n_val :]
    if min(len(train), len(val)) < block_size + 1:
        raise ValueError(
            f"{source} is too short for the context: {len(ids)} tokens split into {len(train)} "
            f"train and {len(val)} validation tokens, but each split needs at least "
            f"block_size + 1 = {block_size + 1}"
        )
    return train, val


def get_batch(data_ids: np.ndarray, batch_size: int, block_size: int,
              rng: np.random.Generator | None = None, backend: str = "numpy", device=None):
    """Random windows of ``data_ids`` (N,) -> (x (B, T), y (B, T)) int64 on ``backend``/``device``.

    Offsets come from ``rng`` (a ``numpy.random.Generator``): pass a seeded one for batches
    that replay, and save ``rng.bit_generator.state`` to continue them exactly. Without one,
    each call draws new offsets from fresh OS entropy, like an unseeded ``default_rng()``.
    """
    if rng is None:
        rng = np.random.default_rng()
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator or None, got {type(rng).__name__}")
    if len(data_ids) < block_size + 1:
        raise ValueError(f"{len(data_ids)} tokens are too few for windows of {block_size + 1}")
    starts = rng.integers(0, len(data_ids) - block_size, size=batch_size)  # (B,)
    offsets = starts[:, None] + np.arange(block_size)  # (B, T)
    x = np.asarray(data_ids[offsets], dtype=np.int64)  # (B, T)
    y = np.asarray(data_ids[offsets + 1], dtype=np.int64)  # (B, T)
    return convert(x, backend, device=device), convert(y, backend, device=device)


def encode_corpus(tokenizer: Tokenizer, text: str, source: str) -> np.ndarray:
    """The ids (N,) of the whole corpus ``text`` (``source`` names it); ValueError naming it
    when the tokenizer cannot encode all of it (a character outside a char vocabulary, a BPE
    pattern that skips some text)."""
    try:
        return np.asarray(tokenizer.encode(text), dtype=np.int64)  # (N,)
    except ValueError as err:
        raise ValueError(f"the tokenizer cannot encode {source}: {err}") from None


def make_tokenizer(cfg, text: str) -> Tokenizer:
    """The run's tokenizer (``cfg`` its TrainConfig): loaded from ``cfg.tokenizer_path``, or
    trained on the corpus."""
    if cfg.tokenizer_path is not None:
        return load_tokenizer(cfg.tokenizer_path)
    if cfg.tokenizer == "bpe":  # merges learned from the training part only: no peek at val
        return ByteBPETokenizer.train(text[: int(len(text) * (1 - cfg.val_fraction))],
                                     cfg.vocab_size)
    return CharTokenizer.from_text(text)  # every character, so val never meets an unknown one


__all__ = ["EMBEDDED", "embedded_corpus", "load_text", "split_train_val", "get_batch",
           "encode_corpus", "make_tokenizer"]
