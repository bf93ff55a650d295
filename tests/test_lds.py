"""The linear datamodeling score (evaluation.lds / evaluation.retrain, launch.validate).

The math (ranks, Spearman, subset sums, constant queries) is checked against scipy / numpy
on hand-made data. The planted case is a tiny embedded corpus in which each fact is stated by
exactly ONE passage (phrasings_per_fact=1): an oracle attribution (the `trex_gold` row: score
1 on that passage, 0 elsewhere) must get a clearly positive LDS, random attributions ~0.
"""

import json

import jax
import numpy as np
import pytest
import scipy.stats

from trackstar_jax import config as config_lib
from trackstar_jax import stages
from trackstar_jax.distributed import sharding
from trackstar_jax.evaluation import lds, retrain

pytestmark = pytest.mark.usefixtures("fast_compile")

M = 6  # subsets retrained in the planted run


# ---------------------------------------------------------------------------------------
# Math against scipy / numpy
# ---------------------------------------------------------------------------------------


def test_rankdata_and_spearman_match_scipy_with_ties():
    rng = np.random.default_rng(0)
    for trial in range(20):
        n = int(rng.integers(3, 30))
        x = rng.integers(0, 5, n).astype(float)  # many ties
        y = rng.normal(size=n) if trial % 2 else rng.integers(0, 3, n).astype(float)
        np.testing.assert_allclose(lds.rankdata(x), scipy.stats.rankdata(x, method="average"))
        want = scipy.stats.spearmanr(x, y).statistic
        got = lds.spearman(x, y)
        if np.isnan(want):
            assert got is None
        else:
            assert got == pytest.approx(want, abs=1e-12)
    assert lds.spearman(np.ones(5), np.arange(5.0)) is None  # constant side: undefined, not NaN
    assert lds.spearman(np.arange(5.0), -np.arange(5.0)) == pytest.approx(-1.0)


def test_subset_sums_match_a_loop():
    rng = np.random.default_rng(1)
    scores, masks = rng.normal(size=(4, 9)), rng.random((5, 9)) < 0.5
    want = np.array([[scores[q, masks[j]].sum() for q in range(4)] for j in range(5)])
    np.testing.assert_allclose(lds.subset_sums(scores, masks), want)


def test_lds_sign_convention_and_constant_loss_query():
    masks = np.array([[1, 0, 1, 0], [0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 0, 1]], bool)
    scores = np.array([[1.0, 0, 0, 0], [0, 0, 0, 1.0], [0.5, 0.1, 0, 0]])  # [Q=3, N=4]
    # Query 0's loss drops when example 0 is present (a proponent); query 1's loss is constant;
    # query 2's loss rises with example 0 (scores say it helps: a wrong prediction).
    losses = np.stack([2.0 - masks[:, 0], np.full(5, 1.5), 1.0 + masks[:, 0] + 0.01 * masks[:, 1]], axis=1)
    res = lds.lds(scores, masks, losses)
    assert res.per_query[0] == pytest.approx(1.0)
    assert res.per_query[1] is None and res.num_constant_loss == 1
    assert res.per_query[2] == pytest.approx(
        scipy.stats.spearmanr(lds.subset_sums(scores, masks)[:, 2], -losses[:, 2]).statistic
    )
    assert res.num_queries == 2 and res.mean == pytest.approx((res.per_query[0] + res.per_query[2]) / 2)
    assert all(v is not None and np.isfinite(v) for v in [res.mean, *res.ci])
    json.dumps(res.to_dict(), allow_nan=False)  # no NaN anywhere in the output
    zero = lds.lds(np.zeros((3, 4)), masks, losses)  # a method that predicts nothing: counted, not NaN
    assert zero.mean is None and zero.num_constant_prediction == 2 and zero.num_queries == 0
    with pytest.raises(ValueError, match="disagree"):
        lds.lds(scores, masks, losses.T)


def test_lds_by_m_is_the_lds_of_the_first_m_subsets():
    rng = np.random.default_rng(2)
    scores, masks = rng.normal(size=(5, 12)), rng.random((30, 12)) < 0.5
    losses = -(masks.astype(float) @ scores.T) + rng.normal(size=(30, 5))  # noisy linear datamodel
    by = lds.lds_by_m(scores, masks, losses, [10, 30], seed=3)
    assert [b["m"] for b in by] == [10, 30]
    for b in by:
        want = lds.lds(scores, masks[: b["m"]], losses[: b["m"]], seed=3)
        assert b["lds"] == want.mean and b["lds_ci"] == list(want.ci) and b["num_queries"] == 5
    assert by[1]["lds"] > 0.3  # the losses follow the scores
    with pytest.raises(ValueError, match="subset count 31 must be in"):
        lds.lds_by_m(scores, masks, losses, [31])


def test_paired_difference_to_trackstar_over_queries():
    """Each row's LDS minus TrackStar's, query by query (both defined), bootstrapped on the same
    resamples: a loop reference over the resampled indices, and a shared per-query effect that
    two separate intervals cannot resolve."""
    rng = np.random.default_rng(3)
    base = rng.uniform(-0.5, 0.5, 40)
    ts = list(base)
    other = list(base - 0.02 + 0.005 * rng.standard_normal(40))
    ts[3], other[7] = None, None  # undefined correlations: those queries leave the pair
    rows = [
        {"method": "trackstar", "per_query": ts},
        {"method": "bm25", "per_query": other},
    ]
    lds.paired_to_reference(rows, seed=5)
    assert "vs_trackstar" not in rows[0]
    p = rows[1]["vs_trackstar"]
    keep = [i for i in range(40) if i not in (3, 7)]
    a = np.asarray([other[i] for i in keep])
    b = np.asarray([ts[i] for i in keep])
    idx = np.random.default_rng(5).integers(0, len(a), size=(1000, len(a)))
    diffs = sorted(float(np.mean([a[j] - b[j] for j in row])) for row in idx)
    assert p["n"] == 38 and p["diff"] == pytest.approx(float(np.mean(a - b)))
    assert p["diff_ci"][1] < 0  # every query is ~0.02 lower: the paired interval excludes 0
    assert p["diff_ci"][0] == pytest.approx(np.quantile(diffs, 0.025), abs=1e-9)
    sep_a, sep_b = lds.metrics_lib.mean_ci(list(a), seed=5), lds.metrics_lib.mean_ci(list(b), seed=5)
    assert sep_a.hi > sep_b.lo  # separately the rows' intervals overlap


def test_draw_subset_is_a_function_of_seed_and_index():
    a = lds.draw_subset(101, 0.5, 3, 7)
    assert a.dtype == bool and a.sum() == 50
    np.testing.assert_array_equal(a, lds.draw_subset(101, 0.5, 3, 7))
    assert not np.array_equal(a, lds.draw_subset(101, 0.5, 3, 8))
    assert not np.array_equal(a, lds.draw_subset(101, 0.5, 4, 7))
    with pytest.raises(ValueError, match="empty or full"):
        lds.draw_subset(3, 0.1, 0, 0)


def test_validate_settings_are_checked(tiny_config):
    tiny_config.validate.fraction = 1.0
    with pytest.raises(config_lib.ConfigError, match="validate.fraction"):
        config_lib.from_configdict(tiny_config)
    tiny_config.validate.fraction = 0.5
    tiny_config.validate.methods = ("nope",)
    with pytest.raises(config_lib.ConfigError, match="validate.methods"):
        config_lib.from_configdict(tiny_config)


# ---------------------------------------------------------------------------------------
# The planted run: retraining, caching, refusals
# ---------------------------------------------------------------------------------------


def _planted_settings(tiny_config, **validate):
    return config_lib.from_configdict(_planted_config(tiny_config, **validate), source="tests/test_lds.py")


def _planted_config(tiny_config, **validate):
    c = tiny_config
    c.model.num_layers = 1
    c.data.embedded.num_facts = 20
    c.data.embedded.phrasings_per_fact = 1  # each fact stated by one passage alone
    c.data.embedded.num_distractors = 20
    c.train.num_steps = 50  # the run Exp. 1's row attributes with (only the subsets' losses enter the LDS)
    c.train.warmup_steps = 10
    c.train.log_every_steps = 50
    c.train.eval_every_steps = 1000
    c.train.checkpoint_every_steps = 1000
    c.train.num_completions = 0
    c.vectors.num_blocks = 1
    c.validate.num_subsets = M
    c.validate.num_steps = 30  # the retrained models: ~48 epochs of their 20 passages still memorise them
    c.validate.methods = ("trex_gold", "bm25", "exp1")
    c.validate.parallel_subsets = 1  # the side-by-side path compiles for minutes: tested in the slow test below
    for k, v in validate.items():
        setattr(c.validate, k, v)
    return c


@pytest.fixture(scope="module")
def planted(tiny_run):
    from experiments import tiny

    settings = _planted_settings(tiny.get_config())
    workdir = tiny_run(_planted_config(tiny.get_config()))
    first = stages.validate(settings, workdir, subset_counts=(3, M))
    return settings, workdir, first


def test_retrains_every_subset_and_writes_the_table(planted):
    _, workdir, first = planted
    assert first["trained"] == list(range(M)) and first["reused"] == [] and first["pending"] == 0
    for i in range(M):
        mask, losses = retrain.read_subset(workdir, i)
        np.testing.assert_array_equal(mask, lds.draw_subset(len(mask), 0.5, 0, i))
        assert losses.shape == (20,) and np.isfinite(losses).all()
    doc = json.loads((workdir / "eval" / "lds.json").read_text())
    assert [r["method"] for r in doc["rows"]] == ["trex_gold", "bm25", "exp1"]
    assert doc["num_subsets"] == M and doc["fraction"] == 0.5
    md = (workdir / "eval" / "lds.md").read_text()
    assert "| T-REx gold |" in md and f"| {M} | 0.5 |" in md
    assert f"| Method | M=3 | M={M} |" in md
    for row in first["rows"]:  # the last count is all subsets: the main figure again
        assert [b["m"] for b in row["by_m"]] == [3, M]
        assert row["by_m"][-1]["lds"] == row["lds"] and row["by_m"][-1]["lds_ci"] == row["lds_ci"]


def test_oracle_attribution_beats_random(planted):
    _, workdir, first = planted
    oracle = next(r for r in first["rows"] if r["method"] == "trex_gold")
    masks = np.stack([retrain.read_subset(workdir, i)[0] for i in range(M)])
    losses = np.stack([retrain.read_subset(workdir, i)[1] for i in range(M)])
    rng = np.random.default_rng(0)
    random = [lds.lds(rng.normal(size=(losses.shape[1], masks.shape[1])), masks, losses).mean for _ in range(20)]
    # Random: per-query spearman over M=6 subsets has sd ~0.45; the mean over 20 queries and
    # 20 draws is ~0 +- 0.03. The oracle is far above it (measured 0.80, random 0.003).
    assert abs(np.mean(random)) < 0.1
    assert oracle["lds"] > 0.3 and oracle["lds"] > np.mean(random) + 0.25
    assert oracle["num_constant_loss"] == 0


def test_rerun_reuses_subsets_and_gives_the_same_lds(planted):
    settings, workdir, first = planted
    again = stages.validate(settings, workdir)
    assert again["trained"] == [] and again["reused"] == list(range(M))
    assert again["rows"] == [{k: v for k, v in r.items() if k != "by_m"} for r in first["rows"]]
    half = stages.validate(settings, workdir, process_index=1, process_count=2)  # one process's share
    assert half["reused"] == [1, 3, 5] and half["trained"] == []


def test_a_different_config_is_refused_naming_the_field(planted, tiny_config):
    _, workdir, _ = planted
    with pytest.raises(config_lib.ConfigError, match="validate.fraction: saved 0.5, now 0.4"):
        stages.validate(_planted_settings(tiny_config, fraction=0.4), workdir)
    with pytest.raises(config_lib.ConfigError, match="validate.num_steps"):
        stages.validate(_planted_settings(tiny_config, num_steps=40), workdir)
    for i in range(M):
        assert retrain.is_done(workdir, i)  # nothing was touched


def test_a_different_corpus_or_query_set_is_refused_naming_the_field(planted, tiny_config):
    _, workdir, _ = planted
    settings = _planted_settings(tiny_config)
    other = settings.replace({"data.embedded.num_distractors": 21})
    with pytest.raises(config_lib.ConfigError, match="num_distractors"):
        stages.validate(other, workdir)
    with pytest.raises(config_lib.ConfigError, match="num_queries: saved 20, now 10"):
        stages.validate(settings.replace({"validate.num_queries": 10}), workdir)


def test_retraining_is_deterministic(planted, tiny_config):
    """Same seed -> same subsets, the same retrained losses bit for bit, the same LDS (K side by side
    vs one at a time: `test_side_by_side_retraining_equals_one_at_a_time`, slow)."""
    settings, workdir, first = planted
    saved = retrain.read_subset(workdir, 5)[1]
    for f in retrain.subset_dir(workdir, 5).iterdir():
        f.unlink()
    again = stages.validate(_planted_settings(tiny_config, parallel_subsets=1), workdir)  # K is not in the manifest
    assert again["trained"] == [5] and again["reused"] == [0, 1, 2, 3, 4]
    np.testing.assert_array_equal(retrain.read_subset(workdir, 5)[1], saved)
    for a, b in zip(again["rows"], first["rows"]):
        assert a["method"] == b["method"] and a["lds"] == pytest.approx(b["lds"], abs=1e-6)
        assert a["num_queries"] == b["num_queries"]


@pytest.mark.slow  # compiling the vmapped, scanned step takes minutes on 8 fake CPU devices
def test_side_by_side_retraining_equals_one_at_a_time(planted):
    """`retrain_subsets` (vmap over K models) against `retrain_subset` (the training loop), per model."""
    settings, workdir, _ = planted
    mesh = sharding.make_mesh(settings.mesh.shape)
    run = stages.load_run(workdir, mesh=mesh)
    masks = np.stack([lds.draw_subset(len(run.corpus.examples), 0.5, 9, i) for i in range(3)])
    steps = retrain.SCAN_STEPS + 7  # a full scan chunk and a partial one
    graphdef, stacked = retrain.retrain_subsets(settings, run.corpus, run.tokenizer, masks, steps, mesh)
    for j, m in enumerate(masks):
        _, want = retrain.retrain_subset(settings, run.corpus, run.tokenizer, m, steps, mesh)
        for got_leaf, want_leaf in zip(jax.tree.leaves(stacked), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(got_leaf[j]), np.asarray(want_leaf), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_trex_lds_config_validates_the_trex_run_in_place(variant):
    from experiments import trex_lds, trex_table1

    got = config_lib.from_configdict(trex_lds.get_config(variant), source="experiments/trex_lds.py")
    run = config_lib.from_configdict(trex_table1.get_config(variant), source="experiments/trex_table1.py")
    for sec in ("seed", "model", "data", "train", "vectors", "hessian", "eval"):  # the run and its table
        assert getattr(got, sec) == getattr(run, sec), sec
    v = got.validate
    assert v.num_subsets >= 50 and v.fraction == 0.5 and v.num_steps == 0  # TRAK's M, alpha; full schedule
    assert 0 < v.num_queries <= run.eval.max_queries  # a subset of the table's queries
    assert v.num_subsets % v.parallel_subsets == 0  # no short last group
    assert set(v.methods) == set(trex_table1.ALL_METHODS)
    assert v.parallel_subsets == (10 if variant == "gpu" else 5)  # the GPU retrains more side by side
