"""Output functions (paper §A.1.1) and the exact, materialised reference path (§3, Eq. 2).

Both gradient paths differentiate the same per-token objective, `token_objective`:

    obj(z) = sum_t  stopgrad(c_t) * f_t          (sum over target tokens, mask w_t)

so that `grad obj = sum_t c_t grad f_t` (the per-token Q of §A.1.1 applied inside the sum):

| output_fn | f_t                            | c_t                       |
| --------- | ------------------------------ | ------------------------- |
| `loss`    | -log p_t                       | w_t                       |
| `margin`  | log(p_t / (1 - p_t))           | w_t (p_t - 1)             |
| `logit`   | logit of the target token      | w_t (p_t - 1)             |
| `trak`    | log(p_t / (1 - p_t))           | w_t                       |

`loss` is TrackStar's choice. With per-token Q, `margin` equals `loss` exactly in exact
arithmetic (-log p = softplus(-f), so (p-1) grad f = grad(-log p)); we keep it because the
paper does, and it is a useful cross-check. `trak` is TRAK's variant: margin gradients summed
over tokens with no per-token Q. TRAK's example-level Q = 1 - pbar (pbar = mean p over target
tokens, `mean_target_prob`) multiplies the candidate's *score*, after R (TRAK; §4.4 footnote,
§A.1.1): it is never folded into the stored vectors, so R_train stays Σ φφᵀ, not Σ Q²φφᵀ
(`index/trak.py` computes Q per candidate; retrieval multiplies the scores by it). A query
gets no Q: an example-level factor on the query does not change its ranking.

The reference path (`reference_vectors`) materialises per-example gradients with
`vmap(grad)`, multiplies them by the correction element-wise and projects every matrix with
the dense `P0 G P1^T`: exactly Eq. 2 as written, used by tests and small models.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from trackstar_jax.features import preconditioner as precond_lib
from trackstar_jax.features import projection as proj_lib
from trackstar_jax.models import lm as model_lib

OUTPUT_FNS = ("loss", "margin", "logit", "trak")
ROLES = ("index", "query")


def token_objective(
    logits: Float[Array, "b t v"],
    targets: Int[Array, "b t"],
    weights: Float[Array, "b t"],
    output_fn: str = "loss",
    role: str = "index",
) -> Float[Array, " b"]:
    """Per-example objective whose gradient is the (Q-weighted) output-function gradient.

    Args:
      logits: model logits for next-token prediction.
      targets: next tokens.
      weights: loss mask (1 on target tokens, 0 on prompt, BOS and padding).
      output_fn: one of `OUTPUT_FNS` (table in the module docstring).
      role: "index" (candidate rows) or "query"; kept for callers, it no longer changes the
        objective (TRAK's Q multiplies scores instead, `index/trak.py`).

    Returns:
      `[B]`: sum_t stopgrad(c_t) f_t per example.
    """
    if output_fn not in OUTPUT_FNS:
        raise ValueError(f"vectors.output_fn must be one of {OUTPUT_FNS}, got {output_fn!r}")
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    logits = logits.astype(jnp.float32)
    w = weights.astype(jnp.float32)
    logp, target_logit = _target_log_probs(logits, targets)
    p = jax.lax.stop_gradient(jnp.exp(logp))
    if output_fn == "loss":
        f, c = -logp, w
    elif output_fn == "logit":
        f, c = target_logit, w * (p - 1.0)
    else:
        # margin log(p/(1-p)) = logit_y - logsumexp_{v != y} logit_v, stable as p -> 1.
        onehot = jax.nn.one_hot(targets, logits.shape[-1], dtype=bool)
        f = target_logit - jax.nn.logsumexp(jnp.where(onehot, -jnp.inf, logits), axis=-1)
        # trak: no per-token Q; its example-level Q multiplies scores (index/trak.py)
        c = w * (p - 1.0) if output_fn == "margin" else w
    return jnp.sum(jax.lax.stop_gradient(c) * f, axis=-1)


def _target_log_probs(
    logits: Float[Array, "b t v"], targets: Int[Array, "b t"]
) -> tuple[Float[Array, "b t"], Float[Array, "b t"]]:
    """`(log p(target_t), logit_t)` in float32, as logit - logsumexp (no `[b, t, v]` log-softmax:
    in one step with `token_objective` the two share it)."""
    logits = logits.astype(jnp.float32)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return target_logit - jax.nn.logsumexp(logits, axis=-1), target_logit


def mean_target_prob(
    logits: Float[Array, "b t v"], targets: Int[Array, "b t"], weights: Float[Array, "b t"]
) -> Float[Array, " b"]:
    """pbar: the mean over target tokens of p(target_t) (TRAK's Q = 1 - pbar, §4.4 footnote).

    A row without target tokens gets 0 (Q = 1).
    """
    logp, _ = _target_log_probs(logits, targets)
    w = weights.astype(jnp.float32)
    return jnp.sum(w * jnp.exp(logp), axis=-1) / jnp.maximum(jnp.sum(w, axis=-1), 1.0)


def pure_params(params: Any) -> dict:
    """A pure nested dict of arrays from an nnx.State or a pure dict."""
    return nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params


def unflatten(flat: Mapping[str, Any]) -> dict:
    """`{'a/b/c': x}` -> `{'a': {'b': {'c': x}}}`."""
    out: dict = {}
    for path, x in flat.items():
        node = out
        parts = path.split("/")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = x
    return out


def per_example_grads(
    params: Any,
    batch: Mapping[str, Array],
    plan: proj_lib.BlockPlan,
    *,
    graphdef: nnx.GraphDef,
    output_fn: str = "loss",
    role: str = "index",
) -> dict[str, Array]:
    """Per-example gradients of the objective w.r.t. every attributed parameter (vmap(grad)).

    Args:
      params: model parameters.
      batch: `tokens [B, T]`, `loss_mask [B, T]`.
      plan: the block plan (its paths are the attributed parameters).
      graphdef: model graph definition.
      output_fn, role: see `token_objective`.

    Returns:
      `{path: [B, *param_shape]}` float32.
    """
    flat = model_lib.flat_params(pure_params(params))
    attributed = {p: flat[p] for p in plan.paths}
    frozen = {p: x for p, x in flat.items() if p not in attributed}

    def one(attr, tokens, mask):
        full = unflatten({**frozen, **attr})
        inputs, targets, weights = model_lib.lm_targets({"tokens": tokens[None], "loss_mask": mask[None]})
        logits = model_lib.apply(graphdef, full, inputs)
        return token_objective(logits, targets, weights, output_fn, role)[0]

    grads = jax.vmap(jax.grad(one), in_axes=(None, 0, 0))(attributed, batch["tokens"], batch["loss_mask"])
    return {p: g.astype(jnp.float32) for p, g in grads.items()}


def reference_vectors(
    params: Any,
    correction: precond_lib.Correction | None,
    batch: Mapping[str, Array],
    *,
    graphdef: nnx.GraphDef,
    plan: proj_lib.BlockPlan,
    output_fn: str = "loss",
    role: str = "index",
    seed: int = 0,
    projections: Mapping[str, tuple[Array, Array]] | None = None,
) -> Float[Array, "b d"]:
    """Eq. 2 as written: materialised per-example gradients -> g / sqrt(V) -> P0 G P1^T, summed per block.

    Args:
      params: model parameters.
      correction: `1/sqrt(V)` (uses the exact element-wise factor where it holds one), or
        None for no correction.
      batch: `tokens [B, T]`, `loss_mask [B, T]`.
      graphdef: model graph definition.
      plan: block plan (k = plan.proj_dim).
      output_fn, role: see `token_objective`.
      seed: projection seed.
      projections: the plain `(P0, P1)` of every parameter (`vectors.step_projections`), made
        outside a jitted step; None makes them here (see `projection.project_grads`).

    Returns:
      `[B, d]` float32 in the layout `[2*num_blocks, k, k]` (block0_attn, block0_mlp, ...).
    """
    grads = per_example_grads(params, batch, plan, graphdef=graphdef, output_fn=output_fn, role=role)
    if correction is not None:
        grads = precond_lib.apply_elementwise(grads, correction)
    sides = proj_lib.project_grads(grads, plan, seed, projections)
    return sides.reshape(sides.shape[0], -1)
