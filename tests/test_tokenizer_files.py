"""Tokenizer files that would lose text or crash (issue 33): a pattern that does not cover the
text is refused where it would drop characters, in training too; malformed fields of a
tokenizer file are one clear error naming the file."""

from __future__ import annotations

import json

import pytest

from gptlab.cli import main
from gptlab.tokenizers.bpe import ByteBPETokenizer
from gptlab.tokenizers.char import load_tokenizer
from gptlab.training.data import embedded_corpus

LETTERS_ONLY = r" ?[a-z]+"  # no digits, no punctuation


def test_a_pattern_that_skips_text_is_refused_not_dropped():
    tokenizer = ByteBPETokenizer.train("ab cd ef", 260, pattern=LETTERS_ONLY)
    assert tokenizer.decode(tokenizer.encode("ab cd ef")) == "ab cd ef"
    with pytest.raises(ValueError, match=r"cannot encode ',' at position 2: the pre-tokenization "
                                         r"pattern ' \?\[a-z\]\+' does not match it"):
        tokenizer.encode("ab, cd! 42 ef")


def test_training_refuses_a_tokenizer_that_cannot_encode_its_corpus(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(embedded_corpus()[:4_000], encoding="utf-8")
    ByteBPETokenizer.train("ab cd ef", 260, pattern=LETTERS_ONLY).save(tmp_path / "tok.json")
    code = main(["train", "--n-layer=1", "--n-head=2", "--n-embd=16", "--block-size=8",
                 "--max-iters=1", "--warmup-iters=0", "--quiet", f"--data={corpus}",
                 f"--tokenizer-path={tmp_path / 'tok.json'}", f"--out-dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"the tokenizer cannot encode {corpus}: cannot encode" in err
    assert not (tmp_path / "run" / "state.json").exists()


@pytest.mark.parametrize("field, value, message", [
    ("pattern", "([a-z]", "is not a regular expression"),
    ("pattern", 5, '"pattern" must be a string, got 5'),
    ("special_tokens", 5, '"special_tokens" must be a JSON object, got 5'),
    ("vocab", [], '"vocab" must be a JSON object, got []'),
    ("merges", [["a"]], "every merge must be a pair of token strings, got ['a']"),
    ("merges", 3, '"merges" must be a JSON list, got 3'),
])
def test_a_malformed_bpe_file_is_one_clear_error_naming_it(tmp_path, field, value, message):
    data = ByteBPETokenizer.train("ab cd ef", 258).to_dict()
    data[field] = value
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ValueError, match=str(path)) as error:
        load_tokenizer(path)
    assert message in str(error.value)


def test_a_char_file_whose_chars_are_not_a_list_is_a_clear_error(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"type": "char", "chars": 5}), encoding="utf-8")
    with pytest.raises(ValueError, match="not a char tokenizer"):
        load_tokenizer(path)
