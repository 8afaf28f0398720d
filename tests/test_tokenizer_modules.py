"""The tokenizer modules import downwards only (base <- bpe <- char: no circle),
the public names stay where the book and training import them, and every kind loads back from
its file through ``load_tokenizer`` and through its own class."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gptlab
from gptlab.tokenizers.base import Tokenizer as BaseTokenizer
from gptlab.tokenizers.bpe import ByteBPETokenizer
from gptlab.tokenizers.char import CharTokenizer, Tokenizer, load_tokenizer, tokenizer_types

ROOM = Path(gptlab.__file__).parent / "tokenizers"


def package_imports(module: str) -> set[str]:
    """The modules of the room that ``gptlab/tokenizers/<module>.py`` imports, anywhere in it."""
    tree = ast.parse((ROOM / f"{module}.py").read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found.add(node.module)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gptlab."):
            found.add(node.module)
    return found


def test_tokenizer_modules_import_downwards_only():
    assert package_imports("base") == set()
    assert package_imports("bpe") == {"base"}
    assert package_imports("char") == {"bpe", "base"}


def test_public_names_stay_where_they_were():
    assert Tokenizer is BaseTokenizer
    assert issubclass(CharTokenizer, Tokenizer) and issubclass(ByteBPETokenizer, Tokenizer)
    assert tokenizer_types() == {"char": CharTokenizer, "bpe": ByteBPETokenizer}


def test_every_kind_loads_back(tmp_path):
    tokenizers = [CharTokenizer.from_text("abc"), ByteBPETokenizer.train("ab ab ab", 300)]
    for tok in tokenizers:
        path = tmp_path / f"{tok.type}.json"
        tok.save(path)
        assert load_tokenizer(path).to_dict() == tok.to_dict()
        assert type(tok).load(path).to_dict() == tok.to_dict()
    with pytest.raises(ValueError, match="char.json: not a byte-level BPE tokenizer.*type 'char'"):
        ByteBPETokenizer.load(tmp_path / "char.json")
    with pytest.raises(ValueError, match="bpe.json: not a char tokenizer.*got type 'bpe'"):
        CharTokenizer.load(tmp_path / "bpe.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="list.json: unknown tokenizer type None"):
        load_tokenizer(tmp_path / "list.json")
    with pytest.raises(ValueError, match="list.json: not a char tokenizer"):
        CharTokenizer.load(tmp_path / "list.json")
