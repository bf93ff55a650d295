"""TrackStar's Hessian approximation R and the final normalisation of the vectors (§3, §A.1.3).

The index stores raw projected vectors `Φ_m = P_d(∇Loss(z_m)/√V)` (vectors.py). TrackStar's
score is `Ḡ(z_m)·Ḡ(z_q)` with (Eq. 2)

    Ḡ(z) = G(z) / ||G(z)||,   G(z) = R^{-1/2} Φ(z),

where R is block diagonal with one `k²×k²` block per layer block (§A.1.3: 16 blocks of
4096×4096 for d = 2^16, not one d×d matrix). R^{-1/2} is applied *before* the unit norm
(normalise R^{-1/2}Φ, not Φ: bergson #157).

R is an autocorrelation `ΦᵀΦ` of projected vectors (Gauss-Newton, §3): `R_train` over the
corpus (accumulated while the index is built), `R_eval` over the query vectors, and TrackStar's
mixture `R = λ R_eval + (1-λ) R_train` (Eq. 3), with λ chosen where the sorted eigenvalue
curves of `λ R_eval` and `(1-λ) R_train` cross at a chosen component (§A.1.3).

Scale convention: we mix *mean* autocorrelations `ΦᵀΦ / n`, not sums. With sums the mixture
would depend on the corpus and query counts (19.6M vs 5.4K in the paper), and the paper's
reasoning about λ (C4 needs a larger λ because its *per-example* gradients are larger)
only holds for means. A global scale of R does not change rankings (unit norm removes it).

Scoring without a second array ("on the fly", the default): with W = R^{-1/2} symmetric,

    Ḡ_m·Ḡ_q = <W Φ_m, W Φ_q> / (||W Φ_m|| ||W Φ_q||) = (Φ_m · q') · s_m,
    q' = W normalise(W Φ_q),   s_m = 1 / ||W Φ_m||,

so retrieval is a plain streamed matmul over the raw stored rows times a per-row scale
`s_m` that is computed once per R (`index.compute_row_scale`). `finalize_rows` gives the other
path (the finalised vectors themselves); tests prove both give the same scores.

R_train from few examples (a user's own small corpus): an autocorrelation of n rows in a
block of width p = k² has rank <= n, and with n near or below p its inverse square root turns
similarity into regression coefficients on the rows (n <= p whitened rows are orthonormal),
so directions a handful of rows span dominate. R_train is therefore the OAS shrinkage
estimate (Chen, Wiesel, Eldar & Hero 2010, Eq. 23) per block, `(1-ρ_b) S_b + ρ_b (tr S_b / p) I`
with ρ_b chosen from S_b and n alone (`oas_shrinkage`): ρ_b ≈ (1 + r_b) / (n (1 - r_b / p)),
r_b = (tr S_b)² / tr S_b² the block's effective rank, so at the paper's n = 19.6M rows per
block of p = 4096 it is at most ~2e-4 (for r_b <= p / 2), while 50 rows get ρ ≈ 0.4-0.8.
`hessian.r_train_shrinkage` fixes ρ instead (0: the paper's unshrunk R_train). Each statistic
says what it was estimated from (`Whitening.statistics`), and one that is too thin to trust
is named in one log line (`thin_notes`).

Ablations (Table 1): `mode="none"` (no R), `"train"` (R_train only, Exp. 3 and 5), `"mixed"`
(TrackStar); `unit_norm=False` for Exp. 1 and TRAK-like scores. The optimizer correction is a
property of the index (vectors section of the config, recorded in its manifest).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jaxtyping import Array, Float

HESSIAN_MODES = ("none", "train", "mixed")
R_EVAL_SOURCES = ("queries", "task_prompts")


@dataclasses.dataclass(frozen=True)
class HessianConfig:
    """How R and the unit norm are applied at scoring time (config section `hessian`).

    Attributes:
      mode: "none" (R = I), "train" (R_train), "mixed" (λ R_eval + (1-λ) R_train).
      mix_lambda: λ in [0, 1]; a negative value chooses λ automatically (§A.1.3).
      fallback_lambda: the λ an automatic choice falls back to when it cannot be made (R_eval
        or R_train has fewer independent directions than the crossing component: a handful of
        queries); the paper's T-REx value 0.9. Negative: refuse instead (the old behaviour).
      lambda_component_fraction: the crossing component as a fraction of d (paper: 1000/65536).
      r_train_shrinkage: ρ of R_train's shrinkage toward its mean eigenvalue per block,
        `(1-ρ) R_train + ρ (tr R_b / p) I`; negative (default): OAS, chosen per block from the
        spectrum and the row count (`oas_shrinkage`; ≈ 0 when rows far outnumber the block
        width p, large when they do not); 0: none (the paper's R_train).
      damping: relative eigenvalue floor of R^{-1/2}: eigenvalues below `damping * max eig`
        (over all blocks) are raised to that floor, so directions with (almost) no variance are
        amplified at most `1/sqrt(damping)` times more than the strongest one.
      unit_norm: unit-normalise R^{-1/2}Φ (TrackStar); False for the un-normalised ablations.
      r_eval_source: where R_eval's gradients come from: "queries" (the evaluated queries) or
        "task_prompts" (§A.1.3 "any set of examples": the queries plus prompts of other facts
        of the same relations, rendered with the same template, up to `r_eval_prompts` in all).
      r_eval_prompts: size of the task-prompt set (source "task_prompts"; > 0).
    """

    mode: str = "mixed"
    mix_lambda: float = -1.0
    fallback_lambda: float = 0.9
    lambda_component_fraction: float = 1000 / 65536
    r_train_shrinkage: float = -1.0
    damping: float = 1e-6
    unit_norm: bool = True
    r_eval_source: str = "queries"
    r_eval_prompts: int = 0

    def __post_init__(self):
        if self.mode not in HESSIAN_MODES:
            raise ValueError(f"hessian.mode must be one of {HESSIAN_MODES}, got {self.mode!r}")
        if self.mix_lambda > 1.0:
            raise ValueError(f"hessian.mix_lambda must be in [0, 1] (or < 0 for automatic), got {self.mix_lambda}")
        if self.fallback_lambda > 1.0:
            raise ValueError(
                f"hessian.fallback_lambda must be in [0, 1] (or < 0 to refuse), got {self.fallback_lambda}"
            )
        if self.r_train_shrinkage > 1.0:
            raise ValueError(
                f"hessian.r_train_shrinkage must be in [0, 1] (or < 0 for OAS), got {self.r_train_shrinkage}"
            )
        if not 0.0 < self.lambda_component_fraction <= 1.0:
            raise ValueError(
                f"hessian.lambda_component_fraction must be in (0, 1], got {self.lambda_component_fraction}"
            )
        if not 0.0 <= self.damping < 1.0:
            raise ValueError(f"hessian.damping must be in [0, 1), got {self.damping}")
        if self.r_eval_source not in R_EVAL_SOURCES:
            raise ValueError(f"hessian.r_eval_source must be one of {R_EVAL_SOURCES}, got {self.r_eval_source!r}")
        if self.r_eval_source == "task_prompts" and self.r_eval_prompts <= 0:
            raise ValueError(
                f"hessian.r_eval_source='task_prompts' needs hessian.r_eval_prompts > 0, got {self.r_eval_prompts}"
            )


# ------------------------------------------------------------------------------------------
# Autocorrelation (R_train, R_eval)
# ------------------------------------------------------------------------------------------


def split_blocks(x: Float[Array, "n d"], num_blocks_total: int) -> Float[Array, "n b k2"]:
    """`[n, d]` -> `[n, blocks, k²]` in the vector layout of vectors.py (block-major)."""
    n, d = x.shape
    if d % num_blocks_total:
        raise ValueError(f"vector dim {d} is not a multiple of the number of blocks {num_blocks_total}")
    return x.reshape(n, num_blocks_total, d // num_blocks_total)


def autocorrelation(x: Float[Array, "n d"], num_blocks_total: int) -> Float[Array, "b k2 k2"]:
    """Per-block sum of outer products `Σ_n x_nb x_nbᵀ` (§A.1.3 `Φ̃ᵀΦ̃`, block diagonal).

    Accumulates in float32 at full matmul precision whatever the input dtype (bf16 rows are
    exactly representable in float32). Rows of zeros (padding) contribute exactly nothing.

    Args:
      x: vectors, one per row, any float dtype.
      num_blocks_total: number of diagonal blocks (2 * num_blocks).

    Returns:
      `[blocks, k², k²]` float32 sums (divide by the row count for the mean).
    """
    xb = split_blocks(jnp.asarray(x).astype(jnp.float32), num_blocks_total)
    return jnp.einsum("nbi,nbj->bij", xb, xb, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


class RStats(NamedTuple):
    """An autocorrelation as a float32 sum plus the number of rows summed (composable)."""

    total: np.ndarray  # [blocks, k2, k2] float32 sum of x xᵀ per block
    count: int

    def mean(self) -> np.ndarray:
        """Mean autocorrelation `ΦᵀΦ / n` in float64 (the matrix that is mixed and inverted)."""
        if self.count <= 0:
            raise ValueError("autocorrelation over zero rows has no mean")
        return np.asarray(self.total, np.float64) / self.count


def r_eval(query_vectors: Float[Array, "q d"], num_blocks_total: int) -> RStats:
    """R_eval (§A.1.3): the autocorrelation of the raw query vectors.

    Args:
      query_vectors: raw projected query vectors (same featurizer as the index rows).
      num_blocks_total: number of diagonal blocks.

    Returns:
      RStats over the queries.
    """
    q = np.asarray(query_vectors)
    if q.ndim != 2 or q.shape[0] == 0:
        raise ValueError(f"R_eval needs a non-empty [num_queries, d] matrix, got shape {q.shape}")
    if not np.isfinite(q).all():
        bad = np.flatnonzero(~np.isfinite(q).all(axis=1))
        raise ValueError(f"R_eval: query vectors {bad[:10].tolist()} contain NaN/inf")
    return RStats(np.asarray(autocorrelation(q, num_blocks_total)), int(q.shape[0]))


# ------------------------------------------------------------------------------------------
# Mixing with automatic λ (§A.1.3) and R^{-1/2}
# ------------------------------------------------------------------------------------------


def lambda_component(dim: int, fraction: float) -> int:
    """The 1-based eigenvalue rank where the curves should cross: `round(fraction * d)`, >= 1.

    The paper uses the 1000th of 65536 (`fraction = 1000/65536`); a fraction scales it with d.
    """
    return max(1, min(dim, int(round(fraction * dim))))


# Rows on one index (TrackStar at several λ, Exp. 3 / 5) resolve the same R_train and R_eval:
# their spectra and R_train^{-1/2} are k²×k² eigendecompositions per block (d = 2^16: 16 of
# 4096² each), so each is computed once per content and process. Results are read-only.
_MEMO: collections.OrderedDict[str, object] = collections.OrderedDict()
_MEMO_SIZE = 8


def _memoized(kind: str, fn: Callable[..., object], *arrays: np.ndarray, **params) -> object:
    """`fn(*arrays, **params)`, computed once per (kind, array contents, params); numpy results
    (also inside a tuple) are made read-only so a caller cannot change the cached value."""
    h = hashlib.sha256(f"{kind}|{sorted(params.items())!r}".encode())
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"|{a.shape}|{a.dtype.str}|".encode())
        h.update(a.data)
    key = h.hexdigest()
    if key in _MEMO:
        _MEMO.move_to_end(key)
        return _MEMO[key]
    out = fn(*arrays, **params)
    for x in out if isinstance(out, tuple) else (out,):
        if isinstance(x, np.ndarray):
            x.flags.writeable = False
    _MEMO[key] = out
    while len(_MEMO) > _MEMO_SIZE:
        _MEMO.popitem(last=False)
    return out


def _block_eigvalsh(r_blocks: np.ndarray, symmetrize: bool) -> np.ndarray:
    r = np.asarray(r_blocks, np.float64)
    return np.linalg.eigvalsh(0.5 * (r + np.swapaxes(r, -1, -2)) if symmetrize else r)


def block_eigenvalues(r_blocks: np.ndarray, *, symmetrize: bool = False) -> np.ndarray:
    """Eigenvalues of each block, ascending, float64 `[blocks, k²]` (memoized, read-only).
    `symmetrize` averages each block with its transpose first (`block_ranks`)."""
    return _memoized("eigvalsh", _block_eigvalsh, np.asarray(r_blocks), symmetrize=symmetrize)


def sorted_eigenvalues(r_blocks: np.ndarray) -> np.ndarray:
    """All eigenvalues of a block-diagonal symmetric matrix, in descending order (float64).

    The spectrum of a block-diagonal matrix is the union of its blocks' spectra.
    """
    return np.sort(block_eigenvalues(r_blocks).reshape(-1))[::-1]


class LambdaUndetermined(ValueError):
    """Automatic λ cannot be chosen: R_eval or R_train has fewer independent directions than the
    crossing component (`make_whitening` falls back to `hessian.fallback_lambda`)."""


def choose_lambda(r_eval_mean: np.ndarray, r_train_mean: np.ndarray, component: int) -> float:
    """λ where the sorted eigenvalue curves of λ R_eval and (1-λ) R_train meet at `component`.

    §A.1.3: "we scale λ such that the (monotonic) singular value curves of λR_eval and
    (1-λ)R_train intersect at the 1000th component". With e_eval, e_train the c-th largest
    eigenvalues, λ e_eval = (1-λ) e_train gives λ = e_train / (e_eval + e_train) exactly. Above
    the crossing R_eval dominates (those task-common directions get downweighted).

    Args:
      r_eval_mean: `[blocks, k², k²]` mean query autocorrelation.
      r_train_mean: `[blocks, k², k²]` mean corpus autocorrelation.
      component: 1-based rank c of the crossing (`lambda_component`).

    Returns:
      λ in (0, 1).

    Raises:
      LambdaUndetermined: if either matrix has fewer than `component` positive eigenvalues
        (e.g. fewer queries than `component`), naming which one and its numerical rank.
    """
    e_eval = sorted_eigenvalues(r_eval_mean)
    e_train = sorted_eigenvalues(r_train_mean)
    if not 1 <= component <= e_eval.size:
        raise ValueError(f"lambda component {component} is outside 1..{e_eval.size}")
    for name, e in (("R_eval", e_eval), ("R_train", e_train)):
        # numpy.linalg.matrix_rank's tolerance for one k²×k² block, at float32 (R is summed in f32).
        tol = max(e[0], 0.0) * np.shape(r_eval_mean)[-1] * np.finfo(np.float32).eps
        rank = int((e > tol).sum())
        if rank < component:
            raise LambdaUndetermined(
                f"automatic lambda: {name} has numerical rank {rank} < crossing component {component} "
                f"(hessian.lambda_component_fraction); use more queries, a smaller fraction, or set hessian.mix_lambda"
            )
    a, b = e_eval[component - 1], e_train[component - 1]
    return float(b / (a + b))


# ------------------------------------------------------------------------------------------
# R_train from few examples: OAS shrinkage (Chen, Wiesel, Eldar & Hero 2010)
# ------------------------------------------------------------------------------------------


def oas_shrinkage(r_mean: np.ndarray, num_examples: int) -> np.ndarray:
    """Per-block shrinkage ρ_b of the Oracle Approximating Shrinkage estimator (Chen et al.,
    "Shrinkage Algorithms for MMSE Covariance Estimation", IEEE TSP 2010, Eq. 23).

    For a sample second moment S of n examples in p dimensions, the estimate
    `(1-ρ) S + ρ (tr S / p) I` with

        ρ = min(1, ((1 - 2/p) tr S² + (tr S)²) / ((n + 1 - 2/p) (tr S² - (tr S)² / p)))

    approximates the ρ minimising the expected Frobenius error to the true second moment for
    Gaussian examples, from S and n alone (R_train is stored as a sum, not as its rows). With
    r = (tr S)² / tr S² (the effective rank, 1..p), ρ ≈ (1 + r) / (n (1 - r / p)): negligible
    when examples far outnumber the effective rank, near 1 when they do not.

    Args:
      r_mean: `[blocks, p, p]` mean autocorrelation (any global scale: ρ is scale-free).
      num_examples: n, the rows it is the mean of.

    Returns:
      float64 `[blocks]` in [0, 1] (1 for an isotropic or all-zero block).
    """
    r = np.asarray(r_mean, np.float64)
    p = r.shape[-1]
    tr = np.trace(r, axis1=1, axis2=2)
    tr2 = np.einsum("bij,bji->b", r, r)  # tr S² (S symmetric: the squared Frobenius norm)
    num = (1.0 - 2.0 / p) * tr2 + tr**2
    den = (num_examples + 1.0 - 2.0 / p) * (tr2 - tr**2 / p)
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = np.where(den > 0, num / np.where(den > 0, den, 1.0), 1.0)
    return np.clip(rho, 0.0, 1.0)


def shrink(r_mean: np.ndarray, rho: np.ndarray) -> np.ndarray:
    """`(1-ρ_b) R_b + ρ_b (tr R_b / p) I` per block (float64): trace-preserving, so the mixture's
    scale convention (mean autocorrelations, λ) is unchanged."""
    r = np.asarray(r_mean, np.float64)
    p = r.shape[-1]
    rho = np.asarray(rho, np.float64).reshape(-1, 1, 1)
    mu = (np.trace(r, axis1=1, axis2=2) / p).reshape(-1, 1, 1)
    return (1.0 - rho) * r + rho * mu * np.eye(p)


def r_train_counts(num_examples: int, block_width: int) -> dict:
    """What R_train is estimated from against what it needs: `thin` when the rows are fewer
    than the block width p = k² (each block then has rank < p and its unshrunk inverse square
    root is undetermined in the directions no row spans)."""
    return {
        "num_examples": int(num_examples),
        "block_width": int(block_width),
        "thin": bool(num_examples < block_width),
    }


class RTrainEstimate(NamedTuple):
    mean: np.ndarray  # [blocks, p, p] float64: the (shrunk) mean autocorrelation that is mixed / inverted
    record: dict  # what it was estimated from (`Whitening.statistics["r_train"]`)


def estimate_r_train(r_train: RStats, shrinkage: float) -> RTrainEstimate:
    """R_train's mean autocorrelation, shrunk toward each block's mean eigenvalue by
    `shrinkage` (< 0: `oas_shrinkage`; 0: none), with the record of what it came from: row
    count against the block width (fewer rows than the block width: rank-deficient, `thin`)."""
    rt = r_train.mean()
    p = int(rt.shape[-1])
    method = "oas" if shrinkage < 0 else ("none" if shrinkage == 0 else "fixed")
    rho = oas_shrinkage(rt, r_train.count) if shrinkage < 0 else np.full(rt.shape[0], float(shrinkage))
    record = {
        **r_train_counts(r_train.count, p),
        "shrinkage": {
            "method": method,
            "rho_min": float(rho.min()),
            "rho_max": float(rho.max()),
            "rho_mean": float(rho.mean()),
        },
    }
    if method == "none":
        return RTrainEstimate(rt, record)
    return RTrainEstimate(_memoized("shrink", shrink, rt, rho), record)


def block_ranks(r_blocks: np.ndarray) -> list[int]:
    """Numerical rank of each `k²×k²` block (numpy.linalg.matrix_rank's tolerance at float32)."""
    out = []
    for w in block_eigenvalues(r_blocks, symmetrize=True):
        tol = max(float(w.max()), 0.0) * w.shape[-1] * np.finfo(np.float32).eps
        out.append(int((w > tol).sum()))
    return out


def mixing_diagnostics(r_eval_mean: np.ndarray, r_train_mean: np.ndarray, mix_lambda: float, damping: float) -> dict:
    """What the mixture does relative to R_train alone (for reports).

    `num_downweighted` is the paper's count (§3, §A.1.3): components above the crossing of the
    sorted spectra, `λ e_eval > (1-λ) e_train` (by construction of the automatic λ, about the
    crossing component: the paper's "top ~1000 of 65K").

    The weight of direction i in the score, relative to scoring with R_train, is `1/μ_i` with
    μ_i the generalized eigenvalues of (R, R_train), `μ_i = λ ν_i + (1-λ)` (ν_i those of
    (R_eval, R_train)). Unit norm removes any global scale of R, so μ_i > 1 by itself means
    nothing; what changes rankings is the *spread* of the weights. `weight_spread` gives the
    quantiles of `1/μ_i` divided by their median (p50 = 1) and max / min; `num_downweighted_2x`
    counts directions weighted at most half the median.

    Returns:
      `{r_eval_rank_per_block, r_train_rank_per_block, num_downweighted, num_downweighted_2x,
      weight_spread: {p01, p10, p50, p90, p99, max_over_min}, dim}`.
    """
    re, rt = np.asarray(r_eval_mean, np.float64), np.asarray(r_train_mean, np.float64)
    nu = _memoized("generalized", _generalized_eigenvalues, re, rt, damping=damping)  # independent of λ
    mu = np.maximum(mix_lambda * nu + (1.0 - mix_lambda), np.finfo(np.float64).tiny)
    weight = 1.0 / mu
    rel = weight / np.median(weight)
    e_eval, e_train = sorted_eigenvalues(re), sorted_eigenvalues(rt)
    q = np.quantile(rel, [0.01, 0.10, 0.50, 0.90, 0.99])
    return {
        "r_eval_rank_per_block": block_ranks(re),
        "r_train_rank_per_block": block_ranks(rt),
        "num_downweighted": int((mix_lambda * e_eval > (1.0 - mix_lambda) * e_train).sum()),
        "num_downweighted_2x": int((rel <= 0.5).sum()),
        "weight_spread": {
            **{k: float(v) for k, v in zip(("p01", "p10", "p50", "p90", "p99"), q)},
            "max_over_min": float(rel.max() / rel.min()),
        },
        "dim": int(e_eval.size),
    }


def _generalized_eigenvalues(re: np.ndarray, rt: np.ndarray, *, damping: float) -> np.ndarray:
    """ν_i of (R_eval, R_train): eigenvalues of `W_t R_eval W_t`, `W_t = R_train^{-1/2}` floored
    like scoring (`inverse_sqrt`), all blocks concatenated."""
    wt = inverse_sqrt(rt, damping, memo=True).matrix.astype(np.float64)
    return np.concatenate([np.linalg.eigvalsh(w @ e @ w) for w, e in zip(wt, re)])


def mix(r_eval_mean: np.ndarray, r_train_mean: np.ndarray, mix_lambda: float) -> np.ndarray:
    """Eq. 3: `R = λ R_eval + (1-λ) R_train` (float64)."""
    if not 0.0 <= mix_lambda <= 1.0:
        raise ValueError(f"mix_lambda must be in [0, 1], got {mix_lambda}")
    return mix_lambda * np.asarray(r_eval_mean, np.float64) + (1.0 - mix_lambda) * np.asarray(r_train_mean, np.float64)


class InverseSqrt(NamedTuple):
    matrix: np.ndarray  # [blocks, k2, k2] float32, symmetric
    floor: float  # absolute eigenvalue floor applied
    num_floored: int  # eigenvalues raised to the floor (all blocks)


def inverse_sqrt(r_blocks: np.ndarray, damping: float, *, memo: bool = False) -> InverseSqrt:
    """Block-wise R^{-1/2} by symmetric eigendecomposition (float64), with an eigenvalue floor.

    `R_b = V diag(w) Vᵀ  ->  R_b^{-1/2} = V diag(max(w, floor)^{-1/2}) Vᵀ` with
    `floor = damping * max(w over all blocks)`. A global (not per-block) floor keeps a block
    with little gradient energy from having its noise blown up to unit scale. Negative
    eigenvalues (round-off) are floored too. On well-conditioned input (all w >= floor) the
    result is exact: `R^{-1/2} R R^{-1/2} = I`.

    Args:
      r_blocks: `[blocks, k², k²]` symmetric PSD blocks.
      damping: relative floor in [0, 1).
      memo: keep the result for a later call on the same R (R_train: Exp. 3 / 5 and every
        mixed row's diagnostics); a one-off mixture is not kept (d = 2^16: 1 GiB each).

    Returns:
      InverseSqrt(matrix float32, floor, num_floored); read-only when memoized.
    """
    r = np.asarray(r_blocks, np.float64)
    if r.ndim != 3 or r.shape[1] != r.shape[2]:
        raise ValueError(f"R must be [blocks, k2, k2], got shape {r.shape}")
    if not np.isfinite(r).all():
        raise ValueError("R contains NaN/inf")
    if memo:
        return _memoized("inverse_sqrt", _inverse_sqrt, r, damping=float(damping))
    return _inverse_sqrt(r, damping=float(damping))


def _inverse_sqrt(r: np.ndarray, *, damping: float) -> InverseSqrt:
    r = 0.5 * (r + np.swapaxes(r, 1, 2))  # exact symmetry for eigh
    w, v = np.linalg.eigh(r)
    top = float(w.max())
    if top <= 0.0:
        raise ValueError("R is zero (or negative semidefinite): no gradient signal to whiten with")
    floor = damping * top
    if floor <= 0.0:  # damping 0: only guard exact zeros / negatives
        floor = top * np.finfo(np.float64).eps
    wd = np.maximum(w, floor)
    # V diag(wd^-1/2) Vᵀ as one batched BLAS GEMM: numpy's three-operand einsum runs an
    # unblocked loop over all four indices (k² = 512: 0.17 s a block against 0.02 s here)
    inv_sqrt = (v * (wd**-0.5)[:, None, :]) @ np.swapaxes(v, 1, 2)
    return InverseSqrt(inv_sqrt.astype(np.float32), float(floor), int((w < floor).sum()))


class Whitening(NamedTuple):
    """The resolved scoring transform: W = R^{-1/2} (None for mode "none") and the unit norm."""

    matrix: np.ndarray | None  # [blocks, k2, k2] float32
    unit_norm: bool
    mode: str
    mix_lambda: float | None  # the λ used (mode "mixed")
    component: int | None  # crossing component (automatic λ)
    num_floored: int
    r_eval: dict | None = None  # mode "mixed": source, count, ranks, down-weighted components
    statistics: dict | None = None  # what R_train, R_eval and λ were estimated from (`make_whitening`)

    def describe(self) -> dict:
        """JSON-able summary for logs and result files."""
        return {
            "mode": self.mode,
            "unit_norm": self.unit_norm,
            "mix_lambda": self.mix_lambda,
            "lambda_component": self.component,
            "num_floored_eigenvalues": self.num_floored,
            **({"r_eval": self.r_eval} if self.r_eval else {}),
        }


def thin_notes(statistics: dict | None) -> list[str]:
    """One line per statistic of a `Whitening.statistics` (or a stage's record of them) that is
    too thin to trust, saying what was done about it; empty when every one is well estimated."""
    return list((statistics or {}).get("thin_notes", []))


def describe_statistics(stats: dict) -> str:
    """One log line of a statistics record (`index.scoring.statistics_record`, a build's
    `index_statistics`): what V, R_train, R_eval and λ were estimated from."""
    parts = []
    v = stats.get("v")
    if v is not None:
        if v["source"] == "optimizer state":
            parts.append(
                f"V from the {v['optimizer']} state at step {v['checkpoint_step']} (~{v['effective_steps']} steps)"
            )
        elif v["source"] == "import estimate" and "num_sequences" in v:  # `second_moment`'s minibatch EMA
            parts.append(
                f"V estimated at import as {v.get('optimizer', 'the optimizer')} holds it: {v.get('num_steps')} steps"
                f" x {v.get('estimate_v_batch_sequences')} sequences of {v.get('estimate_v_source')}"
            )
        elif v["source"] == "import estimate":
            parts.append(
                f"V estimated at import from {v.get('num_examples')} per-example gradients of {v.get('estimate_v_source')}"
            )
        else:
            parts.append(f"no V ({v.get('reason', 'none')})")
    if "r_train" in stats:
        r = stats["r_train"]
        sh = r.get("shrinkage")
        rho = f", shrinkage ρ {sh['rho_min']:.2g}-{sh['rho_max']:.2g} ({sh['method']})" if sh else ""
        parts.append(f"R_train from {r['num_examples']} examples for blocks of width {r['block_width']}{rho}")
    if "r_eval" in stats:
        parts.append(f"R_eval from {stats['r_eval']['num_examples']} examples ({stats['r_eval']['source']})")
    if "lambda" in stats:
        parts.append(f"λ = {stats['lambda']['value']:.4g} ({stats['lambda']['how']})")
    return "; ".join(parts)


def _r_train_note(rec: dict) -> str:
    sh = rec["shrinkage"]
    done = (
        f"shrunk toward its mean eigenvalue per block (ρ = {sh['rho_min']:.2g}-{sh['rho_max']:.2g}, "
        f"hessian.r_train_shrinkage)"
        if sh["method"] != "none"
        else "NOT shrunk (hessian.r_train_shrinkage=0): directions few rows span dominate its inverse"
    )
    return (
        f"R_train is estimated from {rec['num_examples']} examples, fewer than the block width "
        f"{rec['block_width']} (rank-deficient): {done}"
    )


def make_whitening(cfg: HessianConfig, r_train: RStats | None, r_eval_stats: RStats | None = None) -> Whitening:
    """Resolves a HessianConfig into the scoring transform (§3 Eq. 2-3, §A.1.3).

    R_train is `estimate_r_train`'s (OAS-shrunk by default); an automatic λ that cannot be
    chosen (R_eval's rank below the crossing component) falls back to `cfg.fallback_lambda`.
    Both, and every statistic too thin to trust, are logged in one line each and recorded in
    `statistics` (`index.scoring.statistics_record` adds V's).

    Args:
      cfg: the hessian section.
      r_train: R_train of the index (needed for modes "train" and "mixed").
      r_eval_stats: R_eval of the queries (needed for "mixed").

    Returns:
      Whitening with W = R^{-1/2} (or None) and the resolved λ.

    Raises:
      LambdaUndetermined: automatic λ cannot be chosen and `cfg.fallback_lambda` < 0.
    """
    if cfg.mode == "none":
        return Whitening(None, cfg.unit_norm, cfg.mode, None, None, 0)
    if r_train is None:
        raise ValueError(f"hessian.mode={cfg.mode!r} needs R_train (the index has none yet: is the build complete?)")
    est = estimate_r_train(r_train, cfg.r_train_shrinkage)
    rt = est.mean
    stats = {"r_train": est.record, "thin_notes": []}
    if est.record["thin"]:
        stats["thin_notes"].append(_r_train_note(est.record))
    lam, comp, info = None, None, None
    if cfg.mode == "train":
        r = rt
    else:
        if r_eval_stats is None:
            raise ValueError("hessian.mode='mixed' needs query vectors for R_eval")
        re = r_eval_stats.mean()
        if re.shape != rt.shape:
            raise ValueError(f"R_eval blocks {re.shape} differ from R_train blocks {rt.shape}")
        ranks = block_ranks(re)
        stats["r_eval"] = {
            "source": cfg.r_eval_source,
            "num_examples": int(r_eval_stats.count),
            "block_width": int(re.shape[-1]),
            "rank_min": int(min(ranks)),
        }
        if cfg.mix_lambda < 0:
            comp = lambda_component(re.shape[0] * re.shape[1], cfg.lambda_component_fraction)
            stats["r_eval"]["needed_for_automatic_lambda"] = comp
            try:
                lam = choose_lambda(re, rt, comp)
                stats["lambda"] = {"value": lam, "how": "automatic", "component": comp}
            except LambdaUndetermined as e:
                if cfg.fallback_lambda < 0:
                    raise
                lam = float(cfg.fallback_lambda)
                stats["lambda"] = {"value": lam, "how": "fallback", "component": comp, "reason": str(e)}
                stats["r_eval"]["thin"] = True
                stats["thin_notes"].append(
                    f"{str(e).split(';')[0]} (R_eval from {r_eval_stats.count} examples): "
                    f"lambda falls back to hessian.fallback_lambda = {lam:g}"
                )
        else:
            lam = float(cfg.mix_lambda)
            stats["lambda"] = {"value": lam, "how": "fixed"}
        r = mix(re, rt, lam)
        info = {"source": cfg.r_eval_source, "num_vectors": int(r_eval_stats.count)}
        info.update(mixing_diagnostics(re, rt, lam, cfg.damping))
    for note in stats["thin_notes"]:
        logging.warning("%s", note)
    inv = inverse_sqrt(r, cfg.damping, memo=cfg.mode == "train")
    return Whitening(inv.matrix, cfg.unit_norm, cfg.mode, lam, comp, inv.num_floored, info, stats)


# ------------------------------------------------------------------------------------------
# Applying R^{-1/2} and the unit norm (jittable)
# ------------------------------------------------------------------------------------------


def apply_blocks(w: Float[Array, "b k2 k2"] | None, x: Float[Array, "n d"]) -> Float[Array, "n d"]:
    """Block-diagonal matrix times each row: `y_nb = W_b x_nb` (identity when `w` is None)."""
    x = jnp.asarray(x, jnp.float32)
    if w is None:
        return x
    b = w.shape[0]
    y = jnp.einsum("bij,nbj->nbi", jnp.asarray(w, jnp.float32), split_blocks(x, b), precision=jax.lax.Precision.HIGHEST)
    return y.reshape(x.shape)


def normalize(x: Float[Array, "n d"]) -> Float[Array, "n d"]:
    """Unit L2 norm per row; all-zero rows stay zero (score 0) instead of NaN."""
    norm = jnp.linalg.norm(x, axis=-1, keepdims=True)
    return jnp.where(norm > 0, x / jnp.where(norm > 0, norm, 1.0), 0.0)


def finalize_rows(x: Float[Array, "n d"], w: Float[Array, "b k2 k2"] | None, unit_norm: bool) -> Float[Array, "n d"]:
    """Ḡ = normalise(R^{-1/2} Φ) (Eq. 2): the finalised vectors, for index rows and queries alike."""
    y = apply_blocks(w, x)
    return normalize(y) if unit_norm else y


def finalize_queries(
    q_raw: Float[Array, "q d"], w: Float[Array, "b k2 k2"] | None, unit_norm: bool
) -> Float[Array, "q d"]:
    """Queries for on-the-fly scoring against raw rows: `q' = W normalise(W q)` (W = R^{-1/2}).

    Scores are then `(raw_row · q') * row_scale` with `row_scale = 1/||W raw_row||`
    (`row_scale`), equal to `Ḡ_row · Ḡ_q`. Without unit norm, `q' = W W q` and row_scale = 1.
    """
    return apply_blocks(w, finalize_rows(q_raw, w, unit_norm))


def row_scale(rows: Float[Array, "n d"], w: Float[Array, "b k2 k2"] | None, unit_norm: bool) -> Float[Array, " n"]:
    """Per-row scale of on-the-fly scoring: `1/||W g||` (0 for all-zero rows; 1 without unit norm).

    `rows` are the dequantised stored rows (for int8, multiply the result by the int8 scale
    to score against the int8 values directly).
    """
    if not unit_norm:
        return jnp.ones(rows.shape[0], jnp.float32)
    norm = jnp.linalg.norm(apply_blocks(w, rows), axis=-1)
    return jnp.where(norm > 0, 1.0 / jnp.where(norm > 0, norm, 1.0), 0.0)


def scores_on_the_fly(
    q_prime: Float[Array, "q d"], rows: Float[Array, "n d"], scale: Float[Array, " n"]
) -> Float[Array, "q n"]:
    """`(q' · row) * row_scale`: the streamed-retrieval form of Eq. 1 (reference for retrieval.py)."""
    s = jnp.einsum("qd,nd->qn", q_prime, jnp.asarray(rows, jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return s * scale[None, :]
