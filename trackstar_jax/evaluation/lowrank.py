"""Exact low-rank tail-patch step (§4.3): the Adafactor step and the query log-probabilities of
`tailpatch.tailpatch_step`, without a per-proponent gradient or parameter copy.

A dense layer `y_t = x_t W` (W `[m, n]`) has the per-example gradient `G = X^T D` (X `[T, m]`
its inputs, D `[T, n]` the loss gradients at its outputs): rank <= T. Adafactor keeps it so:

* its factored second moments need only the row and column sums of G^2,
  `sum_j G_ij^2 = sum_t ((D D^T) X)_ti X_ti` and `sum_i G_ij^2 = sum_t ((X X^T) D)_tj D_tj`
  (O(T^2 (m + n)), never `m x n`);
* its update `G * row_factor * col_factor` is `X'^T D'` with the factors folded into X and D;
* the block-RMS clip needs `||X'^T D'||_F^2 = sum((X' X'^T) * (D' D'^T))`;
* the learning rate and the parameter scale `max(rms(W), 1e-3)` are scalars; weight decay
  multiplies W by a scalar.

So `W' = alpha W + X'^T D''` and a query's layer computes `x W' = alpha (x W) + (x X'^T) D''`:
the shared W is read once for every group (one batched GEMM instead of one per patched copy),
and the correction costs `T (m + n)` per token. The token embedding's gradient is
`onehot(tokens)^T D_0` (D_0 at the looked-up rows) plus, when the output head is the tied
embedding, `s dlogits^T H` (H the final hidden states, s the head's scale): one factor pair of
rank 2T. Norm scales, biases and any matrix Adafactor does not factor take the dense update.

The factors come from one forward and one activation-only backward: the model's taps
(`models.layers.Tap`, and the `embed` tap of `DecoderLM.hidden`) add a zero perturbation to
every layer output, whose gradient is D, and record the layer input X.

Only `DecoderLM` models whose every parameter is tapped, embedded or the head (`supported`)
and 1-D / 2-D parameters; others keep the dense step. Equality with `tailpatch_step` (optax's
own Adafactor on the materialised gradient) is pinned per architecture in tests/test_tailpatch.py.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jaxtyping import Array, Float, Int

from trackstar_jax.models import layers
from trackstar_jax.models import lm as model_lib
from trackstar_jax.training import step as train_lib

EMBED = "embed"
HEAD = "unembed/kernel"
_EPS = 1e-30  # optax.adafactor's default `eps` (added to G^2), as `train.make_optimizer` leaves it
_MIN_PARAM_RMS = 1e-3  # optax.scale_by_param_block_rms's default `min_scale`


def _tapped_paths(graphdef: nnx.GraphDef, params: Any, seq_len: int = 8) -> dict[str, tuple[int, ...]]:
    """`{path: output shape}` of every tap a forward of `[1, seq_len]` tokens reaches."""
    seen: dict[str, tuple[int, ...]] = {}

    def tap(path, x, y):
        seen[path] = tuple(y.shape)
        return y

    jax.eval_shape(lambda p: nnx.merge(graphdef, p).hidden(jnp.zeros((1, seq_len), jnp.int32), tap), params)
    return seen


def supported(graphdef: nnx.GraphDef, params: Any) -> str | None:
    """None when the low-rank step covers this model, else why not (the dense step is used)."""
    model = nnx.merge(graphdef, params)
    if not isinstance(model, model_lib.DecoderLM):
        return f"{type(model).__name__} is not a DecoderLM"
    flat = model_lib.flat_params(params)
    covered = set(_tapped_paths(graphdef, params)) | {EMBED} | (set() if model.cfg.tie_embeddings else {HEAD})
    missing = sorted(set(flat) - covered)
    if missing:
        return f"parameters no tap reaches: {missing[:4]}"
    high = sorted(p for p, x in flat.items() if len(x.shape) > 2)
    if high:
        return f"parameters of more than 2 dimensions: {high[:4]}"
    return None


def _head_scale(model: model_lib.DecoderLM) -> float:
    return 1.0 / math.sqrt(model.cfg.embed_dim) if model.SCALE_TIED_LOGITS else 1.0


def gradient_factors(
    params: Any, proponent: Mapping[str, Int[Array, " t"]], *, graphdef: nnx.GraphDef
) -> dict[str, Any]:
    """The gradient of the pretraining loss (`train.loss_fn`, a batch of one) on `proponent`,
    per parameter path: `("lowrank", X [r, m], D [r, n])` with G = X^T D, or `("dense", G)`.

    Shapes: proponent `tokens [T]`, `loss_mask [T]`; kernels r = T - 1 (the inputs), the
    embedding r = T - 1 or 2 (T - 1) when tied.
    """
    model = nnx.merge(graphdef, params)
    inputs, targets, weights = model_lib.lm_targets(
        {"tokens": proponent["tokens"][None], "loss_mask": proponent["loss_mask"][None]}
    )
    shapes = _tapped_paths(graphdef, params, inputs.shape[1])
    flat = model_lib.flat_params(params)

    def objective(perts):
        xs = {}

        def tap(path, x, y):
            xs[path] = x
            return y + perts[path].astype(y.dtype)

        h = model.hidden(inputs, tap)
        logits = model.logits(h) + perts["@logits"]
        nll = -jnp.sum(layers.token_log_probs(logits, targets) * weights)
        return nll / jnp.maximum(jnp.sum(weights), 1.0), (xs, h)

    zeros = {p: jnp.zeros(s, jnp.float32) for p, s in shapes.items()}
    zeros["@logits"] = jnp.zeros(targets.shape + (model.cfg.vocab_size,), jnp.float32)
    grads, (xs, h) = jax.grad(objective, has_aux=True)(zeros)

    out: dict[str, Any] = {}
    for path, g in grads.items():
        if path == "@logits":
            continue
        d = g.reshape(-1, g.shape[-1]).astype(jnp.float32)  # [T1, n]
        kind = path.rsplit("/", 1)[-1]
        if path == EMBED:
            onehot = jax.nn.one_hot(inputs[0], model.cfg.vocab_size, dtype=jnp.float32)
            out[path] = ("lowrank", onehot, d)
        elif kind == "kernel":
            out[path] = ("lowrank", xs[path].reshape(-1, xs[path].shape[-1]).astype(jnp.float32), d)
        elif kind == "scale":
            out[path] = ("dense", jnp.sum(xs[path].reshape(d.shape).astype(jnp.float32) * d, axis=0))
        elif kind == "bias":
            out[path] = ("dense", jnp.sum(d, axis=0))
        else:
            raise ValueError(f"low-rank tail-patch: no rule for parameter kind {kind!r} ({path})")
    dlogits = grads["@logits"][0]  # [T1, V]
    hid = h[0].astype(jnp.float32)  # [T1, d]
    if model.cfg.tie_embeddings:  # logits = H (s E^T): dE += s dlogits^T H
        _, x0, d0 = out[EMBED]
        out[EMBED] = ("lowrank", jnp.concatenate([x0, _head_scale(model) * dlogits]), jnp.concatenate([d0, hid]))
    else:
        out[HEAD] = ("lowrank", hid, dlogits)
    missing = set(flat) - set(out)
    if missing:
        raise ValueError(f"low-rank tail-patch: no gradient for {sorted(missing)[:4]} (see `supported`)")
    return out


def _factored_dims(shape: tuple[int, ...], min_dim: int) -> tuple[int, int] | None:
    """optax's rule (`factorized._factored_dims`): the two largest axes, when the smaller of
    them has at least `min_dim_size_to_factor` entries; `(d1, d0)` with d0 the largest."""
    if len(shape) < 2:
        return None
    order = np.argsort(shape)
    if shape[order[-2]] < min_dim:
        return None
    return int(order[-2]), int(order[-1])


def _opt_states(opt_state: Any) -> tuple[Any, Any]:
    """The chain's `FactoredState` and the learning rate's schedule count."""
    factored = next(s for s in opt_state if isinstance(s, optax.FactoredState))
    sched = [s for s in opt_state if isinstance(s, optax.ScaleByScheduleState)]
    if len(sched) != 1:
        raise ValueError("low-rank tail-patch: expected one scheduled learning rate in the optimizer state")
    return factored, sched[0].count


def adafactor_patch(
    factors: Mapping[str, tuple],
    params: Any,
    opt_state: Any,
    opt_cfg: train_lib.OptimizerConfig,
    lr_scale: float | Array = 1.0,
) -> dict[str, tuple]:
    """The tail-patch update `W' - W` of `optax.adafactor` (as `train.make_optimizer(opt_cfg)`
    builds it) for a gradient given as `gradient_factors`, times `lr_scale`, per path:
    `("lowrank", alpha, X', D')` meaning `W' = alpha W + X'^T D'`, or `("dense", W' - W)`.
    """
    fstate, sched_count = _opt_states(opt_state)
    lr = train_lib.make_schedule(opt_cfg)(sched_count)
    decay = 1.0 - jnp.asarray(fstate.count + 1, jnp.float32) ** (-opt_cfg.decay_rate)
    flat = model_lib.flat_params(params)
    v_row, v_col, v = (model_lib.flat_params(t) for t in (fstate.v_row, fstate.v_col, fstate.v))
    wd = opt_cfg.weight_decay_rate
    thr = opt_cfg.clipping_threshold
    out = {}
    for path, f in factors.items():
        w = flat[path].astype(jnp.float32)
        dims = _factored_dims(w.shape, opt_cfg.min_dim_size_to_factor)
        if f[0] == "lowrank" and dims is None:  # a small matrix keeps a full v: its dense gradient
            f = ("dense", f[1].T @ f[2])
        if f[0] == "lowrank":
            _, x, d = f
            rows = jnp.sum((jnp.dot(d, d.T) @ x) * x, axis=0)  # sum_j G_ij^2, [m]
            cols = jnp.sum((jnp.dot(x, x.T) @ d) * d, axis=0)  # sum_i G_ij^2, [n]
            means = (cols / w.shape[0], rows / w.shape[1])  # mean of G^2 over axis 0, over axis 1
            d1, d0 = dims
            new_row = decay * v_row[path] + (1.0 - decay) * (means[d0] + _EPS)  # along axis d1
            new_col = decay * v_col[path] + (1.0 - decay) * (means[d1] + _EPS)  # along axis d0
            row_f = (new_row / jnp.mean(new_row)) ** -0.5
            col_f = new_col**-0.5
            f0, f1 = (row_f, col_f) if d1 == 0 else (col_f, row_f)
            x, d = x * f0[None, :], d * f1[None, :]
            sq = jnp.sum(jnp.dot(x, x.T) * jnp.dot(d, d.T))  # ||X^T D||_F^2
        else:
            g = f[1]
            if dims is None:
                u = g * (decay * v[path] + (1.0 - decay) * (g * g + _EPS)) ** -0.5
            else:
                raise ValueError(f"low-rank tail-patch: {path} is factored but its gradient came dense")
            sq = jnp.sum(u * u)
        c = lr
        if thr is not None:
            c = c / jnp.maximum(1.0, jnp.sqrt(sq / w.size) / thr)
        if opt_cfg.multiply_by_parameter_scale:
            c = c * jnp.maximum(jnp.sqrt(jnp.mean(w * w)), _MIN_PARAM_RMS)
        # optax: u <- c u (+ wd W), then -1; the tail-patch step multiplies the update by lr_scale
        alpha = 1.0 - lr_scale * wd if wd is not None else jnp.float32(1.0)
        if f[0] == "lowrank":
            out[path] = ("lowrank", alpha, x, -(lr_scale * c) * d)
        else:
            out[path] = ("dense", -(lr_scale * c) * u + (alpha - 1.0) * w)
    return out


def patched_log_probs(
    params: Any, patch: Mapping[str, tuple], queries: Mapping[str, Int[Array, "g t"]], *, graphdef: nnx.GraphDef
) -> Float[Array, " g"]:
    """log p(target | prompt) of G queries under `W + patch` (`adafactor_patch`), as
    `tailpatch.target_log_probs` under the patched parameters: every layer computes its output
    with the shared W and adds the patch's low-rank (or dense) term."""
    model = nnx.merge(graphdef, params)

    def low(x, p):  # (x X'^T) D'
        _, _, xf, df = p
        return jnp.einsum("...m,rm->...r", x.astype(jnp.float32), xf) @ df

    def tap(path, x, y):
        p = patch[path]
        yf = y.astype(jnp.float32)
        if path == EMBED:
            if p[0] == "lowrank":  # rows of X'^T D' at the tokens: X'[:, tokens]^T D'
                extra = jnp.einsum("r...,rd->...d", p[2][:, x], p[3]) + (p[1] - 1.0) * yf
            else:
                extra = jnp.take(p[1], x, axis=0)
        elif path.endswith("/kernel"):
            extra = low(x, p) + (p[1] - 1.0) * yf if p[0] == "lowrank" else jnp.einsum("...m,mn->...n", x, p[1])
        elif path.endswith("/scale"):
            extra = x.astype(jnp.float32) * p[1]
        else:  # bias
            extra = jnp.broadcast_to(p[1], y.shape)
        return (yf + extra).astype(y.dtype)

    def logits_fn(tokens):
        h = model.hidden(tokens, tap)
        logits = model.logits(h)
        hf = h.astype(jnp.float32)
        if model.cfg.tie_embeddings:  # logits = H s (E + dE)^T
            p, s = patch[EMBED], _head_scale(model)
            if p[0] == "lowrank":
                extra = s * jnp.einsum("...d,rd->...r", hf, p[3]) @ p[2] + (p[1] - 1.0) * logits
            else:
                extra = s * jnp.einsum("...d,vd->...v", hf, p[1])
        else:
            p = patch[HEAD]
            if p[0] == "lowrank":
                extra = low(hf, p) + (p[1] - 1.0) * logits
            else:
                extra = jnp.einsum("...d,dv->...v", hf, p[1])
        return logits + extra

    return -layers.example_losses(logits_fn, queries)


def tailpatch_step(
    params: Any,
    opt_state: Any,
    proponent: Mapping[str, Int[Array, " t"]],
    queries: Mapping[str, Int[Array, "g tq"]],
    *,
    graphdef: nnx.GraphDef,
    opt_cfg: train_lib.OptimizerConfig,
    lr_scale: float | Array = 1.0,
) -> Float[Array, " g"]:
    """`tailpatch.tailpatch_step` (same arguments, `opt_cfg` for the optimizer it builds; same
    result to float32 rounding) through the low-rank gradient and update.

    Returns:
      log p(target | prompt; theta') of each query, float32 `[G]`.
    """
    factors = gradient_factors(params, proponent, graphdef=graphdef)
    patch = adafactor_patch(factors, params, opt_state, opt_cfg, lr_scale)
    return patched_log_probs(params, patch, queries, graphdef=graphdef)
