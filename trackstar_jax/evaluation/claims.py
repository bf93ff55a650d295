"""The paper's orderings of Table 1 as paired tests: bootstrap the per-query difference of two rows.

Rows of one evaluation share their queries, so a comparison resamples *queries* and takes the
mean difference on each resample (a paired bootstrap): the noise common to both rows (an
easy fact, a fact with one gold sentence) cancels, which two rows' separate intervals cannot
show. Each claim "A > B on metric" gets the 95% interval of mean(A - B) and a verdict:

* **holds**: the interval is above 0;
* **fails**: the interval is below 0 (the opposite ordering is significant);
* **inconclusive**: the interval contains 0.

"A ≥ B" (TrackStar ≥ each ablation) is judged the same way: only a significant A < B fails it.
"Far below" (TRAK vs gradient cosine, (d)) additionally needs TRAK's mean at most
`FAR_BELOW_RATIO` times the other's; a significant but smaller gap is reported as "fails (not far)".

The orderings (issue 12; §4.3, Table 1):
  (a) unit norm matters: Exp. 2 > Exp. 1 on MRR, recall@10 and tail-patch@10;
  (b) TrackStar ≥ each of Exp. 1-5 and TRAK on MRR, recall@10 and tail-patch@10;
  (c) BM25 > TrackStar on MRR; TrackStar > BM25 and > T-REx gold on tail-patch@10;
  (d) TRAK's MRR is far below gradient cosine's (paper: 0.001 vs 0.266).

Beyond the paper (issue 39), when the table has the `trackstar_rerank` row: its difference to
TrackStar on MRR, recall@10 and tail-patch@10 (`rerank_claims`), reported, not judged.

Tail-patch is judged at k = 10, Table 1's column (§4.3, §A.3.2). The same comparisons at
k = 1 (Table A.2's first column) are still computed and shown, marked as not judged
(`Claim.judged = False`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np

from trackstar_jax import files
from trackstar_jax.evaluation import metrics as metrics_lib

ATTRIBUTION_AND_TAILPATCH = ("mrr", "recall_at_10", "tailpatch_at_10")  # Table 1's judged columns
FAR_BELOW_RATIO = 0.5  # (d): "far below" = at most half of the other row's mean (paper: 0.001 / 0.266)


@dataclasses.dataclass(frozen=True)
class Claim:
    """One ordering: `better` beats `worse` on `metric` (`relation` ">" / ">=" / "far_below")."""

    group: str  # "a" .. "d"
    better: str  # row names (baselines.METHODS)
    worse: str
    metric: str
    relation: str = ">"
    judged: bool = True  # False: reported beside the verdicts (tail-patch@1), not one of them

    @property
    def text(self) -> str:
        if self.relation == "far_below":
            return f"{self.worse} far below {self.better} on {self.metric}"
        return f"{self.better} {self.relation} {self.worse} on {self.metric}"


def paper_claims() -> list[Claim]:
    """Orderings (a)-(d) of the module docstring, in that order."""
    out = [Claim("a", "exp2", "exp1", m) for m in ("mrr", "recall_at_10", "tailpatch_at_10")]
    out.append(Claim("a", "exp2", "exp1", "tailpatch_at_1", judged=False))
    for other in ("exp1", "exp2", "exp3", "exp4", "exp5", "trak"):
        out += [Claim("b", "trackstar", other, m, ">=") for m in ("mrr", "recall_at_10", "tailpatch_at_10")]
    out.append(Claim("c", "bm25", "trackstar", "mrr"))
    out += [Claim("c", "trackstar", other, "tailpatch_at_10") for other in ("bm25", "trex_gold")]
    out += [Claim("c", "trackstar", other, "tailpatch_at_1", judged=False) for other in ("bm25", "trex_gold")]
    out.append(Claim("d", "exp2", "trak", "mrr", "far_below"))
    return out


def rerank_claims() -> list[Claim]:
    """TrackStar with its top 100 reranked exactly vs TrackStar: reported, not judged."""
    return [Claim("rerank", "trackstar_rerank", "trackstar", m, judged=False) for m in ATTRIBUTION_AND_TAILPATCH]


def paired_values(
    a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]], metric: str
) -> tuple[np.ndarray, np.ndarray]:
    """Per-query values of `metric` of two rows, on the queries where both are finite.

    Records are matched by `query_id`; attribution metrics use only queries with evidence
    (as `metrics.summarize`).

    Raises:
      ValueError: the rows were not evaluated on the same queries.
    """
    ia = {r["query_id"]: r for r in a}
    ib = {r["query_id"]: r for r in b}
    if set(ia) != set(ib):
        raise ValueError(f"paired comparison needs the same queries in both rows ({len(ia)} vs {len(ib)} query ids)")
    attribution = any(metric.endswith(m) for m in metrics_lib.ATTRIBUTION_METRICS)
    xa, xb = [], []
    for q in sorted(ia):
        ra, rb = ia[q], ib[q]
        if attribution and not (ra.get("has_evidence", True) and rb.get("has_evidence", True)):
            continue
        va, vb = ra.get(metric), rb.get(metric)
        va = math.nan if va is None else float(va)
        vb = math.nan if vb is None else float(vb)
        if math.isfinite(va) and math.isfinite(vb):
            xa.append(va)
            xb.append(vb)
    return np.asarray(xa, np.float64), np.asarray(xb, np.float64)


def paired_difference(
    a: np.ndarray,
    b: np.ndarray,
    *,
    confidence: float = metrics_lib.CONFIDENCE,
    num_resamples: int = metrics_lib.NUM_RESAMPLES,
    seed: int = 0,
) -> metrics_lib.Interval:
    """Mean of `a - b` with a percentile-bootstrap interval that resamples query indices (paired).

    One index matrix `[num_resamples, n]` is drawn and applied to both rows, so every
    resample compares the two rows on the same queries.
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired values must be two 1-d arrays of one length, got {a.shape} and {b.shape}")
    if a.size == 0:
        return metrics_lib.Interval(None, None, None, 0)
    d = a - b
    mean = float(d.mean())
    if d.size == 1:
        return metrics_lib.Interval(mean, mean, mean, 1)
    idx = np.random.default_rng(seed).integers(0, d.size, size=(num_resamples, d.size))
    means = a[idx].mean(axis=1) - b[idx].mean(axis=1)
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return metrics_lib.Interval(mean, float(lo), float(hi), int(d.size))


def verdict(claim: Claim, diff: metrics_lib.Interval, mean_better: float | None, mean_worse: float | None) -> str:
    """ "holds" / "fails" / "inconclusive" for `diff` = better - worse (see the module docstring)."""
    if diff.lo is None:
        return "inconclusive"
    if claim.relation == "far_below":
        if diff.lo > 0:
            far = mean_better is not None and mean_worse is not None and mean_worse <= FAR_BELOW_RATIO * mean_better
            return "holds" if far else "fails (not far)"
        return "fails" if diff.hi < 0 else "inconclusive"
    if diff.lo > 0:
        return "holds"
    if diff.hi < 0:
        return "fails"
    return "inconclusive"


def compare(
    records: Mapping[str, Sequence[Mapping[str, Any]]], claims: Sequence[Claim] | None = None, *, seed: int = 0
) -> list[dict[str, Any]]:
    """Every claim whose two rows were evaluated: means, paired difference interval, verdict.

    Args:
      records: `{row name: per-query records}` (`report.query_records`).
      claims: defaults to `paper_claims()` and `rerank_claims()`.
      seed: bootstrap seed (the same for every claim, like the rows' own intervals).

    Returns:
      JSON-able dicts (claim fields, `n`, `mean_better`, `mean_worse`, `diff`, `diff_ci`, `verdict`).
    """
    out = []
    for c in paper_claims() + rerank_claims() if claims is None else claims:
        if c.better not in records or c.worse not in records:
            continue
        a, b = paired_values(records[c.better], records[c.worse], c.metric)
        iv = paired_difference(a, b, seed=seed)
        mb = float(a.mean()) if a.size else None
        mw = float(b.mean()) if b.size else None
        out.append(
            {
                **dataclasses.asdict(c),
                "claim": c.text,
                "n": iv.n,
                "mean_better": mb,
                "mean_worse": mw,
                "diff": iv.mean,
                "diff_ci": [iv.lo, iv.hi],
                "verdict": verdict(c, iv, mb, mw),
            }
        )
    return out


def markdown(comparisons: Sequence[Mapping[str, Any]], labels: Mapping[str, str] | None = None) -> str:
    """The verdict table for table.md (tail-patch differences in percentage points)."""
    if not comparisons:
        return ""
    labels = labels or {}
    lines = [
        "## The paper's orderings: paired bootstrap over queries of the difference (95%)",
        "",
        "| claim | metric | better | worse | difference [95% CI] | n | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in comparisons:
        pct = c["metric"].startswith("tailpatch")
        scale, unit = (100.0, "%") if pct else (1.0, "")

        def f(v, scale=scale, unit=unit, pct=pct):
            return "–" if v is None else (f"{v * scale:+.2f}{unit}" if pct else f"{v:.3f}")

        rel = {"far_below": "≫", ">=": "≥"}.get(c["relation"], ">")
        lo, hi = c["diff_ci"]
        ci = "" if lo is None else f" [{lo * scale:+.3f}, {hi * scale:+.3f}]"
        d = "–" if c["diff"] is None else f"{c['diff'] * scale:+.3f}{unit}{ci}"
        verdict = files.markdown_text(c["verdict"])
        v = f"**{verdict}**" if c.get("judged", True) else f"_{verdict} (reported, not judged)_"
        better, worse = (files.markdown_text(labels.get(c[k], c[k])) for k in ("better", "worse"))
        lines.append(
            f"| ({files.markdown_text(c['group'])}) {better} {rel} {worse} "
            f"| {files.markdown_text(c['metric'])} | {f(c['mean_better'])} | {f(c['mean_worse'])} | {d} "
            f"| {files.markdown_text(c['n'])} | {v} |"
        )
    return "\n".join(lines) + "\n"
