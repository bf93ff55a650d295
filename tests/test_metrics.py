"""metrics: hand-computed examples of PAIR-code metrics.ts, tail-patch@k, intervals, table rows."""

import math

import numpy as np
import pytest

from trackstar_jax.evaluation import metrics


@pytest.mark.parametrize(
    "flags, mrr, recall, precision",
    [
        # first entailing proponent at rank 3 (index 2); 2 of the first 10 entailing
        ([0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1], 1 / 3, 1.0, 0.2),
        # entailing at rank 1
        ([1] + [0] * 9, 1.0, 1.0, 0.1),
        # no hit at all: every metric is 0
        ([0] * 10, 0.0, 0.0, 0.0),
        # only hit is at rank 12: MRR counts the whole list, recall/precision@10 do not
        ([0] * 11 + [1], 1 / 12, 0.0, 0.0),
        # fewer than 10 proponents: precision@10 is 0 by metrics.ts's `precisionAtK[9] ?? 0`
        ([0, 1, 1], 0.5, 1.0, 0.0),
        # empty list
        ([], 0.0, 0.0, 0.0),
        # all ten entailing
        ([1] * 10, 1.0, 1.0, 1.0),
    ],
)
def test_ground_truth_metrics_hand_computed(flags, mrr, recall, precision):
    got = metrics.ground_truth_metrics([bool(f) for f in flags])
    assert got["mrr"] == pytest.approx(mrr)
    assert got["recall_at_10"] == recall
    assert got["precision_at_10"] == pytest.approx(precision)


def test_query_metrics_uses_gold_ids_and_prefix():
    got = metrics.query_metrics([7, 3, 9, 1], gold_ids={9, 100}, prefix="mention_")
    assert got == {"mention_mrr": pytest.approx(1 / 3), "mention_recall_at_10": 1.0, "mention_precision_at_10": 0.0}


def test_tailpatch_at_k():
    d = [0.5, 0.1, -0.3, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    got = metrics.tailpatch_at_k(d)
    assert got["tailpatch_at_1"] == pytest.approx(0.5)
    assert got["tailpatch_at_3"] == pytest.approx(0.1)
    assert got["tailpatch_at_5"] == pytest.approx(0.1)
    assert got["tailpatch_at_10"] == pytest.approx(0.15)
    # fewer proponents than k: mean of those present; none: NaN
    assert metrics.tailpatch_at_k([0.2, 0.4], ks=(5,))["tailpatch_at_5"] == pytest.approx(0.3)
    assert math.isnan(metrics.tailpatch_at_k([], ks=(1,))["tailpatch_at_1"])


def test_mean_ci_bootstrap_covers_mean_and_is_reproducible():
    rng = np.random.default_rng(0)
    v = rng.binomial(1, 0.3, size=400).astype(float)
    a = metrics.mean_ci(v, seed=1)
    b = metrics.mean_ci(v, seed=1)
    assert a == b
    assert a.lo < a.mean < a.hi and 0.0 <= a.lo and a.hi <= 1.0
    # percentile bootstrap of a mean ~ normal approximation for n=400
    se = v.std() / math.sqrt(len(v))
    assert a.hi - a.lo == pytest.approx(2 * 1.96 * se, rel=0.15)
    assert metrics.mean_ci([math.nan, 2.0]) == metrics.Interval(2.0, 2.0, 2.0, 1)
    assert metrics.mean_ci([]) == metrics.Interval(None, None, None, 0)


def _records():
    # 4 queries; q3 has no evidence (excluded from attribution metrics, kept for tail-patch)
    return [
        {
            "mrr": 1.0,
            "recall_at_10": 1.0,
            "precision_at_10": 0.3,
            "tailpatch_at_1": 0.02,
            "has_evidence": True,
            "correct": True,
            "bucket": "[1,10)",
        },
        {
            "mrr": 0.5,
            "recall_at_10": 1.0,
            "precision_at_10": 0.1,
            "tailpatch_at_1": 0.00,
            "has_evidence": True,
            "correct": False,
            "bucket": "[1,10)",
        },
        {
            "mrr": 0.0,
            "recall_at_10": 0.0,
            "precision_at_10": 0.0,
            "tailpatch_at_1": 0.04,
            "has_evidence": True,
            "correct": False,
            "bucket": "[10,100)",
        },
        {
            "mrr": 0.0,
            "recall_at_10": 0.0,
            "precision_at_10": 0.0,
            "tailpatch_at_1": -0.01,
            "has_evidence": False,
            "correct": True,
            "bucket": "[10,100)",
        },
    ]


def test_method_row_excludes_no_evidence_from_attribution_and_splits():
    names = ("mrr", "recall_at_10", "precision_at_10", "tailpatch_at_1")
    row = metrics.method_row("bm25", _records(), names, bucket_order=["0", "[1,10)", "[10,100)"])
    assert row["num_queries"] == 4 and row["num_no_evidence"] == 1
    assert row["mrr"] == pytest.approx(0.5) and row["mrr_n"] == 3
    assert row["recall_at_10"] == pytest.approx(2 / 3)
    assert row["tailpatch_at_1"] == pytest.approx(0.0125) and row["tailpatch_at_1_n"] == 4
    lo, hi = row["mrr_ci"]
    assert lo <= row["mrr"] <= hi
    assert row["by_correctness"]["correct"]["mrr"] == pytest.approx(1.0)
    assert row["by_correctness"]["incorrect"]["mrr"] == pytest.approx(0.25)
    assert list(row["by_bucket"]) == ["[1,10)", "[10,100)"]
    assert row["by_bucket"]["[10,100)"]["tailpatch_at_1"] == pytest.approx(0.015)


def test_markdown_table_formats_gold_and_percent():
    names = ("mrr", "tailpatch_at_1")
    rows = [
        metrics.method_row("T-REx gold", _records(), names, extra={"gold_attribution": True}),
        metrics.method_row("bm25", _records(), names),
    ]
    md = metrics.markdown_table(rows, names)
    lines = md.strip().splitlines()
    assert lines[0] == "| method | n | mrr | tailpatch_at_1 |"
    assert "| T-REx gold | 4 | gold | +1.25%" in lines[2]
    assert lines[3].startswith("| bm25 | 4 | 0.500 [")
