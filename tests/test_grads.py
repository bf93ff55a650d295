"""Per-example gradients, output functions and masking (paper §3, §A.1.1)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

# The same model and batch shapes as test_factored.py, so that eager primitive compiles are shared.
from trackstar_jax import data as data_lib
from trackstar_jax.features import factored, grads, vectors
from trackstar_jax.features import projection as proj
from trackstar_jax.models import lm as model_lib

VOCAB, B, T = 97, 4, 12


pytestmark = pytest.mark.usefixtures("fast_compile")  # conftest.py


@functools.lru_cache(maxsize=None)
def _model(tied=False):
    cfg = model_lib.LMConfig(
        vocab_size=VOCAB,
        num_layers=2,
        embed_dim=32,
        num_heads=2,
        head_dim=16,
        mlp_dim=64,
        max_len=16,
        tie_embeddings=tied,
    )
    graphdef, params = model_lib.split_model(model_lib.make_model(cfg, seed=3))
    params = nnx.to_pure_dict(params)
    plan = vectors.make_block_plan(params, cfg, vectors.VectorConfig(num_blocks=2, proj_dim=4))
    return cfg, graphdef, params, plan


def _batch(seed, b, t, prompt=0, pad=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCAB, size=(b, t)).astype(np.int32)
    tokens[:, 0] = 1
    mask = np.ones((b, t), np.float32)
    mask[:, : 1 + prompt] = 0
    if pad:
        tokens[:, t - pad :] = data_lib.PAD_ID
        mask[:, t - pad :] = 0
    return {"tokens": tokens, "loss_mask": mask}


def test_per_example_grads_match_a_loop_of_single_example_grads():
    cfg, graphdef, params, plan = _model()
    batch = _batch(0, B, T, prompt=2, pad=2)

    @jax.jit
    def single(p, one):  # one example at a time, through the model's own loss
        return jax.grad(lambda q: model_lib.example_losses(lambda x: model_lib.apply(graphdef, q, x), one)[0])(p)

    with jax.default_matmul_precision("highest"):
        got = grads.per_example_grads(params, batch, plan, graphdef=graphdef)
        for i in range(B):
            flat = model_lib.flat_params(single(params, {k: v[i : i + 1] for k, v in batch.items()}))
            assert "embed" not in got  # the token embedding is never attributed
            for path in plan.paths:
                np.testing.assert_allclose(
                    np.asarray(got[path][i]), np.asarray(flat[path]), rtol=1e-4, atol=1e-6, err_msg=path
                )


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize(
    "output_fn,role", [("loss", "index"), ("margin", "index"), ("logit", "index"), ("trak", "index"), ("trak", "query")]
)
def test_output_function_gradients_match_closed_forms(output_fn, role):
    rng = np.random.default_rng(1)
    b, t, v = 2, 5, 7
    logits = rng.normal(size=(b, t, v)).astype(np.float32) * 2
    targets = rng.integers(0, v, size=(b, t))
    w = (rng.uniform(size=(b, t)) > 0.3).astype(np.float32)
    w[:, 0] = 1
    g = np.asarray(jax.grad(lambda z: jnp.sum(grads.token_objective(z, targets, w, output_fn, role)))(logits))
    p_all = _softmax(logits.astype(np.float64))
    onehot = np.eye(v)[targets]
    p = np.sum(p_all * onehot, -1)
    if output_fn in ("loss", "margin"):  # margin with per-token Q = p-1 is exactly the loss gradient
        want = (p_all - onehot) * w[..., None]
    elif output_fn == "logit":  # (p - 1) d logit_y
        want = (p - 1)[..., None] * onehot * w[..., None]
    else:  # trak: d/dz log(p/(1-p)) = onehot - p_others/(1-p), no Q in the gradient for either role
        others = p_all * (1 - onehot) / (1 - p)[..., None]
        want = (onehot - others) * w[..., None]
    np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-6)


def test_labels_at_masked_positions_change_nothing():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(2, 6, 9)).astype(np.float32))
    targets = rng.integers(0, 9, size=(2, 6))
    w = np.array([[0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 1, 0]], np.float32)
    other = np.where(w > 0, targets, (targets + 3) % 9)
    for fn in grads.OUTPUT_FNS:
        obj = lambda tg: jax.grad(lambda z: jnp.sum(grads.token_objective(z, tg, w, fn)))(logits)  # noqa: E731, B023  (called in this iteration)
        np.testing.assert_array_equal(np.asarray(obj(targets)), np.asarray(obj(other)), err_msg=fn)


@pytest.mark.parametrize("path", ["fast", "reference"])
def test_padding_and_prompt_masking(path):
    cfg, graphdef, params, plan = _model(tied=True)
    fn = functools.partial(
        factored.factored_vectors if path == "fast" else grads.reference_vectors, graphdef=graphdef, plan=plan
    )
    base = _batch(3, B, T, prompt=2, pad=4)
    base["tokens"][B - 1], base["loss_mask"][B - 1] = data_lib.PAD_ID, 0  # a padding row
    # Arbitrary token ids under a zero mask at the end of the rows change nothing (causal
    # attention: no earlier position sees them); a real row in place of the padding row leaves
    # the other rows alone.
    other = {k: v.copy() for k, v in base.items()}
    other["tokens"][:, T - 4 :] = np.random.default_rng(4).integers(1, VOCAB, size=(B, 4))
    other["tokens"][B - 1], other["loss_mask"][B - 1] = _batch(9, 1, T)["tokens"][0], 1
    # Unmasking the prompt changes the vectors (the mask is what selects target tokens).
    unmasked = {k: v.copy() for k, v in base.items()}
    unmasked["loss_mask"][:, 1:3] = 1
    with jax.default_matmul_precision("highest"):
        a = np.asarray(fn(params, None, base))
        b = np.asarray(fn(params, None, other))
        d = np.asarray(fn(params, None, unmasked))
    scale = np.abs(a).max()
    assert np.all(a[B - 1] == 0)
    np.testing.assert_allclose(b[: B - 1], a[: B - 1], rtol=1e-5, atol=1e-6 * scale)
    assert np.abs(d[: B - 1] - a[: B - 1]).max() > 1e-3 * scale


def test_trak_rows_hold_plain_margin_gradients_and_q_is_the_mean_target_prob():
    # TRAK's Q multiplies scores after R (index/trak.py), so index and query rows are the same
    # margin gradients (the old code folded 1 - pbar into index rows: R became sum Q^2 phi phi^T).
    cfg, graphdef, params, plan = _model()
    batch = _batch(5, B, T, prompt=1)
    kw = dict(graphdef=graphdef, plan=plan, output_fn="trak")
    idx = np.asarray(factored.factored_vectors(params, None, batch, role="index", **kw))
    qry = np.asarray(factored.factored_vectors(params, None, batch, role="query", **kw))
    np.testing.assert_array_equal(idx, qry)
    inputs, targets, w = model_lib.lm_targets(batch)
    logits = model_lib.apply(graphdef, params, inputs)
    p = np.exp(np.asarray(model_lib.token_log_probs(logits, targets), np.float64))
    pbar = np.sum(p * np.asarray(w), -1) / np.sum(np.asarray(w), -1)
    np.testing.assert_allclose(np.asarray(grads.mean_target_prob(logits, targets, w)), pbar, rtol=1e-5)


def test_unknown_output_fn_and_role():
    with pytest.raises(ValueError, match="output_fn"):
        grads.token_objective(jnp.zeros((1, 2, 3)), jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2)), "kl")
    with pytest.raises(ValueError, match="role"):
        grads.token_objective(jnp.zeros((1, 2, 3)), jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2)), "loss", "train")


def test_tap_on_a_parameter_outside_the_plan_is_an_error():
    cfg, graphdef, params, plan = _model()
    small = proj.BlockPlan(
        plan.num_blocks, plan.proj_dim, tuple(e for e in plan.entries if e.path != "layer_1/mlp/up/kernel")
    )
    with pytest.raises(ValueError, match="layer_1/mlp/up/kernel"):
        factored.factored_vectors(params, None, _batch(6, B, T), graphdef=graphdef, plan=small)
