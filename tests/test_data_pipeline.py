"""gptlab.data_pipeline: normalisation and hashing, streaming files with bad input counted,
exact and MinHash/LSH deduplication against known planted duplicates (the MinHash estimate and
the LSH S-curve against their probability formulas, within binomial bounds), the quality
classifier (its gradient, its training, Pareto sampling), the mixture, packing and the
document mask (equal to running the documents separately)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import get_backend, to_host
from gptlab.tokenizers.bpe import ENDOFTEXT, ByteBPETokenizer
from gptlab.data_pipeline import (
    GPT3_MIXTURE,
    GPT3_TRAINING_TOKENS,
    DedupSettings,
    MinHasher,
    NearDuplicateIndex,
    PipelineReport,
    TextFiles,
    band_keys,
    candidate_pairs,
    candidate_probability,
    classifier_backward,
    classifier_forward,
    document_mask,
    edit_words,
    embedded_documents,
    encode_documents,
    end_of_text_id,
    estimate_jaccard,
    exact_duplicates,
    filter_documents,
    hashed_features,
    jaccard,
    keep_probability,
    match_precision_recall,
    mix_sources,
    mixture_epochs,
    normalize,
    pack_documents,
    pareto_keep,
    plant_near_duplicates,
    precision_recall,
    read_documents,
    run_pipeline,
    shingles,
    stable_hash,
    synthetic_documents,
    train_quality_classifier,
    true_pairs,
)
from gptlab.gradcheck import check_layer
from gptlab.layers.sdpa import sdpa_forward
from gptlab.tokenizers.char import CharTokenizer

Z = 5.0  # binomial bounds at five standard deviations: a correct formula fails ~1 in 10^6


def fast(max_examples: int = 15):
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])  # fmt: skip


@pytest.fixture(scope="module")
def vocabulary() -> list[str]:
    return sorted(set(normalize(" ".join(embedded_documents())).split()))


def sets_with_jaccard(rng, s: float, size: int = 105) -> tuple[set[str], set[str]]:
    """Two sets of ``size`` shingles sharing m, with m chosen so that J = m / (2 size - m) = s
    exactly (s must make m an integer); fresh random shingles each call."""
    m = round(2 * size * s / (1 + s))
    assert math.isclose(m / (2 * size - m), s), "choose s and size so that m is an integer"
    tokens = [f"w{x}" for x in rng.choice(10**9, size=2 * size - m, replace=False)]
    return set(tokens[:size]), set(tokens[size - m :])


# --------------------------------------------------------------------------------------------
# Normalisation, hashing, exact duplicates


def test_normalize_applies_nfkc_lowercase_and_collapses_whitespace():
    assert normalize("  The\u00a0ﬁle\t\nIS   ＡＢＣ  ") == "the file is abc"


def test_stable_hash_is_the_same_in_every_process():
    """Unlike hash(), which Python salts per process."""
    code = "from gptlab.data_pipeline import stable_hash; print(stable_hash('a document'))"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
            for seed in ("1", "2")}  # fmt: skip
    assert outs == {str(stable_hash("a document"))}


def test_exact_duplicates_find_copies_that_differ_only_in_formatting(vocabulary):
    base = synthetic_documents(30, 40, vocabulary, seed=1)
    corpus = plant_near_duplicates(base, 10, 2, 0.0, vocabulary, seed=2)
    matches = exact_duplicates(corpus.documents)
    assert len(set(corpus.documents)) == len(corpus.documents), "copies differ before normalising"
    assert corpus.is_copy.sum() == 20 and not corpus.edits.any()
    originals = np.flatnonzero(~corpus.is_copy)
    assert [corpus.documents[i] for i in originals[np.argsort(corpus.cluster[originals])]] == base
    for i, j in enumerate(matches):
        earlier = [k for k in range(i) if corpus.cluster[k] == corpus.cluster[i]]
        assert j == (earlier[0] if earlier else None)


def test_edit_words_makes_the_asked_number_of_edits(vocabulary):
    rng = np.random.default_rng(0)
    text = " ".join(f"w{i}" for i in range(50))
    for n in (0, 1, 7, 50):
        edited = edit_words(text, n, vocabulary, rng)
        assert abs(len(edited.split()) - 50) <= n  # an insertion adds a word, a deletion drops one
        survivors = set(normalize(edited).split()) & {f"w{i}" for i in range(50)}
        assert len(survivors) >= 50 - n  # each edit removes at most one original word
        assert (normalize(edited) == normalize(text)) == (n == 0)
    with pytest.raises(ValueError, match=r"n_edits must be in \[0, 50\]"):
        edit_words(text, 51, vocabulary, rng)


# --------------------------------------------------------------------------------------------
# Shingles, MinHash, LSH


def test_shingles_of_words_and_characters():
    assert shingles("A b  C d", 3) == {"a b c", "b c d"}
    assert shingles("Ab", 3, "char") == {"ab"}
    assert shingles("abcd", 3, "char") == {"abc", "bcd"}
    with pytest.raises(ValueError, match="unit must be 'word' or 'char'"):
        shingles("x", 3, "line")
    with pytest.raises(ValueError, match="n must be a positive integer"):
        shingles("x", 0)


def test_jaccard_and_its_estimate_at_the_extremes():
    a, b = {"x", "y", "z"}, {"y", "z", "w"}
    assert jaccard(a, b) == 0.5 and jaccard(set(), set()) == 1.0
    hasher = MinHasher(64, seed=3)
    assert estimate_jaccard(hasher.signature(a), hasher.signature(set(a))) == 1.0
    assert estimate_jaccard(hasher.signature({"p", "q"}), hasher.signature({"r", "s"})) <= 2 / 64


@given(s=st.sampled_from([0.0, 0.2, 0.25, 0.5, 0.75, 0.875, 1.0]),
       seed=st.integers(0, 2**16))  # fmt: skip
@fast(12)
def test_minhash_estimate_is_unbiased_within_the_binomial_bound(s, seed):
    """Averaged over 20 independent hashers of k = 64 values, J_hat has mean J and standard
    deviation sqrt(J (1 - J) / (20 k)); the average lies within Z of those."""
    rng = np.random.default_rng(seed)
    a, b = sets_with_jaccard(rng, s)
    assert jaccard(a, b) == pytest.approx(s)
    estimates = [estimate_jaccard((h := MinHasher(64, seed=seed + t)).signature(a), h.signature(b))
                 for t in range(20)]  # fmt: skip
    sd = math.sqrt(s * (1 - s) / (20 * 64))
    assert abs(np.mean(estimates) - s) <= Z * sd + 1e-9


def test_sampled_pairs_estimates_stay_within_the_binomial_bound():
    """Each pair's own estimate: within Z standard deviations of its exact Jaccard."""
    rng, hasher = np.random.default_rng(1), MinHasher(128, seed=1)
    for s in (0.2, 0.5, 0.75):
        for _ in range(20):
            a, b = sets_with_jaccard(rng, s)
            err = abs(estimate_jaccard(hasher.signature(a), hasher.signature(b)) - s)
            assert err <= Z * math.sqrt(s * (1 - s) / 128)


@pytest.mark.parametrize("bands, rows", [(8, 4), (16, 2), (4, 8)])
def test_lsh_candidate_rate_follows_the_s_curve(bands, rows):
    """Over 200 fresh pairs of each Jaccard s, the fraction that share a band is
    1 - (1 - s^r)^b within the binomial bound."""
    rng, hasher = np.random.default_rng(bands), MinHasher(bands * rows, seed=bands)
    for s in (0.2, 0.5, 0.75):
        hits = 0
        for _ in range(200):
            a, b = sets_with_jaccard(rng, s)
            sig = hasher.signatures([a, b])
            hits += (0, 1) in candidate_pairs(sig, bands, rows)
        p = float(candidate_probability(s, bands, rows))
        assert abs(hits / 200 - p) <= Z * math.sqrt(p * (1 - p) / 200) + 1e-9


def test_candidate_pairs_are_the_pairs_that_share_a_band():
    rng = np.random.default_rng(0)
    sig = rng.integers(0, 3, size=(12, 6))  # few values: many bands collide
    want = {(i, j) for i in range(12) for j in range(i + 1, 12)
            if any(np.array_equal(sig[i, 2 * r : 2 * r + 2], sig[j, 2 * r : 2 * r + 2])
                   for r in range(3))}  # fmt: skip
    assert candidate_pairs(sig, 3, 2) == want
    with pytest.raises(ValueError, match=r"bands \* rows = 4 \* 2 = 8 exceeds the signature "
                                         "length 6"):
        band_keys(sig[0], 4, 2)


def test_precision_recall_and_true_pairs():
    cluster = [0, 0, 0, 3, 4, 4]
    assert true_pairs(cluster) == 3 + 1
    assert precision_recall([(0, 1), (4, 5), (2, 3)], cluster) == (2 / 3, 2 / 4)
    assert precision_recall([], cluster) == (1.0, 0.0)
    # drop 1 as a copy of 0 (right), 3 as a copy of 2 (wrong), keep the rest: 3 drops were due
    assert match_precision_recall([None, 0, None, 2, None, None], cluster) == (1 / 2, 1 / 3)


def test_near_dedup_finds_every_planted_copy_and_nothing_else(vocabulary):
    """Copies with 2% of their words edited have Jaccard about 0.9 (word 3-grams), unrelated
    documents below 0.05: the index at threshold 0.5 drops exactly the copies."""
    base = synthetic_documents(150, 80, vocabulary, seed=3)
    corpus = plant_near_duplicates(base, 40, 2, 0.02, vocabulary, seed=4)
    settings = DedupSettings()
    hasher = MinHasher(settings.num_perm, seed=0)
    index = NearDuplicateIndex(settings.num_perm, settings.bands, settings.rows, settings.threshold)
    kept_ids, pairs = [], []
    for i, doc in enumerate(corpus.documents):
        j = index.add(hasher.signature(shingles(doc, settings.shingle_n, settings.shingle_unit)))
        if j is None:
            kept_ids.append(i)
        else:
            pairs.append((kept_ids[j], i))
    assert all(corpus.cluster[i] == corpus.cluster[k] for k, i in pairs)  # precision 1
    assert len(pairs) == 40 * 2  # every copy but one per cluster: recall 1
    assert sorted(set(corpus.cluster[kept_ids].tolist())) == list(range(150))


# --------------------------------------------------------------------------------------------
# Streaming files


def write_documents(path: Path, documents: list[str], separator: str = "\n\n\n") -> None:
    path.write_bytes(separator.join(documents).encode("utf-8"))


@given(docs=st.lists(st.text(st.sampled_from("ab é日\n"), min_size=1, max_size=30)
                     .filter(lambda d: d.strip() and "\n\n\n" not in d and not d.endswith("\n")
                             and not d.startswith("\n")), min_size=1, max_size=8),
       chunk=st.integers(1, 17))  # fmt: skip
@fast(25)
def test_streaming_reads_every_document_whatever_the_chunk_size(tmp_path_factory, docs, chunk):
    """Chunks of 1..17 bytes cut documents, separators and multi-byte characters anywhere."""
    path = tmp_path_factory.mktemp("stream") / "docs.txt"
    write_documents(path, docs)
    report = PipelineReport()
    assert list(read_documents(path, chunk_bytes=chunk, report=report)) == docs
    assert report.documents_read == len(docs) and report.skipped == 0


def test_bad_input_is_skipped_and_counted(tmp_path):
    good = tmp_path / "good.txt"
    write_documents(good, ["first doc", "second doc"])
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine text\n\n\n\xff\xfe not utf-8\n\n\n   \n\n\nnul\x00byte\n\n\n"
                    + b"x" * 100 + b"\n\n\nlast")  # fmt: skip
    report = PipelineReport()
    docs = list(read_documents([good, tmp_path / "missing.txt", tmp_path, bad], chunk_bytes=8,
                               max_document_bytes=50, report=report))  # fmt: skip
    assert docs == ["first doc", "second doc", "fine text", "last"]
    assert (report.files_read, report.files_unreadable) == (2, 2)
    skipped = (report.documents_not_utf8, report.documents_empty, report.documents_too_long)
    assert skipped == (2, 1, 1)
    assert "missing.txt" in report.unreadable[0] and len(report.unreadable) == 2


def test_reader_arguments_are_checked(tmp_path):
    for kwargs, message in (({"separator": ""}, "separator must be a non-empty string"),
                            ({"chunk_bytes": 0}, "chunk_bytes must be a positive integer"),
                            ({"max_document_bytes": 1.5}, "max_document_bytes must be a positive")):
        with pytest.raises(ValueError, match=message):
            list(read_documents(tmp_path / "x.txt", **kwargs))


def test_run_pipeline_streams_files_and_reports(tmp_path, vocabulary):
    base = synthetic_documents(40, 50, vocabulary, seed=5)
    corpus = plant_near_duplicates(base, 10, 2, [0.0, 0.02], vocabulary, seed=6)
    write_documents(tmp_path / "a.txt", corpus.documents[:30])
    write_documents(tmp_path / "b.txt", corpus.documents[30:])
    with open(tmp_path / "b.txt", "ab") as file:
        file.write(b"\n\n\n\xff not utf-8")
    (tmp_path / "c.txt").write_bytes(b"\xff\xfe\x00")
    out = tmp_path / "out.txt"
    report = run_pipeline([tmp_path / n for n in ("a.txt", "b.txt", "c.txt", "none.txt")], out,
                          chunk_bytes=64, progress=False)  # fmt: skip
    kept = out.read_text().split("\n\n\n")
    assert report.kept == len(kept) == 40
    assert (report.exact_duplicates, report.near_duplicates) == (10, 10)
    assert (report.documents_not_utf8, report.files_unreadable, report.files_read) == (2, 1, 3)
    with pytest.raises(ValueError, match="is a folder"):
        run_pipeline([], tmp_path)


# --------------------------------------------------------------------------------------------
# The quality classifier


def test_hashed_features_are_unit_rows_of_stable_buckets():
    x = hashed_features(["a b a", "b c", ""], n_features=16, ngrams=(1,))
    assert np.allclose(np.linalg.norm(x[:2], axis=1), 1.0) and not x[2].any()
    counts = np.zeros(16)
    for word in "a b a".split():
        counts[stable_hash(word) % 16] += 1
    assert np.allclose(x[0], counts / np.linalg.norm(counts))
    with pytest.raises(ValueError, match="ngrams must be positive n-gram lengths"):
        hashed_features(["a"], ngrams=(0,))


def test_classifier_gradient_matches_finite_differences():
    rng = np.random.default_rng(0)
    x, w, b = rng.random((6, 5)), rng.standard_normal((5, 1)), rng.standard_normal(1)
    labels = rng.integers(0, 2, size=(6, 1))
    result = check_layer(classifier_forward, classifier_backward, x, w, b, labels, l2=0.3)
    result.assert_ok(1e-7)


def junk_documents(vocabulary, n, seed):
    """Word salad: uniformly random words, unlike the Zipf-shaped prose of real documents."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(vocabulary, size=60)) for _ in range(n)]


def test_classifier_separates_reference_text_from_word_salad(vocabulary):
    docs = [d for d in embedded_documents() if len(d.split()) >= 30]
    junk = junk_documents(vocabulary, len(docs), seed=0)
    texts, labels = docs[::2] + junk[::2], [1] * len(docs[::2]) + [0] * len(junk[::2])
    clf, losses = train_quality_classifier(texts, labels, n_features=1024, steps=100)
    assert losses[-1] < 0.5 * losses[0] and losses[0] == pytest.approx(math.log(2))
    scores = clf.scores(docs[1::2] + junk[1::2])
    truth = np.array([1] * len(docs[1::2]) + [0] * len(junk[1::2]))
    assert np.mean((scores > 0.5) == truth) > 0.9


@pytest.mark.parametrize("score", [0.0, 0.5, 0.9, 1.0])
def test_pareto_keep_rate_is_two_minus_score_to_the_minus_alpha(score):
    n = 20000
    kept = pareto_keep(np.full(n, score), alpha=9.0, seed=1)
    p = float(keep_probability(score, 9.0))
    assert abs(kept.mean() - p) <= Z * math.sqrt(p * (1 - p) / n) + 1e-9
    assert np.array_equal(kept, pareto_keep(np.full(n, score), alpha=9.0, seed=1))


def test_pareto_keep_checks_its_arguments():
    with pytest.raises(ValueError, match="scores must be probabilities"):
        pareto_keep([0.5, 1.5])
    with pytest.raises(ValueError, match="alpha must be positive"):
        pareto_keep([0.5], alpha=0.0)


def test_filter_documents_is_reproducible_and_counts_quality_drops(vocabulary):
    docs = [d for d in embedded_documents() if len(d.split()) >= 30]
    junk = junk_documents(vocabulary, len(docs), seed=1)
    clf, _ = train_quality_classifier(docs + junk, [1] * len(docs) + [0] * len(junk),
                                      n_features=512, steps=50)  # fmt: skip
    runs = []
    for _ in range(2):
        report = PipelineReport()
        runs.append(list(filter_documents(docs + junk, classifier=clf, dedup=None, seed=3,
                                          report=report)))  # fmt: skip
        assert report.quality_dropped + report.exact_duplicates + report.kept == 2 * len(docs)
    assert runs[0] == runs[1]
    assert sum(d in junk for d in runs[0]) < 0.1 * len(junk) < sum(d in docs for d in runs[0])


# --------------------------------------------------------------------------------------------
# Mixture, packing, masks


def test_gpt3_table_epochs_follow_from_tokens_and_weights_where_the_table_agrees():
    """Table 2.2's epochs for Common Crawl and Books2 are w N / n to within 0.01; those of
    WebText2, Books1 and Wikipedia are not (the weights are rounded: the five sum to 1.01)."""
    tokens = {k: v[0] for k, v in GPT3_MIXTURE.items()}
    weights = {k: v[1] for k, v in GPT3_MIXTURE.items()}
    epochs = mixture_epochs(tokens, weights, GPT3_TRAINING_TOKENS)
    for name, (_, _, table) in GPT3_MIXTURE.items():
        agrees = name in ("Common Crawl (filtered)", "Books2")
        assert (abs(epochs[name] - table) <= 0.01) == agrees, name
    assert sum(weights.values()) == pytest.approx(1.01)


def test_mixture_takes_token_shares_by_weight_and_counts_epochs():
    rng = np.random.default_rng(0)
    sources = {name: [list(range(n)) for n in rng.integers(1, 20, size=size)]
               for name, size in (("a", 30), ("b", 5), ("c", 12))}  # fmt: skip
    weights = {"a": 0.5, "b": 0.3, "c": 0.2}
    taken = dict.fromkeys(sources, 0)
    for name, doc in mix_sources(sources, weights, total_tokens=5000, seed=1):
        taken[name] += len(doc)
    total = sum(taken.values())
    assert 5000 <= total < 5000 + 20
    for name in sources:
        assert abs(taken[name] - weights[name] * total) <= 20
    sizes = {name: sum(map(len, docs)) for name, docs in sources.items()}
    planned = mixture_epochs(sizes, weights, total)
    for name in sources:
        assert abs(taken[name] / sizes[name] - planned[name]) <= 20 / sizes[name]


def test_mixture_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="weights name the sources"):
        next(mix_sources({"a": [[1]]}, {"b": 1.0}, 10))
    with pytest.raises(ValueError, match="weights must be positive"):
        next(mix_sources({"a": [[1]]}, {"a": 0.0}, 10))
    with pytest.raises(ValueError, match="total_tokens must be a positive integer"):
        next(mix_sources({"a": [[1]]}, {"a": 1.0}, 0))
    with pytest.raises(ValueError, match="source 'a' gave no tokens"):
        list(mix_sources({"a": [[]]}, {"a": 1.0}, 10))
    with pytest.raises(ValueError, match="source 'a' gave no tokens"):
        list(mix_sources({"a": iter([[1, 2]])}, {"a": 1.0}, 10))  # an iterator runs dry
    write_documents(tmp_path / "a.txt", ["x y", "z"])
    files = TextFiles(tmp_path / "a.txt")
    assert [d for _, d in mix_sources({"a": files}, {"a": 1.0}, 8)] == ["x y", "z"] * 2
    assert files.report.files_read == 2  # read twice, once per epoch


@given(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=8), row_len=st.integers(1, 7))
@fast(30)
def test_packing_keeps_every_token_in_order(lengths, row_len):
    docs = [list(range(100 * k, 100 * k + n)) for k, n in enumerate(lengths)]
    stream = [t for doc in docs for t in [*doc, -1]]
    rows = list(pack_documents(docs, row_len, eot_id=7777))
    flat = [int(t) for row in rows for t in row]
    assert all(len(row) == row_len and row.dtype == np.int64 for row in rows)
    assert flat == [7777 if t == -1 else t for t in stream[: len(flat)]]
    assert len(stream) - len(flat) < row_len


def test_packing_with_tokenizers():
    bpe = ByteBPETokenizer.train("the cat sat on the mat " * 20, 270)
    eot = end_of_text_id(bpe)
    docs = ["the cat", f"a mat {ENDOFTEXT} forged"]
    ids = list(encode_documents(docs, bpe))
    assert eot not in ids[1], "a literal end-of-text string stays text"
    rows = list(pack_documents(ids, 4, eot))
    assert bpe.decode([t for r in rows for t in r]).startswith(f"the cat{ENDOFTEXT}a mat")
    with pytest.raises(ValueError, match="has no <\\|endoftext\\|> token; pass eot_id"):
        end_of_text_id(CharTokenizer.from_text("abc"))
    with pytest.raises(ValueError, match="row_len must be a positive integer"):
        next(pack_documents(ids, 0, eot))
    with pytest.raises(ValueError, match="eot_id must be a non-negative integer"):
        next(pack_documents(ids, 4, -1))


@pytest.mark.parametrize("backend_name", ["numpy", "torch"])
@given(lengths=st.lists(st.integers(1, 6), min_size=1, max_size=5), seed=st.integers(0, 99))
@fast(15)
def test_document_mask_equals_running_each_document_alone(backend_name, lengths, seed):
    """sdpa on a packed row with the document mask gives, at each document's positions, exactly
    causal sdpa of that document alone (its eot included)."""
    backend = get_backend(backend_name)
    EOT, NH, HS = 0, 2, 3
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, 9, size=n - 1).tolist() for n in lengths]  # n - 1 tokens + eot
    row = np.concatenate([[*d, EOT] for d in docs])[None, :]  # (1, T)
    T = row.shape[1]
    q, k, v = (rng.standard_normal((1, NH, T, HS)) for _ in range(3))
    mask = document_mask(backend.asarray(row), EOT)  # (1, T, T)
    assert to_host(mask).dtype == bool and tuple(mask.shape) == (1, T, T)
    packed, _ = sdpa_forward(*map(backend.asarray, (q, k, v)), mask[:, None])
    start = 0
    for n in lengths:
        alone, _ = sdpa_forward(*(backend.asarray(a[..., start : start + n, :]) for a in (q, k, v)),
                                causal=True)  # fmt: skip
        np.testing.assert_allclose(to_host(packed)[..., start : start + n, :], to_host(alone),
                                   rtol=1e-12, atol=1e-14)  # fmt: skip
        start += n


def test_document_mask_without_separators_is_causal():
    rows = torch.tensor([[3, 4, 5, 6]])
    assert torch.equal(document_mask(rows, eot_id=0)[0], torch.tril(torch.ones(4, 4, dtype=bool)))
    with pytest.raises(TypeError, match="rows must be an integer array"):
        document_mask(torch.zeros(1, 4), eot_id=0)
