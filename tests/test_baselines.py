"""baselines: BM25 (Lucene variant) against a numpy reference; exact-match passage ranks first."""

import math
import re

import numpy as np
import pytest

from trackstar_jax.evaluation import baselines, queries

PASSAGES = [
    "The cat sat on the mat.",
    "Allan Peiper was born in Alexandra, Victoria, Australia.",
    "Allan Peiper is a former professional cyclist.",
    "Alexandra is a town in Victoria.",
    "Born in Paris, the painter moved to Lyon.",
    "Cyclists from Australia rode in the Tour de France.",
    "the the the of of a",
]


def _reference_lucene_bm25(texts, query, k1=1.2, b=0.75):
    """Lucene BM25 written out: idf = log(1 + (N - df + .5)/(df + .5)), tf / (tf + k1 (1 - b + b dl/avgdl))."""
    tok = lambda t: [w for w in re.findall(r"(?u)\b\w\w+\b", t.lower()) if w not in queries.STOPWORDS]
    docs = [tok(t) for t in texts]
    n = len(docs)
    avgdl = sum(len(d) for d in docs) / n
    out = np.zeros(n)
    for term in tok(query):
        df = sum(term in d for d in docs)
        if df == 0:
            continue
        idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
        for i, d in enumerate(docs):
            tf = d.count(term)
            out[i] += idf * tf / (tf + k1 * (1 - b + b * len(d) / avgdl))
    return out


@pytest.mark.parametrize(
    "query", ["Allan Peiper was born in Alexandra", "cyclist Australia", "painter Paris Lyon", "zzz"]
)
def test_scores_match_lucene_formula(query):
    bm = baselines.BM25(PASSAGES)
    np.testing.assert_allclose(bm.scores(query), _reference_lucene_bm25(PASSAGES, query), rtol=1e-5, atol=1e-6)


def test_exact_match_passage_ranks_first():
    bm = baselines.BM25(PASSAGES)
    for i, text in enumerate(PASSAGES[:6]):
        s, ids = bm.topk([text], k=3)
        assert ids[0, 0] == i, (text, ids)
    s, ids = bm.topk(["Allan Peiper was born in Alexandra"], k=len(PASSAGES))
    assert ids[0, 0] == 1 and sorted(ids[0].tolist()) == list(range(len(PASSAGES)))
    assert np.all(np.diff(s[0]) <= 0)


def test_stable_topk_breaks_ties_by_lower_id():
    s = np.array([0.5, 2.0, 0.5, 2.0, 0.5, 1.0], np.float32)
    np.testing.assert_array_equal(baselines.stable_topk(s, 4), [1, 3, 5, 0])
    np.testing.assert_array_equal(baselines.stable_topk(s, 10), [1, 3, 5, 0, 2, 4])
    # vs a full stable sort over random scores with many ties
    r = np.random.default_rng(0).integers(0, 5, 200).astype(np.float32)
    np.testing.assert_array_equal(baselines.stable_topk(r, 17), np.argsort(-r, kind="stable")[:17])


def test_empty_corpus_is_an_error():
    with pytest.raises(ValueError, match="empty corpus"):
        baselines.BM25([])


def test_stopwords_are_bm25s_en():
    """queries.STOPWORDS spells out the list bm25s uses for stopwords="en" (Lucene's English set)."""
    from bm25s.stopwords import STOPWORDS_EN

    assert queries.STOPWORDS == frozenset(STOPWORDS_EN)


def test_importing_the_package_does_not_start_jax(tmp_path):
    """No module of the package starts JAX's backends at import time (jax.distributed must come first)."""
    import subprocess
    import sys

    code = (
        "import importlib, pkgutil, trackstar_jax\n"
        "from jax._src import xla_bridge\n"
        "for m in pkgutil.iter_modules(trackstar_jax.__path__):\n"
        "    importlib.import_module('trackstar_jax.' + m.name)\n"
        "    assert not xla_bridge.backends_are_initialized(), m.name\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
