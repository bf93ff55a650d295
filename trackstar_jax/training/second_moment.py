"""Estimated optimizer second moments V for a model that ships no optimizer state (§3, Eq. 2).

TrackStar's correction divides gradients by sqrt(V), V being the optimizer's running
estimate of E[g^2]. A released model (Hugging Face folder, GGUF) has no optimizer state, so
we estimate V from per-example gradients of the training objective over a seeded sample of
the corpus, and store it in exactly the structure optax's Adafactor keeps (`v_row`, `v_col`,
`v` of `scale_by_factored_rms`), so `features.preconditioner.from_opt_state` reads it like a
pretraining checkpoint's state.

What is estimated: with `S = mean_n g_n^2` (g_n the gradient of example n's mean token loss,
`training.step.loss_fn` on a batch of one), `v_row = mean(S, axis=d0) + eps`,
`v_col = mean(S, axis=d1) + eps` for a factored matrix (optax's `_factored_dims` rule:
d0 the largest axis, both at least `min_dim_size_to_factor`) and `v = S + eps` otherwise.
This is exactly the state `optax.adafactor(decay_rate=1.0)` holds after one update per
example: with exponent 1 its decay `1 - (t+1)^-1 = t / (t+1)` makes every accumulator the
running MEAN of `g^2 + eps` over the updates (tests/test_second_moment.py checks this).

Limits: per-example gradients, not pretraining batch gradients, so V is E[g^2] of single
examples (mean^2 + variance) rather than of 1024-example batches (mean^2 + variance / 1024);
the correction is unchanged by a global scale (unit normalisation), not by this shape change.
"""

from __future__ import annotations

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
    corpus: data_lib.Corpus, tok: Any, ids: Sequence[int], batch_size: int, max_len: int
) -> Iterable[dict[str, np.ndarray]]:
    """Batches of the passages `ids` under the pretraining loss, padded to power-of-two lengths.

    Yields:
      `tokens int32 [batch_size, L]`, `loss_mask int32 [batch_size, L]`, `example_id int32
      [batch_size]` (-1 on padding rows, whose mask is zero).
    """
    items, _ = data_lib.encode_passages(tok, [corpus.examples[i].text for i in ids], max_len)
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
