"""Token attribution (`retrieval.attribution`) and two-stage retrieval (`retrieval.rerank`), issue 39.

Token scores: each side's contributions sum to the retrieval's own score for every gradient
row of the table (1 and 8 devices), and the per-token vectors equal an independent reference
(per-token loss gradients by vmap(grad), corrected and projected densely) on a tiny model.
Reranking: the exact scorer equals a float64 reference over materialised gradients, and
reranking every row reproduces the exact ranking.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import covering, skip_if_not_enough_devices, tiny_run_config, update_compiler_config

from trackstar_jax import config as config_lib
from trackstar_jax import methods as methods_lib
from trackstar_jax import stages
from trackstar_jax.distributed import sharding
from trackstar_jax.features import grads as grads_lib
from trackstar_jax.features import preconditioner as precond_lib
from trackstar_jax.features import projection as proj_lib
from trackstar_jax.features import vectors as vectors_lib
from trackstar_jax.index import hessian
from trackstar_jax.models import lm as model_lib
from trackstar_jax.retrieval import attribution, rerank
from trackstar_jax.retrieval import stage as retrieval_stage

pytestmark = pytest.mark.usefixtures("fast_compile")  # conftest.py: cheaper compiles, restored on exit

GRADIENT_ROWS = [n for n, m in methods_lib.METHODS.items() if m.kind == "gradient" and not m.rerank_k]
# The fixed-λ TrackStar rows differ from "trackstar" only in λ, which `_settings` fixes for all
# of them (two queries are too few for the automatic λ): the same test, so run once.
DISTINCT_ROWS = [n for n in GRADIENT_ROWS if n == "trackstar" or not n.startswith("trackstar")]
QUERIES = [
    retrieval_stage.TextQuery("a", "The capital of", " France is Paris"),
    retrieval_stage.TextQuery("b", "It", " was"),
]


@pytest.fixture(scope="module")
def run_dir(tiny_run):
    old = update_compiler_config({"jax_disable_most_optimizations": True})  # compile time dominates here
    try:
        c = tiny_run_config(num_facts=6, num_distractors=6, num_steps=2, chunk_rows=16)
        c.vectors.batch_size = 16
        # float32 rows and a well-conditioned R: 24 rows give R_train rank < d = 256, and with the
        # default floor (1e-6) R^{-1/2} amplifies float32 round-off of a row ~1000x in its score
        c.index.dtype = "float32"
        c.hessian.damping = 1e-2
        yield c, tiny_run(c)
    finally:
        update_compiler_config(old)


def _settings(c, name, **retrieval):
    s = config_lib.from_configdict(c)
    s = s.replace(methods_lib.METHODS[name].overrides(s.index.dir))
    if name.startswith("trackstar"):  # two queries are too few for the automatic λ
        s = s.replace({"hessian.mix_lambda": 0.5})
    return s.replace({f"retrieval.{k}": v for k, v in retrieval.items()})


# every row on 1 and 8 devices; CI runs a covering (each row, each device count), `-m slow` the rest
@pytest.mark.parametrize("name, num_devices", covering(DISTINCT_ROWS, [1, 8], strength=1))
def test_token_scores_sum_to_the_retrieval_score(run_dir, name, num_devices):
    skip_if_not_enough_devices(num_devices)
    c, workdir = run_dir
    settings = _settings(c, name, token_scores=True)
    mesh = sharding.make_mesh(devices=jax.devices()[:num_devices])
    stages.build_index(settings, workdir)
    run = stages.load_run(workdir, mesh=mesh)
    recs, info = retrieval_stage.retrieve_queries(run, settings, workdir, QUERIES, mesh=mesh, k=3)
    assert info["token_scores_seconds"] >= 0
    for r in recs:
        scores = np.asarray(r["proponent_scores"])
        assert len(r["proponent_token_scores"]) == len(r["target_token_scores"]) == 3
        props = np.asarray([sum(p["scores"]) for p in r["proponent_token_scores"]])
        targets = np.asarray([sum(t) for t in r["target_token_scores"]])
        tol = 1e-4 * np.abs(scores).max()
        np.testing.assert_allclose(props, scores, rtol=1e-4, atol=tol)
        np.testing.assert_allclose(targets, scores, rtol=1e-4, atol=tol)
        # one score per target token (every token after BOS of a passage), spelled as the text reads
        for pid, p in zip(r["proponent_ids"], r["proponent_token_scores"]):
            assert len(p["tokens"]) == len(p["scores"])
            assert p["tokens"][-1] == attribution.EOS_TEXT
            assert "".join(p["tokens"][:-1]) == run.corpus.texts[pid]
        target = next(q.target for q in QUERIES if q.example_id == r["example_id"])  # " P" is unknown here
        assert "".join(r["target_tokens"]).strip() == run.tokenizer.decode(run.tokenizer.encode(target)).strip()
        # the split is not trivial: tokens differ in their share
        assert np.ptp(r["proponent_token_scores"][0]["scores"]) > 0


def test_token_scores_draw_one_bar_over_the_queries(run_dir, monkeypatch):
    """One overall bar for the token scores, not one per query's inner featurize batches."""
    from trackstar_jax.training import logs  # noqa: PLC0415

    bars = []

    class Recording(logs.tqdm.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append((kwargs["desc"], kwargs["total"], self.disable))

    c, workdir = run_dir
    settings = _settings(c, "trackstar", token_scores=True)
    stages.build_index(settings, workdir)
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    run = stages.load_run(workdir, mesh=mesh)
    monkeypatch.setattr(logs.tqdm, "tqdm", Recording)
    retrieval_stage.retrieve_queries(run, settings, workdir, QUERIES, mesh=mesh, k=3)
    after = bars[[d for d, _, _ in bars].index("token scores") :]
    assert after[0] == ("token scores", len(QUERIES), False)
    inner = after[1:]  # each query's featurize loops, several batches long for its proponents' tokens
    assert any(total > 1 for _, total, _ in inner) and all(d == "featurize queries" and off for d, _, off in inner)


def _per_token_reference(params, graphdef, plan, correction, tokens, mask, seed):
    """Φ_t by per-token loss gradients: vmap over target positions of grad(-log p_t), corrected
    element-wise and projected with the dense P0 G P1ᵀ (independent of the one-hot masks)."""
    flat = model_lib.flat_params(params)
    attributed = {p: flat[p] for p in plan.paths}
    frozen = {p: x for p, x in flat.items() if p not in attributed}
    positions = attribution.target_positions(mask)

    tokens = jnp.asarray(tokens)

    def token_loss(attr, j):
        logits = model_lib.apply(graphdef, grads_lib.unflatten({**frozen, **attr}), tokens[None, :-1])
        logp = jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1)
        return -logp[j - 1, tokens[j]]

    g = jax.vmap(jax.grad(token_loss), in_axes=(None, 0))(attributed, jnp.asarray(positions))
    g = precond_lib.apply_elementwise(g, correction)
    return np.asarray(proj_lib.project_grads(g, plan, seed)).reshape(len(positions), -1)


@pytest.mark.parametrize("path", vectors_lib.PATHS)
def test_token_vectors_and_shares_match_a_per_token_reference(run_dir, path):
    c, workdir = run_dir
    run = stages.load_run(workdir)
    vec_cfg = dataclasses.replace(config_lib.from_configdict(c).vectors, path=path, exact_v=True)
    fn = vectors_lib.make_vector_fn(run.graphdef, run.model_cfg, vec_cfg, run.params, run.opt_state, role="index")
    prop = rerank.encode_rows(run, [0])[0]
    query = dict(zip(("tokens", "loss_mask"), _query_pair(run)))
    featurize = lambda pairs: retrieval_stage.query_vectors(run, fn, pairs)  # noqa: E731
    pos, vecs = attribution.token_vectors(featurize, *prop)
    exact = vectors_lib.make_precond(run.params, run.opt_state, dataclasses.replace(vec_cfg, path="reference"), fn.plan)
    with jax.default_matmul_precision("highest"):
        ref = _per_token_reference(run.params, run.graphdef, fn.plan, exact, *prop, vec_cfg.proj_seed)
        qref = _per_token_reference(
            run.params, run.graphdef, fn.plan, exact, query["tokens"], query["loss_mask"], vec_cfg.proj_seed
        )
    np.testing.assert_array_equal(pos, np.arange(1, len(prop[0])))
    np.testing.assert_allclose(vecs, ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())
    # the shares by the dense formula (W Φ_t / ||W Σ Φ||) · Ḡ_q, with a random symmetric positive W
    rng = np.random.default_rng(0)
    nb, k2 = vectors_lib.block_layout(vec_cfg)
    a = rng.normal(size=(nb, k2, k2)).astype(np.float32)
    w = np.einsum("bij,bkj->bik", a, a) / k2 + np.eye(k2, dtype=np.float32)
    whit = hessian.Whitening(w, True, "train", None, None, 0)
    g_q = np.einsum("bij,bj->bi", w, qref.sum(0).reshape(nb, k2)).reshape(-1)
    g_q /= np.linalg.norm(g_q)
    y = np.einsum("bij,nbj->nbi", w, ref.reshape(len(ref), nb, k2)).reshape(len(ref), -1)
    want = y @ g_q / np.linalg.norm(y.sum(0))
    q_prime = np.einsum("bij,bj->bi", w, g_q.reshape(nb, k2)).reshape(-1)
    got = attribution.proponent_token_scores(whit, q_prime, ref)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    # the query side against the same row: W Φ_t(q) / ||W Σ Φ(q)|| · Ḡ_m
    g_m = y.sum(0) / np.linalg.norm(y.sum(0))
    yq = np.einsum("bij,nbj->nbi", w, qref.reshape(len(qref), nb, k2)).reshape(len(qref), -1)
    want_q = yq @ g_m / np.linalg.norm(yq.sum(0))
    got_q = attribution.target_token_scores(whit, ref.sum(0), qref)
    np.testing.assert_allclose(got_q, want_q, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got.sum(), got_q.sum(), rtol=1e-4)  # both sides split the same score


def _query_pair(run):
    q = retrieval_stage.encode_text_queries(run, QUERIES[:1])[0]
    return q["tokens"], q["loss_mask"]


def test_token_strings_read_as_the_text(run_dir):
    _, workdir = run_dir
    run = stages.load_run(workdir)
    for i in range(5):
        tokens, mask = rerank.encode_rows(run, [i])[0]
        s = attribution.token_strings(run.tokenizer, tokens, attribution.target_positions(mask))
        assert "".join(s[:-1]) == run.corpus.texts[i] and s[-1] == attribution.EOS_TEXT


def test_no_target_token_is_a_clear_error():
    with pytest.raises(ValueError, match="no target token"):
        attribution.token_vectors(lambda p: None, np.array([2, 5, 6]), np.array([0, 0, 0]))


# ------------------------------------------------------------------------------------------
# Two-stage retrieval
# ------------------------------------------------------------------------------------------


def _exact_reference(run, vec_cfg, query, rows, unit_norm):
    """float64 cosine (or dot) of materialised per-example gradients times the exact 1/V,
    as benchmarks/peer_race.py's exact top-10."""
    plan = vectors_lib.make_block_plan(run.params, run.model_cfg, vec_cfg)
    corr = precond_lib.from_opt_state(run.params, run.opt_state, plan.paths, exact=True)

    def flat(pairs, role):
        seq = max(len(t) for t, _ in pairs)
        tokens = np.zeros((len(pairs), seq), np.int32)
        mask = np.zeros((len(pairs), seq), np.int32)
        for i, (t, m) in enumerate(pairs):
            tokens[i, : len(t)], mask[i, : len(t)] = t, m
        g = jax.jit(
            lambda b: precond_lib.apply_elementwise(
                grads_lib.per_example_grads(run.params, b, plan, graphdef=run.graphdef, role=role), corr
            )
        )({"tokens": tokens, "loss_mask": mask})
        return np.concatenate([np.asarray(g[p], np.float64).reshape(len(pairs), -1) for p in plan.paths], axis=1)

    q, r = flat([query], "query")[0], flat(rows, "index")
    dots = r @ q
    return dots / (np.linalg.norm(r, axis=1) * np.linalg.norm(q)) if unit_norm else dots


@pytest.mark.parametrize("unit_norm", [True, False])
def test_exact_scorer_matches_a_float64_reference(run_dir, unit_norm):
    c, workdir = run_dir
    run = stages.load_run(workdir)
    vec_cfg = config_lib.from_configdict(c).vectors
    scorer = rerank.ExactScorer(run.graphdef, run.model_cfg, run.params, run.opt_state, vec_cfg, unit_norm)
    rows = rerank.encode_rows(run, range(20))  # more than one batch of 16
    got = scorer.scores(_query_pair(run), rows)
    want = _exact_reference(run, vec_cfg, _query_pair(run), rows, unit_norm)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_rerank_of_every_row_is_the_exact_ranking(run_dir):
    c, workdir = run_dir
    run = stages.load_run(workdir)
    n = len(run.corpus.examples)
    base = _settings(c, "trackstar_l090")
    stages.build_index(base, workdir)
    plain, _ = retrieval_stage.retrieve_queries(run, base, workdir, QUERIES[:1], k=n)
    recs, info = retrieval_stage.retrieve_queries(
        run, base.replace({"retrieval.rerank_k": 10 * n}), workdir, QUERIES[:1], k=5
    )
    r = recs[0]
    assert info["rerank_k"] == n and info["rerank_seconds"] > 0
    want = _exact_reference(run, base.vectors, _query_pair(run), rerank.encode_rows(run, range(n)), True)
    assert r["proponent_ids"] == np.lexsort((np.arange(n), -want))[:5].tolist()
    np.testing.assert_allclose(r["proponent_scores"], np.sort(want)[::-1][:5], rtol=1e-4)
    index_score = dict(zip(plain[0]["proponent_ids"], plain[0]["proponent_scores"]))
    np.testing.assert_allclose(r["proponent_index_scores"], [index_score[i] for i in r["proponent_ids"]], rtol=1e-5)
    assert r["opponent_ids"] == plain[0]["opponent_ids"][:5]


def test_rerank_k_is_checked():
    with pytest.raises(ValueError, match="retrieval.rerank_k must be >= 0"):
        config_lib.RetrievalSettings(rerank_k=-1)


# ------------------------------------------------------------------------------------------
# The released files' schema (github.com/PAIR-code/pretraining-tda, "TDA method results")
# ------------------------------------------------------------------------------------------


def test_retrieval_files_follow_the_released_schema_and_pair_by_row(run_dir, tmp_path):
    """launch.retrieve's jsonl: the released files' fields first, in their order, `example_id` a
    string (the authors' viewer calls `example_id.startsWith`), and two methods' files list the
    same queries line by line (the viewer's side-by-side mode pairs rows by index)."""
    import json

    from trackstar_jax.retrieval import records

    c, workdir = run_dir
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("".join(json.dumps({"prompt": q.prompt, "target": q.target}) + "\n" for q in QUERIES))
    files = {}
    for name in ("exp2", "trackstar_l090"):
        s = _settings(c, name, queries=str(qfile), output=f"schema_{name}", overwrite=True, top_k=3)
        stages.build_index(s, workdir)
        man = stages.retrieve(s, workdir)
        files[name] = [json.loads(line) for line in open(man["output"])]
    assert records.PAIR_FIELDS == (
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
    for name, recs in files.items():
        for r in recs:
            assert tuple(r)[: len(records.PAIR_FIELDS)] == records.PAIR_FIELDS
            assert isinstance(r["example_id"], str) and r["query_set"] == f"schema_{name}"
    key = lambda r: (r["example_id"], r["inputs_plaintext"], r["targets_plaintext"])  # noqa: E731
    assert [key(r) for r in files["exp2"]] == [key(r) for r in files["trackstar_l090"]]
    assert [key(r) for r in files["exp2"]] == [(str(i), q.prompt, q.target) for i, q in enumerate(QUERIES)]
