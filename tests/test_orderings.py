"""tools/orderings.py (the evidence for Run A's failing orderings in docs/results.md) on a small
hand-made evaluation: contrasts against a hand computation, the answer split, the subset MRR
and the rank correlation against a numpy reference, and `--scores` on a finished tiny
evaluation (its rescoring gives back the table's MRR)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO

from trackstar_jax import data
from trackstar_jax.data import corpus_types as corpus_lib

sys.path.insert(0, str(REPO / "tools"))
import orderings  # noqa: E402

TEXTS = [
    "Ada Lovelace was born in London.",  # 0: gold of query 0
    "London is a large city.",  # 1: names query 0's answer
    "Paris is in France.",  # 2: names query 1's answer
    "Victor Hugo died in Paris.",  # 3: gold of query 1
    "Cats sleep a lot.",  # 4
    "The river is long.",  # 5
]
QUERIES = [
    {"query_id": 0, "subject": "Ada Lovelace", "object": "London", "prompt": "Ada Lovelace was born in the city of:",
     "target": " London", "aliases": ["London"], "subject_aliases": [], "entailing_ids": [0]},
    {"query_id": 1, "subject": "Victor Hugo", "object": "Paris", "prompt": "Victor Hugo died in the city of:",
     "target": " Paris", "aliases": ["Paris"], "subject_aliases": [], "entailing_ids": [3]},
]  # fmt: skip
# per row: per query (ids, tail-patch deltas)
ROWS = {
    "exp2": {0: ([1, 0, 4], [0.3, 0.2, 0.1]), 1: ([2, 5, 3], [0.4, 0.0, 0.2])},
    "exp4": {0: ([4, 5, 0], [0.1, 0.05, 0.2]), 1: ([3, 2, 4], [0.2, 0.4, 0.1])},
}


@pytest.fixture
def evaluation(tmp_path):
    ex = [corpus_lib.Example(i, t) for i, t in enumerate(TEXTS)]
    data.save_corpus(corpus_lib.Corpus("test", ex, [], {}, corpus_lib.fingerprint(TEXTS)), tmp_path / "corpus")
    (tmp_path / "eval" / "retrievals").mkdir(parents=True)
    (tmp_path / "eval" / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUERIES))
    for row, per_q in ROWS.items():
        lines = [
            json.dumps({"example_id": str(q), "proponent_ids": ids, "proponent_tailpatch": tp})
            for q, (ids, tp) in per_q.items()
        ]
        (tmp_path / "eval" / "retrievals" / f"{row}.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_contrast_is_the_paired_mean_difference_of_the_two_rows(evaluation):
    e = orderings.Evaluation.read(evaluation)
    by_metric = {c["metric"]: c for c in orderings.contrasts(e)}
    assert {c["contrast"] for c in by_metric.values()} == {"optimizer correction (Exp. 4 − Exp. 2)"}
    # MRR: exp2 ranks query 0's gold 2nd and query 1's 3rd; exp4 ranks them 3rd and 1st
    assert by_metric["mrr"]["without"] == pytest.approx((1 / 2 + 1 / 3) / 2)
    assert by_metric["mrr"]["with"] == pytest.approx((1 / 3 + 1) / 2)
    tp2, tp4 = (0.6 / 3 + 0.6 / 3) / 2, (0.35 / 3 + 0.7 / 3) / 2
    assert by_metric["tailpatch_at_10"]["difference"] == pytest.approx(tp4 - tp2)
    assert by_metric["tailpatch_at_10"]["n"] == 2


def test_composition_and_answer_split_count_the_right_passages(evaluation):
    e = orderings.Evaluation.read(evaluation)
    men = orderings.Mentions(e.texts)
    comp = orderings.composition(e, men)
    # exp2's lists: query 0 -> {1, 0} name London; query 1 -> {2, 3} name Paris: 4 of 6
    assert comp["exp2"]["names_answer"] == pytest.approx(4 / 6)
    assert comp["exp2"]["entails"] == pytest.approx(2 / 6)
    assert comp["exp4"]["names_answer"] == pytest.approx(3 / 6)
    assert comp["exp2"]["distinct_passages"] == 6
    split = orderings.tailpatch_split(e, men)
    # distinct pairs naming the answer: (0,1) .3, (0,0) .2, (1,2) .4, (1,3) .2
    assert split["names_answer"]["mean"] == pytest.approx(np.mean([0.3, 0.2, 0.4, 0.2]))
    assert split["names_answer"]["n"] == 4
    assert split["does_not"]["mean"] == pytest.approx(np.mean([0.1, 0.0, 0.05, 0.1]))
    assert split["per_row"]["exp4"]["share_naming_answer"] == pytest.approx(3 / 6)


def test_spearman_matches_pearson_of_ranks():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=20), rng.normal(size=20)
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    assert orderings.spearman(x, y) == pytest.approx(np.corrcoef(rx, ry)[0, 1])
    assert np.isnan(orderings.spearman(x[:2], y[:2])) and np.isnan(orderings.spearman(x, np.ones(20)))


def test_mrr_with_distractors_keeps_the_gold_and_is_exact_on_the_whole_set():
    scores = np.asarray([[0.9, 0.5, 0.8, 0.1], [0.2, 0.7, 0.1, 0.3], [0.0, 0.0, 0.0, 0.0]])
    gold = [[1], [3], []]  # the third query has no evidence: left out
    out = orderings.mrr_with_distractors(scores, gold, counts=(0, 1, 10**9), draws=50)
    assert out[0] == pytest.approx(1.0)  # the gold alone
    # one distractor: query 0's gold (0.5) loses to 2 of its 3 others (expected RR 2/3 * 1/2 + 1/3),
    # query 1's (0.3) to 1 of 3 (1/3 * 1/2 + 2/3)
    assert out[1] == pytest.approx(((2 / 3 * 1 / 2 + 1 / 3) + (1 / 3 * 1 / 2 + 2 / 3)) / 2, abs=0.08)
    assert out[10**9] == pytest.approx((1 / 3 + 1 / 2) / 2)  # every passage: the table's MRR


def test_cli_prints_the_report(evaluation):
    out = subprocess.run(
        [sys.executable, str(REPO / "tools" / "orderings.py"), str(evaluation)],
        capture_output=True,
        text=True,
        check=True,
    )
    rep = json.loads(out.stdout)
    assert rep["num_queries"] == 2 and set(rep["composition"]) == {"exp2", "exp4"}


# ---------------------------------------------------------------------------------------
# --scores on a finished tiny evaluation: the rescoring gives back the table's MRR
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def evaluated(tiny_run):
    from conftest import tiny_run_config, update_compiler_config

    from trackstar_jax import config as config_lib
    from trackstar_jax import stages

    old = update_compiler_config({"jax_disable_most_optimizations": True})
    try:
        c = tiny_run_config(num_facts=20, num_distractors=20, num_steps=40, chunk_rows=32)
        c.vectors.proj_dim = 4
        c.eval.methods = ("exp1", "exp2", "exp4", "trak")
        c.eval.optional_methods = ()
        c.eval.max_new_tokens = 2
        c.tailpatch.max_queries = 6
        c.tailpatch.top_ks = (1, 10)
        workdir = tiny_run(c, evaluate=True)
        table = stages.evaluate(config_lib.from_configdict(c), workdir)  # finds its own output: the table
        yield workdir, table
    finally:
        update_compiler_config(old)


def test_rescoring_gives_back_the_tables_mrr(evaluated, tmp_path):
    workdir, table = evaluated
    rows = ("exp1", "exp2", "exp4", "trak")
    cache = tmp_path / "scores.npz"
    rep = orderings.report(workdir, scores=True, cache=cache, score_rows=rows, sizes=(5, 10**9))
    got = rep["rescored"]
    for r in table["rows"]:
        assert got[r["method"]]["mrr"] == pytest.approx(r["mrr"], abs=1e-9), r["method"]
        assert got[r["method"]]["recall_at_10"] == pytest.approx(r["recall_at_10"], abs=1e-9)
    for name, *_ in orderings.ABLATIONS:
        assert 0 <= got[name]["mrr"] <= 1
    assert -1 <= got[orderings.ONE_SIDED]["spearman_with_tailpatch"] <= 1
    for kind in ("loss_nocorr", "loss_corr"):
        assert sum(got[orderings.QUERY_VECTORS + kind]["mean_share_per_side"]) == pytest.approx(1, abs=0.01)
    assert set(rep["block_energy"]) == {"index", "index_loss_nocorr", "index_trak_nocorr"}
    # the cached matrices give the same report without the run
    assert orderings.report(workdir, scores=True, cache=cache, score_rows=rows, sizes=(5, 10**9))["rescored"] == got


# ---------------------------------------------------------------------------------------
# tools/v_estimates.py: both estimates of V against the tiny run's own Adafactor V
# ---------------------------------------------------------------------------------------

import v_estimates  # noqa: E402


def test_top_overlap_and_log_factor_corr_against_hand_computation():
    a = np.array([[5.0, 4, 3, 2, 1], [1, 2, 3, 4, 5]])
    b = np.array([[5.0, 1, 3, 2, 4], [5, 4, 3, 2, 1]])
    assert v_estimates.top_overlap(a, b, k=2) == pytest.approx((1 / 2 + 0) / 2)  # {0,1}&{0,4}; {4,3}&{0,1}
    from trackstar_jax.training import second_moment as sm

    st = sm.FactoredState(
        count=0, v_row={"w": np.array([1.0, 2.0, 4.0])}, v_col={"w": np.array([3.0, 1.0])}, v={"w": np.zeros(1)}
    )
    est = st._replace(
        v_row={"w": np.array([2.0, 4.0, 8.0])}, v_col={"w": np.array([1.0, 3.0])}
    )  # rows x2; cols swapped
    got = v_estimates.log_factor_corr(st, est)
    assert got["kernels"] == 1 and got["median_rows_cols"] == [1.0, -1.0]


@pytest.mark.slow  # 94 s on the loaded 2-core VM beyond the module's evaluated run (two estimates, two indices)
def test_v_estimates_on_the_tiny_evaluated_run(evaluated):
    workdir, _ = evaluated
    over = {
        "estimate_v_source": "candidates",  # the tiny run holds out 4 passages; its training text is the candidates
        "estimate_v_batch_sequences": 8,
        "estimate_v_steps": 3,
        "estimate_v_examples": 16,
    }
    rep = v_estimates.report(workdir, over, ["exp4"])
    assert set(rep["estimates"]) == {"per_example", "minibatch"}
    assert (
        rep["estimates"]["minibatch"]["num_sequences"] == 24 and rep["estimates"]["per_example"]["num_examples"] == 16
    )
    for m in ("per_example", "minibatch"):
        c = rep["log_factor_corr"][m]
        assert c["kernels"] > 0 and all(-1 <= x <= 1 for x in c["median_rows_cols"])
        assert 0 <= rep["top10_overlap_with_true"][m]["exp4"] <= 1
    assert len(list(workdir.glob("vcheck_minibatch_*"))) == 1  # each V its own index


# ---------------------------------------------------------------------------------------
# tools/v_2x2.py: scoring V x step V on the tiny evaluated run
# ---------------------------------------------------------------------------------------

import v_2x2  # noqa: E402


def test_sign_factor_names_the_factor_that_flips_the_sign():
    a, b = v_2x2.V_KINDS
    cells = lambda aa, ab, ba, bb: {(a, a): aa, (a, b): ab, (b, a): ba, (b, b): bb}  # noqa: E731  (scoring, step)
    assert v_2x2.sign_factor(cells(-1, 1, -1, 1)) == "step"
    assert v_2x2.sign_factor(cells(-1, -1, 1, 1)) == "scoring"
    assert v_2x2.sign_factor(cells(-1, -1, -1, -1)) == "neither"
    assert v_2x2.sign_factor(cells(-1, 1, 1, 1)) == "both"
    assert v_2x2.sign_factor({(a, a): -1, (b, a): 1}) == "scoring (partial)"  # a run stopped part way
    assert v_2x2.sign_factor({(a, a): -1, (b, a): -1, (a, b): 1}) == "step (partial)"


def test_the_2x2_variant_evaluates_and_tail_patches_the_rows_the_tool_re_measures():
    from experiments import smollm2_table1
    from trackstar_jax import config as config_lib

    s = config_lib.from_configdict(smollm2_table1.get_config("2x2"))
    assert tuple(s.eval.methods) == tuple(s.tailpatch.methods) == v_2x2.ROWS
    assert set(v_2x2.CORRECTED) < set(v_2x2.ROWS) and {a for c in v_2x2.CONTRASTS for a in c} <= set(v_2x2.ROWS)
    # the earlier Run A's V (the 2 x 2's per-example side), >= 150 tail-patched queries (issue 57)
    assert (s.vectors.estimate_v_method, s.vectors.estimate_v_source) == ("per_example", "candidates")
    assert s.tailpatch.max_queries >= 150 and s.data.max_examples < smollm2_table1.get_config().data.max_examples


def test_frozen_state_scales_only_the_named_tensor():
    from trackstar_jax.training import second_moment as sm

    st = sm.FactoredState(
        count=np.int32(3),
        v_row={"embed": np.zeros(1), "w": np.ones(4)},
        v_col={"embed": np.zeros(1), "w": np.ones(5)},
        v={"embed": np.full((6, 2), 2.0), "w": np.zeros(1)},
    )
    out = v_2x2.frozen_state((st,), ["embed"])[0]
    np.testing.assert_array_equal(out.v["embed"], 2.0 * v_2x2.FREEZE_SCALE)
    np.testing.assert_array_equal(out.v_col["w"], 1.0) and np.testing.assert_array_equal(out.v_row["w"], 1.0)
    with pytest.raises(ValueError, match="no Adafactor"):
        v_2x2.frozen_state((st,), ["nope"])


def test_markdown_prints_the_measured_cells_last_line_first_and_names_the_rest(tmp_path):
    def cell(name, e2, e4):
        d = {"mean": e4 - e2, "ci": [e4 - e2 - 1e-4, e4 - e2 + 1e-4], "n": 150}
        return {"cell": name, "tailpatch_at_10": {"exp2": e2, "exp4": e4}, "exp4 - exp2": d}

    f = tmp_path / "cells.jsonl"
    lines = [
        cell("scoring=per_example, step=per_example", 0.001, 0.0005),
        cell("scoring=per_example, step=per_example", 0.002, 0.0005),  # measured again: this line counts
        cell("scoring=per_example, step=per_example, frozen=embed", 0.001, 0.0015),
    ]
    f.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    out = v_2x2.markdown(f, ["exp2", "exp4"]).splitlines()
    assert out[0] == "| scoring V | step V | Exp. 2 | Exp. 4 | Exp. 4 − Exp. 2 |"
    assert out[2] == "| per example | per example | +0.200 | +0.050 | −0.150 [−0.160, −0.140] (n = 150) |"
    assert [r.split(" | ")[2] for r in out[3:6]] == ["not measured"] * 3
    assert out[6].startswith("| per example | per example, embed frozen | +0.100 | +0.150 | +0.050 [")
    assert len(out) == 7


def test_saved_estimate_is_read_back_only_for_its_own_settings_and_shapes(tmp_path):
    calls = []

    def estimate(scale):
        def run():
            calls.append(scale)
            return {"v": np.full((3, 2), scale, np.float32), "count": np.int32(7)}, {"b": 4, "seconds": 1.0}

        return run

    like = {"v": np.zeros((3, 2), np.float32), "count": np.int32(0)}
    stem = tmp_path / "v_minibatch"
    first, rec = v_2x2.saved_estimate(stem, {"b": 4}, like, estimate(2.0))
    again, rec2 = v_2x2.saved_estimate(stem, {"b": 4}, like, estimate(3.0))
    assert calls == [2.0] and rec2 == rec  # read back: not estimated again
    np.testing.assert_array_equal(again["v"], first["v"])
    assert int(again["count"]) == 7
    v_2x2.saved_estimate(stem, {"b": 8}, like, estimate(5.0))  # other settings: estimated again
    v_2x2.saved_estimate(stem, {"b": 8}, {"v": np.zeros((2, 3), np.float32), "count": np.int32(0)}, estimate(6.0))
    assert calls == [2.0, 5.0, 6.0]  # other shapes (another model): estimated again


@pytest.mark.slow  # 300 s on the loaded 2-core VM beyond the module's evaluated run (a V estimate, an index, 5 tail-patch passes)
def test_v_2x2_on_the_tiny_evaluated_run(evaluated):
    workdir, table = evaluated
    over = {"estimate_v_source": "candidates", "estimate_v_batch_sequences": 8, "estimate_v_steps": 2}
    rep = v_2x2.report(workdir, over, max_queries=6, freeze=["embed"], rows=("exp2", "exp4"))
    assert len(rep["cells"]) == 5 and rep["tailpatched_queries"] == 6
    base = rep["cells"]["scoring=per_example, step=per_example"]["tailpatch_at_10"]
    for r in table["rows"]:  # the evaluation's own V and lists: its own tail-patch values
        if r["method"] in base:
            assert base[r["method"]] == pytest.approx(r["tailpatch_at_10"], rel=1e-9, abs=1e-12)
    frozen = rep["cells"]["scoring=per_example, step=per_example, frozen=embed"]["tailpatch_at_10"]
    assert frozen != base  # the embedding's update mattered
    assert rep["sign"]["exp4 - exp2"]["sign_set_by"] in ("scoring", "step", "both", "neither")


# ---------------------------------------------------------------------------------------
# tools/figure2.py: the row's metrics against the projection dimension d
# ---------------------------------------------------------------------------------------

import figure2  # noqa: E402


def test_proj_dim_for_inverts_the_layout_and_refuses_another_d():
    assert [figure2.proj_dim_for(d, 8) for d in (1024, 4096, 16384)] == [8, 16, 32]
    assert figure2.proj_dim_for(144, 2) == 6
    with pytest.raises(ValueError, match=r"nearest: \[4624, 5184\]"):
        figure2.proj_dim_for(5000, 8)


def test_figure2_markdown_takes_each_points_last_line(tmp_path):
    f = tmp_path / figure2.POINTS_FILE
    pt = {"row": "trackstar", "mrr": 0.5, "mrr_ci": [0.4, 0.6], "recall_at_10": 0.7, "recall_at_10_ci": [0.6, 0.8]}
    lines = [
        {**pt, "d": 4096, "tailpatch_at_10": 0.001, "tailpatch_at_10_ci": [0.0005, 0.0015]},
        {**pt, "d": 1024, "tailpatch_at_10": 0.002, "tailpatch_at_10_ci": [0.001, 0.003]},
        {**pt, "d": 4096, "mrr": 0.25, "tailpatch_at_10": 0.001, "tailpatch_at_10_ci": [0.0005, 0.0015],
         "info": {"whitening": {"mix_lambda": 0.885}}, "retrieve_seconds": 12.3, "tailpatch_seconds": 40},
        {**pt, "d": 4096, "reference": True, "row": "trackstar_rerank", "tailpatch_at_10": None},
    ]  # fmt: skip
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    pts = figure2.read_points(f)
    assert [(p["d"], bool(p.get("reference"))) for p in pts] == [(1024, False), (4096, False), (4096, True)]
    out = figure2.markdown(pts).splitlines()
    assert out[2].startswith("| trackstar | 1,024 | 0.500 [0.400, 0.600] | 0.700 [0.600, 0.800] | 0.200 [0.100, 0.300]")
    assert "| 0.250 [0.400, 0.600] |" in out[3] and "| 0.885 | 12 + 40 |" in out[3]  # the last line of d = 4096
    assert out[4].startswith("| trackstar_rerank | exact rerank (d → ∞) |") and "| – |" in out[4]


@pytest.mark.slow  # ~3 min on the idle 2-core VM beyond the module's evaluated run (two indices, their tail-patch pairs)
def test_figure2_on_the_tiny_evaluated_run(evaluated):
    """Two new d (k = 2 and 6 beside the run's 4) in one featurize pass; the run's own d gives back
    the table's MRR, recall@10 and tail-patch@10; every point is a real measurement."""
    workdir, table = evaluated
    nb = table["settings"]["vectors"]["num_blocks"]
    small, own, big = (2 * nb * k * k for k in (2, 4, 6))
    rep = figure2.report(workdir, [big, own, small], max_queries=6, row="exp4")
    pts = {p["d"]: p for p in rep["points"]}
    assert sorted(pts) == [small, own, big] and rep["evaluation_d"] == own and rep["tailpatched_queries"] == 6
    row = next(r for r in table["rows"] if r["method"] == "exp4")
    for m in figure2.METRICS:
        assert pts[own][m] == pytest.approx(row[m], rel=1e-9, abs=1e-12), m
    built = rep["new_indices"]  # the pass wrote both new indices, every row
    assert pathlib.Path(built["index"]).name == f"index_d{big}" and built["dim"] == big and built["complete"]
    assert [pathlib.Path(x).name for x in built["shared_pass"]] == [f"index_d{small}"]
    for d in (small, big):
        assert 0 <= pts[d]["mrr"] <= 1 and np.isfinite(pts[d]["tailpatch_at_10"])
        summary = json.loads((workdir / f"index_d{d}" / "build_summary-p0000.json").read_text())
        assert summary["dim"] == d and summary["complete"] and summary["rows"] == built["rows_written"]
        assert pts[d]["info"]["index"].endswith(f"index_d{d}")
    assert len(figure2.read_points(workdir / "eval" / figure2.POINTS_FILE)) == 3
    assert (workdir / "eval" / "figure2.png").stat().st_size > 0
