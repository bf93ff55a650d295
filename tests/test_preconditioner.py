"""Second-moment correction vs optax's own Adafactor / Adam updates (style.md §4.4)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from trackstar_jax.features import preconditioner as pc
from trackstar_jax.models import lm as model_lib

# The shape regimes of style.md §4.4 (+ square and 1-D), under parameter-like paths.
SHAPES = {
    "layer_0/mlp/up/kernel": (256, 130),
    "layer_0/mlp/down/kernel": (130, 256),
    "layer_0/attn/query/kernel": (100, 300),  # not factored: 100 < 128
    "layer_0/attn/out/kernel": (128, 128),
    "layer_0/mlp_norm/scale": (130,),
}


def _params():
    rng = np.random.default_rng(0)
    flat = {p: rng.normal(size=s).astype(np.float32) for p, s in SHAPES.items()}
    return {
        "layer_0": {
            "mlp": {
                "up": {"kernel": flat["layer_0/mlp/up/kernel"]},
                "down": {"kernel": flat["layer_0/mlp/down/kernel"]},
            },
            "attn": {
                "query": {"kernel": flat["layer_0/attn/query/kernel"]},
                "out": {"kernel": flat["layer_0/attn/out/kernel"]},
            },
            "mlp_norm": {"scale": flat["layer_0/mlp_norm/scale"]},
        }
    }


def _grads(params, seed):
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(
        tree, [jax.random.normal(k, x.shape) * (1 + i) for i, (k, x) in enumerate(zip(keys, leaves))]
    )


def _flat(tree):
    return model_lib.flat_params(tree)


@pytest.mark.parametrize("chain", [False, True])
def test_correction_equals_optax_adafactor_update(chain):
    params = _params()
    tx = (
        optax.adafactor(learning_rate=1.0, clipping_threshold=None, multiply_by_parameter_scale=False)
        if chain
        else optax.scale_by_factored_rms()
    )
    state = tx.init(params)
    for s in range(3):  # a realistic, multi-step state
        _, state = tx.update(_grads(params, s), state, params)
    g = _grads(params, 99)
    # optax's update on g uses the state after accumulating g: read V from exactly that state.
    updates, new_state = tx.update(g, state, params)
    corr = pc.from_opt_state(params, new_state, tuple(SHAPES), exact=True)
    sign = -1.0 if chain else 1.0  # adafactor's chain ends with scale_by_learning_rate(1.0) -> -1
    for path, u in _flat(updates).items():
        ours = _flat(g)[path] * corr.elementwise(path, SHAPES[path])
        np.testing.assert_allclose(np.asarray(ours), sign * np.asarray(u), rtol=1e-5, atol=1e-6, err_msg=path)
    # The rank-one pair is exact exactly where optax factored (and for 1-D scales).
    assert set(corr.rank_one_exact) == {
        "layer_0/mlp/up/kernel",
        "layer_0/mlp/down/kernel",
        "layer_0/attn/out/kernel",
        "layer_0/mlp_norm/scale",
    }
    assert set(corr.full) == {"layer_0/attn/query/kernel"}


def test_factored_axes_follow_optax_rule():
    # v_row drops the LARGEST dim (style.md §4.4): for (256, 130) the row factor is along axis 1.
    params = _params()
    tx = optax.scale_by_factored_rms()
    _, state = tx.update(_grads(params, 0), tx.init(params), params)
    corr = pc.from_opt_state(params, state, tuple(SHAPES))
    assert corr.row["layer_0/mlp/up/kernel"].shape == (256,) and corr.col["layer_0/mlp/up/kernel"].shape == (130,)
    v_row = _flat(optax.tree_utils.tree_get(state, "v_row"))["layer_0/mlp/up/kernel"]
    v_col = _flat(optax.tree_utils.tree_get(state, "v_col"))["layer_0/mlp/up/kernel"]
    assert v_row.shape == (130,) and v_col.shape == (256,)
    np.testing.assert_allclose(
        np.asarray(corr.col["layer_0/mlp/up/kernel"]), np.asarray(v_row / jnp.mean(v_row)) ** -0.5, rtol=1e-6
    )
    np.testing.assert_allclose(np.asarray(corr.row["layer_0/mlp/up/kernel"]), np.asarray(v_col) ** -0.5, rtol=1e-6)


def test_adam_nu_is_accepted():
    params = _params()
    tx = optax.adam(1e-3)
    state = tx.init(params)
    for s in range(2):
        _, state = tx.update(_grads(params, s), state, params)
    corr = pc.from_opt_state(params, state, tuple(SHAPES), exact=True)
    nu = _flat(optax.tree_utils.tree_get(state, "nu"))
    for path in SHAPES:
        np.testing.assert_allclose(
            np.asarray(corr.elementwise(path, SHAPES[path])), np.asarray(nu[path]) ** -0.5, rtol=1e-5, err_msg=path
        )


def test_zeros_in_v_are_floored_at_optax_epsilon():
    params = _params()
    state = optax.scale_by_factored_rms().init(params)  # all zeros
    corr = pc.from_opt_state(params, state, tuple(SHAPES), exact=True)
    for path, shape in SHAPES.items():
        f = np.asarray(corr.elementwise(path, shape))
        assert np.all(np.isfinite(f)), path
        np.testing.assert_allclose(f, pc.EPSILON**-0.5, rtol=1e-5)


def test_bad_states_raise_clear_errors():
    params = _params()
    with pytest.raises(ValueError, match="correction=False"):
        pc.from_opt_state(params, None, tuple(SHAPES))
    with pytest.raises(ValueError, match="correction=False"):
        pc.from_opt_state(params, optax.sgd(0.1).init(params), tuple(SHAPES))
    tx = optax.scale_by_factored_rms()
    _, state = tx.update(_grads(params, 0), tx.init(params), params)
    bad = jax.tree_util.tree_map_with_path(
        lambda kp, x: x.at[0].set(jnp.nan) if "attn/query" in model_lib.param_path_str(kp) and x.ndim == 2 else x, state
    )
    with pytest.raises(ValueError, match="layer_0/attn/query/kernel"):
        pc.from_opt_state(params, bad, tuple(SHAPES))
    with pytest.raises(ValueError, match="layer_1/mlp/up/kernel"):  # a parameter the state does not cover
        pc.from_opt_state(
            {**params, "layer_1": {"mlp": {"up": {"kernel": np.ones((4, 4), np.float32)}}}},
            state,
            tuple(SHAPES) + ("layer_1/mlp/up/kernel",),
        )


def test_rank_one_factorisation():
    rng = np.random.default_rng(0)
    r, c = rng.uniform(0.5, 2, size=7), rng.uniform(0.5, 2, size=5)
    v = jnp.asarray(np.outer(r, c).astype(np.float32))
    a, b = pc.rank_one_factors(v)
    np.testing.assert_allclose(np.asarray(a[:, None] * b[None, :]), np.asarray(v) ** -0.5, rtol=1e-5)
    v2 = jnp.asarray(rng.uniform(0.1, 2, size=(7, 5)).astype(np.float32))
    a2, b2 = pc.rank_one_factors(v2)
    err = np.linalg.norm(np.asarray(a2[:, None] * b2[None, :]) - np.asarray(v2) ** -0.5)
    assert err > 1e-3  # a full V is only approximated
