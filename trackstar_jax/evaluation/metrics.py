"""Fact-tracing metrics (§4.3) and their aggregation into the table (Table 1, A.1, A.2).

Per query, exactly as PAIR-code/pretraining-tda `demo/metrics.ts::getGroundTruthMetrics`
(the authors' viewer), given `is_correct[i]` = "proponent i is entailing", in rank order:

* `mrr` ("mrr_first") = 1 / (1 + index of the first entailing proponent) over the *whole*
  proponent list, 0 when none is entailing;
* `recall_at_10` = 1 if any of the first 10 proponents is entailing, else 0;
* `precision_at_10` = (entailing among the first 10) / 10, and 0 when fewer than 10
  proponents were retrieved (`precisionAtK[9] ?? 0` in metrics.ts).

Tail-patch at k (§4.3, Table A.1): the mean over the top-k proponents of the change in the
query target's probability after one training step on that proponent.

Aggregation: the mean over queries with a 95% percentile-bootstrap interval (1000 resamples
of queries with replacement, fixed seed), the same for every metric and method, so rows are
comparable. Queries whose fact has no entailing passage in the corpus are excluded from
the attribution metrics (they cannot score > 0) and counted in `num_no_evidence`; they
still count for tail-patch. Rows are also split by model correctness (Table A.2) and by
frequency bucket (§A.4).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from trackstar_jax import files

ATTRIBUTION_METRICS = ("mrr", "recall_at_10", "precision_at_10")
DEFAULT_TAILPATCH_KS = (1, 3, 5, 10)
NUM_RESAMPLES = 1000
CONFIDENCE = 0.95


def ground_truth_metrics(is_correct: Sequence[bool]) -> dict[str, float]:
    """metrics.ts `getGroundTruthMetrics` for one ranked proponent list.

    Args:
      is_correct: `is_correct[i]` says whether the proponent at rank i (0-based) is entailing.

    Returns:
      `{"mrr": ..., "recall_at_10": ..., "precision_at_10": ...}`.
    """
    flags = [bool(x) for x in is_correct]
    first = flags.index(True) if True in flags else -1
    return {
        "mrr": 1.0 / (1 + first) if first > -1 else 0.0,
        "recall_at_10": float(any(flags[:10])),
        "precision_at_10": sum(flags[:10]) / 10.0 if len(flags) >= 10 else 0.0,
    }


def query_metrics(proponent_ids: Sequence[int], gold_ids: Iterable[int], prefix: str = "") -> dict[str, float]:
    """`ground_truth_metrics` with `is_correct[i] = proponent_ids[i] in gold_ids`; keys get `prefix`."""
    gold = {int(i) for i in gold_ids}
    m = ground_truth_metrics([int(p) in gold for p in proponent_ids])
    return {prefix + k: v for k, v in m.items()}


def tailpatch_at_k(deltas: Sequence[float], ks: Sequence[int] = DEFAULT_TAILPATCH_KS) -> dict[str, float]:
    """Mean tail-patch change over the top-k proponents, for each k (Table A.1).

    When fewer than k proponents exist (e.g. a fact with 2 gold passages), the mean is over
    those that exist; with none, the value is NaN (left out of the aggregate).
    """
    d = np.asarray(deltas, np.float64)
    return {f"tailpatch_at_{k}": float(d[:k].mean()) if d[:k].size else math.nan for k in ks}


@dataclasses.dataclass(frozen=True)
class Interval:
    """A mean with its percentile-bootstrap interval over `n` queries."""

    mean: float | None
    lo: float | None
    hi: float | None
    n: int


def mean_ci(
    values: Sequence[float], *, confidence: float = CONFIDENCE, num_resamples: int = NUM_RESAMPLES, seed: int = 0
) -> Interval:
    """Mean and percentile-bootstrap confidence interval (NaNs are left out).

    The bootstrap resamples queries with replacement `num_resamples` times and takes the
    (1-c)/2 and (1+c)/2 quantiles of the resampled means. Unlike the normal approximation it
    stays inside [0, 1] for the 0/1 recall of a small query set.

    Args:
      values: per-query values.
      confidence: interval mass (0.95).
      num_resamples: bootstrap resamples.
      seed: resampling seed (fixed so that tables are reproducible).

    Returns:
      `Interval(mean, lo, hi, n)`; all None when no value is finite.
    """
    v = np.asarray(list(values), np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return Interval(None, None, None, 0)
    mean = float(v.mean())
    if v.size == 1:
        return Interval(mean, mean, mean, 1)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, v.size, size=(num_resamples, v.size))
    means = v[idx].mean(axis=1)
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return Interval(mean, float(lo), float(hi), int(v.size))


def summarize(records: Sequence[Mapping[str, Any]], metric_names: Sequence[str], *, seed: int = 0) -> dict[str, Any]:
    """`{metric: mean, metric + "_ci": [lo, hi], metric + "_n": n}` over `records`.

    Attribution metrics (`ATTRIBUTION_METRICS`, with any prefix) are averaged only over
    records with `has_evidence`; other metrics over all records (NaN = missing).
    """
    out: dict[str, Any] = {}
    for name in metric_names:
        attribution = any(name.endswith(m) for m in ATTRIBUTION_METRICS)
        vals = [r.get(name, math.nan) for r in records if (r.get("has_evidence", True) or not attribution)]
        vals = [math.nan if v is None else v for v in vals]
        iv = mean_ci(vals, seed=seed)
        out[name] = iv.mean
        out[name + "_ci"] = [iv.lo, iv.hi]
        out[name + "_n"] = iv.n
    return out


def method_row(
    method: str,
    records: Sequence[Mapping[str, Any]],
    metric_names: Sequence[str],
    *,
    bucket_order: Sequence[str] = (),
    seed: int = 0,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One table row: overall summary plus splits by model correctness and frequency bucket.

    Args:
      method: row name.
      records: per-query dicts with the metric values and `has_evidence`, `correct`
        (bool or None) and `bucket` keys.
      metric_names: metrics to summarise.
      bucket_order: bucket names in display order (others follow, sorted).
      seed: bootstrap seed.
      extra: fields copied into the row (e.g. the method's settings).

    Returns:
      `{"method", "num_queries", "num_no_evidence", <summary>, "by_correctness": {...},
      "by_bucket": {...}}`, plus `"by_relation"` when records name their relation.
    """
    row: dict[str, Any] = {
        "method": method,
        "num_queries": len(records),
        "num_no_evidence": sum(1 for r in records if not r.get("has_evidence", True)),
    }
    if extra:
        row.update(extra)
    row.update(summarize(records, metric_names, seed=seed))
    split: dict[str, Any] = {}
    for label, flag in (("correct", True), ("incorrect", False)):
        sub = [r for r in records if r.get("correct") is flag]
        if sub:
            split[label] = {"num_queries": len(sub), **summarize(sub, metric_names, seed=seed)}
    row["by_correctness"] = split
    buckets = list(bucket_order) + sorted({r.get("bucket") for r in records} - set(bucket_order) - {None})
    by_bucket: dict[str, Any] = {}
    for b in buckets:
        sub = [r for r in records if r.get("bucket") == b]
        if sub:
            by_bucket[b] = {"num_queries": len(sub), **summarize(sub, metric_names, seed=seed)}
    row["by_bucket"] = by_bucket
    by_relation: dict[str, Any] = {}
    for rel in sorted({r["relation"] for r in records if r.get("relation")}):
        sub = [r for r in records if r.get("relation") == rel]
        by_relation[rel] = {"num_queries": len(sub), **summarize(sub, metric_names, seed=seed)}
    if by_relation:
        row["by_relation"] = by_relation
    return row


def _fmt(value: float | None, ci: Sequence[float | None] | None, percent: bool) -> str:
    if value is None:
        return "–"
    if not isinstance(value, (int, float)) or isinstance(value, bool):  # a tampered table.json
        return files.markdown_text(value)
    scale, unit = (100.0, "%") if percent else (1.0, "")
    s = f"{value * scale:+.2f}{unit}" if percent else f"{value:.3f}"
    if ci and ci[0] is not None and all(isinstance(x, (int, float)) for x in ci[:2]):
        s += f" [{ci[0] * scale:.2f}, {ci[1] * scale:.2f}]" if percent else f" [{ci[0]:.3f}, {ci[1]:.3f}]"
    return s


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], *, title: str = "") -> str:
    """Markdown table of `rows` (mean [95% CI]); tail-patch columns are shown in percent.

    A row that sets `gold_attribution` shows "gold" in its attribution columns, as Table 1
    does for the T-REx gold row.
    """
    head = ["method", "n"] + [files.markdown_text(c) for c in columns]
    lines = ([f"### {files.markdown_text(title)}", ""] if title else []) + [
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] * len(head)) + "|",
    ]
    for r in rows:
        cells = [files.markdown_text(r["method"]), files.markdown_text(r["num_queries"])]
        for c in columns:
            if r.get("gold_attribution") and any(c.endswith(m) for m in ATTRIBUTION_METRICS):
                cells.append("gold")
            else:
                cells.append(_fmt(r.get(c), r.get(c + "_ci"), percent=c.startswith("tailpatch")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
