"""Several processes (a pod): each streams its own row range (`process_row_range`,
`local_candidates`) and the candidates are merged on the host (`merge_candidates`) into the
result one process would give (`process_stream_topk`).
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Array, Float

from trackstar_jax.retrieval.kernel import SENTINEL
from trackstar_jax.retrieval.score_plan import Plan
from trackstar_jax.retrieval.topk import RowSource, TopK, check_k, check_queries, empty_topk, stream_topk


def process_row_range(num_rows: int, chunk_rows: int, process_index: int, process_count: int) -> tuple[int, int]:
    """Rows `[lo, hi)` that process `process_index` of `process_count` scores.

    Whole chunks of `chunk_rows` are dealt out contiguously (process 0 the lowest ids), so
    every process reads the same chunk shapes as a single process would; a process gets no
    rows (`lo == hi`) when there are fewer chunks than processes.
    """
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is not in [0, {process_count})")
    num_chunks = -(-int(num_rows) // int(chunk_rows))
    a, b = num_chunks * process_index // process_count, num_chunks * (process_index + 1) // process_count
    return min(a * chunk_rows, num_rows), min(b * chunk_rows, num_rows)


class RowRange:
    """The rows `[lo, hi)` of a `RowSource` as a `RowSource` of its own (ids from 0)."""

    def __init__(self, reader: RowSource, lo: int, hi: int):
        if not 0 <= lo < hi <= reader.num_rows:
            raise ValueError(f"row range [{lo}, {hi}) is empty or outside [0, {reader.num_rows})")
        self.reader, self.lo = reader, int(lo)
        self.num_rows, self.dim, self.dtype, self.manifest = int(hi - lo), reader.dim, reader.dtype, reader.manifest

    def read_block(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Rows `[lo + start, lo + stop)` of the underlying source."""
        return self.reader.read_block(self.lo + start, self.lo + stop)


def _pad_candidates(res: TopK, num_queries: int, k: int) -> TopK:
    """`res` widened to `[Q, k]` with rows that never win: top -inf, bottom +inf, id SENTINEL."""
    have = res.top_ids.shape[1] if res.top_ids.shape[0] else 0
    out = []
    for scores, ids, fill in ((res.top_scores, res.top_ids, -np.inf), (res.bottom_scores, res.bottom_ids, np.inf)):
        s = np.full((num_queries, k), fill, np.float32)
        i = np.full((num_queries, k), SENTINEL, np.int64)
        if have:
            s[:, :have], i[:, :have] = scores, ids
        out += [s, i]
    return TopK(*out)


def merge_candidates(parts: Sequence[TopK], k: int) -> TopK:
    """Exact merge of candidate lists over disjoint row sets (one per process), on the host.

    Each part holds `[Q, >= k']` candidates with global ids (padding: score -inf / +inf and
    id `SENTINEL`). The result is ordered like `topk`: proponents by (score desc, id asc),
    opponents by (score asc, id asc), with ids as an explicit tie key, so it does not depend
    on the order of the parts.

    Raises:
      ValueError: fewer than `k` real candidates for some query.
    """
    ts = np.concatenate([p.top_scores for p in parts], axis=1)
    ti = np.concatenate([p.top_ids for p in parts], axis=1)
    bs = np.concatenate([p.bottom_scores for p in parts], axis=1)
    bi = np.concatenate([p.bottom_ids for p in parts], axis=1)
    top = np.lexsort((ti, -ts.astype(np.float64)), axis=-1)[:, :k]
    bot = np.lexsort((bi, bs.astype(np.float64)), axis=-1)[:, :k]
    out = TopK(
        np.take_along_axis(ts, top, 1),
        np.take_along_axis(ti, top, 1),
        np.take_along_axis(bs, bot, 1),
        np.take_along_axis(bi, bot, 1),
    )
    if (out.top_ids == SENTINEL).any() or (out.bottom_ids == SENTINEL).any():
        raise ValueError(f"fewer than k={k} candidate rows in the merged parts")
    return out


def local_candidates(
    queries: Float[Array, "q d"],
    reader: RowSource,
    k: int,
    chunk_rows: int,
    mesh: Mesh | None = None,
    row_scale: Float[Array, " n"] | None = None,
    *,
    process_index: int,
    process_count: int,
    query_batch_size: int | None = None,
    plan: Plan | None = None,
    precision: str = "float32",
) -> TopK:
    """One process's share of `process_stream_topk`: top-k / bottom-k of its rows
    (`process_row_range`) with global ids, padded to `[Q, k]` with rows that never win."""
    n = int(reader.num_rows)
    k = check_k(k, n)
    q = check_queries(queries, int(reader.dim))
    lo, hi = process_row_range(n, int(chunk_rows), process_index, process_count)
    if hi == lo:
        return _pad_candidates(empty_topk(0), q.shape[0], k)
    scale = None if row_scale is None else np.asarray(row_scale, np.float32)[lo:hi]
    sub = RowRange(reader, lo, hi)
    res = stream_topk(
        q,
        sub,
        min(k, hi - lo),
        chunk_rows,
        mesh,
        scale,
        query_batch_size=query_batch_size,
        plan=plan,
        precision=precision,
    )
    return _pad_candidates(res._replace(top_ids=res.top_ids + lo, bottom_ids=res.bottom_ids + lo), q.shape[0], k)


def process_stream_topk(
    queries: Float[Array, "q d"],
    reader: RowSource,
    k: int,
    chunk_rows: int,
    mesh: Mesh | None = None,
    row_scale: Float[Array, " n"] | None = None,
    *,
    query_batch_size: int | None = None,
    plan: Plan | None = None,
    precision: str = "float32",
) -> TopK:
    """`stream_topk` split over the processes of a `jax.distributed` job (a pod).

    This process streams only its rows (`process_row_range`) over `mesh` (its *local*
    devices) and keeps a local top-k / bottom-k with global ids (`local_candidates`); the
    candidates of all processes are gathered (one all-gather) and merged
    (`merge_candidates`): every process returns the same result, equal to `stream_topk` over
    the whole index. The scoring is wrapped in a fail-fast barrier, so a process whose
    reading fails tells the others at once. In a single process it is `stream_topk`.

    Args:
      queries, reader, k, chunk_rows, row_scale, query_batch_size, plan, precision: as `stream_topk`
        (`row_scale` over the whole index; only this process's range is read).
      mesh: this process's devices (default: one device).

    Returns:
      TopK (see `topk`).
    """
    from trackstar_jax.distributed import multihost  # noqa: PLC0415  (layer 0; late to keep import light)

    with multihost.step("retrieve:scored"):
        local = local_candidates(
            queries,
            reader,
            k,
            chunk_rows,
            mesh,
            row_scale,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
            query_batch_size=query_batch_size,
            plan=plan,
            precision=precision,
        )
    # ids travel as int32 (JAX's default integer width; row ids are < 2^31, see SENTINEL)
    ts, ti, bs, bi = (
        multihost.gather_from_processes(x)
        for x in (
            local.top_scores,
            local.top_ids.astype(np.int32),
            local.bottom_scores,
            local.bottom_ids.astype(np.int32),
        )
    )
    parts = [TopK(ts[p], ti[p].astype(np.int64), bs[p], bi[p].astype(np.int64)) for p in range(ts.shape[0])]
    return merge_candidates(parts, int(k))
