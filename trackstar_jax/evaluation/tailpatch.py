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

The step depends only on the proponent, so pairs that share one share its step: a *group* is
one proponent and up to G queries measured under its patched parameters (in a T-REx table the
rows' top-10 lists hold ~4.5 queries per distinct proponent). `tailpatch_step` is one group;
`tailpatch_groups` vmaps it over B groups; `tailpatch_pairs` is the plain per-pair form (groups
of one); `make_jit_tailpatch` jits the groups with the batch split over the mesh's data axes
and the model and optimizer state in the training shardings (split over `fsdp` when it is > 1);
`run_pairs` groups any list of pairs. `tailpatch.queries_per_step` is G.

Two steps compute the same thing (`tailpatch.step`): "lowrank" (default; `evaluation/lowrank.py`)
keeps each proponent's gradient and Adafactor update as per-layer factors of rank <= T and runs
the queries through the shared parameters plus those factors: no per-proponent gradient or
parameter copy; "dense" (this module's `tailpatch_step`, the reference) materialises both, so
its memory grows as B x parameters (/ fsdp). Models the low-rank step does not cover
(`lowrank.supported`) take the dense one. Size `tailpatch.batch_size` (B) with `launch.plan`.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jaxtyping import Array, Float, Int

from trackstar_jax import data as data_lib
from trackstar_jax.distributed import memory as memory_lib
from trackstar_jax.distributed import sharding as sharding_lib
from trackstar_jax.evaluation import lowrank
from trackstar_jax.models import lm as model_lib
from trackstar_jax.training import step as train_lib


def target_log_probs(
    params: Any, queries: Mapping[str, Int[Array, "g t"]], *, graphdef: nnx.GraphDef
) -> Float[Array, " g"]:
    """log p(target | prompt) of G queries in one forward pass: per query, the sum of its
    target tokens' log-probabilities.

    Args:
      params: model parameters (pure dict).
      queries: `tokens [G, T]` (BOS + prompt + target, padded) and `loss_mask [G, T]` (1 on
        target tokens).
      graphdef: the model's graphdef.
    """
    return -model_lib.example_losses(lambda x: model_lib.apply(graphdef, params, x), queries)


def tailpatch_step(
    params: Any,
    opt_state: Any,
    proponent: Mapping[str, Int[Array, " t"]],
    queries: Mapping[str, Int[Array, "g tq"]],
    *,
    graphdef: nnx.GraphDef,
    opt: optax.GradientTransformation,
    lr_scale: float | Array = 1.0,
) -> Float[Array, " g"]:
    """One pretraining step on `proponent`, then log p(target) of each of G queries under the
    new parameters (one step, G measurements: the step does not depend on the query).

    Args:
      params: final-checkpoint parameters.
      opt_state: final-checkpoint optimizer state (its step count drives the schedule).
      proponent: `tokens [T]`, `loss_mask [T]` of one training example.
      queries: `tokens [G, Tq]`, `loss_mask [G, Tq]` of G queries.
      graphdef: model graphdef.
      opt: the run's optimizer, `train.make_optimizer(optimizer_config)`.
      lr_scale: multiplies the update (1.0 = the schedule's learning rate; see
        `learning_rate_scale` for an override).

    Returns:
      log p(target | prompt; theta') of each query, float32 `[G]`.
    """
    batch = {"tokens": proponent["tokens"][None], "loss_mask": proponent["loss_mask"][None]}
    grads = jax.grad(lambda p: train_lib.loss_fn(p, graphdef, batch)[0])(params)
    updates, _ = opt.update(grads, opt_state, params)
    updates = jax.tree.map(lambda u: u * lr_scale, updates)
    return target_log_probs(optax.apply_updates(params, updates), queries, graphdef=graphdef)


def tailpatch_groups(
    params: Any,
    opt_state: Any,
    proponents: Mapping[str, Int[Array, "b t"]],
    queries: Mapping[str, Int[Array, "b g tq"]],
    *,
    graphdef: nnx.GraphDef,
    opt: optax.GradientTransformation,
    lr_scale: float | Array = 1.0,
    opt_cfg: train_lib.OptimizerConfig | None = None,
    before: Float[Array, "b g"] | None = None,
) -> dict[str, Float[Array, "b g"]]:
    """`tailpatch_step` vmapped over B groups (group i: proponent i patched, its G queries measured).

    With `opt_cfg` (the config `opt` was made from) the exact low-rank step runs instead
    (`lowrank.tailpatch_step`), where the model is one it covers (`lowrank.supported`).
    `before`: the queries' log p(target) under the unpatched parameters when already known
    (`run_pairs` computes each query's once); None: computed here.

    Returns:
      `{"log_prob_before": [B, G], "log_prob_after": [B, G], "delta_prob": [B, G]}` where
      `delta_prob = exp(after) - exp(before)` is the change in the target's probability.
    """
    step = functools.partial(tailpatch_step, graphdef=graphdef, opt=opt, lr_scale=lr_scale)
    if opt_cfg is not None:
        why = lowrank.supported(graphdef, params)
        if why is None:
            step = functools.partial(lowrank.tailpatch_step, graphdef=graphdef, opt_cfg=opt_cfg, lr_scale=lr_scale)
        else:
            logging.warning("tail-patch: the dense step (the low-rank one does not cover this model: %s)", why)
    after = jax.vmap(step, in_axes=(None, None, 0, 0))(params, opt_state, proponents, queries)
    if before is None:
        before = grouped_log_probs(params, queries, graphdef=graphdef)
    # p' - p = p (exp(log p' - log p) - 1): expm1 keeps small changes exact in float32.
    return {
        "log_prob_before": before,
        "log_prob_after": after,
        "delta_prob": jnp.exp(before) * jnp.expm1(after - before),
    }


def grouped_log_probs(
    params: Any, queries: Mapping[str, Int[Array, "b g tq"]], *, graphdef: nnx.GraphDef
) -> Float[Array, "b g"]:
    """`target_log_probs` of `[B, G]` queries under `params` (one forward pass over all)."""
    flat = jax.tree.map(lambda x: x.reshape(-1, x.shape[-1]), queries)
    return target_log_probs(params, flat, graphdef=graphdef).reshape(queries["tokens"].shape[:2])


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
    """Per pair (row i: proponent i patched, query i measured): `tailpatch_groups` with groups of one.

    Returns:
      `{"log_prob_before": [P], "log_prob_after": [P], "delta_prob": [P]}`.
    """
    out = tailpatch_groups(
        params,
        opt_state,
        proponents,
        jax.tree.map(lambda x: x[:, None], queries),
        graphdef=graphdef,
        opt=opt,
        lr_scale=lr_scale,
    )
    return {k: v[:, 0] for k, v in out.items()}


def make_jit_tailpatch(
    mesh: jax.sharding.Mesh,
    *,
    graphdef: nnx.GraphDef,
    opt: optax.GradientTransformation,
    opt_cfg: train_lib.OptimizerConfig | None = None,
):
    """`jit(tailpatch_groups)`: groups split over (data, fsdp); parameters and optimizer state in
    `sharding.fsdp_shardings` (replicated unless the mesh's fsdp axis has size > 1, then each
    leaf split over it by its own shape, as in training; XLA gathers what each layer needs).

    The returned function takes `(params, opt_state, proponents [B, T], queries [B, G, Tq],
    lr_scale, before [B, G])` (`before`: the queries' unpatched log-probabilities, e.g. from its
    `.log_probs(params, queries)`, `grouped_log_probs` jitted alike), places the state in those
    shardings (a no-op when it already is, e.g. from `stages.load_run(mesh=...)`) and runs the step; B
    must be a multiple of the mesh's data-parallel size (pad with repeated groups). `opt_cfg`:
    the low-rank step (`tailpatch_groups`).
    """
    rep = sharding_lib.replicated(mesh)
    props = {k: sharding_lib.batch_sharding(mesh, 2) for k in ("tokens", "loss_mask")}
    queries = {k: sharding_lib.batch_sharding(mesh, 3) for k in ("tokens", "loss_mask")}
    out = sharding_lib.batch_sharding(mesh, 2)

    def fn(params, opt_state, proponents, queries, lr_scale, before):
        return tailpatch_groups(
            params,
            opt_state,
            proponents,
            queries,
            graphdef=graphdef,
            opt=opt,
            lr_scale=lr_scale,
            opt_cfg=opt_cfg,
            before=before,
        )

    # None: the state's shardings are those it is placed in below (derived from its shapes).
    jitted = jax.jit(fn, in_shardings=(None, None, props, queries, rep, out), out_shardings=out)
    jit_before = jax.jit(
        functools.partial(grouped_log_probs, graphdef=graphdef), in_shardings=(None, queries), out_shardings=out
    )

    def place(params, opt_state):
        return jax.device_put((params, opt_state), sharding_lib.fsdp_shardings((params, opt_state), mesh))

    def call(params, opt_state, proponents, queries, lr_scale, before):
        return jitted(*place(params, opt_state), proponents, queries, lr_scale, before)

    def log_probs(params, queries):
        return jit_before(place(params, {})[0], queries)

    call.jitted, call.mesh, call.log_probs = jitted, mesh, log_probs
    return call


def compile_tailpatch(
    jit_fn, params: Any, opt_state: Any, batch_size: int, queries_per_step: int, prop_len: int, query_len: int
) -> Any:
    """AOT-compiles `make_jit_tailpatch`'s step for `batch_size` groups of a `prop_len`-token
    proponent and `queries_per_step` `query_len`-token queries, on the shapes of `params` /
    `opt_state` (arrays or ShapeDtypeStructs, placed as the call places them; nothing is
    computed or allocated)."""
    mesh = jit_fn.mesh
    state_sh = sharding_lib.fsdp_shardings((params, opt_state), mesh)
    state = jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), (params, opt_state), state_sh
    )

    def rows(*shape):
        sh = sharding_lib.batch_sharding(mesh, len(shape))
        return {k: jax.ShapeDtypeStruct(shape, np.int32, sharding=sh) for k in ("tokens", "loss_mask")}

    lr = jax.ShapeDtypeStruct((), np.float32, sharding=sharding_lib.replicated(mesh))
    props, queries = rows(batch_size, prop_len), rows(batch_size, queries_per_step, query_len)
    before = jax.ShapeDtypeStruct(
        (batch_size, queries_per_step), np.float32, sharding=sharding_lib.batch_sharding(mesh, 2)
    )
    return jit_fn.jitted.lower(*state, props, queries, lr, before).compile()


def check_fits(jit_fn, params: Any, opt_state: Any, batch_size: int, queries_per_step: int, max_len: int) -> dict:
    """Refuses (`memory.DoesNotFitError`, naming `tailpatch.batch_size` and the other knobs) a
    tail-patch step of `batch_size` groups (`max_len`-token proponents, each with
    `queries_per_step` `max_len`-token queries: the longest rows) that does not fit in device
    memory; before any pair runs.

    Returns:
      The step's `memory.compiled_memory` (`{}` without an analysis).
    """
    compiled = compile_tailpatch(jit_fn, params, opt_state, batch_size, queries_per_step, max_len, max_len)
    mem = memory_lib.compiled_memory(compiled)
    what = f"{batch_size} proponents x {queries_per_step} queries x {max_len} tokens on mesh {dict(jit_fn.mesh.shape)}"
    memory_lib.check_fits("tailpatch", mem.get("peak_bytes"), what=what)
    return mem


def pair_batch_size(batch_size: int, mesh: jax.sharding.Mesh) -> int:
    """Proponents per jitted step: `tailpatch.batch_size` rounded up to the data-parallel size
    (the step splits them over `(data, fsdp)`)."""
    dp = sharding_lib.data_parallel_size(mesh)
    return -(-batch_size // dp) * dp


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


def group_pairs(pairs: np.ndarray, queries_per_step: int, widths: np.ndarray | None = None) -> list[list[int]]:
    """Indices into `pairs` (`[P, 2]` rows of (query, proponent)) grouped by proponent, at most
    `queries_per_step` per group; largest groups first (so a call's groups are of like size and
    `run_pairs` pads few query slots), ties in the order of their first pair; pairs in input order.
    With `widths` (`[N]`, the padded width of each proponent row, `prop_width`): groups of one
    query-slot count (`slots_for`) ordered by width, so a call's proponents share a width too."""
    by_prop: dict[int, list[int]] = {}
    prop = np.asarray(pairs).reshape(-1, 2)[:, 1]
    for i, p in enumerate(prop.tolist()):
        by_prop.setdefault(p, []).append(i)
    groups = [idx[j : j + queries_per_step] for idx in by_prop.values() for j in range(0, len(idx), queries_per_step)]
    if widths is None:
        return sorted(groups, key=lambda g: (-len(g), g[0]))
    return sorted(groups, key=lambda g: (-slots_for(len(g), queries_per_step), int(widths[prop[g[0]]]), -len(g), g[0]))


def prop_width(loss_mask: np.ndarray) -> np.ndarray:
    """`[N]` padded width of each proponent row of `loss_mask` (`[N, T]`): its last target
    position + 1, rounded up to a power of two >= 8 (`data.bucket_len` with one step per
    doubling: each width is a compile of ~35 s for a 135M model on CPU, so fewer than the
    featurizer's ladder), at most T. Under causal attention the positions after the last target
    change no loss, so a step on the row cut to this width is the step on the whole row (the cut
    only saves the padding's forward and backward)."""
    m = np.asarray(loss_mask) > 0
    t = m.shape[1]
    used = np.where(m.any(axis=1), t - np.argmax(m[:, ::-1], axis=1), 1)
    return np.asarray([data_lib.bucket_len(int(u), t, per_octave=1, min_len=8) for u in used], np.int64)


def slots_for(largest: int, queries_per_step: int) -> int:
    """Query slots of a call whose largest group has `largest` queries: the next power of two,
    at most `queries_per_step` (a few compiled shapes; singletons pay for one forward, not G)."""
    return min(queries_per_step, 1 << max(0, largest - 1).bit_length())


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
    queries_per_step: int = 1,
    progress=None,
    mesh: jax.sharding.Mesh | None = None,
    needed: np.ndarray | None = None,
    on_call=None,
) -> dict[str, np.ndarray]:
    """Runs `jit_fn` over index pairs: grouped by proponent (`group_pairs`), `batch_size` groups
    per call, each call with `slots_for` its largest group query slots (static shapes: a short
    group is padded with its own first query, the last call with repeated groups; padding is
    computed and dropped) and its proponents cut to the widest of their `prop_width`s (groups
    are ordered by width within a slot count, so a call of short sentences does not pay for the
    corpus's longest: a few compiled widths, the same values).

    The calls (and the blocks of unpatched queries) are formed from all of `pairs`; `needed`
    only says which of them run. A pair's value therefore depends on `pairs`, never on which
    pairs are still needed: an evaluation resumed with part of its pairs cached computes the
    rest bit for bit as an uninterrupted one would (the batch a row sits in, and the shape of
    its call, change float results at the last bit).

    Args:
      jit_fn: from `make_jit_tailpatch`.
      params, opt_state: the final checkpoint.
      prop_rows: encoded proponents `{"tokens": [N, T], "loss_mask": [N, T]}`.
      query_rows: encoded queries `{"tokens": [Q, Tq], "loss_mask": [Q, Tq]}`.
      pairs: `[P, 2]` int rows (query row, proponent row).
      batch_size: groups per call (a multiple of the data-parallel size).
      lr_scale: see `learning_rate_scale`.
      queries_per_step: G, queries measured per proponent step.
      progress: optional callable(num_needed_pairs_done) for progress reporting.
      mesh: `jit_fn`'s mesh; when it spans several processes (a pod) the groups of each call
        are placed where its devices are and the results gathered to every process.
      needed: optional `[P]` bool: the pairs to compute (default all); a call holding none of
        them is skipped.
      on_call: optional callable(pair indices `[n]`, `{key: [n]}`) after each call, with its
        needed pairs' results (e.g. to cache them as they come).

    Returns:
      `{"log_prob_before", "log_prob_after", "delta_prob"}`, each `[P]` float64 numpy, in the
      order of `pairs` (0 where a pair was not needed).
    """
    pairs = np.asarray(pairs, np.int64).reshape(-1, 2)
    needed = np.ones((len(pairs),), bool) if needed is None else np.asarray(needed, bool)
    out = {k: np.zeros((len(pairs),), np.float64) for k in ("log_prob_before", "log_prob_after", "delta_prob")}
    multi = mesh is not None and mesh.is_multi_process  # a pod: each process places its devices' groups

    def put(rows):
        return sharding_lib.device_batch(rows, mesh) if multi else jax.tree.map(jnp.asarray, rows)

    # Each query's unpatched log p(target) once (it does not depend on the proponent), in
    # [batch_size, queries_per_step] blocks of the step's own shapes and shardings.
    qids = np.unique(pairs[:, 0])
    want_q = set(pairs[needed, 0].tolist())
    before_q = np.zeros((int(qids.max()) + 1 if len(qids) else 0,), np.float32)
    per = batch_size * queries_per_step
    for lo in range(0, len(qids), per):
        ids = qids[lo : lo + per]
        if not want_q.intersection(ids.tolist()):
            continue
        ids = np.concatenate([ids, np.repeat(ids[-1:], per - len(ids))]).reshape(batch_size, queries_per_step)
        qs = put({k: query_rows[k][ids] for k in ("tokens", "loss_mask")})
        before_q[ids.ravel()] = np.asarray(sharding_lib.to_host(jit_fn.log_probs(params, qs))).ravel()
    widths = prop_width(prop_rows["loss_mask"])
    groups = group_pairs(pairs, queries_per_step, widths)
    done = 0
    for start in range(0, len(groups), batch_size):
        real = groups[start : start + batch_size]
        if not any(needed[i] for g in real for i in g):
            continue
        chunk = real + [real[-1]] * (batch_size - len(real))
        g_call = slots_for(max(len(g) for g in real), queries_per_step)
        slots = np.asarray([g + [g[0]] * (g_call - len(g)) for g in chunk], np.int64)  # [B, g_call] pair indices
        rows = pairs[slots[:, 0], 1]
        width = int(widths[rows].max())  # the call's proponents cut to their padded width (`prop_width`)
        props = {k: prop_rows[k][rows, :width] for k in ("tokens", "loss_mask")}
        qs = {k: query_rows[k][pairs[slots, 0]] for k in ("tokens", "loss_mask")}
        before = before_q[pairs[slots, 0]]
        props, qs = put(props), put(qs)
        if multi:
            lr = sharding_lib.put_global(np.float32(lr_scale), sharding_lib.replicated(mesh))
            before = sharding_lib.put_global(before, sharding_lib.batch_sharding(mesh, 2))
        else:
            lr, before = jnp.float32(lr_scale), jnp.asarray(before)
        res = sharding_lib.to_host(jit_fn(params, opt_state, props, qs, lr, before))
        for k in out:  # the real slots only
            got = np.asarray(res[k], np.float64)
            for b, g in enumerate(real):
                out[k][g] = got[b, : len(g)]
        idx = np.asarray([i for g in real for i in g if needed[i]], np.int64)
        done += len(idx)
        if on_call is not None:
            on_call(idx, {k: v[idx] for k, v in out.items()})
        if progress is not None:
            progress(done)
    return out
