"""GPT-3's data pipeline in miniature (Brown et al. 2020, section 2.2 and Appendices A-B):
documents in (the embedded corpus, generated corpora with planted near-duplicates, text files of
any size, streamed), a quality classifier with Pareto sampling, exact and MinHash/LSH
deduplication, a weighted mixture of sources, and packing into full rows with an end-of-text id
and an optional document-aware attention mask. Book: chapter 20.

Modules, importing downwards only: ``documents`` <- ``dedup`` <- ``quality`` <- ``pipeline``;
``packing`` (mixture, tokenization, packing, masks) needs only ``documents``. May import:
``gptlab.training`` (the embedded corpus), ``gptlab.tokenizers`` and the layers below them.
"""

from .dedup import (
    MinHasher,
    NearDuplicateIndex,
    band_keys,
    candidate_pairs,
    candidate_probability,
    estimate_jaccard,
    exact_duplicates,
    jaccard,
    match_precision_recall,
    precision_recall,
    shingles,
    true_pairs,
)
from .documents import (
    PipelineReport,
    PlantedCorpus,
    TextFiles,
    edit_words,
    embedded_documents,
    normalize,
    plant_near_duplicates,
    read_documents,
    stable_hash,
    synthetic_documents,
)
from .packing import (
    GPT3_MIXTURE,
    GPT3_TRAINING_TOKENS,
    document_ids,
    document_mask,
    document_positions,
    encode_documents,
    end_of_text_id,
    mix_sources,
    mixture_epochs,
    pack_documents,
)
from .pipeline import DedupSettings, filter_documents, run_pipeline
from .quality import (
    GPT3_PARETO_ALPHA,
    QualityClassifier,
    classifier_backward,
    classifier_forward,
    hashed_features,
    keep_probability,
    pareto_keep,
    train_quality_classifier,
)

__all__ = [
    "band_keys",
    "candidate_pairs",
    "candidate_probability",
    "classifier_backward",
    "classifier_forward",
    "DedupSettings",
    "document_ids",
    "document_mask",
    "document_positions",
    "edit_words",
    "embedded_documents",
    "encode_documents",
    "end_of_text_id",
    "estimate_jaccard",
    "exact_duplicates",
    "filter_documents",
    "GPT3_MIXTURE",
    "GPT3_PARETO_ALPHA",
    "GPT3_TRAINING_TOKENS",
    "hashed_features",
    "jaccard",
    "keep_probability",
    "match_precision_recall",
    "MinHasher",
    "mix_sources",
    "mixture_epochs",
    "NearDuplicateIndex",
    "normalize",
    "pack_documents",
    "pareto_keep",
    "PipelineReport",
    "plant_near_duplicates",
    "PlantedCorpus",
    "precision_recall",
    "QualityClassifier",
    "read_documents",
    "run_pipeline",
    "shingles",
    "stable_hash",
    "synthetic_documents",
    "TextFiles",
    "train_quality_classifier",
    "true_pairs",
]
