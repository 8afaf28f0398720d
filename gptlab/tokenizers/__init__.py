"""Tokenizers: text <-> integer ids. Book: chapters 1 and 13.

    base.py   the ``Tokenizer`` interface: special tokens, streaming, JSON files
    bpe.py    byte-level BPE (GPT-2): training, the merges, GPT-2's own files
    char.py   ``CharTokenizer`` and ``load_tokenizer``, which reads back every kind

Inside the room the arrows run base <- bpe <- char. May import: nothing else of gptlab (a
tokenizer knows text and ids, not arrays or models), so every other room may use it.
"""
