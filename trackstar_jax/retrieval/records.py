"""Retrieval output records in the PAIR-code/pretraining-tda schema (one query per jsonl line).

The paper's released files (`trex_retrievals_*.jsonl`, github.com/PAIR-code/pretraining-tda
README "TDA method results") and their viewer (`demo/`, pair-code.github.io/pretraining-tda/demo)
use these fields, in this order: `PAIR_FIELDS` (`example_id, query_set, inputs_plaintext,
targets_plaintext, proponents, proponent_ids, proponent_scores, opponents, opponent_ids,
opponent_scores`), then for fact queries `fact_id, relation, ..., proponent_correct`. Our lines
put those first, in that order, and our own fields after them (fact fields, tail-patch deltas,
token scores, rerank scores), which the viewer ignores. `example_id` is a string, as in the
released files: the viewer calls `example_id.startsWith("trex")` on every query it shows (a
number there stops its page). Its side-by-side mode pairs two files' rows by line number, so
every retrieval output of a query set lists the queries in the query set's order.
`retrieve` and the evaluation's per-method files both build their lines here.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

PAIR_FIELDS = (
    "example_id",
    "query_set",
    "inputs_plaintext",
    "targets_plaintext",
    "proponents",
    "proponent_ids",
    "proponent_scores",
    "opponents",
    "opponent_ids",
    "opponent_scores",
)


def ordered(rec: dict) -> dict:
    """`rec` with the `PAIR_FIELDS` it has first, in the released files' order, then the rest as they were."""
    return {**{k: rec[k] for k in PAIR_FIELDS if k in rec}, **{k: v for k, v in rec.items() if k not in PAIR_FIELDS}}


def pair_record(
    example_id: Any,
    prompt: str,
    target: str,
    texts: Sequence[str],
    top_ids: Iterable[int],
    top_scores: Iterable[float],
    bottom_ids: Iterable[int] | None = None,
    bottom_scores: Iterable[float] | None = None,
    gold: Iterable[int] | None = None,
    **extra: Any,
) -> dict:
    """One query's line.

    Args:
      example_id, prompt, target: the query (`inputs_plaintext`, `targets_plaintext`).
      texts: the corpus passages by example id (proponents are shown as text).
      top_ids, top_scores: ranked proponents; bottom_*: opponents (gradient methods).
      gold: the fact's entailing passage ids -> `proponent_correct` (fact queries only).
      extra: further fields (query_set, fact_id, relation, model_completion, ...), after
        the schema's own (`ordered`).
    """
    ids = [int(i) for i in top_ids]
    rec = {
        **extra,
        "example_id": str(example_id),
        "inputs_plaintext": prompt,
        "targets_plaintext": target,
        "proponents": [texts[i] for i in ids],
        "proponent_ids": ids,
        "proponent_scores": [float(s) for s in top_scores],
    }
    if gold is not None:
        g = set(int(i) for i in gold)
        rec["proponent_correct"] = [i in g for i in ids]
    if bottom_ids is not None:
        oids = [int(i) for i in bottom_ids]
        rec.update(
            {
                "opponents": [texts[i] for i in oids],
                "opponent_ids": oids,
                "opponent_scores": [float(s) for s in bottom_scores],
            }
        )
    return ordered(rec)
