"""The evaluation's report writers on hand-made inputs: per-query records, retrieval files, table.md."""

import json

import numpy as np
import pytest

from trackstar_jax import config as config_lib
from trackstar_jax.evaluation import baselines, metrics, queries, query_set, report
from trackstar_jax.evaluation.rows import Retrieved

TEXTS = ["Ana was born in Paris.", "Paris is big.", "Bo was born in Rome.", "Rome is old.", "noise"]


def _query(qid, fact, subj, obj, entailing, mentions):
    return queries.Query(
        query_id=qid,
        fact_id=fact,
        relation="P19",
        subject=subj,
        object=obj,
        prompt=f"{subj} was born in",
        target=f" {obj}",
        aliases=(obj,),
        subject_aliases=(subj,),
        entailing_ids=entailing,
        mention_ids=mentions,
        bucket="[1,10)",
        template_variant=0,
    )


@pytest.fixture
def eq():
    qs = [
        _query(0, "f0", "Ana", "Paris", (0,), (0, 1)),
        _query(1, "f1", "Bo", "Rome", (2,), (2,)),
        _query(2, "f2", "Cy", "Oslo", (), ()),
    ]  # a fact without evidence: excluded from MRR
    return query_set.EvalQueries(
        qs,
        [],
        completions=[" Paris", " Milan", " Oslo"],
        correct=[True, False, True],
        report=queries.QueryReport(),
        templates={},
    )


@pytest.fixture
def retrieved():
    return Retrieved(
        proponent_ids=[[1, 0, 4], [2, 3, 0], [4, 3, 1]],
        proponent_scores=[[0.9, 0.8, 0.1], [0.7, 0.5, 0.2], [0.3, 0.2, 0.1]],
        opponent_ids=[[4], [4], [0]],
        opponent_scores=[[-0.5], [-0.4], [-0.3]],
    )


DELTAS = {
    (0, 1): 0.5,
    (0, 0): 2.0,
    (0, 4): -1.0,
    (1, 2): 1.0,
    (1, 3): 0.0,
    (1, 0): 0.25,
    (2, 4): 0.0,
    (2, 3): 0.0,
    (2, 1): 0.0,
}


def test_query_records_match_hand_computed_metrics(eq, retrieved):
    recs = report.query_records(eq, retrieved, DELTAS, (1, 3), baselines.method("trackstar"))
    assert [r["query_id"] for r in recs] == [0, 1, 2]
    # query 0: first gold (id 0) at rank 2 -> MRR 1/2; query 1: gold at rank 1; query 2: no evidence.
    assert recs[0]["mrr"] == pytest.approx(0.5) and recs[1]["mrr"] == pytest.approx(1.0)
    assert recs[0]["recall_at_10"] == 1.0 and recs[2]["has_evidence"] is False
    # mention label: query 0's mentions are {0, 1}: the first proponent already counts.
    assert recs[0]["mention_mrr"] == pytest.approx(1.0)
    # tail-patch@k = mean delta of the top k proponents (metrics.tailpatch_at_k)
    assert recs[0]["tailpatch_at_1"] == pytest.approx(0.5)
    assert recs[0]["tailpatch_at_3"] == pytest.approx((0.5 + 2.0 - 1.0) / 3)
    assert recs[1]["tailpatch_at_3"] == pytest.approx(1.25 / 3)
    assert [r["correct"] for r in recs] == [True, False, True]


def test_gold_rows_get_only_tailpatch(eq, retrieved):
    recs = report.query_records(eq, retrieved, DELTAS, (1,), baselines.method("trex_gold"))
    assert "mrr" not in recs[0] and recs[0]["tailpatch_at_1"] == pytest.approx(0.5)


def test_retrieval_file_is_the_pair_code_schema(eq, retrieved, tmp_path):
    path = tmp_path / "trackstar.jsonl"
    report.write_retrievals(path, TEXTS, eq, retrieved, baselines.method("trackstar"), DELTAS)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == 3
    first = lines[0]
    assert first["example_id"] == "0" and first["query_set"] == "trackstar"
    assert first["inputs_plaintext"] == "Ana was born in" and first["targets_plaintext"] == " Paris"
    assert first["proponent_ids"] == [1, 0, 4] and first["proponents"] == [TEXTS[1], TEXTS[0], TEXTS[4]]
    assert first["proponent_scores"] == [0.9, 0.8, 0.1] and first["proponent_correct"] == [False, True, False]
    assert first["proponent_tailpatch"] == [0.5, 2.0, -1.0]
    assert first["opponent_ids"] == [4] and first["opponents"] == [TEXTS[4]]
    assert first["model_completion"] == " Paris" and first["model_correct"] is True
    assert first["fact_id"] == "f0" and first["relation"] == "P19"
    # the frequency fields under the names the authors' viewer reads (`c4_frequency ?? fact_frequency`)
    assert first["fact_frequency"] == 2 and first["frequency_bucket"] == eq.queries[0].bucket
    # rows without opponents (BM25) have no opponent fields
    no_opp = Retrieved(retrieved.proponent_ids, retrieved.proponent_scores)
    lines = report.retrieval_lines(TEXTS, eq, no_opp, baselines.method("bm25"), DELTAS)
    assert "opponent_ids" not in lines[0] and lines[0]["query_set"] == "bm25"


def test_table_markdown_shows_rows_splits_and_examples(eq, retrieved):
    names = (
        list(metrics.ATTRIBUTION_METRICS)
        + [f"mention_{x}" for x in metrics.ATTRIBUTION_METRICS]
        + ["tailpatch_at_1", "tailpatch_at_3"]
    )
    rows = []
    for name in ("bm25", "trackstar"):
        m = baselines.method(name)
        recs = report.query_records(eq, retrieved, DELTAS, (1, 3), m)
        rows.append(
            metrics.method_row(name, recs, names, extra={"label": m.label, "kind": m.kind, "gold_attribution": False})
        )
    table = {
        "rows": rows,
        "corpus": {"name": "hand", "num_examples": len(TEXTS)},
        "num_queries": 3,
        "query_mode": "gold",
        "template_variant": 0,
        "model": {"num_params": 1234, "checkpoint_step": 7},
        "model_accuracy": 2 / 3,
        "ci": "95% bootstrap",
    }
    md = report.table_markdown(table, eq, {"bm25": retrieved, "trackstar": retrieved}, TEXTS, (1, 3), 2)
    assert md.startswith("# Fact tracing table") and "hand (5 passages), 3 queries" in md
    main = md.split("## Example queries")[0]
    assert "BM25" in main and "TrackStar" in main
    assert "Facts the model predicts correctly" in md and "Facts the model predicts incorrectly" in md
    examples = md.split("## Example queries")[1]
    assert "**Ana was born in** → Paris" in examples and "**Bo was born in** → Rome" in examples
    assert "Cy was born in" not in examples  # only num_examples_shown=2 queries
    assert "✓ [0]" in examples and "[1] (0.9) Paris is big." in examples


def test_eval_dir_names_modes_and_templates(tmp_path):
    s = config_lib.Settings()
    assert report.eval_dir(s, tmp_path) == tmp_path / "eval"
    assert report.eval_dir(s.replace({"eval.query_mode": "prediction"}), tmp_path).name == "eval_prediction"
    assert report.eval_dir(s.replace({"eval.template_variant": 2}), tmp_path).name == "eval_gold_t2"
    assert report.eval_dir(s.replace({"eval.output_dir": "mine"}), tmp_path).name == "mine"
    with pytest.raises(ValueError, match="eval.output_dir"):
        s.replace({"eval.output_dir": "../x"})
    assert np.isfinite(metrics.CONFIDENCE)
