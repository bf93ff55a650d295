"""Is a completion the fact's object? The one correctness rule (paper §4.2).

Used by the training summary's `fact_accuracy` and by the evaluation's `model_accuracy`, so
both score a model the same way: lowercase, drop punctuation and stopwords, and require
the completion's words to *start with* an alias's words (whole words: "Parisian" is not
"Paris"; "Paris in 1950" is).
"""

from __future__ import annotations

import re
from typing import Iterable

# Lucene's English stop words (EnglishAnalyzer.ENGLISH_STOP_WORDS_SET), the list bm25s calls "en"
# (`test_stopwords_are_bm25s_en` pins the equality). Spelled out here because importing bm25s
# runs a JAX computation, which starts JAX's backends at import time (too early for
# `jax.distributed.initialize` and for config set after import).
STOPWORDS = frozenset(
    (
        "a",
        "an",
        "and",
        "are",
        "as",
        "at",
        "be",
        "but",
        "by",
        "for",
        "if",
        "in",
        "into",
        "is",
        "it",
        "no",
        "not",
        "of",
        "on",
        "or",
        "such",
        "that",
        "the",
        "their",
        "then",
        "there",
        "these",
        "they",
        "this",
        "to",
        "was",
        "will",
        "with",
    )
)

_WORD_RE = re.compile(r"\w+", re.UNICODE)


def words(text: str) -> list[str]:
    """Lowercased word tokens (unicode `\\w+` runs)."""
    return _WORD_RE.findall(text.lower())


def normalize_answer(text: str) -> tuple[str, ...]:
    """Lowercase, drop punctuation and stopwords (§4.2 correctness scoring)."""
    return tuple(w for w in words(text) if w not in STOPWORDS)


def is_correct(prediction: str, aliases: Iterable[str]) -> bool:
    """§4.2: the greedy completion matches an alias after lowercasing + stopword removal.

    A completion keeps going after the object ("Paris in 1950"), so it is correct when its
    normalised word sequence *starts with* a normalised alias (whole words). Aliases that
    normalise to nothing (all stopwords) never match.
    """
    pred = normalize_answer(prediction)
    for alias in aliases:
        a = normalize_answer(alias)
        if a and pred[: len(a)] == a:
            return True
    return False
