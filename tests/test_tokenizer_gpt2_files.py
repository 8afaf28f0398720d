"""GPT-2's own tokenizer files (vocab.json + merges.txt) against Hugging Face.

Files that Hugging Face writes load into ``ByteBPETokenizer`` with identical ids; files we write
are byte for byte Hugging Face's and load back into Hugging Face (``tokenizers`` and
``transformers``) with identical ids, also in GPT-2's own id layout (``<|endoftext|>`` last); the
pre-tokenizing regex agrees with Hugging Face's on every character Python's Unicode tables
assign, and the documented disagreement on newer characters is checked; bad files give errors
that name the problem. No network: Hugging Face trains its tokenizer here, offline.
"""

from __future__ import annotations

import json
import unicodedata

import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gptlab.tokenizers.bpe import BYTE_TO_CHAR, ENDOFTEXT, GPT2_PATTERN, ByteBPETokenizer
from gptlab.training.data import embedded_corpus

tokenizers = pytest.importorskip("tokenizers")

CORPUS = embedded_corpus()
TRAIN, HELD_OUT = CORPUS[:60_000], CORPUS[60_000:80_000]
VOCAB_SIZE = 600

# texts where pre-tokenization and byte handling are easy to get wrong
TEXTS = ["", " ", "  ", "\n", "\n\n", " \n \n", "a\n\n b\n", "\t\t x\r\n", "   leading spaces",
         "trailing spaces   ", "it's", "It'S", "we'll they've I'm he'd you're don't", "'s't're",
         "''ll", "x'll 'd'", "12345 3.14 1,000,000 -7", "a1b2 c3", "Hello, world!!! (ok?)",
         "x**2 >= 3.14e-10", "naïve café", "e\u0301\u0302", "日本語のテキスト", "中文 中文",
         "🙂👍🏽👩\u200d👩\u200d👧 🙂", "\x00\x01\x7f\x85\u2028\u00a0nbsp", "tab\tand\u3000wide",
         ENDOFTEXT, f"a{ENDOFTEXT}b", "<|endoftext", HELD_OUT[:3000]]

assigned_text = st.text(st.characters(blacklist_categories=("Cs", "Cn")), max_size=40)


def fast(max_examples: int):
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def hf_from_files(vocab_path, merges_path):
    """Hugging Face's byte-level BPE read from GPT-2 files (no prefix space, GPT-2's regex)."""
    return tokenizers.ByteLevelBPETokenizer(str(vocab_path), str(merges_path))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """vocab.json and merges.txt written by Hugging Face's own trainer and ``save_model``."""
    hf = tokenizers.ByteLevelBPETokenizer(add_prefix_space=False)
    hf.train_from_iterator([TRAIN], vocab_size=VOCAB_SIZE, min_frequency=2,
                           special_tokens=[ENDOFTEXT], show_progress=False)
    directory = tmp_path_factory.mktemp("hf")
    hf.save_model(str(directory))
    return directory


@pytest.fixture(scope="module")
def hf(hf_dir):
    return hf_from_files(hf_dir / "vocab.json", hf_dir / "merges.txt")


@pytest.fixture(scope="module")
def ours(hf_dir):
    return ByteBPETokenizer.from_gpt2_files(hf_dir / "vocab.json", hf_dir / "merges.txt")


# --- reading Hugging Face's files ---------------------------------------------------------------

def test_hugging_face_files_load_with_their_special_token(hf_dir, ours):
    vocab = json.loads((hf_dir / "vocab.json").read_text(encoding="utf-8"))
    assert ours.vocab_size == len(vocab) == VOCAB_SIZE
    assert ours.special_tokens == {ENDOFTEXT: vocab[ENDOFTEXT]}
    assert {**ours.vocab, **ours.special_tokens} == vocab
    merges = (hf_dir / "merges.txt").read_text(encoding="utf-8").splitlines()[1:]
    assert [f"{a} {b}" for a, b in ours.merges] == merges


@pytest.mark.parametrize("text", TEXTS)
def test_same_ids_as_hugging_face(ours, hf, text):
    assert ours.encode(text) == hf.encode(text).ids
    assert ours.decode(ours.encode(text)) == text


@fast(200)
@given(text=assigned_text)
def test_same_ids_as_hugging_face_for_any_text(ours, hf, text):
    assert ours.encode(text) == hf.encode(text).ids


# --- writing: the same bytes, read back by Hugging Face -----------------------------------------

def test_written_files_are_hugging_faces_bytes(hf_dir, ours, tmp_path):
    vocab_path, merges_path = ours.save_gpt2_files(tmp_path / "new")  # the folder is made
    assert (vocab_path.name, merges_path.name) == ("vocab.json", "merges.txt")
    assert vocab_path.read_bytes() == (hf_dir / "vocab.json").read_bytes()
    assert merges_path.read_bytes() == (hf_dir / "merges.txt").read_bytes()
    assert merges_path.read_text(encoding="utf-8").startswith("#version: 0.2\n")


def test_save_load_round_trip(tmp_path):
    trained = ByteBPETokenizer.train(TRAIN[:20_000], 400, special_tokens=[ENDOFTEXT, "<pad>"])
    paths = trained.save_gpt2_files(tmp_path)
    loaded = ByteBPETokenizer.from_gpt2_files(*paths, special_tokens=[ENDOFTEXT, "<pad>"])
    assert loaded.to_dict() == trained.to_dict()


def gpt2_layout(tok: ByteBPETokenizer) -> ByteBPETokenizer:
    """The same tokenizer with GPT-2's ids: the 256 bytes in ``bytes_to_unicode`` order (printable
    bytes first), then one id per merge in rank order, then ``<|endoftext|>``."""
    tokens = [*BYTE_TO_CHAR.values(), *(a + b for a, b in tok.merges)]
    vocab = {token: i for i, token in enumerate(tokens)}
    return ByteBPETokenizer(vocab, tok.merges, {ENDOFTEXT: len(vocab)})


def test_gpt2_id_layout_round_trips_through_hugging_face(ours, tmp_path):
    gpt2_like = gpt2_layout(ours)
    assert gpt2_like.special_tokens[ENDOFTEXT] == VOCAB_SIZE - 1  # last, as GPT-2's 50256
    assert gpt2_like.vocab["!"] == 0 and gpt2_like.vocab[BYTE_TO_CHAR[0]] == 188
    paths = gpt2_like.save_gpt2_files(tmp_path)
    assert ByteBPETokenizer.from_gpt2_files(*paths).to_dict() == gpt2_like.to_dict()
    hf = hf_from_files(*paths)
    for text in TEXTS:
        ids = gpt2_like.encode(text)
        assert ids == hf.encode(text).ids
        assert gpt2_like.decode(ids) == ours.decode(ours.encode(text)) == text


def test_transformers_reads_our_files_and_treats_end_of_text_as_allowed(ours, tmp_path):
    """``transformers`` always turns the string ``<|endoftext|>`` into its id: our encode with
    ``allowed_special="all"``. Our default keeps it ordinary text (``gptlab.tokenizers.base``)."""
    transformers = pytest.importorskip("transformers")
    gpt2_like = gpt2_layout(ours)
    gpt2_like.save_gpt2_files(tmp_path)
    hf = transformers.GPT2TokenizerFast.from_pretrained(str(tmp_path), local_files_only=True)
    assert hf.eos_token_id == gpt2_like.special_tokens[ENDOFTEXT]
    for text in TEXTS:
        assert hf(text)["input_ids"] == gpt2_like.encode(text, allowed_special="all")


# --- the pre-tokenizing regex: ours (the regex package) against Hugging Face's engine ------------

def pretoken_spans_agree(text: str) -> bool:
    hf = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    ours = [match.span() for match in regex.finditer(GPT2_PATTERN, text)]
    return ours == [span for _, span in hf.pre_tokenize_str(text)]


def contexts(chars) -> str:
    """Each character next to letters, digits, spaces, itself, an apostrophe and a newline."""
    return "".join(f"a{c}b {c}{c} x'{c}1{c}\n" for c in chars)


def test_same_regex_as_hugging_face_on_every_assigned_character():
    """Every code point that Python's Unicode tables assign (private use: every 16th), in
    contexts that exercise each alternative of GPT-2's pattern, splits as in Hugging Face."""
    def assigned(c: int) -> bool:
        category = unicodedata.category(chr(c))
        return category not in ("Cn", "Cs") and (category != "Co" or c % 16 == 0)

    chars = [chr(c) for c in range(0x110000) if assigned(c)]
    blocks = [chars[i:i + 4096] for i in range(0, len(chars), 4096)]
    assert [i for i, block in enumerate(blocks) if not pretoken_spans_agree(contexts(block))] == []


def test_regex_disagrees_only_on_characters_newer_than_pythons_tables():
    """The documented difference (``gptlab.tokenizers.bpe``): the regex package follows a newer Unicode
    version than Hugging Face's engine, so characters that Python's tables leave unassigned may
    be letters or digits to one and not to the other. Every disagreement in the first two planes
    is such a character."""
    unassigned = [chr(c) for c in range(0x20000) if unicodedata.category(chr(c)) == "Cn"]
    disagree = [c for c in unassigned if not pretoken_spans_agree(contexts([c]))]
    newer = {c for c in unassigned if regex.match(r"[\p{L}\p{N}]", c)}
    assert set(disagree) <= newer


# --- errors ---------------------------------------------------------------------------------------

def write(directory, vocab: dict, merges_text: str):
    (directory / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (directory / "merges.txt").write_text(merges_text, encoding="utf-8")
    return directory / "vocab.json", directory / "merges.txt"


@pytest.fixture()
def good_files(hf_dir):
    """The text of Hugging Face's two files, to break one piece at a time."""
    vocab = json.loads((hf_dir / "vocab.json").read_text(encoding="utf-8"))
    return vocab, (hf_dir / "merges.txt").read_text(encoding="utf-8")


def test_missing_files_are_named(hf_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.json"):
        ByteBPETokenizer.from_gpt2_files(tmp_path / "nothing.json", hf_dir / "merges.txt")
    with pytest.raises(FileNotFoundError, match="nothing.txt"):
        ByteBPETokenizer.from_gpt2_files(hf_dir / "vocab.json", tmp_path / "nothing.txt")


def test_bad_vocab_files(good_files, tmp_path):
    vocab, merges = good_files
    cases = {
        r"vocab.json: not a JSON vocabulary \(Expecting": "{not json",
        "vocab.json: not a JSON vocabulary .*decode": b"\xff\xfe{}",
        "expected a JSON object mapping each token to an integer id": "[1, 2]",
        "mapping each token to an integer id": json.dumps({**vocab, "!": 1.5}),
        "each once: id 1 occurs 2 times": json.dumps({**vocab, "!": 1, '"': 1}),
        rf"each once: id {VOCAB_SIZE + 5} is out of range":
            json.dumps({**vocab, "!": VOCAB_SIZE + 5}),
        "no special token '<|endoftext|>' in the vocabulary; special_tokens must name":
            json.dumps({t: i - (i > 0) for t, i in vocab.items() if t != ENDOFTEXT}),
    }
    (tmp_path / "merges.txt").write_text(merges, encoding="utf-8")
    for message, text in cases.items():
        (tmp_path / "vocab.json").write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(ValueError, match=message):
            ByteBPETokenizer.from_gpt2_files(tmp_path / "vocab.json", tmp_path / "merges.txt")


def test_bad_merges_files(good_files, tmp_path):
    vocab, merges = good_files
    lines = merges.splitlines()
    unmade = next(a + " " + b for a in BYTE_TO_CHAR.values() for b in BYTE_TO_CHAR.values()
                  if a + b not in vocab)
    cases = {
        r"merges.txt, line 3: expected a merge 'a b' .*got 'Ġa'": [*lines[:2], "Ġa", *lines[3:]],
        r"line 2: .*got 'Ġ Ġ Ġ'": [lines[0], "Ġ Ġ Ġ", *lines[2:]],
        r"line 5: .*got ''": [*lines[:4], "", *lines[4:]],
        r"merge \['Ġ', 'zz'\] uses or makes a token missing": [*lines, "Ġ zz"],
        rf"merge \[{unmade.split()[0]!r}, {unmade.split()[1]!r}\] uses or makes a token missing":
            [*lines, unmade],
    }
    for message, bad_lines in cases.items():
        write(tmp_path, vocab, "\n".join(bad_lines) + "\n")
        with pytest.raises(ValueError, match=message):
            ByteBPETokenizer.from_gpt2_files(tmp_path / "vocab.json", tmp_path / "merges.txt")
    (tmp_path / "merges.txt").write_bytes(b"#version: 0.2\n\xff \xfe\n")
    with pytest.raises(ValueError, match="merges.txt: not UTF-8 text"):
        ByteBPETokenizer.from_gpt2_files(tmp_path / "vocab.json", tmp_path / "merges.txt")


def test_header_is_optional_and_files_without_special_tokens_need_none(good_files, tmp_path):
    vocab, merges = good_files
    without = {t: i - 1 for t, i in vocab.items() if t != ENDOFTEXT}  # its id was 0
    paths = write(tmp_path, without, merges.split("\n", 1)[1])  # no #version line
    tok = ByteBPETokenizer.from_gpt2_files(*paths, special_tokens=())
    assert tok.special_tokens == {} and tok.vocab == without


def test_only_gpt2s_pattern_fits_the_files(tmp_path):
    tok = ByteBPETokenizer.train("ab ab ab", 260, pattern=r" ?\S+|\s+")
    with pytest.raises(ValueError, match="save_gpt2_files works with GPT2_PATTERN only"):
        tok.save_gpt2_files(tmp_path)
