"""training.second_moment: the estimated V equals optax Adafactor's own accumulation.

Reference: `optax.adafactor(decay_rate=1.0, ...)` fed the same per-example gradients, one
`update` per example. With exponent 1, optax's decay at count t is `1 - (t+1)^-1 = t/(t+1)`,
so after N updates `v_row` / `v_col` / `v` are the running MEAN over the N gradients of
`mean(g^2 + eps, axis=d0)`, `mean(g^2 + eps, axis=d1)`, `g^2 + eps`: the same quantity our
estimate computes as a mean of squared gradients factored afterwards. The reference
gradients come from `jax.grad` of `training.step.loss_fn` on each example alone, trimmed
to its own length (no padding, no scan), independently of the estimate's batched scan.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from trackstar_jax.features import preconditioner as pc
from trackstar_jax.models import lm
from trackstar_jax.training import second_moment as sm
from trackstar_jax.training import step as step_lib

pytestmark = pytest.mark.usefixtures("fast_compile")

CFG = lm.LMConfig(
    arch="llama",
    vocab_size=40,
    num_layers=1,
    embed_dim=32,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    mlp_dim=48,
    max_len=32,
    tie_embeddings=False,
)


def _examples(n, seed=0):
    rng = np.random.default_rng(seed)
    return [
        np.concatenate([[2], rng.integers(4, CFG.vocab_size, size=rng.integers(3, 20))]).astype(np.int32)
        for _ in range(n)
    ]


def _batches(examples, batch_size):
    for s in range(0, len(examples), batch_size):
        chunk = examples[s : s + batch_size]
        tokens = np.zeros((batch_size, 32), np.int32)
        mask = np.zeros((batch_size, 32), np.int32)
        ids = np.full((batch_size,), -1, np.int32)
        for r, t in enumerate(chunk):
            tokens[r, : len(t)], mask[r, 1 : len(t)], ids[r] = t, 1, s + r
        yield {"tokens": tokens, "loss_mask": mask, "example_id": ids}


def test_estimate_equals_optax_adafactor_mean_accumulation():
    min_dim = 20  # factored: the 32 x 32 / 32 x 48 / 40 x 32 matrices; full v: key/value 32 x 16 and 1-D scales
    model = lm.make_model(CFG, seed=3)
    graphdef, state = lm.split_model(model)
    from flax import nnx

    params = nnx.to_pure_dict(state)
    examples = _examples(7)
    opt_cfg = step_lib.OptimizerConfig(min_dim_size_to_factor=min_dim)
    opt = step_lib.make_optimizer(opt_cfg)
    ours, n = sm.estimate_opt_state(graphdef, params, opt, opt_cfg, _batches(examples, 3))  # 3 batches, 2 pad rows
    assert n == 7

    ref_tx = optax.adafactor(learning_rate=0.0, decay_rate=1.0, min_dim_size_to_factor=min_dim)
    ref = ref_tx.init(params)
    for t in examples:
        batch = {
            "tokens": jnp.asarray(t[None]),
            "loss_mask": jnp.asarray(np.r_[0, np.ones(len(t) - 1)][None], jnp.int32),
        }
        g = jax.jit(jax.grad(lambda p, b: step_lib.loss_fn(p, graphdef, b)[0]))(params, batch)
        _, ref = ref_tx.update(g, ref, params)

    factored = 0
    for field in ("v_row", "v_col", "v"):
        got = lm.flat_params(optax.tree_utils.tree_get(ours, field))
        want = lm.flat_params(optax.tree_utils.tree_get(ref, field))
        assert got.keys() == want.keys()
        for path in got:
            assert got[path].shape == want[path].shape, (field, path)
            np.testing.assert_allclose(np.asarray(got[path]), np.asarray(want[path]), rtol=2e-5, atol=0, err_msg=path)
            factored += field == "v_row" and got[path].shape != (1,)
    assert 0 < factored < len(lm.flat_params(params))
    (fs,) = [s for s in ours if isinstance(s, sm.FactoredState)]
    assert int(fs.count) == 7
    # The run's own optimizer state structure (restores into the checkpoint target) ...
    assert jax.tree.structure(ours) == jax.tree.structure(opt.init(params))
    # ... and the correction reads it like a pretraining checkpoint's state.
    paths = tuple(lm.attributed_paths(params))
    corr = pc.from_opt_state(params, ours, paths)
    ref_corr = pc.from_opt_state(params, ref, paths)
    for p in paths:
        np.testing.assert_allclose(np.asarray(corr.row[p]), np.asarray(ref_corr.row[p]), rtol=2e-5)
        np.testing.assert_allclose(np.asarray(corr.col[p]), np.asarray(ref_corr.col[p]), rtol=2e-5)


def test_sample_ids_are_seeded_distinct_and_capped():
    a = sm.sample_ids(100, 10, seed=1)
    assert a == sm.sample_ids(100, 10, seed=1) and a == sorted(set(a)) and len(a) == 10
    assert a != sm.sample_ids(100, 10, seed=2)
    assert sm.sample_ids(5, 10, seed=0) == [0, 1, 2, 3, 4]


def test_no_examples_is_a_clear_error():
    graphdef, state = lm.split_model(lm.make_model(dataclasses.replace(CFG), seed=0))
    from flax import nnx

    with pytest.raises(ValueError, match="at least one example"):
        sm.mean_squared_grads(graphdef, nnx.to_pure_dict(state), [])


# --- V as the optimizer holds it: EMA of squared minibatch-mean gradients (issue 57) ---


def _model():
    from flax import nnx

    graphdef, state = lm.split_model(lm.make_model(CFG, seed=3))
    return graphdef, nnx.to_pure_dict(state)


def _whole_minibatch_grad(graphdef, params, examples, ids):
    """Reference: `jax.grad` of `loss_fn` on one batch holding the whole minibatch (no accumulation)."""
    (batch,) = list(_batches([examples[i] for i in ids], len(ids)))
    batch = {k: jnp.asarray(v) for k, v in batch.items() if k != "example_id"}
    return jax.jit(jax.grad(lambda p, b: step_lib.loss_fn(p, graphdef, b)[0]))(params, batch)


STEPS = [[0, 1, 2, 3], [4, 5, 6, 0], [1, 3, 5, 6]]  # N = 3 steps of B = 4 sequences


def _micro(examples, steps, micro):
    """Each step's minibatch in micro-batches of `micro` rows (accumulated by the estimator)."""
    return ([dict(b) for b in _batches([examples[i] for i in ids], micro)] for ids in steps)


def test_minibatch_estimate_is_a_plain_adafactor_ema_of_minibatch_gradients():
    min_dim, decay = 20, 0.8
    graphdef, params = _model()
    examples = _examples(7, seed=1)
    opt_cfg = step_lib.OptimizerConfig(min_dim_size_to_factor=min_dim, decay_rate=decay)
    rule = sm.SECOND_MOMENT_RULES["adafactor"](opt_cfg, 0.0)
    ours, n = sm.minibatch_opt_state(graphdef, params, rule, _micro(examples, STEPS, micro=3))  # 3 + 1(+2 pad)
    assert n == 3 and int(ours.count) == 3

    # Independent reference: the EMA written out, on whole-minibatch gradients, for every leaf.
    trees = [_whole_minibatch_grad(graphdef, params, examples, ids) for ids in STEPS]
    grads = [lm.flat_params(g) for g in trees]
    checked = 0
    for path, p in lm.flat_params(params).items():
        v_row = v_col = v = 0.0
        for t, g in enumerate(grads):
            beta = 1.0 - (t + 1.0) ** -decay  # optax's decay_rate_pow at count t (0 at the first step)
            g2 = np.asarray(g[path], np.float64) ** 2 + sm.EPSILON
            if p.ndim == 2 and min(p.shape) >= min_dim:
                d0 = 1 if p.shape[1] >= p.shape[0] else 0  # the larger axis (the last on a tie): v_row averages it out
                v_row = beta * v_row + (1 - beta) * g2.mean(axis=d0)
                v_col = beta * v_col + (1 - beta) * g2.mean(axis=1 - d0)
            else:
                v = beta * v + (1 - beta) * g2
        got = {f: np.asarray(lm.flat_params(getattr(ours, f))[path]) for f in ("v_row", "v_col", "v")}
        if p.ndim == 2 and min(p.shape) >= min_dim:
            np.testing.assert_allclose(got["v_row"], v_row, rtol=2e-4, err_msg=path)
            np.testing.assert_allclose(got["v_col"], v_col, rtol=2e-4, err_msg=path)
            checked += 1
        else:
            np.testing.assert_allclose(got["v"], v, rtol=2e-4, err_msg=path)
    assert checked >= 2
    # ... and it is the state optax's own adafactor holds after the same steps at learning rate 0
    ref_tx = optax.adafactor(learning_rate=0.0, decay_rate=decay, min_dim_size_to_factor=min_dim)
    ref = ref_tx.init(params)
    for g in trees:
        _, ref = ref_tx.update(g, ref, params)
    (fs,) = [s for s in ref if isinstance(s, sm.FactoredState)]
    for f in ("v_row", "v_col", "v"):
        for path, want in lm.flat_params(getattr(fs, f)).items():
            np.testing.assert_allclose(
                np.asarray(lm.flat_params(getattr(ours, f))[path]), np.asarray(want), rtol=2e-4, err_msg=path
            )


def test_minibatch_v_is_not_the_per_example_mean():
    """B > 1: the minibatch V (mu^2 + sigma^2/B) is below the per-example one (mu^2 + sigma^2)."""
    graphdef, params = _model()
    examples = _examples(8, seed=2)
    opt_cfg = step_lib.OptimizerConfig(min_dim_size_to_factor=1000)  # every leaf keeps a full v
    rule = sm.SECOND_MOMENT_RULES["adafactor"](opt_cfg, 0.0)
    steps = [[0, 1, 2, 3], [4, 5, 6, 7]]
    mb, _ = sm.minibatch_opt_state(graphdef, params, rule, _micro(examples, steps, micro=2))
    per_ex, _ = sm.mean_squared_grads(graphdef, params, _batches(examples, 4))
    ratio = [
        float(np.mean(np.asarray(x)) / np.mean(np.asarray(y)))
        for x, y in zip(jax.tree.leaves(mb.v), jax.tree.leaves(per_ex))
    ]
    assert np.median(ratio) < 0.7


def test_adam_rule_and_effective_v_are_adams_own_preconditioner():
    b2, eps = 0.95, 1e-8
    graphdef, params = _model()
    examples = _examples(7, seed=4)
    rule = sm.SECOND_MOMENT_RULES["adam"](None, b2)
    ours, n = sm.minibatch_opt_state(graphdef, params, rule, _micro(examples, STEPS, micro=2))
    grads = [_whole_minibatch_grad(graphdef, params, examples, ids) for ids in STEPS]
    nu = jax.tree.map(lambda x: np.zeros(x.shape), params)
    for g in grads:  # Adam's EMA written out
        nu = jax.tree.map(lambda v, x: b2 * v + (1 - b2) * np.asarray(x, np.float64) ** 2, nu, g)
    assert isinstance(ours, optax.ScaleByAdamState) and n == 3
    for a, b in zip(jax.tree.leaves(ours.nu), jax.tree.leaves(nu)):
        # micro-batched float32 gradients: entries far below the leaf's scale carry its round-off
        np.testing.assert_allclose(np.asarray(a), b, rtol=2e-4, atol=1e-6 * np.abs(b).max())
    # optax's Adam update (b1 = 0, so the update is g / (sqrt(nu_hat) + eps)) equals g / sqrt(V_eff)
    tx = optax.scale_by_adam(b1=0.0, b2=b2, eps=eps)
    st = tx.init(params)
    for g in grads:
        upd, st = tx.update(g, st, params)
    v_eff = pc.adam_effective_v(st.nu, st.count, b2, eps)
    for u, g, v in zip(jax.tree.leaves(upd), jax.tree.leaves(grads[-1]), jax.tree.leaves(v_eff)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(g) / np.sqrt(np.asarray(v)), rtol=1e-4, atol=1e-12)
