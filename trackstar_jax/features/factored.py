"""Fast factored path: projected, corrected per-example gradients without materialising them.

For a dense layer `y_t = x_t W` (W `[m, n]`), the per-example gradient of the objective is
`G = sum_t x_t g_t^T` with `g_t = d obj / d y_t`. With the rank-one correction
`1/sqrt(V) = a b^T` (exact for factored Adafactor; see `preconditioner.py`), the projected,
corrected gradient is

    P0 (diag(a) G diag(b)) P1^T = sum_t (P0' x_t) (P1' g_t)^T,   P0' = P0 diag(a), P1' = P1 diag(b)

so the correction folds into the projection matrices and each token needs only two small
projections (k (m + n) multiply-adds) and a k x k outer product; the sum over tokens is one
batched contraction. A norm `y_t = xhat_t * s` (1-D scale seen as a `1 x n` matrix) has
`G = sum_t (xhat_t * g_t)`, projected as `P0' (P1' G)^T`; a bias `y_t = ... + c` (of a dense
layer or a LayerNorm, also `1 x n`) has `G = sum_t g_t`, projected the same way.

Mechanics (one forward, one batched backward). `model.apply(..., tap=...)` hands every
layer's `(x, y)` to a tap. The tap routes `y` through `_capture`, an identity in the forward
whose custom VJP, given the output cotangent `g`, returns the projected per-example gradient
`sum_t (P0' x_t)(P1' g_t)^T` as the cotangent of a dummy zero input `z_s [B, k, k]` shared by
every layer of block-side s. Differentiating the objective with respect to the dummies (and
nothing else) therefore yields the per-example block vectors directly: the backward pass
computes activation gradients only (no weight gradients), each layer's `g` is consumed as
soon as it exists, and the forward keeps `P0' x` (`[B, T, k]`) rather than `x` for kernels
whose input is wider than k (narrower inputs are kept as they are, and projected in the
backward pass).
Cost per token: forward + input-gradient backward (~4 |theta| FLOPs, vs ~6 for a training
step) plus the projections.

Where V is not rank-one (unfactored Adafactor, Adam) this path by default uses the
Adafactor-style rank-one factorisation of V (`preconditioner.rank_one_factors`); the reference
path applies the exact V. The measured difference is recorded in BUILD_NOTES.md ("Issue 3").
With `exact_v=True` (config `vectors.exact_v`) a dense layer whose correction holds an exact
element-wise factor F (`Correction.full`) is instead captured by `_capture_dense_exact`: its
backward materialises that one layer's per-example gradient `G_b = sum_t x_t g_t^T`
(`[B, m, n]`, freed before the next layer's), applies `G_b * F` and projects
`P0 (G_b * F) P1^T`: exact V at the cost of one weight-gradient contraction per such layer
(what a training step pays; bergson's Adam path does the same per module).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from trackstar_jax.distributed import runtime
from trackstar_jax.features import grads as grads_lib
from trackstar_jax.features import preconditioner as precond_lib
from trackstar_jax.features import projection as proj_lib
from trackstar_jax.models import layers as layers_lib
from trackstar_jax.models import lm as model_lib


@jax.custom_vjp
def _capture_dense(
    y: Float[Array, "b t n"], xp: Float[Array, "b t k"], p1: Float[Array, "k n"], z: Float[Array, "b k k"]
) -> Float[Array, "b t n"]:
    """Identity on `y`; its VJP sends `sum_t xp_t (P1' g_t)^T` to `z` (xp = P0' x, projected)."""
    del xp, p1, z
    return y


def _capture_dense_fwd(y, xp, p1, z):
    del z
    return y, (xp, p1)


def _capture_dense_bwd(res, g):
    xp, p1 = res
    gp = jnp.einsum("btn,kn->btk", g, p1.astype(g.dtype), preferred_element_type=jnp.float32)
    dz = jnp.einsum("btk,btl->bkl", xp, gp)
    return g, None, None, dz


_capture_dense.defvjp(_capture_dense_fwd, _capture_dense_bwd)


@jax.custom_vjp
def _capture_dense_lazy(
    y: Float[Array, "b t n"],
    x: Float[Array, "b t m"],
    p0: Float[Array, "k m"],
    p1: Float[Array, "k n"],
    z: Float[Array, "b k k"],
) -> Float[Array, "b t n"]:
    """As `_capture_dense`, but keeps `x` and projects it in the backward pass (for m <= k,
    where `x` is no larger than `P0' x`, and shared by the layers reading the same input)."""
    del x, p0, p1, z
    return y


def _capture_dense_lazy_fwd(y, x, p0, p1, z):
    del z
    return y, (x, p0, p1)


def _capture_dense_lazy_bwd(res, g):
    x, p0, p1 = res
    xp = jnp.einsum("btm,km->btk", x, p0.astype(x.dtype), preferred_element_type=jnp.float32)
    gp = jnp.einsum("btn,kn->btk", g, p1.astype(g.dtype), preferred_element_type=jnp.float32)
    return g, None, None, None, jnp.einsum("btk,btl->bkl", xp, gp)


_capture_dense_lazy.defvjp(_capture_dense_lazy_fwd, _capture_dense_lazy_bwd)


def _capture_dense_exact(
    y: Float[Array, "b t n"],
    x: Float[Array, "b t m"],
    p0: Float[Array, "k m"],
    p1: Float[Array, "k n"],
    f: Float[Array, "m n"],
    z: Float[Array, "b k k"],
    operand_dtype: str | None = None,
) -> Float[Array, "b t n"]:
    """Identity on `y`; its VJP sends `P0 ((sum_t x_t g_t^T) * F) P1^T` to `z`: the layer's
    per-example gradient materialised (one layer at a time), corrected element-wise by `F`.
    `operand_dtype` (the model's `matmul_dtype`, None: as they come): the dtype `x` and `g` are
    rounded to for the gradient's GEMM (float32 accumulation), as the layer's own GEMMs take them."""
    del x, p0, p1, f, z, operand_dtype
    return y


def _capture_dense_exact_fwd(y, x, p0, p1, f, z, operand_dtype):
    del z
    return y, (x if operand_dtype is None else x.astype(operand_dtype), p0, p1, f)


# Whether `_capture_dense_exact` materialises one example's `[m, n]` gradient at a time (a loop
# of 2-D GEMMs: the gradient stays in cache for its correction and projection) rather than the
# whole batch's `[B, m, n]` (one batched contraction). XLA:CPU ran the batched form's contraction
# and the layout copy after it 1.7-2.5x slower at the pythia-70m layer shapes (BUILD_NOTES, issue
# 13). Accelerators keep the batched form: a loop there would serialise the (sharded) batch.
EXACT_V_PER_EXAMPLE = {"cpu": True}


def _exact_projected(xt, g, p0, p1, f):
    """`P0 ((xt g) * F) P1^T` for one example (`xt [m, t]`: its inputs transposed, `g [t, n]`)
    -> `[k, l]`, the cheaper side projected first (`[k, n]` when m >= n, else `[m, l]`)."""
    grad = jnp.matmul(xt, g, preferred_element_type=jnp.float32) * f
    if grad.shape[0] >= grad.shape[1]:
        return jnp.matmul(p0, grad) @ p1.T
    return p0 @ jnp.matmul(grad, p1.T)


def _capture_dense_exact_bwd(operand_dtype, res, g):
    x, p0, p1, f = res
    # The inputs transposed once for the whole batch (`[B, m, T]`), not per example inside the
    # loop: the loop's `x^T g` ran 7-13% faster at the pythia-70m shapes (BUILD_NOTES, issue 13).
    if operand_dtype is None:
        xt, gg = jnp.swapaxes(x, 1, 2), g
    else:  # a bf16 GEMM's layout on the CPU: `x^T` written out (`layers.physical_transpose`)
        xt, gg = layers_lib.physical_transpose(x), g.astype(operand_dtype)
    if EXACT_V_PER_EXAMPLE.get(runtime.target_platform(), False):
        dz = jax.lax.map(lambda xg: _exact_projected(*xg, p0, p1, f), (xt, gg))
    else:
        dz = jax.vmap(_exact_projected, in_axes=(0, 0, None, None, None))(xt, gg, p0, p1, f)
    return g, None, None, None, None, dz


_capture_dense_exact = jax.custom_vjp(_capture_dense_exact, nondiff_argnums=(6,))
_capture_dense_exact.defvjp(_capture_dense_exact_fwd, _capture_dense_exact_bwd)


@jax.custom_vjp
def _capture_scale(
    y: Float[Array, "b t n"],
    xhat: Float[Array, "b t n"],
    p0: Float[Array, " k"],
    p1: Float[Array, "k n"],
    z: Float[Array, "b k k"],
) -> Float[Array, "b t n"]:
    """Identity on `y`; its VJP sends `p0 (P1' sum_t xhat_t * g_t)^T` to `z` (a norm scale)."""
    del xhat, p0, p1, z
    return y


def _capture_scale_fwd(y, xhat, p0, p1, z):
    del z
    return y, (xhat, p0, p1)


def _capture_scale_bwd(res, g):
    xhat, p0, p1 = res
    s = jnp.einsum("btn,btn->bn", xhat.astype(jnp.float32), g.astype(jnp.float32))
    u = jnp.einsum("bn,kn->bk", s, p1)
    dz = p0[None, :, None] * u[:, None, :]
    return g, None, None, None, dz


_capture_scale.defvjp(_capture_scale_fwd, _capture_scale_bwd)


@jax.custom_vjp
def _capture_bias(
    y: Float[Array, "b t n"], p0: Float[Array, " k"], p1: Float[Array, "k n"], z: Float[Array, "b k k"]
) -> Float[Array, "b t n"]:
    """Identity on `y`; its VJP sends `p0 (P1' sum_t g_t)^T` to `z` (a bias: it multiplies 1)."""
    del p0, p1, z
    return y


def _capture_bias_fwd(y, p0, p1, z):
    del z
    return y, (p0, p1)


def _capture_bias_bwd(res, g):
    p0, p1 = res
    u = jnp.einsum("btn,kn->bk", g.astype(jnp.float32), p1)
    return g, None, None, p0[None, :, None] * u[:, None, :]


_capture_bias.defvjp(_capture_bias_fwd, _capture_bias_bwd)


def folded_projections(
    plan: proj_lib.BlockPlan, correction: precond_lib.Correction | None, seed: int, unfolded: frozenset = frozenset()
) -> dict[str, tuple[Array, Array]]:
    """`{path: (P0 diag(a) [k, m], P1 diag(b) [k, n])}`: projections with the correction folded in
    (plain `(P0, P1)` for the paths in `unfolded`, whose correction is applied element-wise)."""
    out = {}
    for e in plan.entries:
        p0, p1 = proj_lib.side_matrices(seed, e.path, e.shape, plan.proj_dim)
        if correction is not None and e.path not in unfolded:
            p0 = p0 * correction.row[e.path][None, :]
            p1 = p1 * correction.col[e.path][None, :]
        out[e.path] = (p0, p1)
    return out


def exact_paths(correction: precond_lib.Correction | None, exact_v: bool) -> frozenset:
    """The kernels whose correction `factored_vectors` applies element-wise (`exact_v` and an
    element-wise factor in `correction.full`); every other correction is folded in."""
    return frozenset(correction.full) if (exact_v and correction is not None) else frozenset()


def step_projections(
    plan: proj_lib.BlockPlan, correction: precond_lib.Correction | None, seed: int, exact_v: bool = False
) -> dict[str, tuple[Array, Array]]:
    """`folded_projections` as `factored_vectors` uses them: the correction folded in except for
    the kernels it applies exactly (`exact_paths`)."""
    return folded_projections(plan, correction, seed, exact_paths(correction, exact_v))


def stack_projections(sets: Sequence[Mapping[str, tuple[Array, Array]]]) -> dict[str, tuple[Array, Array]]:
    """Several featurizers' projections (`step_projections` of settings that differ only in their
    correction or k) stacked along k: `{path: (P0 [K, m], P1 [K, n_out])}`, K = k_0 + ... +
    k_{n-1}, for one shared pass.

    One backward pass then serves all n: a layer's captured `sum_t (P0 x_t)(P1 g_t)^T` is
    `[K, K]`, and its k_i x k_i diagonal blocks are the n featurizers' own (`factored_vectors`
    keeps those; the off-diagonal blocks, K^2 - sum k_i^2 multiply-adds per token, are dropped).
    The projections themselves cost what n passes would; the forward and backward are paid once."""
    if not sets:
        raise ValueError("stack_projections needs at least one projection set")
    if any(s.keys() != sets[0].keys() for s in sets):
        raise ValueError("stack_projections: the projection sets cover different parameters")
    return {p: tuple(jnp.concatenate([s[p][i] for s in sets]) for i in (0, 1)) for p in sets[0]}


def factored_vectors(
    params: Any,
    correction: precond_lib.Correction | None,
    batch: Mapping[str, Array],
    *,
    graphdef: nnx.GraphDef,
    plan: proj_lib.BlockPlan,
    output_fn: str | Sequence[str] = "loss",
    role: str = "index",
    seed: int = 0,
    exact_v: bool = False,
    projections: Mapping[str, tuple[Array, Array]] | None = None,
    return_mean_prob: bool = False,
    set_dims: Sequence[int] | None = None,
) -> Float[Array, "b d"] | tuple[Array, Array | None]:
    """Projected, corrected per-example gradients by the factored path (same signature as
    `grads.reference_vectors`, plus `exact_v` and `return_mean_prob`).

    Args:
      params: model parameters.
      correction: `1/sqrt(V)`; its rank-one pair `(row, col)` is used (exact for factored
        Adafactor), and `full` is ignored unless `exact_v`. None = no correction.
      batch: `tokens [B, T]`, `loss_mask [B, T]`.
      graphdef: model graph definition.
      plan: block plan (k = plan.proj_dim).
      output_fn, role: see `grads.token_objective`. For n stacked sets, `output_fn` may name
        one output function per set (a tuple of n): the forward pass is shared and the backward
        runs once per distinct function (`jax.vjp`, vmapped over their cotangents), so TRAK's
        margin rows and the loss rows come from one pass.
      seed: projection seed.
      exact_v: apply the exact element-wise factor (`correction.full`, built with
        `from_opt_state(..., exact=True)`) to the dense layers that have one, by materialising
        one layer's per-example gradient at a time (`_capture_dense_exact`).
      projections: `step_projections(plan, correction, seed, exact_v)`, made once outside a
        jitted step and passed in; None makes them here (inside a jitted step their threefry
        streams are ~30k HLO ops: ~20 s of XLA:CPU compile at the pythia-14m shape). n sets
        stacked along k (`stack_projections`) make one pass give n featurizers' vectors.
      return_mean_prob: also return each row's p̄ (`grads.mean_target_prob`, TRAK's Q = 1 - p̄)
        from the same forward, or None where the pass makes no logits (the fused loss head).
      set_dims: static; the k of each stacked set, in stacking order, for sets of different k
        (featurizers whose d differ, Figure 2's d sweep); None: every set has `plan.proj_dim`.
        `plan` is any of the sets' plans (they differ only in k).

    Returns:
      `[B, d]` float32 in the layout `[2*num_blocks, k, k]`; for n stacked sets
      `[B, d_0 + ... + d_{n-1}]`, set i's `d_i = 2*num_blocks*k_i^2` columns after set i - 1's;
      with `return_mean_prob`, `(vectors, p̄ [B] or None)`.

    Raises:
      ValueError: if the model taps a parameter that is not in the block plan, or stacked
        sets meet a correction applied element-wise (`exact_v`), which does not fold in.
    """
    params = grads_lib.pure_params(params)
    inputs, targets, weights = model_lib.lm_targets(batch)
    b, k = inputs.shape[0], plan.proj_dim
    exact = exact_paths(correction, exact_v)
    # the exact path's per-example GEMMs take the model's GEMM operand dtype where the CPU runs
    # it in bf16 (`model.matmul_dtype`, `layers.LOWP_MATMUL`)
    model_od = getattr(getattr(nnx.merge(graphdef, params), "cfg", None), "matmul_dtype", "") or None
    lowp = layers_lib.LOWP_MATMUL.get(runtime.target_platform(), ())
    exact_od = model_od if exact and model_od in lowp else None
    projs = step_projections(plan, correction, seed, exact_v) if projections is None else projections
    kk = next(iter(projs.values()))[1].shape[0] if projs else k  # sum of the n stacked sets' k
    if set_dims is None:
        if kk % k:
            raise ValueError(f"projections of {kk} rows are not a stack of k={k} row sets")
        set_dims = (k,) * (kk // k)
    elif sum(set_dims) != kk:
        raise ValueError(f"projections of {kk} rows are not a stack of sets of {tuple(set_dims)} rows")
    n = len(set_dims)
    fns = (output_fn,) * n if isinstance(output_fn, str) else tuple(output_fn)
    if len(fns) != n:
        raise ValueError(f"{len(fns)} output functions for {n} stacked projection sets")
    objs = tuple(dict.fromkeys(fns))  # the distinct objectives, in order: one backward each
    if n > 1 and exact:
        raise ValueError("stacked projections cannot share a pass with an element-wise (exact_v) correction")
    entries = {e.path: e for e in plan.entries}
    unembed = any(p.split("/")[0] == model_lib.UNEMBED for p in entries)  # vectors.unembed

    def objective(zs):
        seen = set()

        def tap(path, x, y):
            if path not in entries:
                if not model_lib.is_attributed(path, unembed):
                    return y  # e.g. an attention key bias, or unembed: a model parameter left out
                raise ValueError(f"the model uses parameter {path!r}, which is not in the block plan")
            seen.add(path)
            e = entries[path]
            p0, p1 = projs[path]
            if e.kind == "bias":
                return _capture_bias(y, p0[:, 0], p1, zs[e.side])
            if e.kind == "scale":
                return _capture_scale(y, x, p0[:, 0], p1, zs[e.side])
            if path in exact:
                return _capture_dense_exact(y, x, p0, p1, correction.full[path], zs[e.side], exact_od)
            if e.shape[0] <= kk:  # keeping x costs no more memory than keeping P0' x
                return _capture_dense_lazy(y, x, p0, p1, zs[e.side])
            xp = jnp.einsum("btm,km->btk", x, p0.astype(x.dtype), preferred_element_type=jnp.float32)
            return _capture_dense(y, xp, p1, zs[e.side])

        if objs == ("loss",) and not unembed:
            # The fused head (no [B, T, V] logits; its input gradient made in the forward pass).
            # The loss weights are the objective's constant c_t = w_t (`grads.token_objective`).
            out, pbar = model_lib.nll_sum(graphdef, params, inputs, targets, weights, tap, weight_grad=False), None
            out = out[None]
        else:
            logits = model_lib.apply(graphdef, params, inputs, tap)
            out = jnp.stack([jnp.sum(grads_lib.token_objective(logits, targets, weights, f, role)) for f in objs])
            pbar = grads_lib.mean_target_prob(jax.lax.stop_gradient(logits), targets, weights)
        unused = sorted(set(entries) - seen)
        if unused:
            raise ValueError(f"block-plan parameter(s) never reached the model's tap: {', '.join(unused)}")
        return out, pbar

    zs = [jnp.zeros((b, kk, kk), jnp.float32) for _ in range(plan.num_sides)]
    if len(objs) == 1:

        def scalar(z):
            out, pbar = objective(z)
            return out[0], pbar

        grads, pbar = jax.grad(scalar, has_aux=True)(zs)
        sides = jnp.stack(grads, axis=1)[None]  # [1, B, S, K, K]
    else:  # one forward; the backward batched over the objectives' unit cotangents
        out, pull, pbar = jax.vjp(objective, zs, has_aux=True)
        (grads,) = jax.vmap(pull)(jnp.eye(len(objs), dtype=out.dtype))
        sides = jnp.stack(grads, axis=2)  # [m, B, S, K, K]
    if n == 1:
        vecs = sides[0].reshape(b, -1)
    else:
        # set i's vectors are the diagonal block [o_i:o_i + k_i, o_i:o_i + k_i] of every side
        # (o_i = k_0 + ... + k_{i-1}), in the backward of its own objective
        offs = [sum(set_dims[:i]) for i in range(n)]
        vecs = jnp.concatenate(
            [
                sides[objs.index(f), :, :, o : o + ki, o : o + ki].reshape(b, -1)
                for f, o, ki in zip(fns, offs, set_dims)
            ],
            axis=1,
        )
    return (vecs, pbar) if return_mean_prob else vecs
