"""Estimated optimizer second moments V for a model that ships no optimizer state (§3, Eq. 2).

TrackStar's correction divides gradients by sqrt(V), V being the optimizer's running
estimate of E[g^2]. A released model (Hugging Face folder, GGUF) has no optimizer state, so
we estimate V at the released weights and store it in exactly the structure optax's
Adafactor keeps (`v_row`, `v_col`, `v` of `scale_by_factored_rms`), so
`features.preconditioner.from_opt_state` reads it like a pretraining checkpoint's state.
`estimate` runs one of `ESTIMATORS` (`vectors.estimate_v_method`) on the texts of
`V_SOURCES` (`vectors.estimate_v_source`, never the candidates but by name):

- "minibatch" (the default; `minibatch_opt_state`): V as the optimizer holds it: optax's own
  `scale_by_factored_rms` (the run's decay schedule and factoring) updated N times with the
  minibatch-mean gradient of B sequences (accumulated), weights fixed. E[g_B^2] = mu^2 +
  sigma^2 / B, as in pretraining; limits: B and N are what a CPU affords (SmolLM2's steps held
  ~1M tokens), and the pretraining V averages along the training trajectory, this one at the
  final weights. `SECOND_MOMENT_RULES["adam"]` gives Adam's `nu` the same way (not wired into
  the import; `preconditioner.adam_effective_v`).
- "per_example" (`mean_squared_grads`, `factored_state`): with `S = mean_n g_n^2` (g_n the
  gradient of example n's mean token loss, `training.step.loss_fn` on a batch of one),
  `v_row = mean(S, axis=d0) + eps`, `v_col = mean(S, axis=d1) + eps` for a factored matrix
  (optax's `_factored_dims` rule: d0 the largest axis, both at least `min_dim_size_to_factor`)
  and `v = S + eps` otherwise: exactly the state `optax.adafactor(decay_rate=1.0)` holds after
  one update per example (its decay `t / (t+1)` makes every accumulator a running MEAN;
  tests/test_second_moment.py checks both). E[g^2] of single examples is mu^2 + sigma^2, off
  from the optimizer's by up to B per parameter, which unit normalisation does not remove.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from optax._src.factorized import FactoredState, _factored_dims  # optax's own state and factoring rule

from trackstar_jax import data as data_lib
from trackstar_jax.training import step as step_lib

EPSILON = 1e-30  # optax.scale_by_factored_rms default: added to every g^2


def sample_ids(num_examples: int, size: int, seed: int) -> list[int]:
    """`min(size, num_examples)` distinct example ids, sorted, drawn with numpy's PCG64 from `seed`."""
    size = min(int(size), int(num_examples))
    return sorted(int(i) for i in np.random.default_rng(seed).choice(num_examples, size=size, replace=False))


def example_batches(
    corpus: data_lib.Corpus | Sequence[str], tok: Any, ids: Sequence[int], batch_size: int, max_len: int
) -> Iterable[dict[str, np.ndarray]]:
    """Batches of the passages `ids` (of a corpus or a list of texts) under the pretraining
    loss, padded to the length ladder (`data.bucket_len`).

    Yields:
      `tokens int32 [batch_size, L]`, `loss_mask int32 [batch_size, L]`, `example_id int32
      [batch_size]` (-1 on padding rows, whose mask is zero).
    """
    texts = corpus.texts if isinstance(corpus, data_lib.Corpus) else corpus
    items, _ = data_lib.encode_passages(tok, [texts[i] for i in ids], max_len)
    for s in range(0, len(items), batch_size):
        chunk = items[s : s + batch_size]
        length = data_lib.bucket_len(max(len(t) for t, _ in chunk), max_len)
        yield data_lib.pad_batch(chunk, list(ids[s : s + batch_size]), batch_size, length)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnums=0)
def _add_squared_grads(
    acc: Any, params: Any, tokens: jax.Array, loss_mask: jax.Array, *, graphdef: nnx.GraphDef
) -> Any:
    """`acc + sum_rows g_row^2` (float32), one example's gradient at a time (`lax.scan`), so
    memory holds one gradient, not a batch of them. Padding rows have zero loss and gradient."""

    def body(carry, row):
        t, m = row
        g = jax.grad(lambda p: step_lib.loss_fn(p, graphdef, {"tokens": t[None], "loss_mask": m[None]})[0])(params)
        return jax.tree.map(lambda a, x: a + jnp.square(x.astype(jnp.float32)), carry, g), None

    acc, _ = jax.lax.scan(body, acc, (tokens, loss_mask))
    return acc


def mean_squared_grads(
    graphdef: nnx.GraphDef, params: Any, batches: Iterable[Mapping[str, np.ndarray]]
) -> tuple[Any, int]:
    """`(S, n)`: `S = mean_n g_n^2` per parameter (float32, params' tree) over the n real rows of
    `batches` (rows with `example_id >= 0`), g_n the gradient of `training.step.loss_fn` on row n alone.

    Raises:
      ValueError: no real rows.
    """
    acc = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params)
    n = 0
    for b in batches:
        n += int(np.sum(np.asarray(b["example_id"]) >= 0))
        acc = _add_squared_grads(acc, params, jnp.asarray(b["tokens"]), jnp.asarray(b["loss_mask"]), graphdef=graphdef)
    if n == 0:
        raise ValueError(
            "estimating V needs at least one example (vectors.estimate_v_examples >= 1, a non-empty corpus)"
        )
    return jax.tree.map(lambda a: a / n, acc), n


def factored_state(
    mean_sq: Any, params: Any, min_dim_size_to_factor: int, count: int, epsilon: float = EPSILON
) -> FactoredState:
    """optax `FactoredState` holding the Adafactor factoring of `mean_sq` (see the module docstring).

    `epsilon` is added to every entry (optax's `g^2 + epsilon`; 0 for a V that is already an
    optimizer's, such as an imported checkpoint's, training/optimizer_state.py).

    Shapes follow optax's init exactly: factored leaves keep `v_row` (the param without axis
    d0), `v_col` (without d1) and `v = zeros([1])`; unfactored ones `v_row = v_col = zeros([1])`
    and a full `v`. Leaves are in the parameter's dtype, as optax keeps them.
    """

    def one(s, p):
        dt, s = p.dtype, jnp.asarray(s)  # host numpy too (an imported V)
        dims = _factored_dims(tuple(p.shape), True, min_dim_size_to_factor)
        if dims is None:
            z = jnp.zeros((1,), dt)
            return z, z, (s + epsilon).astype(dt)
        d1, d0 = dims
        return (
            (jnp.mean(s, axis=d0) + epsilon).astype(dt),
            (jnp.mean(s, axis=d1) + epsilon).astype(dt),
            jnp.zeros((1,), dt),
        )

    out = jax.tree.map(one, mean_sq, params)
    is_triple = lambda x: isinstance(x, tuple) and len(x) == 3 and all(isinstance(y, jax.Array) for y in x)  # noqa: E731
    pick = lambda i: jax.tree.map(lambda t: t[i], out, is_leaf=is_triple)  # noqa: E731
    return FactoredState(count=jnp.asarray(count, jnp.int32), v_row=pick(0), v_col=pick(1), v=pick(2))


def with_second_moments(opt_state: Any, factored: FactoredState) -> Any:
    """`opt_state` (e.g. `make_optimizer(cfg).init(params)`) with its one `FactoredState` replaced.

    Raises:
      ValueError: the state holds no (or more than one) FactoredState, i.e. is not Adafactor's.
    """
    found = []

    def swap(x):
        if isinstance(x, FactoredState):
            found.append(x)
            return factored
        return x

    out = jax.tree.map(swap, opt_state, is_leaf=lambda x: isinstance(x, FactoredState))
    if len(found) != 1:
        raise ValueError(f"expected one optax Adafactor FactoredState in the optimizer state, found {len(found)}")
    return out


def estimate_opt_state(
    graphdef: nnx.GraphDef,
    params: Any,
    opt: optax.GradientTransformation,
    opt_cfg: step_lib.OptimizerConfig,
    batches: Iterable[Mapping[str, np.ndarray]],
) -> tuple[Any, int]:
    """`(opt.init(params) with estimated v_row / v_col / v, number of examples used)`.

    `opt` must be `training.step.make_optimizer(opt_cfg)` (Adafactor), so the state restores
    into the run's checkpoint target and tail-patching can continue from it.
    """
    mean_sq, n = mean_squared_grads(graphdef, params, batches)
    fs = factored_state(mean_sq, params, opt_cfg.min_dim_size_to_factor, count=n)
    return with_second_moments(opt.init(params), fs), n


# ---------------------------------------------------------------------------------------
# V as the optimizer holds it: an EMA of squared MINIBATCH gradients (issue 57)
# ---------------------------------------------------------------------------------------
#
# The optimizer's V is not E[g_n^2] of single examples (mu^2 + sigma^2) but the optimizer's
# own running average of the square of each step's minibatch-mean gradient (mu^2 + sigma^2/B).
# `minibatch_opt_state` takes N steps of B sequences each (by gradient accumulation over
# micro-batches, so B is not bounded by memory), with the parameters fixed (learning rate
# 0), and feeds each step's gradient to the optimizer's own second-moment transformation
# (`SECOND_MOMENT_RULES`): its state after N steps is V as that optimizer holds it, decay and
# factoring included.


def _adafactor_rule(opt_cfg: step_lib.OptimizerConfig, beta2: float) -> optax.GradientTransformation:
    """Adafactor's V (`optax.scale_by_factored_rms`, as `optax.adafactor` chains it): the run's
    `decay_rate` schedule (beta2_t = 1 - (t+1)^-decay_rate from count 0, so the first step
    weighs 1: no bias) and factoring (`min_dim_size_to_factor`); `beta2` is unused."""
    del beta2
    return optax.scale_by_factored_rms(
        decay_rate=opt_cfg.decay_rate, min_dim_size_to_factor=opt_cfg.min_dim_size_to_factor, epsilon=EPSILON
    )


def _adam_rule(opt_cfg: step_lib.OptimizerConfig, beta2: float) -> optax.GradientTransformation:
    """Adam's V (`optax.scale_by_adam`'s `nu`, full, not factored): an EMA with constant `beta2`
    from zero, so it is biased by (1 - beta2^N); `features.preconditioner.adam_effective_v` removes it."""
    del opt_cfg
    return optax.scale_by_adam(b1=0.0, b2=beta2, eps=0.0)


# optimizer name -> its second-moment transformation (state after N updates = its V)
SECOND_MOMENT_RULES = {"adafactor": _adafactor_rule, "adam": _adam_rule}


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnums=0)
def _add_loss_sum_grad(acc: Any, params: Any, tokens: jax.Array, loss_mask: jax.Array, *, graphdef: nnx.GraphDef):
    """`(acc[0] + grad of the batch's summed target-token loss (float32), acc[1] + its target tokens)`."""

    def loss_sum(p):
        _, aux = step_lib.loss_fn(p, graphdef, {"tokens": tokens, "loss_mask": loss_mask})
        return aux["loss_sum"], aux["num_tokens"]

    g, n = jax.grad(loss_sum, has_aux=True)(params)
    return jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc[0], g), acc[1] + n


def minibatch_gradient(graphdef: nnx.GraphDef, params: Any, micro_batches: Iterable[Mapping[str, np.ndarray]]) -> Any:
    """The gradient of `training.step.loss_fn` on the union of `micro_batches` (one optimizer
    step's minibatch, accumulated): sum over micro-batches of the summed-token-loss gradient,
    over the total number of target tokens (float32, params' tree). Padding rows add nothing.

    Raises:
      ValueError: the micro-batches hold no target token.
    """
    acc = (jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params), jnp.zeros((), jnp.float32))
    for b in micro_batches:
        acc = _add_loss_sum_grad(acc, params, jnp.asarray(b["tokens"]), jnp.asarray(b["loss_mask"]), graphdef=graphdef)
    n = float(acc[1])
    if n == 0:
        raise ValueError("a minibatch for estimating V has no target tokens")
    return jax.tree.map(lambda a: a / n, acc[0])


def step_ids(num_texts: int, batch_sequences: int, steps: int, seed: int) -> list[list[int]]:
    """`steps` lists of `batch_sequences` distinct text ids (numpy PCG64 from `seed`; each step
    drawn anew, as epochs reshuffle, so one text may recur across steps).

    Raises:
      ValueError: fewer texts than one step's sequences.
    """
    if batch_sequences > num_texts:
        raise ValueError(
            f"vectors.estimate_v_batch_sequences={batch_sequences} exceeds the {num_texts} texts of the V source"
        )
    rng = np.random.default_rng(seed)
    return [sorted(int(i) for i in rng.choice(num_texts, size=batch_sequences, replace=False)) for _ in range(steps)]


def minibatch_opt_state(
    graphdef: nnx.GraphDef,
    params: Any,
    rule: optax.GradientTransformation,
    steps: Iterable[Iterable[Mapping[str, np.ndarray]]],
) -> tuple[Any, int]:
    """`(rule's state after one update per step, number of steps)`: each step's gradient is
    `minibatch_gradient` of its micro-batches; the parameters never move (learning rate 0).

    Raises:
      ValueError: no steps.
    """
    state, n = rule.init(params), 0
    update = jax.jit(lambda g, s: rule.update(g, s, params)[1])
    for micro in steps:
        state, n = update(minibatch_gradient(graphdef, params, micro), state), n + 1
    if n == 0:
        raise ValueError("estimating V needs at least one step (vectors.estimate_v_steps >= 1)")
    return state, n


# ---------------------------------------------------------------------------------------
# Where the estimate's text comes from (`vectors.estimate_v_source`)
# ---------------------------------------------------------------------------------------


def _heldout_texts(arg: str, corpus: data_lib.Corpus, data_cfg: data_lib.DataConfig) -> list[str]:
    del arg, data_cfg
    return list(corpus.eval_texts)


def _candidate_texts(arg: str, corpus: data_lib.Corpus, data_cfg: data_lib.DataConfig) -> list[str]:
    del arg, data_cfg
    return corpus.texts


def _lama_texts(arg: str, corpus: data_lib.Corpus, data_cfg: data_lib.DataConfig) -> list[str]:
    if not arg:
        raise ValueError("vectors.estimate_v_source 'lama:' needs relations, e.g. 'lama:P108,P127'")
    cfg = dataclasses.replace(
        data_cfg, source="lama", relations=arg, max_examples=0, eval_fraction=0.0, statements_per_fact=0,
        eval_fact_fraction=0.0, templates_file="",
    )  # fmt: skip
    return data_lib.build_corpus(cfg).texts


def _file_texts(arg: str, corpus: data_lib.Corpus, data_cfg: data_lib.DataConfig) -> list[str]:
    kind = "jsonl" if arg.endswith((".jsonl", ".jsonl.gz", ".json")) else "text"
    cfg = data_lib.DataConfig(source=kind, path=arg, text_key=data_cfg.text_key)
    return data_lib.build_corpus(cfg).texts


# `vectors.estimate_v_source` "<kind>" or "<kind>:<arg>" -> `(arg, corpus, data config) -> texts`
V_SOURCES = {
    "heldout": _heldout_texts,  # the corpus's held-out passages (`data.eval_fraction`): never candidates
    "candidates": _candidate_texts,  # the candidates themselves (the estimate then acts as a second R_train)
    "lama": _lama_texts,  # evidence sentences of other T-REx relations under data.path: "lama:P108,P127"
    "file": _file_texts,  # a .txt (a passage per line) or .jsonl (data.text_key) file or folder: "file:<path>"
}


def source_texts(
    source: str, corpus: data_lib.Corpus, data_cfg: data_lib.DataConfig
) -> tuple[list[str], dict[str, int]]:
    """The texts of `vectors.estimate_v_source`, without any that is a candidate (unless the
    source is the candidates), and `{"num_source_texts", "num_dropped_candidates"}`.

    Raises:
      ValueError: an unknown kind, or no texts left (names the key and what to set).
    """
    kind, _, arg = source.partition(":")
    if kind not in V_SOURCES:
        raise ValueError(f"vectors.estimate_v_source={source!r}: kind must be one of {sorted(V_SOURCES)}")
    texts = list(dict.fromkeys(V_SOURCES[kind](arg, corpus, data_cfg)))
    dropped = 0
    if kind != "candidates":
        cands = set(corpus.texts)
        kept = [t for t in texts if t not in cands]
        texts, dropped = kept, len(texts) - len(kept)
    if not texts:
        raise ValueError(
            f"vectors.estimate_v_source={source!r} gives no text that is not a candidate "
            "(set data.eval_fraction > 0 for 'heldout', or use 'lama:<other relations>' / 'file:<path>')"
        )
    return texts, {"num_source_texts": len(texts), "num_dropped_candidates": dropped}


# ---------------------------------------------------------------------------------------
# The estimators (`vectors.estimate_v_method`)
# ---------------------------------------------------------------------------------------

# The `vectors` keys each method reads: recorded with the estimate (opt_state.json, and so the
# index manifest's `model.second_moment`), and compared by a re-import of a finished run.
METHOD_KEYS = {
    "per_example": ("estimate_v_method", "estimate_v_source", "estimate_v_examples", "estimate_v_seed"),
    "minibatch": (
        "estimate_v_method", "estimate_v_source", "estimate_v_batch_sequences", "estimate_v_steps", "estimate_v_seed",
    ),
}  # fmt: skip
SIZE_KEY = {"per_example": "estimate_v_examples", "minibatch": "estimate_v_steps"}  # 0: no estimate


def _estimate_per_example(vec_cfg, graphdef, params, opt, opt_cfg, texts, tok, max_len) -> tuple[Any, dict]:
    ids = sample_ids(len(texts), vec_cfg.estimate_v_examples, vec_cfg.estimate_v_seed)
    batches = example_batches(texts, tok, ids, vec_cfg.batch_size, max_len)
    opt_state, n = estimate_opt_state(graphdef, params, opt, opt_cfg, batches)
    return opt_state, {
        "what": "mean of squared per-example gradients of training.step.loss_fn, factored as optax.adafactor",
        "num_examples": n,
    }


def _estimate_minibatch(vec_cfg, graphdef, params, opt, opt_cfg, texts, tok, max_len) -> tuple[Any, dict]:
    b, n_steps = vec_cfg.estimate_v_batch_sequences, vec_cfg.estimate_v_steps
    steps = step_ids(len(texts), b, n_steps, vec_cfg.estimate_v_seed)
    micro = min(vec_cfg.batch_size, b)
    batches = (list(example_batches(texts, tok, ids, micro, max_len)) for ids in steps)
    rule_state, n = minibatch_opt_state(graphdef, params, _adafactor_rule(opt_cfg, 0.0), batches)
    return with_second_moments(opt.init(params), rule_state), {
        "what": "optax.scale_by_factored_rms state after N steps of minibatch-mean gradients of "
        "training.step.loss_fn (B sequences per step, learning rate 0): Adafactor's V",
        "optimizer": "adafactor",
        "decay_rate": opt_cfg.decay_rate,
        "min_dim_size_to_factor": opt_cfg.min_dim_size_to_factor,
        "num_steps": n,
        "num_sequences": n * b,
        "num_distinct_sequences": len({i for ids in steps for i in ids}),
    }


# `vectors.estimate_v_method` -> `(vec_cfg, graphdef, params, opt, opt_cfg, texts, tok, max_len) -> (opt_state, record)`
ESTIMATORS = {"per_example": _estimate_per_example, "minibatch": _estimate_minibatch}


def settings_record(vec_cfg: Any) -> dict:
    """The `vectors` keys the configured method reads (`METHOD_KEYS`), as recorded with the estimate."""
    return {k: getattr(vec_cfg, k) for k in METHOD_KEYS[vec_cfg.estimate_v_method]}


def estimate(
    vec_cfg: Any,
    graphdef: nnx.GraphDef,
    params: Any,
    opt: optax.GradientTransformation,
    opt_cfg: step_lib.OptimizerConfig,
    corpus: data_lib.Corpus,
    data_cfg: data_lib.DataConfig,
    tok: Any,
    max_len: int,
) -> tuple[Any, dict]:
    """`(opt.init(params) with V estimated as `vec_cfg` says, its record)`: the record holds the
    settings (`settings_record`), the source's size, and the method's own counts.

    Raises:
      ValueError: bad source or sizes (naming the `vectors` key).
    """
    texts, info = source_texts(vec_cfg.estimate_v_source, corpus, data_cfg)
    opt_state, rec = ESTIMATORS[vec_cfg.estimate_v_method](vec_cfg, graphdef, params, opt, opt_cfg, texts, tok, max_len)
    return opt_state, {"kind": "estimated", **settings_record(vec_cfg), **info, **rec}
