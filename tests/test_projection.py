"""Block plan and two-sided projection vs dense references (paper §A.1.2)."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import covering

from trackstar_jax.features import projection as proj
from trackstar_jax.models import lm as model_lib


def _tiny_shapes(tied=True, layers=4, unembed=True):
    cfg = model_lib.LMConfig(
        vocab_size=50,
        num_layers=layers,
        embed_dim=16,
        num_heads=2,
        head_dim=4,
        mlp_dim=24,
        max_len=8,
        tie_embeddings=tied,
    )
    _, params = model_lib.abstract_params(cfg)
    flat = model_lib.flat_params(params)
    return cfg, {p: tuple(flat[p].shape) for p in model_lib.attributed_paths(flat, unembed)}


@pytest.mark.parametrize("shape", [(3, 5), (5, 3), (1, 7), (4, 4)])
def test_projection_equals_dense_kronecker_form(shape):
    k = 3
    p0, p1 = proj.side_matrices(11, "layer_0/mlp/up/kernel", shape, k)
    g = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    # Row-major vec: vec(P0 G P1^T) = (P0 kron P1) vec(G).
    dense = np.kron(np.asarray(p0, np.float64), np.asarray(p1, np.float64)) @ g.reshape(-1).astype(np.float64)
    got = proj.project_matrix(jnp.asarray(g), p0, p1)
    np.testing.assert_allclose(np.asarray(got).reshape(-1), dense, rtol=1e-5, atol=1e-5)


def test_block_sum_equals_projecting_the_block_diagonal_concatenation():
    cfg, shapes = _tiny_shapes(tied=False, layers=2)
    plan = proj.block_plan(shapes, cfg.num_layers, 1, 3)
    rng = np.random.default_rng(1)
    grads = {p: rng.normal(size=(2,) + s).astype(np.float32) for p, s in shapes.items()}
    got = np.asarray(proj.project_grads({p: jnp.asarray(g) for p, g in grads.items()}, plan, seed=5))
    for side in range(plan.num_sides):
        entries = [e for e in plan.entries if e.side == side]
        p0s, p1s = zip(*[proj.side_matrices(5, e.path, e.shape, 3) for e in entries])
        big_p0 = np.concatenate([np.asarray(p, np.float64) for p in p0s], axis=1)  # [k, sum m]
        big_p1 = np.concatenate([np.asarray(p, np.float64) for p in p1s], axis=1)  # [k, sum n]
        for b in range(2):
            mats = [grads[e.path][b].reshape(e.shape).astype(np.float64) for e in entries]
            rows, cols = sum(m.shape[0] for m in mats), sum(m.shape[1] for m in mats)
            block = np.zeros((rows, cols))
            r = c = 0
            for m in mats:  # block-diagonal concatenation
                block[r : r + m.shape[0], c : c + m.shape[1]] = m
                r, c = r + m.shape[0], c + m.shape[1]
            np.testing.assert_allclose(got[b, side], big_p0 @ block @ big_p1.T, rtol=1e-4, atol=1e-4)


def test_block_plan_assignment():
    cfg, shapes = _tiny_shapes(tied=False, layers=4)
    plan = proj.block_plan(shapes, cfg.num_layers, 2, 4)
    side = {e.path: e.side for e in plan.entries}
    assert set(side) == set(shapes)  # every attributed parameter in exactly one block-side
    assert side["layer_0/attn/query/kernel"] == 0 and side["layer_1/attn_norm/scale"] == 0
    assert side["layer_1/mlp/down/kernel"] == 1 and side["layer_0/mlp_norm/scale"] == 1
    assert side["layer_2/attn/key/kernel"] == 2 and side["layer_3/mlp/gate/kernel"] == 3
    assert side["final_norm/scale"] == 3 and side["unembed/kernel"] == 3  # with vectors.unembed
    assert plan.entry("layer_0/attn_norm/scale").shape == (1, 16)
    assert plan.dim == 2 * 2 * 16


def test_block_plan_errors_name_the_parameter():
    cfg, shapes = _tiny_shapes()
    with pytest.raises(ValueError, match="layer_0/attn/rotary/freq"):
        proj.block_plan({**shapes, "layer_0/attn/rotary/freq": (3, 3, 3)}, cfg.num_layers, 2, 4)
    with pytest.raises(ValueError, match="layer_0/adapter/kernel"):
        proj.block_plan({**shapes, "layer_0/adapter/kernel": (3, 3)}, cfg.num_layers, 2, 4)
    with pytest.raises(ValueError, match="pooler/kernel"):
        proj.block_plan({**shapes, "pooler/kernel": (3, 3)}, cfg.num_layers, 2, 4)
    with pytest.raises(ValueError, match="layer_9/mlp/up/kernel"):
        proj.block_plan({**shapes, "layer_9/mlp/up/kernel": (3, 3)}, cfg.num_layers, 2, 4)
    with pytest.raises(ValueError, match="num_blocks"):
        proj.block_plan(shapes, cfg.num_layers, cfg.num_layers + 1, 4)


@pytest.mark.parametrize("partitionable,dtype", covering([True, False], ["float32", "bfloat16"], strength=1))
def test_side_matrices_have_the_bits_of_a_draw_of_their_own_shape(partitionable, dtype):
    """`side_matrices` draws a flat power-of-two stream and cuts it (one threefry compile for many
    shapes): the same bits as the eager draw of the exact shape, below and above the 2^16-entry
    minimum length, and with the non-partitionable threefry (drawn as is)."""
    path = "layer_0/mlp/up/kernel"
    # Both draws are compiled under this module's flags: `conftest.update_compiler_config` clears
    # jax's caches when a module flips `jax_disable_most_optimizations` (they do not key on it).
    prev = jax.config.jax_threefry_partitionable
    jax.config.update("jax_threefry_partitionable", partitionable)
    try:
        for shape, k in [((5, 3), 2), ((1, 7), 3), ((300, 257), 256)]:  # 76,800 entries: 2^17
            got = proj.side_matrices(9, path, shape, k, jnp.dtype(dtype))
            key = jax.random.fold_in(jax.random.key(9), proj.path_hash(path))
            for side, (p, size) in enumerate(zip(got, shape)):
                want = (jax.random.normal(jax.random.fold_in(key, side), (k, size)) * (1.0 / np.sqrt(k))).astype(dtype)
                assert p.shape == (k, size) and p.dtype == jnp.dtype(dtype)
                np.testing.assert_array_equal(np.asarray(p, np.float32), np.asarray(want, np.float32))
    finally:
        jax.config.update("jax_threefry_partitionable", prev)


def test_keys_depend_on_path_and_seed_only():
    a = proj.side_matrices(3, "layer_0/mlp/up/kernel", (4, 5), 2)
    b = proj.side_matrices(3, "layer_0/mlp/up/kernel", (4, 5), 2)
    c = proj.side_matrices(3, "layer_0/mlp/gate/kernel", (4, 5), 2)
    d = proj.side_matrices(4, "layer_0/mlp/up/kernel", (4, 5), 2)
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
    assert not np.allclose(np.asarray(a[0]), np.asarray(c[0]))
    assert not np.allclose(np.asarray(a[0]), np.asarray(d[0]))
    assert not np.allclose(np.asarray(a[0])[:, :4], np.asarray(a[1])[:, :4])  # P0 and P1 independent
    assert proj.path_hash("layer_0/mlp/up/kernel") == proj.path_hash("layer_0/mlp/up/kernel")


def test_vectors_independent_of_tree_order():
    cfg, shapes = _tiny_shapes(layers=2)
    rng = np.random.default_rng(2)
    grads = {p: jnp.asarray(rng.normal(size=(1,) + s).astype(np.float32)) for p, s in shapes.items()}
    items = list(shapes.items())
    random.Random(0).shuffle(items)
    plan_a = proj.block_plan(shapes, cfg.num_layers, 2, 3)
    plan_b = proj.block_plan(dict(items), cfg.num_layers, 2, 3)
    shuffled = dict(random.Random(1).sample(list(grads.items()), len(grads)))
    np.testing.assert_array_equal(
        np.asarray(proj.project_grads(grads, plan_a, 0)), np.asarray(proj.project_grads(shuffled, plan_b, 0))
    )


@pytest.mark.parametrize("shape", [(1, 64), (8, 8), (64, 2), (32, 48)])
def test_scaling_preserves_norm_in_expectation_for_every_shape(shape):
    # E ||P0 W P1^T||^2 = ||W||^2 with N(0, 1/k) entries: no module is reweighted by its shape.
    k, trials = 8, 400
    w = jnp.asarray(np.random.default_rng(3).normal(size=shape).astype(np.float32))

    def one(i):
        p0, p1 = proj.side_matrices(i, "layer_0/mlp/up/kernel", shape, k)
        return jnp.sum(proj.project_matrix(w, p0, p1) ** 2)

    ratio = float(jnp.mean(jax.vmap(one)(jnp.arange(trials))) / jnp.sum(w * w))
    # Relative std of one trial is ~sqrt(2/k^2 + ...) <= ~0.6; over 400 trials the mean is within ~0.1.
    assert abs(ratio - 1.0) < 0.1, ratio
