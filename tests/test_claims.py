"""Paired bootstrap of row differences and the verdicts for the paper's orderings (claims.py)."""

import math

import numpy as np
import pytest

from trackstar_jax.evaluation import claims, metrics


def _loop_reference(a, b, seed, num_resamples=metrics.NUM_RESAMPLES, confidence=metrics.CONFIDENCE):
    """Plain loops over the same resampled query indices: mean(a[idx]) - mean(b[idx]), then quantiles."""
    n = len(a)
    idx = np.random.default_rng(seed).integers(0, n, size=(num_resamples, n))
    diffs = []
    for r in range(num_resamples):
        sa = sb = 0.0
        for j in range(n):
            sa += a[idx[r, j]]
            sb += b[idx[r, j]]
        diffs.append(sa / n - sb / n)
    diffs.sort()
    # numpy's default quantile: linear interpolation between order statistics at (m - 1) * q
    out = []
    for q in ((1 - confidence) / 2, (1 + confidence) / 2):
        pos = (num_resamples - 1) * q
        lo, frac = int(math.floor(pos)), pos - math.floor(pos)
        out.append(diffs[lo] + frac * (diffs[min(lo + 1, num_resamples - 1)] - diffs[lo]))
    return sum(a) / n - sum(b) / n, out[0], out[1]


def test_paired_difference_matches_a_loop_reference():
    rng = np.random.default_rng(7)
    a = rng.random(60)
    b = a - 0.05 + 0.1 * rng.standard_normal(60)
    iv = claims.paired_difference(a, b, seed=3)
    mean, lo, hi = _loop_reference(list(a), list(b), seed=3)
    assert iv.n == 60
    np.testing.assert_allclose([iv.mean, iv.lo, iv.hi], [mean, lo, hi], rtol=0, atol=1e-12)
    assert lo < mean < hi


def test_pairing_is_narrower_than_separate_intervals():
    # a and b share a large per-query effect: the rows' own intervals overlap, the paired one does not
    rng = np.random.default_rng(0)
    base = rng.random(200)
    a, b = base + 0.02, base.copy()
    iv = claims.paired_difference(a, b, seed=0)
    assert iv.lo > 0  # every query is 0.02 better
    ia, ib = metrics.mean_ci(a, seed=0), metrics.mean_ci(b, seed=0)
    assert ia.lo < ib.hi  # separately they look indistinguishable


def _records(values, metric="mrr", evidence=None):
    return [
        {"query_id": i, metric: v, "has_evidence": True if evidence is None else evidence[i]}
        for i, v in enumerate(values)
    ]


def test_verdicts_holds_fails_inconclusive_and_far_below():
    n = 100
    hi, lo = [1.0] * n, [0.0] * n
    noisy = [float(i % 2) for i in range(n)]
    other = [float((i + 1) % 2) for i in range(n)]
    mostly = [float(i % 5 > 0) for i in range(n)]  # mean 0.8: below exp2's 1.0, but not far below
    recs = {
        "exp2": _records(hi),
        "exp1": _records(lo),
        "trackstar": _records(noisy),
        "exp3": _records(other),
        "trak": _records(mostly),
    }
    out = claims.compare(
        recs,
        [
            claims.Claim("a", "exp2", "exp1", "mrr"),
            claims.Claim("a", "exp1", "exp2", "mrr"),
            claims.Claim("b", "trackstar", "exp3", "mrr", ">="),
            claims.Claim("d", "exp2", "trak", "mrr", "far_below"),
            claims.Claim("d", "exp2", "missing_row", "mrr"),
        ],
    )
    assert [c["verdict"] for c in out] == ["holds", "fails", "inconclusive", "fails (not far)"]
    assert out[0]["diff"] == 1.0 and out[0]["n"] == n and out[0]["claim"] == "exp2 > exp1 on mrr"
    recs["trak"] = _records([0.01] * n)
    assert claims.compare(recs, [claims.Claim("d", "exp2", "trak", "mrr", "far_below")])[0]["verdict"] == "holds"
    md = claims.markdown(out, {"exp2": "Exp. 2"})
    assert "| (a) Exp. 2 > exp1 | mrr |" in md and "**holds**" in md


def test_paired_values_skip_missing_and_no_evidence_and_refuse_other_queries():
    a = _records([1.0, 0.5, math.nan, 0.2], evidence=[True, False, True, True])
    b = _records([0.0, 0.0, 0.3, None], evidence=[True, True, True, True])
    xa, xb = claims.paired_values(a, b, "mrr")
    assert xa.tolist() == [1.0] and xb.tolist() == [0.0]  # q1: no evidence; q2: NaN; q3: None
    ta = [{"query_id": i, "tailpatch_at_1": v, "has_evidence": False} for i, v in enumerate([0.1, 0.2])]
    tb = [{"query_id": i, "tailpatch_at_1": v, "has_evidence": True} for i, v in enumerate([0.0, 0.1])]
    assert claims.paired_values(ta, tb, "tailpatch_at_1")[0].tolist() == [0.1, 0.2]  # tail-patch needs no evidence
    with pytest.raises(ValueError, match="same queries"):
        claims.paired_values(a, b[:2], "mrr")


def test_paper_claims_cover_orderings_a_to_d():
    cs = claims.paper_claims()
    assert {c.group for c in cs} == {"a", "b", "c", "d"}
    assert {c.worse for c in cs if c.group == "b"} == {"exp1", "exp2", "exp3", "exp4", "exp5", "trak"}
    assert claims.Claim("c", "bm25", "trackstar", "mrr") in cs
    # Table 1's tail-patch column is k = 10 (§4.3, §A.3.2): (a) and (c) are judged there; k = 1 is
    # still compared, but reported beside the verdicts, not as one.
    judged = {(c.group, c.better, c.worse, c.metric) for c in cs if c.judged}
    for key in (("a", "exp2", "exp1"), ("c", "trackstar", "bm25"), ("c", "trackstar", "trex_gold")):
        assert (*key, "tailpatch_at_10") in judged
        assert (*key, "tailpatch_at_1") not in judged
        assert claims.Claim(*key, "tailpatch_at_1", judged=False) in cs
    assert not any(c.metric == "tailpatch_at_1" for c in cs if c.judged)


def test_unjudged_claims_are_marked_in_the_markdown():
    recs = {"exp2": _records([1.0] * 20, "tailpatch_at_1"), "exp1": _records([0.0] * 20, "tailpatch_at_1")}
    out = claims.compare(recs, [claims.Claim("a", "exp2", "exp1", "tailpatch_at_1", judged=False)])
    assert out[0]["verdict"] == "holds" and out[0]["judged"] is False
    md = claims.markdown(out)
    assert "_holds (reported, not judged)_" in md and "**holds**" not in md


def test_the_rerank_row_is_compared_to_trackstar_when_present_reported_not_judged():
    def recs(values):
        return [
            {"query_id": i, "mrr": v, "recall_at_10": v, "tailpatch_at_10": v / 10, "has_evidence": True}
            for i, v in enumerate(values)
        ]

    both = {"trackstar": recs([0.0, 0.5] * 20), "trackstar_rerank": recs([1.0, 0.5] * 20)}
    out = claims.compare(both)  # the default claims: the paper's, then the rerank's
    assert [(c["better"], c["worse"], c["metric"]) for c in out] == [
        ("trackstar_rerank", "trackstar", m) for m in ("mrr", "recall_at_10", "tailpatch_at_10")
    ]
    assert [c["diff"] for c in out] == pytest.approx([0.5, 0.5, 0.05]) and not any(c["judged"] for c in out)
    assert claims.compare({"trackstar": both["trackstar"]}) == []  # no rerank row: no comparison
