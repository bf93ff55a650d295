"""TRAK's example-level Q multiplies scores after R (§4.4 footnote, index/trak.py): the "trak"
row's retrieval against a plain numpy TRAK: R = Σ φφᵀ over the stored margin gradients (block
diagonal, as the paper's R), score_m = Q_m φ_mᵀ R⁻¹ φ_q with Q_m = 1 - p̄_m."""

import numpy as np
import pytest
from conftest import tiny_run_config, update_compiler_config

from trackstar_jax import config as config_lib
from trackstar_jax import methods, stages
from trackstar_jax.index import build, store
from trackstar_jax.index import trak as trak_lib
from trackstar_jax.models import lm as model_lib
from trackstar_jax.retrieval import stage as retrieval_stage


@pytest.fixture(scope="module")
def trak_run(tiny_run):
    old = update_compiler_config({"jax_disable_most_optimizations": True})
    try:
        c = tiny_run_config(num_facts=20, num_distractors=20, num_steps=40, chunk_rows=32)
        c.index.dtype = "float32"
        c.hessian.damping = 0.0  # the reference inverts R exactly
        c.hessian.r_train_shrinkage = 0.0  # (the paper's R_train, unshrunk)
        c.vectors.proj_dim = 4  # d = 2 * 2 * 16 = 64, blocks of 16 << rows: R has full rank
        workdir = tiny_run(c)
        s = config_lib.from_configdict(c)
        s = s.replace(methods.method("trak").overrides(s.index.dir))
        stages.build_index(s, workdir)
        yield s, workdir
    finally:
        update_compiler_config(old)


def _numpy_mean_probs(run):
    """p̄ per passage by one unbatched-by-length forward (padded at the end; causal) and numpy."""
    from trackstar_jax import data as data_lib

    items, _ = data_lib.encode_passages(run.tokenizer, run.corpus.texts, run.model_cfg.max_len)
    t_max = max(len(t) for t, _ in items)
    tokens = np.zeros((len(items), t_max), np.int32)
    mask = np.zeros((len(items), t_max))
    for i, (t, m) in enumerate(items):
        tokens[i, : len(t)], mask[i, : len(m)] = t, m
    logits = np.asarray(model_lib.apply(run.graphdef, run.params, tokens[:, :-1]), np.float64)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    p = np.exp(np.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0])
    w = mask[:, 1:]
    return (p * w).sum(-1) / w.sum(-1)


def test_trak_scores_equal_a_plain_numpy_trak(trak_run):
    s, workdir = trak_run
    run = stages.load_run(workdir, runtime=s)
    reader = store.open_index(build.index_dir(s.index, workdir))
    phi = np.asarray(reader.read_dequantized(0, reader.num_rows), np.float64)  # stored rows: plain margin grads
    queries = [retrieval_stage.TextQuery(i, p, t) for i, (p, t) in enumerate([("The", " capital"), ("A", " city")])]
    recs, _ = retrieval_stage.retrieve_queries(run, s, workdir, queries, k=reader.num_rows)
    vec_fn = retrieval_stage.vectors_lib.make_vector_fn(
        run.graphdef, run.model_cfg, s.vectors, run.params, run.opt_state, role="query"
    )
    q_raw = np.asarray(retrieval_stage.featurize_text_queries(run, vec_fn, queries), np.float64)
    q = 1.0 - _numpy_mean_probs(run)
    np.testing.assert_allclose(trak_lib.candidate_q(run, reader), q, rtol=1e-4, atol=1e-5)
    assert q.std() > 1e-3  # Q differs between candidates, so folding it into R would change scores
    nb = reader.num_blocks_total
    bd = phi.shape[1] // nb
    want = np.zeros((len(queries), len(phi)))
    for b in range(nb):  # block-diagonal TRAK: R_b = Φ_bᵀΦ_b / n, score += φ_mbᵀ R_b⁻¹ φ_qb
        pb, qb = phi[:, b * bd : (b + 1) * bd], q_raw[:, b * bd : (b + 1) * bd]
        r = pb.T @ pb / len(pb)
        want += qb @ np.linalg.solve(r, pb.T)
    want *= q[None, :]
    for qi, rec in enumerate(recs):
        got = np.zeros(len(phi))
        got[rec["proponent_ids"]] = rec["proponent_scores"]
        np.testing.assert_allclose(got, want[qi], rtol=2e-3, atol=2e-3 * np.abs(want[qi]).max())
        assert rec["proponent_ids"][:5] == list(np.argsort(-want[qi], kind="stable")[:5])
    # The folded variant (Q inside the rows, R = Σ Q²φφᵀ) ranks differently: the test can tell them apart.
    folded = np.zeros_like(want)
    for b in range(nb):
        pb, qb = phi[:, b * bd : (b + 1) * bd] * q[:, None], q_raw[:, b * bd : (b + 1) * bd]
        folded += qb @ np.linalg.solve(pb.T @ pb / len(pb), pb.T)
    assert not np.allclose(folded, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


def test_a_trak_index_with_q_folded_in_is_refused(trak_run):
    s, workdir = trak_run
    run = stages.load_run(workdir, runtime=s)
    man = build.index_manifest(run, s.vectors, s.index.storage, 64)
    assert man["vectors"]["trak_q"] == "scores"  # an old trak index (no such key) fails the identity check


def test_q_comes_from_the_index_pass_and_equals_its_own_forward(trak_run, monkeypatch):
    """The trak index's build caches Q = 1 - p̄ from the featurize pass's own forward (no
    second pass over the candidates); it equals numpy's p̄ and `candidate_q`'s own forward
    pass, which still computes it when the cache is gone (a resumed or split build)."""
    s, workdir = trak_run
    run = stages.load_run(workdir, runtime=s)
    reader = store.open_index(build.index_dir(s.index, workdir))
    cached = trak_lib.q_file(reader.path, reader.manifest)
    assert cached.exists()
    real = trak_lib.mean_probs
    monkeypatch.setattr(trak_lib, "mean_probs", lambda *a, **k: pytest.fail("a second forward pass"))
    from_pass = trak_lib.candidate_q(run, reader)
    np.testing.assert_allclose(from_pass, 1.0 - _numpy_mean_probs(run), rtol=1e-4, atol=1e-5)
    cached.unlink()
    monkeypatch.setattr(trak_lib, "mean_probs", real)
    np.testing.assert_allclose(trak_lib.candidate_q(run, reader), from_pass, rtol=1e-5, atol=1e-6)
    assert cached.exists()
