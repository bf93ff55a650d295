"""Token attribution: each token's share of a proponent's score (issue 39; paper §3 Eq. 1-2).

An example's objective is a sum over its target tokens, `obj(z) = sum_t c_t f_t`
(`features.grads.token_objective`), and every step after the gradient is linear: the optimizer
correction, the projection `P_d` and `W = R^{-1/2}`. So the raw vector splits over tokens,

    Φ(z) = Σ_t Φ_t(z),     Φ_t(z) = P_d(c_t ∇f_t(z) / √V),

and `Φ_t` is what the featurizer returns for the same example with its loss mask one-hot at
t (same model, projection, correction and path, fast or reference). The unit norm divides by
the norm of the *whole* example, so TrackStar's score `Ḡ(z_m)·Ḡ(z_q)` (`index.hessian`) splits
into

    proponent token t:   (W Φ_t(z_m) / ||W Φ(z_m)||) · Ḡ(z_q)  =  (Φ_t(z_m) · q') s_m
    query target token t: Ḡ(z_m) · W Φ_t(z_q) / ||W Φ(z_q)||

(q' = W normalise(W Φ_q), s_m = 1/||W Φ_m|| as in on-the-fly scoring; without the unit norm
both divisions are 1), and each side's contributions sum to the score. The proponent side
recomputes `Φ(z_m) = Σ_t Φ_t(z_m)` (its norm included), so it sums to the score of the
recomputed row: the index's score up to the storage dtype's rounding (float32: round-off).
The query side uses the stored row, so it sums to the index score itself.

Defined for every gradient row of the table (`methods.METHODS`, kind "gradient"): Exp. 1
(dot: no norm), Exp. 2-5, TrackStar (any λ), and TRAK. For `loss`, `margin` and `logit`
c_t depends on token t only; TRAK's Q = 1 - p̄ is one factor per *candidate* that multiplies
its score after R (`index.trak`, §4.4 footnote), so both sides' token shares of a TRAK
proponent are multiplied by that candidate's Q (`row_factors`), as its score is. Not
defined for BM25 (its score is a sum over *query* terms of saturating term-frequency weights
of the whole passage: no additive share per passage token) nor for the dense-embedding row
(a normalised mean-pooled encoder output: not linear in anything per token), nor for the
T-REx gold row (no score). With `retrieval.rerank_k` the token scores attribute the index
(projected) score, `proponent_index_scores`: the exact reranking score has no projection.

Cost: one featurize row per target token of every scored example (a 2,048-token passage is
2,048 rows), so it is off by default (`config.retrieval.token_scores`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
from jaxtyping import Float

from trackstar_jax.index import hessian

# featurize((tokens, loss_mask) pairs) -> raw vectors [n, d] (`retrieval.stage.query_vectors`)
Featurize = Callable[[Sequence[tuple[np.ndarray, np.ndarray]]], np.ndarray]
EOS_TEXT = "<eos>"  # how an end-of-sequence target token is spelled in the token lists
DECODE_WINDOW = 8  # tokens of left context decoded with each token (multi-byte characters, leading spaces)


def target_positions(loss_mask: np.ndarray) -> np.ndarray:
    """Positions j >= 1 whose token is a target (`loss_mask[j] > 0`; `lm_targets` drops position 0)."""
    m = np.asarray(loss_mask)
    return np.flatnonzero(m[1:] > 0) + 1


def one_hot_examples(tokens: np.ndarray, loss_mask: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """The example once per target token, its loss mask one-hot at that token (`target_positions` order)."""
    out = []
    for j in target_positions(loss_mask):
        m = np.zeros(len(tokens), np.int32)
        m[j] = 1
        out.append((np.asarray(tokens, np.int32), m))
    return out


def token_vectors(
    featurize: Featurize, tokens: np.ndarray, loss_mask: np.ndarray
) -> tuple[np.ndarray, Float[np.ndarray, "n d"]]:
    """`(target positions [n], Φ_t [n, d])`: the raw vector of each target token, in order.

    `featurize` is the featurizer of the side (index rows: role "index", queries: role
    "query"). `Φ_t.sum(0)` is the example's raw vector.
    """
    rows = one_hot_examples(tokens, loss_mask)
    if not rows:
        raise ValueError("token attribution: the example has no target token (loss_mask is 0 after BOS)")
    vecs = np.asarray(featurize(rows), np.float32)
    return target_positions(loss_mask), vecs


def proponent_token_scores(
    whitening: hessian.Whitening, q_prime: Float[np.ndarray, " d"], token_vecs: Float[np.ndarray, "n d"]
) -> np.ndarray:
    """Each proponent token's share `(Φ_t · q') s_m` of the score, s_m = 1/||W Σ_t Φ_t|| (1 without
    the unit norm); they sum to the score of the row `Σ_t Φ_t`. float64 `[n]`."""
    w = None if whitening.matrix is None else np.asarray(whitening.matrix)
    whole = np.asarray(token_vecs, np.float32).sum(0, keepdims=True)
    s = float(np.asarray(hessian.row_scale(whole, w, whitening.unit_norm))[0])
    return (np.asarray(token_vecs, np.float64) @ np.asarray(q_prime, np.float64)) * s


def target_token_scores(
    whitening: hessian.Whitening, row: Float[np.ndarray, " d"], token_vecs: Float[np.ndarray, "n d"]
) -> np.ndarray:
    """Each query target token's share `Ḡ_m · W Φ_t(q) / ||W Φ(q)||` of the score against the
    (dequantised, raw) index row `row`; they sum to that row's score. float64 `[n]`."""
    w = None if whitening.matrix is None else np.asarray(whitening.matrix)
    g_m = np.asarray(hessian.finalize_rows(np.asarray(row, np.float32)[None], w, whitening.unit_norm), np.float64)[0]
    y = np.asarray(hessian.apply_blocks(w, np.asarray(token_vecs, np.float32)), np.float64)
    norm = float(np.linalg.norm(y.sum(0))) if whitening.unit_norm else 1.0
    return (y @ g_m) / norm if norm > 0 else np.zeros(len(y))


def token_strings(tokenizer: Any, tokens: Sequence[int], positions: Sequence[int]) -> list[str]:
    """The text of each token at `positions`, as it reads in the decoded example: decoded with
    up to `DECODE_WINDOW` tokens of left context (so a leading space, or a character split over
    byte tokens, lands where the text has it); BOS / EOS / padding, which decode to nothing,
    read `EOS_TEXT` for EOS and "" otherwise."""
    tokens = [int(t) for t in tokens]
    out = []
    for j in positions:
        j = int(j)
        if tokens[j] == tokenizer.eos_id:
            out.append(EOS_TEXT)
            continue
        lo = max(1, j - DECODE_WINDOW)
        before, upto = tokenizer.decode(tokens[lo:j]), tokenizer.decode(tokens[lo : j + 1])
        out.append(upto[len(before) :] if upto.startswith(before) else tokenizer.decode([tokens[j]]))
    return out


def attribute(
    *,
    whitening: hessian.Whitening,
    q_prime: Float[np.ndarray, " d"],
    query: tuple[np.ndarray, np.ndarray],
    query_token_vecs: tuple[np.ndarray, np.ndarray],
    rows: Float[np.ndarray, "k d"],
    proponents: Sequence[tuple[np.ndarray, np.ndarray]],
    featurize_index: Featurize,
    tokenizer: Any,
    row_factors: Sequence[float] | None = None,
) -> dict:
    """One query's token scores against its proponents (the record fields).

    Args:
      whitening: the scoring's W and unit norm (`index.scoring.Scoring.whitening`).
      q_prime: the query's finalised vector (`Scoring.finalize_queries`).
      query: its `(tokens, loss_mask)`; query_token_vecs: its `token_vectors` (query role).
      rows: the proponents' raw (dequantised) index rows, in rank order.
      proponents: their `(tokens, loss_mask)` as the index featurized them.
      featurize_index: the index rows' featurizer.
      tokenizer: for the token strings.
      row_factors: each proponent's factor on its score after R and the unit norm (TRAK's Q,
        `Scoring.row_factor`); None: 1.

    Returns:
      `{"proponent_token_scores": [{"tokens", "scores"} per proponent], "target_tokens":
      [str], "target_token_scores": [[float] per proponent]}`.
    """
    qpos, qvecs = query_token_vecs
    props, targets = [], []
    factors = [1.0] * len(rows) if row_factors is None else [float(f) for f in row_factors]
    for (tokens, mask), row, factor in zip(proponents, rows, factors):
        pos, vecs = token_vectors(featurize_index, tokens, mask)
        props.append(
            {
                "tokens": token_strings(tokenizer, tokens, pos),
                "scores": (factor * proponent_token_scores(whitening, q_prime, vecs)).tolist(),
            }
        )
        targets.append((factor * target_token_scores(whitening, row, qvecs)).tolist())
    return {
        "proponent_token_scores": props,
        "target_tokens": token_strings(tokenizer, query[0], qpos),
        "target_token_scores": targets,
    }
