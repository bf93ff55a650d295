"""Optimizer second-moment correction `1/sqrt(V)` (paper §3, Eq. 2) from the optimizer state.

TrackStar divides each per-example gradient element-wise by the square root of the
optimizer's estimate of E[g^2] before projecting. We read V from the checkpoint:

* optax Adafactor (`scale_by_factored_rms`): a factored matrix keeps `v_row`, `v_col` and
  optax applies `update = g * row_factor * col_factor` with (optax `_src/factorized.py`)
  `(d1, d0) = _factored_dims(shape)` (the two largest axes, d0 the LARGEST),
  `v_row` = mean of g^2 over d0 (so it is indexed by axis d1), `v_col` = mean over d1,
  `row_factor = (v_row / mean(v_row)) ** -0.5` (along d1), `col_factor = v_col ** -0.5`
  (along d0). We reuse optax's `_factored_dims` itself, so the correction is exactly the
  `1/sqrt(V)` of optax's own update. An unfactored parameter (a dim below
  `min_dim_size_to_factor`, or a 1-D norm scale or bias) keeps a full `v`: `1/sqrt(v)`.
* Adam-family (`nu`): `1/sqrt(nu)` element-wise. Adam's bias correction `1/(1-b2^t)` is the
  same for every parameter, a global scale that unit normalisation removes; not applied to
  `nu` as read. Adam's own denominator is `sqrt(nu_hat) + eps`, not a global rescale of
  `sqrt(nu)` when eps matters: `adam_effective_v` turns an Adam state into the V whose
  `1/sqrt` is exactly Adam's `1/(sqrt(nu_hat) + eps)`, for a state read from a checkpoint or
  estimated (`training.second_moment`).

Zeros in V (a never-updated state) are floored at optax's epsilon (1e-30), as optax's
`grad^2 + epsilon` accumulation would; NaN/inf in V is an error naming the parameter.

Every correction is stored as the rank-one pair `(a [m], b [n])` with `1/sqrt(V) ~ a b^T`
for a parameter seen as an `m x n` matrix (1-D scales and biases as `1 x n`): this is what the fast
factored path folds into its projection matrices (`P0 diag(a)`, `P1 diag(b)`). It is exact
for factored Adafactor and for 1-D scales. Where V is a full matrix (unfactored Adafactor,
Adam), the pair is the Adafactor-style rank-one factorisation of V itself,
`V ~ r c^T / mean(r)` with r, c its row / column means; the exact element-wise factor is
kept in `full` as well when `exact=True` (the reference path uses it).
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float
from optax._src.factorized import _factored_dims  # optax's own factoring rule (style.md §4.4)

from trackstar_jax.models import lm as model_lib

EPSILON = 1e-30  # optax.scale_by_factored_rms default epsilon
ADAFACTOR_FIELDS = ("v_row", "v_col", "v")
ADAM_FIELD = "nu"


class Correction(flax.struct.PyTreeNode):
    """`1/sqrt(V)` per attributed parameter (a pytree; pass it through jit).

    Attributes:
      row: `{path: a [m]}` factor along the parameter's first (input) axis; `[1]` for 1-D.
      col: `{path: b [n]}` factor along the last (output) axis.
      full: `{path: [m, n] or [n]}` exact element-wise factor, only for parameters whose V
        is not rank-one and only when built with `exact=True`.
      rank_one_exact: static, sorted tuple of the paths whose `a b^T` equals `1/sqrt(V)` exactly.
    """

    row: dict
    col: dict
    full: dict
    rank_one_exact: tuple = flax.struct.field(pytree_node=False, default=())

    def elementwise(self, path: str, shape: tuple[int, ...]) -> Array:
        """The factor applied element-wise to a gradient of `shape` (exact if stored)."""
        if path in self.full:
            return self.full[path]
        a, b = self.row[path], self.col[path]
        return b if len(shape) == 1 else a[:, None] * b[None, :]


def _moment_leaves(opt_state: Any, field: str, paths: set[str]) -> dict[str, Array]:
    """`{param_path: leaf}` for every `.../<field>/<param_path>` leaf of the optimizer state."""
    found: dict[str, Array] = {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        segs = model_lib.param_path_str(key_path).split("/")
        for i, s in enumerate(segs):
            if s == field:
                rest = "/".join(segs[i + 1 :])
                if rest in paths:
                    if rest in found:
                        raise ValueError(f"optimizer state holds two '{field}' entries for parameter {rest!r}")
                    found[rest] = leaf
    return found


@jax.jit
def _checked_floor(v: Array) -> tuple[Array, Array, Array]:
    """`(max(v, EPSILON), all finite, any negative)` of a second moment."""
    v = v.astype(jnp.float32)
    return jnp.maximum(v, EPSILON), jnp.all(jnp.isfinite(v)), jnp.any(v < 0)


def _check_moment(finite: Array, negative: Array, path: str, what: str) -> None:
    """Raises, naming the parameter, if `_checked_floor` found NaN/inf or a negative value."""
    if isinstance(finite, jax.core.Tracer):  # an abstract state (jax.eval_shape, the planner): no values to check
        return
    if not bool(finite):
        raise ValueError(f"optimizer second moment {what} of parameter {path!r} contains NaN/inf")
    if bool(negative):
        raise ValueError(f"optimizer second moment {what} of parameter {path!r} is negative")


@jax.jit
def rank_one_factors(v: Float[Array, "m n"]) -> tuple[Float[Array, " m"], Float[Array, " n"]]:
    """Adafactor-style rank-one factorisation of a full V: `1/sqrt(V) ~ a b^T`.

    `V ~ r c^T / mean(r)` with r the row means and c the column means of V (what Adafactor
    would have stored had it factored this matrix), so `a = (r / mean(r))^-1/2`,
    `b = c^-1/2`. Exact when V is itself rank-one (e.g. any 1 x n matrix).
    """
    r, c = jnp.mean(v, axis=1), jnp.mean(v, axis=0)
    return (r / jnp.mean(r)) ** -0.5, c**-0.5


# One jitted call per parameter for each kind of state below, one compile per shape. Run op by
# op, the checks, floors and factors were ~30 small XLA compiles of a featurizer's set-up at the
# pythia-70m shape (too small for the persistent cache, so warm runs paid them too); jitted one
# step at a time, they cost three dispatches and host syncs per matrix.


@jax.jit
def _factored_pair(v_row: Float[Array, " r"], v_col: Float[Array, " c"]) -> tuple[tuple[Array, Array], tuple, tuple]:
    """optax's `(row_factor, col_factor)` of a factored Adafactor matrix from its `v_row`,
    `v_col` (floored here), with each one's `_checked_floor` flags `(finite, negative)`."""
    v_row, *row_flags = _checked_floor(v_row)
    v_col, *col_flags = _checked_floor(v_col)
    return ((v_row / jnp.mean(v_row)) ** -0.5, v_col**-0.5), tuple(row_flags), tuple(col_flags)


@functools.partial(jax.jit, static_argnames="exact")
def _full_factors(v: Float[Array, "..."], exact: bool) -> tuple[tuple[Array, Array, Array | None], tuple]:
    """For a full (unfactored) V, `[n]` or `[m, n]`, floored: the rank-one pair
    `rank_one_factors` (a `[n]` V seen as `1 x n`), the exact `1/sqrt(V)` of a matrix when
    `exact` (else None), and `_checked_floor`'s flags `(finite, negative)`."""
    v, *flags = _checked_floor(v)
    a, b = rank_one_factors(v[None, :] if v.ndim == 1 else v)
    return (a, b, v**-0.5 if exact and v.ndim == 2 else None), tuple(flags)


def from_opt_state(params: Any, opt_state: Any, paths: tuple[str, ...], *, exact: bool = True) -> Correction:
    """Builds the correction for `paths` from an optax Adafactor or Adam state.

    Args:
      params: parameter tree (pure dict or nnx.State; shapes only are used).
      opt_state: the optimizer state of the checkpoint.
      paths: attributed parameter paths.
      exact: also keep the exact element-wise factor where V is not rank-one (needed by the
        reference path; the fast path uses only the rank-one pair).

    Returns:
      A `Correction`.

    Raises:
      ValueError: if `opt_state` is None, holds neither Adafactor (`v_row`/`v_col`/`v`) nor
        Adam (`nu`) second moments, misses a parameter, or has shapes that contradict
        optax's factoring rule; the message names the parameter.
    """
    if opt_state is None:
        raise ValueError(
            "the optimizer correction (vectors.correction=True) needs the checkpoint's optimizer state, "
            "but opt_state is None; restore it, or set vectors.correction=False"
        )
    shapes = {p: tuple(x.shape) for p, x in model_lib.flat_params(params).items()}
    path_set = set(paths)
    ada = {f: _moment_leaves(opt_state, f, path_set) for f in ADAFACTOR_FIELDS}
    adam = _moment_leaves(opt_state, ADAM_FIELD, path_set)
    if any(ada.values()):
        kind = "adafactor"
    elif adam:
        kind = "adam"
    else:
        raise ValueError(
            "optimizer state has no second-moment estimates (optax Adafactor v_row/v_col/v or Adam nu) "
            "for the attributed parameters; set vectors.correction=False to skip the correction"
        )
    row, col, full, flags = {}, {}, {}, {}
    for path in paths:
        shape = shapes[path]
        if kind == "adam":
            if path not in adam:
                raise ValueError(f"optimizer state has no Adam 'nu' for parameter {path!r}")
            v_full = adam[path]
        else:
            missing = [f for f in ADAFACTOR_FIELDS if path not in ada[f]]
            if missing:
                raise ValueError(f"optimizer state has no Adafactor {'/'.join(missing)} for parameter {path!r}")
            v_row, v_col, v = ada["v_row"][path], ada["v_col"][path], ada["v"][path]
            dims = _factored_dims(shape, True, 1)
            if tuple(v.shape) == shape and (len(shape) < 2 or tuple(v_row.shape) == (1,)):
                v_full = v  # unfactored: full second moment
            elif dims is not None and len(shape) == 2:
                d1, d0 = dims
                want_row, want_col = (shape[d1],), (shape[d0],)
                if tuple(v_row.shape) != want_row or tuple(v_col.shape) != want_col:
                    raise ValueError(
                        f"Adafactor state of parameter {path!r} {shape}: v_row {tuple(v_row.shape)}, "
                        f"v_col {tuple(v_col.shape)} do not match optax's factoring (expected {want_row}, {want_col})"
                    )
                (row_factor, col_factor), row_flags, col_flags = _factored_pair(v_row, v_col)  # along d1, d0
                _check_moment(*row_flags, path, "v_row")
                _check_moment(*col_flags, path, "v_col")
                a, b = (row_factor, col_factor) if d1 == 0 else (col_factor, row_factor)
                row[path], col[path], flags[path] = a, b, True
                continue
            else:
                raise ValueError(
                    f"Adafactor state of parameter {path!r} {shape} has v {tuple(v.shape)}, v_row {tuple(v_row.shape)}: "
                    "neither a full nor a factored second moment"
                )
        if tuple(v_full.shape) != shape:
            raise ValueError(f"second moment of parameter {path!r} has shape {tuple(v_full.shape)}, parameter {shape}")
        (a, b, f), v_flags = _full_factors(v_full, exact)
        _check_moment(*v_flags, path, "v" if kind == "adafactor" else "nu")
        row[path], col[path] = a, b
        flags[path] = len(shape) == 1  # a 1 x n matrix is always rank-one
        if f is not None:
            full[path] = f
    return Correction(row=row, col=col, full=full, rank_one_exact=tuple(sorted(p for p, ok in flags.items() if ok)))


def adam_effective_v(nu: Any, count: int | Array, b2: float, eps: float = 1e-8) -> Any:
    """`(sqrt(nu / (1 - b2^count)) + eps)^2` per leaf of `nu` (a tree or one array): the V whose
    `1/sqrt(V)` is Adam's own preconditioner `1/(sqrt(nu_hat) + eps)` after `count` updates
    with second-moment decay `b2` (optax `scale_by_adam`: bias-corrected `nu_hat`, `eps`
    outside the square root). Feed the result as `nu` to `from_opt_state`.

    Args:
      nu: Adam's second-moment EMA (optax `ScaleByAdamState.nu`), float.
      count: updates taken (optax's `count`), >= 1.
      b2: Adam's beta2 (e.g. 0.95 for SmolLM2's AdamW, 0.999 optax's default).
      eps: Adam's epsilon (optax default 1e-8).
    """
    corr = 1.0 - jnp.asarray(b2, jnp.float32) ** jnp.asarray(count, jnp.float32)
    return jax.tree.map(lambda v: jnp.square(jnp.sqrt(v.astype(jnp.float32) / corr) + eps), nu)


def identity(params: Any, paths: tuple[str, ...]) -> Correction:
    """No correction (ablations): every factor is one."""
    shapes = {p: tuple(x.shape) for p, x in model_lib.flat_params(params).items()}
    row, col = {}, {}
    for p in paths:
        shape = shapes[p] if len(shapes[p]) == 2 else (1,) + tuple(shapes[p])
        row[p], col[p] = jnp.ones((shape[0],), jnp.float32), jnp.ones((shape[1],), jnp.float32)
    return Correction(row=row, col=col, full={}, rank_one_exact=tuple(sorted(paths)))


def apply_elementwise(grads: Mapping[str, Array], correction: Correction) -> dict[str, Array]:
    """`g / sqrt(V)` element-wise for materialised gradients `{path: [B, *shape]}` (reference)."""
    return {p: g * correction.elementwise(p, g.shape[1:])[None] for p, g in grads.items()}


def rank_one_error(correction_exact: Correction) -> dict[str, float]:
    """Relative Frobenius error of the rank-one pair vs the exact factor, per non-rank-one parameter."""
    out = {}
    for p, f in correction_exact.full.items():
        approx = correction_exact.row[p][:, None] * correction_exact.col[p][None, :]
        out[p] = float(np.linalg.norm(np.asarray(approx - f)) / np.linalg.norm(np.asarray(f)))
    return out
