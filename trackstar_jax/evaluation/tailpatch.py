"""Tail-patch influence metric (§4.3, Table A.1).

"Starting from the final model checkpoint and maintaining all pretraining hyperparameters,
we take a single training step — a *tail-patch* step — on a single retrieved proponent and
measure the change in probability of the target sequence."

For a query q = (prompt, target) and a proponent z:

    theta' = theta + Adafactor_update(grad_theta Loss(z; theta), opt_state, theta)
    delta(q, z) = p(target | prompt; theta') - p(target | prompt; theta)

where Loss is the pretraining objective (`train.loss_fn`: mean next-token loss over z's
tokens, a batch of one), the optimizer is the run's own `train.make_optimizer(OptimizerConfig)`
fed the checkpoint's optimizer state — so the step uses the second moments, the step count,
the update clipping, the parameter scaling and the learning rate of the schedule at the
final step, exactly as pretraining's next step would — and p(target | prompt) is the product
of the target tokens' probabilities. The per-query score is the mean of delta over the top-k
proponents (`metrics.tailpatch_at_k`).

`tailpatch_step` is one (proponent, query) pair; `tailpatch_pairs` vmaps it over a batch of
pairs; `make_jit_tailpatch` jits that with the pair batch split over the mesh's data axes and
the model and optimizer state in the training shardings (split over `fsdp` when it is > 1).
Every pair updates its own copy of the parameters, so memory grows as pairs x parameters
(/ fsdp): size `tailpatch.batch_size` accordingly.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jaxtyping import Array, Float, Int

from trackstar_jax.distributed import memory as memory_lib
from trackstar_jax.distributed import sharding as sharding_lib
from trackstar_jax.models import lm as model_lib
from trackstar_jax.training import step as train_lib


def target_log_prob(params: Any, query: Mapping[str, Int[Array, " t"]], *, graphdef: nnx.GraphDef) -> Float[Array, ""]:
    """log p(target | prompt) of one query: the sum of its target tokens' log-probabilities.

    Args:
      params: model parameters (pure dict).
      query: `tokens [T]` (BOS + prompt + target, padded) and `loss_mask [T]` (1 on target tokens).
      graphdef: the model's graphdef.
    """
    batch = {"tokens": query["tokens"][None], "loss_mask": query["loss_mask"][None]}
    return -model_lib.example_losses(lambda x: model_lib.apply(graphdef, params, x), batch)[0]


def tailpatch_step(
    params: Any,
    opt_state: Any,
    proponent: Mapping[str, Int[Array, " t"]],
    query: Mapping[str, Int[Array, " tq"]],
    *,
    graphdef: nnx.GraphDef,
    opt: optax.GradientTransformation,
    lr_scale: float | Array = 1.0,
) -> Float[Array, ""]:
    """One pretraining step on `proponent`, then log p(query target) under the new parameters.

    Args:
      params: final-checkpoint parameters.
      opt_state: final-checkpoint optimizer state (its step count drives the schedule).
      proponent: `tokens [T]`, `loss_mask [T]` of one training example.
      query: `tokens [Tq]`, `loss_mask [Tq]` of one query.
      graphdef: model graphdef.
      opt: the run's optimizer, `train.make_optimizer(optimizer_config)`.
      lr_scale: multiplies the update (1.0 = the schedule's learning rate; see
        `learning_rate_scale` for an override).

    Returns:
      log p(target | prompt; theta') as a float32 scalar.
    """
    batch = {"tokens": proponent["tokens"][None], "loss_mask": proponent["loss_mask"][None]}
    grads = jax.grad(lambda p: train_lib.loss_fn(p, graphdef, batch)[0])(params)
    updates, _ = opt.update(grads, opt_state, params)
    updates = jax.tree.map(lambda u: u * lr_scale, updates)
    return target_log_prob(optax.apply_updates(params, updates), query, graphdef=graphdef)


def tailpatch_pairs(
    params: Any,
    opt_state: Any,
    proponents: Mapping[str, Int[Array, "p t"]],
    queries: Mapping[str, Int[Array, "p tq"]],
    *,
    graphdef: nnx.GraphDef,
    opt: optax.GradientTransformation,
    lr_scale: float | Array = 1.0,
) -> dict[str, Float[Array, " p"]]:
    """`tailpatch_step` vmapped over pairs (row i: proponent i patched, query i measured).

    Returns:
      `{"log_prob_before": [P], "log_prob_after": [P], "delta_prob": [P]}` where
      `delta_prob = exp(after) - exp(before)` is the change in the target's probability.
    """
    step = functools.partial(tailpatch_step, graphdef=graphdef, opt=opt, lr_scale=lr_scale)
    after = jax.vmap(step, in_axes=(None, None, 0, 0))(params, opt_state, proponents, queries)
    before = jax.vmap(functools.partial(target_log_prob, graphdef=graphdef), in_axes=(None, 0))(params, queries)
    # p' - p = p (exp(log p' - log p) - 1): expm1 keeps small changes exact in float32.
    return {
        "log_prob_before": before,
        "log_prob_after": after,
        "delta_prob": jnp.exp(before) * jnp.expm1(after - before),
    }


def make_jit_tailpatch(mesh: jax.sharding.Mesh, *, graphdef: nnx.GraphDef, opt: optax.GradientTransformation):
    """`jit(tailpatch_pairs)`: pairs split over (data, fsdp); parameters and optimizer state in
    `sharding.fsdp_shardings` (replicated unless the mesh's fsdp axis has size > 1, then each
    leaf split over it by its own shape, as in training; XLA gathers what each layer needs).

    The returned function takes `(params, opt_state, proponents, queries, lr_scale)`, places
    the state in those shardings (a no-op when it already is, e.g. from `load_run(mesh=...)`)
    and runs the step; the pair batch size must be a multiple of the mesh's data-parallel size
    (pad with repeated pairs).
    """
    rep = sharding_lib.replicated(mesh)
    rows = sharding_lib.batch_sharding(mesh, 2)
    vec = sharding_lib.batch_sharding(mesh, 1)
    pair = {"tokens": rows, "loss_mask": rows}

    def fn(params, opt_state, proponents, queries, lr_scale):
        return tailpatch_pairs(params, opt_state, proponents, queries, graphdef=graphdef, opt=opt, lr_scale=lr_scale)

    # None: the state's shardings are those it is placed in below (derived from its shapes).
    jitted = jax.jit(fn, in_shardings=(None, None, pair, pair, rep), out_shardings=vec)

    def call(params, opt_state, proponents, queries, lr_scale):
        params, opt_state = jax.device_put((params, opt_state), sharding_lib.fsdp_shardings((params, opt_state), mesh))
        return jitted(params, opt_state, proponents, queries, lr_scale)

    call.jitted, call.mesh = jitted, mesh
    return call


def compile_tailpatch(jit_fn, params: Any, opt_state: Any, batch_size: int, prop_len: int, query_len: int) -> Any:
    """AOT-compiles `make_jit_tailpatch`'s step for `batch_size` pairs of a `prop_len`-token
    proponent and a `query_len`-token query, on the shapes of `params` / `opt_state` (arrays or
    ShapeDtypeStructs, placed as the call places them; nothing is computed or allocated)."""
    mesh = jit_fn.mesh
    state_sh = sharding_lib.fsdp_shardings((params, opt_state), mesh)
    state = jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), (params, opt_state), state_sh
    )
    rows = sharding_lib.batch_sharding(mesh, 2)

    def pair(t):
        return {k: jax.ShapeDtypeStruct((batch_size, t), np.int32, sharding=rows) for k in ("tokens", "loss_mask")}

    lr = jax.ShapeDtypeStruct((), np.float32, sharding=sharding_lib.replicated(mesh))
    return jit_fn.jitted.lower(*state, pair(prop_len), pair(query_len), lr).compile()


def check_fits(jit_fn, params: Any, opt_state: Any, batch_size: int, max_len: int) -> dict:
    """Refuses (`memory.DoesNotFitError`, naming `tailpatch.batch_size` and the other knobs) a
    tail-patch step of `batch_size` pairs of `max_len`-token proponents and queries (the longest
    rows) that does not fit in device memory; before any pair runs.

    Returns:
      The step's `memory.compiled_memory` (`{}` without an analysis).
    """
    mem = memory_lib.compiled_memory(compile_tailpatch(jit_fn, params, opt_state, batch_size, max_len, max_len))
    what = f"{batch_size} pairs x {max_len} tokens on mesh {dict(jit_fn.mesh.shape)}"
    memory_lib.check_fits("tailpatch", mem.get("peak_bytes"), what=what)
    return mem


def learning_rate_scale(opt_cfg: train_lib.OptimizerConfig, step: int, learning_rate: float) -> float:
    """Factor that turns the schedule's step-`step` learning rate into `learning_rate`.

    Adafactor's update is linear in the learning rate (it scales the clipped update before the
    parameter-scale factor and the sign flip), so an override is a plain rescale. A negative
    `learning_rate` means "keep the schedule's value" (factor 1). The optimizer state's count
    equals the checkpoint step, and `make_schedule` is evaluated at that count.

    Raises:
      ValueError: with weight decay the update is not linear in the learning rate.
    """
    if learning_rate < 0:
        return 1.0
    if opt_cfg.weight_decay_rate is not None:
        raise ValueError(
            "tailpatch.learning_rate override needs weight_decay_rate=None (the update is not linear in lr)"
        )
    scheduled = float(train_lib.make_schedule(opt_cfg)(step))
    return float(learning_rate) / scheduled


def run_pairs(
    jit_fn,
    params: Any,
    opt_state: Any,
    prop_rows: Mapping[str, np.ndarray],
    query_rows: Mapping[str, np.ndarray],
    pairs: np.ndarray,
    *,
    batch_size: int,
    lr_scale: float,
    progress=None,
    mesh: jax.sharding.Mesh | None = None,
) -> dict[str, np.ndarray]:
    """Runs `jit_fn` over index pairs in fixed-size batches (the last one padded by repetition).

    Args:
      jit_fn: from `make_jit_tailpatch`.
      params, opt_state: the final checkpoint.
      prop_rows: encoded proponents `{"tokens": [N, T], "loss_mask": [N, T]}`.
      query_rows: encoded queries `{"tokens": [Q, Tq], "loss_mask": [Q, Tq]}`.
      pairs: `[P, 2]` int rows (query row, proponent row).
      batch_size: pairs per call (static shape; a multiple of the data-parallel size).
      lr_scale: see `learning_rate_scale`.
      progress: optional callable(num_done) for progress reporting.
      mesh: `jit_fn`'s mesh; when it spans several processes (a pod) the pairs of each batch
        are placed where its devices are and the results gathered to every process.

    Returns:
      `{"log_prob_before", "log_prob_after", "delta_prob"}`, each `[P]` float64 numpy.
    """
    pairs = np.asarray(pairs, np.int64).reshape(-1, 2)
    out = {k: np.zeros((len(pairs),), np.float64) for k in ("log_prob_before", "log_prob_after", "delta_prob")}
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        n = len(chunk)
        if n < batch_size:
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch_size - n, axis=0)])
        props = {k: prop_rows[k][chunk[:, 1]] for k in ("tokens", "loss_mask")}
        qs = {k: query_rows[k][chunk[:, 0]] for k in ("tokens", "loss_mask")}
        if mesh is not None and mesh.is_multi_process:  # a pod: each process places its devices' pairs
            props, qs = sharding_lib.device_batch(props, mesh), sharding_lib.device_batch(qs, mesh)
            lr = sharding_lib.put_global(np.float32(lr_scale), sharding_lib.replicated(mesh))
        else:
            props, qs, lr = jax.tree.map(jnp.asarray, (props, qs)) + (jnp.float32(lr_scale),)
        res = sharding_lib.to_host(jit_fn(params, opt_state, props, qs, lr))
        for k in out:
            out[k][start : start + n] = np.asarray(res[k][:n], np.float64)
        if progress is not None:
            progress(start + n)
    return out
