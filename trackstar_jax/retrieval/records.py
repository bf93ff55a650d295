"""Retrieval output records in the PAIR-code/pretraining-tda schema (one query per jsonl line).

The paper's released files (`trex_retrievals_*.jsonl`) and their viewer use these fields:
`example_id, query_set, inputs_plaintext, targets_plaintext, proponents, proponent_ids,
proponent_scores, opponents*`, and for fact queries `proponent_correct`. `retrieve` and the
evaluation's per-method files both build their lines here.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence


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
      extra: further fields placed first (fact_id, relation, model_completion, ...).
    """
    ids = [int(i) for i in top_ids]
    rec = {
        **extra,
        "example_id": example_id,
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
    return rec
