"""Two-stage retrieval: rescore the index's top K with the exact, unprojected score (issue 39).

The index ranks by `Ḡ_m·Ḡ_q` of d-dimensional projections, so its top-10 is exact for the
projected vectors but only approximately the top-10 of the unprojected gradients (the peer race
measured 0.888-0.900 top-10 overlap at d = 6,144). The second stage takes the index's top
`retrieval.rerank_k` rows of each query and rescores them with

    exact(m, q) = <g_m / √V, g_q / √V> / (||g_m / √V|| ||g_q / √V||)

(`g` the per-example gradient of the row's output function over every attributed parameter,
materialised by `features.grads.per_example_grads`; `1/√V` the *exact* element-wise
correction (`vectors.path = "reference"`'s), whatever the index's path; the cosine when
`hessian.unit_norm`, else the dot product): the score `benchmarks/peer_race.py` takes as the
exact reference. There is no R: R (R_train, R_eval and their mixture) is a block-diagonal
matrix over the *projected* coordinates (§3, §A.1.3) and has no unprojected counterpart that
the index holds; the paper's exact comparison (§A.1.2) is the corrected gradient cosine too.
For a row with R (TrackStar, Exp. 3 / 5) the second stage therefore swaps the Hessian term
for exactness in the projection; the records keep both scores (`proponent_scores`: the
reranked, exact score that orders them; `proponent_index_scores`: the index's).

Cost: one per-example gradient per candidate (K per query) and |θ| floats per row of a
batch; for models whose gradient does not fit `vectors.batch_size` times in memory lower
that batch size.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from trackstar_jax import data as data_lib
from trackstar_jax.features import grads as grads_lib
from trackstar_jax.features import preconditioner as precond_lib
from trackstar_jax.features import vectors as vectors_lib


class ExactScorer:
    """The exact corrected-gradient score of a run's rows and queries (module docstring).

    Args:
      graphdef, model_cfg, params, opt_state: the run (`training.checkpoint.Run`).
      vec_cfg: the index's vector settings (output function, correction, unembed, batch size).
      unit_norm: cosine (True) or dot product.
    """

    def __init__(self, graphdef, model_cfg, params, opt_state, vec_cfg: vectors_lib.VectorConfig, unit_norm: bool):
        self.vec_cfg, self.unit_norm, self.params = vec_cfg, unit_norm, params
        self.max_len = model_cfg.max_len
        self.plan = vectors_lib.make_block_plan(params, model_cfg, vec_cfg)
        ref = dataclasses.replace(vec_cfg, path="reference")  # the exact element-wise 1/sqrt(V)
        self.correction = vectors_lib.make_precond(params, opt_state, ref, self.plan)
        self._grads = {
            role: jax.jit(
                functools.partial(
                    _corrected_grads, graphdef=graphdef, plan=self.plan, output_fn=vec_cfg.output_fn, role=role
                )
            )
            for role in grads_lib.ROLES
        }
        self._dots = jax.jit(
            functools.partial(_dots, graphdef=graphdef, plan=self.plan, output_fn=vec_cfg.output_fn, role="index")
        )

    def _batches(self, items: Sequence[tuple[np.ndarray, np.ndarray]], bs: int | None = None):
        """Padded batches of `bs` rows (default `vectors.batch_size`), lengths bucketed as the
        index build's (`data.bucket_len`): a handful of shapes, each compiled once."""
        bs = bs or self.vec_cfg.batch_size
        for lo in range(0, len(items), bs):
            part = items[lo : lo + bs]
            seq = data_lib.bucket_len(max(len(t) for t, _ in part), self.max_len)
            b = data_lib.pad_batch(part, list(range(len(part))), bs, seq)
            yield len(part), {"tokens": b["tokens"], "loss_mask": b["loss_mask"]}

    def query_grads(self, queries: Sequence[tuple[np.ndarray, np.ndarray]]) -> dict[str, jax.Array]:
        """The queries' corrected gradients `{path: [Q, *shape]}` (role "query")."""
        bs = 1 if len(queries) == 1 else None  # one query (reranking): no padding rows
        parts = [(n, self._grads["query"](self.params, self.correction, b)) for n, b in self._batches(queries, bs)]
        return {p: jnp.concatenate([g[p][:n] for n, g in parts]) for p in parts[0][1]}

    def score_matrix(
        self, queries: Sequence[tuple[np.ndarray, np.ndarray]], rows: Sequence[tuple[np.ndarray, np.ndarray]]
    ) -> np.ndarray:
        """The exact score of every row (index role) with every query. float64 `[Q, len(rows)]`."""
        qg = self.query_grads(queries)
        qn = np.asarray(sum(jnp.einsum("q...,q...->q", g, g) for g in qg.values()), np.float64)
        dots, norms = [], []
        for n, batch in self._batches(list(rows)):
            d, s = self._dots(self.params, self.correction, batch, qg)
            dots.append(np.asarray(d, np.float64)[:n])
            norms.append(np.asarray(s, np.float64)[:n])
        dot, nrm = np.concatenate(dots).T, np.concatenate(norms)
        if not self.unit_norm:
            return dot
        den = np.sqrt(qn[:, None] * nrm[None, :])
        return np.where(den > 0, dot / np.where(den > 0, den, 1.0), 0.0)

    def scores(self, query: tuple[np.ndarray, np.ndarray], rows: Sequence[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """`score_matrix` of one query. float64 `[len(rows)]`."""
        return self.score_matrix([query], rows)[0]


def _corrected_grads(params, correction, batch, *, graphdef, plan, output_fn, role) -> dict[str, jax.Array]:
    g = grads_lib.per_example_grads(params, batch, plan, graphdef=graphdef, output_fn=output_fn, role=role)
    return g if correction is None else precond_lib.apply_elementwise(g, correction)


def _dots(params, correction, batch, qg, *, graphdef, plan, output_fn, role):
    """`(g_b · g_q [B, Q], ||g_b||² [B])` over every attributed parameter, g corrected."""
    g = _corrected_grads(params, correction, batch, graphdef=graphdef, plan=plan, output_fn=output_fn, role=role)
    hp = jax.lax.Precision.HIGHEST
    dots = sum(jnp.einsum("b...,q...->bq", x, qg[p], precision=hp) for p, x in g.items())
    sq = sum(jnp.einsum("b...,b...->b", x, x, precision=hp) for x in g.values())
    return dots, sq


def rerank(
    scorer: ExactScorer,
    query: tuple[np.ndarray, np.ndarray],
    cand_ids: Sequence[int],
    cand_index_scores: Sequence[float],
    rows: Sequence[tuple[np.ndarray, np.ndarray]],
    k: int,
) -> tuple[list[int], list[float], list[float]]:
    """The top `k` of the candidates by their exact score (ties: lower id first, as `topk`).

    Returns:
      `(ids, exact scores, index scores)`, each `k` long (fewer if fewer candidates).
    """
    exact = scorer.scores(query, rows)
    ids = np.asarray(cand_ids, np.int64)
    order = np.lexsort((ids, -exact))[:k]
    return ids[order].tolist(), exact[order].tolist(), np.asarray(cand_index_scores, np.float64)[order].tolist()


def encode_rows(run: Any, ids: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Index rows `ids` as the index featurized them: `(tokens, loss_mask)` under the pretraining loss."""
    items, _ = data_lib.encode_passages(run.tokenizer, [run.corpus.texts[int(i)] for i in ids], run.model_cfg.max_len)
    return items
