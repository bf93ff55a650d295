"""The row-kind registry (`evaluation.rows`): a kind is one `register` call, and the evaluation's
rows, LDS's score matrix and the explorer all reach it through the one `Retriever` interface.

A toy kind defined here ("reverse_id": passage i scores -((i - L) mod N) for a query whose
prompt + target has L characters, so its ranking is known in closed form) is registered once
and checked by number on each of the three paths.
"""

import dataclasses
import re

import numpy as np
import pytest
from conftest import tiny_run_config

from trackstar_jax import config as config_lib
from trackstar_jax import methods as methods_lib
from trackstar_jax import stages
from trackstar_jax.distributed import sharding
from trackstar_jax.evaluation import baselines, lds, query_set, rows
from trackstar_jax.index import open_index, trak

pytestmark = pytest.mark.usefixtures("fast_compile")


class ReverseId(rows.Retriever):
    """Scores only; `retrieve` is the interface's default (top of `scores`, ties by lower id)."""

    def __init__(self, method, ctx):
        self.n = len(ctx.run.corpus.texts)

    def scores(self, qs):
        lengths = np.asarray([len(q.prompt + q.target) for q in qs.text_queries()])
        return -((np.arange(self.n)[None, :] - lengths[:, None]) % self.n).astype(np.float32)


TOY = methods_lib.Method("toy", "reverse_id", "Reverse id (toy)")


def _expected_top(text: str, n: int, k: int) -> tuple[list[int], list[float]]:
    return [(len(text) + t) % n for t in range(k)], [-float(t) for t in range(k)]


@pytest.fixture
def registered(monkeypatch):
    """The toy kind registered (one call) and its row offered, on copies of the registries."""
    monkeypatch.setattr(rows, "ROW_KINDS", dict(rows.ROW_KINDS))
    monkeypatch.setitem(methods_lib.METHODS, TOY.name, TOY)
    rows.register(rows.RowKind("reverse_id", ReverseId))


@pytest.fixture(scope="module")
def ctx_eq(tiny_run):
    config = tiny_run_config(num_facts=12, num_distractors=12, num_steps=3, chunk_rows=32, **{"eval.max_new_tokens": 2})
    settings, workdir = config_lib.from_configdict(config), tiny_run(config)
    mesh = sharding.make_mesh(settings.mesh.shape)
    run = stages.load_run(workdir, mesh=mesh, runtime=settings)
    ctx = rows.Context(settings, workdir, run, mesh)
    return settings, ctx, query_set.make_eval_queries(run, settings)


def test_unknown_kind_is_refused_listing_the_registered_ones(registered, ctx_eq):
    _, ctx, _ = ctx_eq
    with pytest.raises(ValueError, match=r"row kind 'nope' is not registered \(known: gradient, bm25, dense, gold, "):
        rows.make_retrievers([dataclasses.replace(TOY, kind="nope")], ctx)
    with pytest.raises(ValueError, match="'reverse_id' is already registered"):
        rows.register(rows.RowKind("reverse_id", lambda m, c: ReverseId(m, c)))
    rows.register(rows.row_kind("reverse_id"))  # the same registration again (a re-import) is a no-op


def test_a_registered_kind_runs_in_the_evaluation_and_lds(registered, ctx_eq):
    _, ctx, eq = ctx_eq
    n = len(ctx.run.corpus.texts)
    got = rows.make_retrievers([TOY], ctx)["toy"].retrieve(eq, 4)  # what `evaluation.evaluate` calls per row
    for q, ids, scores in zip(eq.queries, got.proponent_ids, got.proponent_scores):
        assert (ids, scores) == _expected_top(q.prompt + q.target, n, 4)
    assert got.opponent_ids is None

    scores = lds.method_scores(ctx, TOY, eq)  # what `lds.validate` scores per row
    want = np.asarray([[-((i - len(q.prompt + q.target)) % n) for i in range(n)] for q in eq.queries], np.float32)
    np.testing.assert_array_equal(scores, want)
    masks = np.stack([lds.draw_subset(n, 0.5, 0, j) for j in range(5)])
    res = lds.lds(scores, masks, -lds.subset_sums(want, masks))  # losses the toy predicts exactly
    assert res.mean == 1.0 and res.num_queries == len(eq.queries)


def test_the_memory_check_asks_each_rows_kind(registered, ctx_eq, monkeypatch):
    """`evaluation.stage.check_fits` names no kind: a registered kind's `check_fits` is called with
    its row, the gradient kind checks its featurize step and read chunk, and the tail-patch step
    is checked once."""
    from trackstar_jax.evaluation import stage

    _, ctx, _ = ctx_eq
    seen = []
    monkeypatch.setitem(
        rows.ROW_KINDS,
        "reverse_id",
        dataclasses.replace(rows.row_kind("reverse_id"), check_fits=lambda m, c: seen.append((m, c)) or {"toy": 1}),
    )
    out = stage.check_fits(ctx, [TOY, methods_lib.METHODS["bm25"], methods_lib.METHODS["trackstar"]])
    assert seen == [(TOY, ctx)]
    assert sorted(out) == ["featurize:trackstar", "retrieve:trackstar", "tailpatch", "toy"]


def test_the_evaluation_checks_memory_only_against_a_known_limit(ctx_eq, monkeypatch, tmp_path):
    """`stage.prepare` runs `check_fits` where a device memory limit is known (a GPU / TPU, or
    `TRACKSTAR_JAX_DEVICE_MEMORY_BYTES`) and skips it on a CPU without one: there it could refuse
    nothing, and its compiles are not the programs the stage runs."""
    from trackstar_jax.distributed import memory
    from trackstar_jax.evaluation import stage

    _, ctx, _ = ctx_eq
    ctx = dataclasses.replace(ctx, workdir=tmp_path)  # its eval folder goes there
    calls = []
    monkeypatch.setattr(stage, "check_fits", lambda c, m: calls.append(m) or {})
    monkeypatch.delenv(memory.MEMORY_ENV, raising=False)
    assert memory.device_memory_limit() is None  # the CPU reports no bytes_limit
    out = stage.prepare(ctx, [methods_lib.METHODS["trackstar"]])
    assert calls == [] and (out / stage.STARTED_FILE).is_file()
    monkeypatch.setenv(memory.MEMORY_ENV, str(1 << 40))
    stage.prepare(ctx, [methods_lib.METHODS["trackstar"]])
    assert calls == [[methods_lib.METHODS["trackstar"]]]


def test_the_tailpatch_bar_shows_before_the_first_batch_returns_and_moves_per_batch(ctx_eq, monkeypatch, capsys):
    """The tail-patch bar is drawn (saying the step compiles) before the first batch of proponent
    steps returns, and advances after every batch, not once per cache slice of 8 batches."""
    from trackstar_jax.evaluation import stage, tailpatch
    from trackstar_jax.training import logs

    settings, ctx, eq = ctx_eq
    settings = settings.replace({"tailpatch.top_ks": (3,), "tailpatch.batch_size": 8, "tailpatch.queries_per_step": 1})
    retrieved = {"bm25": rows.make_retriever(methods_lib.METHODS["bm25"], ctx).retrieve(eq, 3)}
    pairs = {(q, p) for q in range(len(eq.queries)) for p in retrieved["bm25"].proponent_ids[q][:3]}
    bs = tailpatch.pair_batch_size(8, ctx.mesh)
    num_props = len({p for _, p in pairs})
    assert bs < num_props <= 8 * bs  # several batches, all in the first cache slice
    monkeypatch.setattr(logs, "MIN_INTERVAL_S", 0.0)  # draw every update
    real = tailpatch.run_pairs
    seen = []

    def spy(*args, **kwargs):
        seen.append(capsys.readouterr().err)  # what was drawn before the first batch ran
        return real(*args, **kwargs)

    monkeypatch.setattr(tailpatch, "run_pairs", spy)
    out = stage.tailpatch_all(ctx.run, eq, retrieved, settings, ctx.mesh)
    assert len(out) == len(pairs)
    assert f"tail-patch:   0%|          | 0/{len(pairs)}" in seen[0] and "compiling the step" in seen[0]
    drawn = [int(x.split("/")[0]) for x in re.findall(r"\| (\d+/\d+) \[", capsys.readouterr().err)]
    assert 0 < drawn[0] < len(pairs) and drawn[-1] == len(pairs)  # a partial count: per batch


def test_built_in_kinds_give_their_scores_through_the_interface(ctx_eq):
    """Gold: 1 on the fact's evidence; BM25: its top-k is the top of its own score matrix."""
    _, ctx, eq = ctx_eq
    gold = lds.method_scores(ctx, methods_lib.METHODS["trex_gold"], eq)
    for q, row in zip(eq.queries, gold):
        assert sorted(np.flatnonzero(row)) == sorted(q.entailing_ids)
    bm25 = rows.make_retriever(methods_lib.METHODS["bm25"], ctx)
    s, top = bm25.scores(eq), bm25.retrieve(eq, 3)
    assert ctx.shared("bm25", lambda: None) is bm25.index  # built once per context
    for row, ids, sc in zip(s, top.proponent_ids, top.proponent_scores):
        assert ids == baselines.stable_topk(row, 3).tolist()
        np.testing.assert_allclose(sc, row[ids], rtol=1e-6)


def test_a_registered_kind_is_served_by_the_explorer(registered, ctx_eq):
    pytest.importorskip("starlette", reason="the serve extra is not installed")
    from trackstar_jax.serving import engine as engine_lib

    settings, ctx, _ = ctx_eq
    engine = stages.open_engine(settings, ctx.workdir, dense=False)  # no index: gradient rows skipped
    assert engine.methods == ["bm25", "toy"]  # by kind, in registration order
    assert "no index" in engine.skipped["exp1"] and "typed query has no fact" in engine.skipped["trex_gold"]
    (toy,) = [m for m in engine.describe()["methods"] if m["name"] == "toy"]
    assert toy == {"name": "toy", "kind": "reverse_id", "label": "Reverse id (toy)"}
    prompt, target = "Alice was born in", " Paris"
    got = engine.query(prompt, target, k=5, method="toy")
    ids, scores = _expected_top(prompt + target, len(ctx.run.corpus.texts), 5)
    assert [p["example_id"] for p in got["proponents"]] == ids and [p["score"] for p in got["proponents"]] == scores
    assert [p["text"] for p in got["proponents"]] == [ctx.run.corpus.texts[i] for i in ids]
    assert got["opponents"] == [] and got["record"]["proponent_ids"] == ids
    with pytest.raises(engine_lib.QueryError, match="only gradient rows"):
        engine.query(prompt, target, k=5, method="toy", token_scores=True)


def test_rows_on_one_index_featurize_the_queries_once(ctx_eq, monkeypatch):
    """TrackStar at two λ share the index: the second row reuses the first one's raw query and
    R_eval vectors (`retrieve_queries(memo=ctx.shared)`) and retrieves what it would alone."""
    from trackstar_jax.retrieval import stage as retrieval_stage  # noqa: PLC0415

    settings, ctx, eq = ctx_eq
    calls = []
    real = retrieval_stage.query_vectors
    monkeypatch.setattr(retrieval_stage, "query_vectors", lambda *a: calls.append(len(a[2])) or real(*a))
    shared = rows.Context(settings, ctx.workdir, ctx.run, ctx.mesh)
    a, b = (methods_lib.METHODS[n] for n in ("trackstar", "trackstar_l050"))
    first = rows.make_retriever(a, shared).retrieve(eq, 5)
    n_first = len(calls)
    assert n_first in (1, 2)  # the queries, and R_eval's prompts unless they are the queries
    second = rows.make_retriever(b, shared).retrieve(eq, 5)
    assert len(calls) == n_first  # nothing featurized again
    alone = rows.make_retriever(b, rows.Context(settings, ctx.workdir, ctx.run, ctx.mesh)).retrieve(eq, 5)
    assert len(calls) == 2 * n_first
    assert second.proponent_ids == alone.proponent_ids
    np.testing.assert_array_equal(second.proponent_scores, alone.proponent_scores)
    assert first.info["whitening"] != second.info["whitening"]  # other λ: another R


def test_a_rows_index_is_written_with_the_indices_that_share_its_pass(ctx_eq):
    """`make_retrievers` tells `build_index` the table's gradient rows: retrieving Exp. 1 writes
    Exp. 4's index (correction on) and TRAK's (another output function: its backward runs
    beside the loss's after the one forward, and TRAK's Q = 1 - p̄ comes from that forward)
    beside its own, in one pass, but not one that is already finished."""
    import json  # noqa: PLC0415

    settings, ctx, eq = ctx_eq
    settings = settings.replace({"index.dir": "pass"})
    shared = rows.Context(settings, ctx.workdir, ctx.run, ctx.mesh)
    table = [methods_lib.METHODS[n] for n in ("exp1", "exp2", "exp4", "trak")]
    dirs = {m.name: rows.method_settings(settings, m).index.dir for m in table}
    assert len({dirs["exp1"], dirs["exp4"], dirs["trak"]}) == 3 and dirs["exp1"] == dirs["exp2"]
    retrievers = rows.make_retrievers(table, shared)
    retrievers["exp1"].retrieve(eq, 5)
    summary = json.loads((ctx.workdir / dirs["exp4"] / "build_summary-p0000.json").read_text())
    assert (ctx.workdir / dirs["exp4"] / "COMPLETE").exists() and (ctx.workdir / dirs["trak"] / "COMPLETE").exists()
    assert sorted(summary["shared_pass"]) == sorted(str(ctx.workdir / dirs[n]) for n in ("exp1", "trak"))
    assert summary["rows_written"] == summary["rows"]
    trak_index = open_index(ctx.workdir / dirs["trak"])
    q_path = trak.q_file(trak_index.path, trak_index.manifest)
    assert q_path.exists()  # Q from the shared pass's forward: equal to its own forward pass's
    q_pass = np.load(q_path)
    q_path.unlink()
    np.testing.assert_allclose(trak.candidate_q(ctx.run, trak_index), q_pass, rtol=1e-5, atol=1e-6)
    retrievers["exp4"].retrieve(eq, 5)
    reused = json.loads((ctx.workdir / dirs["exp4"] / "build_summary-p0000.json").read_text())
    assert reused == summary  # finished: reused as written, its file still the building pass's


def test_every_table_row_has_a_registered_kind():
    assert {m.kind for m in methods_lib.METHODS.values()} <= set(rows.ROW_KINDS)
    assert [k for k, v in rows.ROW_KINDS.items() if v.gold_attribution] == ["gold"]
