"""Exact top-k retrieval: every query scored against every index row (paper §4: "exact scoring
between each query and all candidate examples"), sharded over a mesh and streamed from disk.

Per query we keep the top-k rows (proponents, highest score first) and the bottom-k rows
(opponents, lowest score first). The order is total and deterministic: proponents by
(score descending, id ascending), opponents by (score ascending, id ascending), so equal
scores always come out lowest id first, on any number of devices and for any chunking.

How (issue 5, style.md §4.3):
  * Rows are split over all devices of the mesh. Inside `jax.shard_map`, each device scores
    its rows against the queries (float32 accumulation whatever the storage dtype) -- in one
    dot when the shard's scores fit a buffer, else block by block merged into a running local
    top-k / bottom-k -- with *global* row ids. The candidates are all-gathered and merged
    into the global result.
  * Exact ties without a composite sort key: `lax.top_k` is stable (equal values keep their
    input order, documented). Every merge concatenates candidate lists in ascending-id order
    (running list before the new block, device 0 before device 1, earlier chunk before later
    chunk), and each list is itself sorted by (score desc, id asc), so among equal scores the
    input position order *is* the id order and the stable selection keeps the lowest ids.
    Opponents are the top-k of the negated scores, with the same argument. Negative zero is
    canonicalised to +0 first, so that a total-order comparison cannot split -0 from +0.
  * Rows that do not exist (padding to a multiple of the device count, the overlap of a
    clamped last block) get score -inf and id `SENTINEL`; they can never beat a real row
    (every real score is finite; a non-finite score is reported as an error).
  * Streaming (`stream_topk`): the index is read chunk by chunk through an `RowSource`,
    the next chunk is read (and put on the devices) by a background thread while the current
    one is scored, queries go in fixed-size batches, and the running top-k is merged across
    chunks with the same stable merge -- the result equals the in-memory `topk`.
  * Modules: the plan (`score_plan.py`), the per-device kernel and the sharded program
    (`kernel.py`), this module (in memory, streamed, the memory check), several processes
    (`merge.py`).

CPU formulations (measured on the 2-core dev machine, BUILD_NOTES "Issue 5"): one query is
scored as `rows @ q` (row-major matvec, memory-bound), never as `q @ rows.T` (~15x slower);
many queries as `q @ rows.T`, in blocks whose score tile stays small (fresh buffers over
~32 MB cost page faults on every call). XLA:CPU widens bfloat16 element by element through a
slow path unless the dot itself takes bfloat16, so bfloat16 rows are scored by a hand-written
FFI kernel (`native.scores`: rows widened by integer shifts in registers, float32 FMAs; up to
64 queries, `upcast="native"`), or -- with more queries, or when that kernel is unavailable
-- by a native bf16 x bf16 -> f32 dot against a 3-term bf16 split of the query (few queries,
`"bf16_split3"`), or read as uint32 pairs widened by integer shifts before a float32 matmul
(many queries, `"bf16_pairs"`). All are exact to float32 rounding.

Accelerator formulations (GPU / TPU, `score_plan._accelerator_plan`; issue 36):
plain matmuls on the rows in their stored dtype with float32 accumulation
(`preferred_element_type`), scores laid out `[queries, rows]` (query-major), so `lax.top_k`
selects along the minor axis; float32 rows at `Precision.HIGHEST`, bfloat16 rows against the
query split into bfloat16 terms (tensor-core GEMMs, no widened copy of the rows), other dtypes
widened inside the fused dot. Score tiles are far larger than on the CPU (HBM, no page-fault
cost per buffer): a shard is scored whole up to 2^27 scores, else in blocks of 2^26 scores.
On a GPU, up to `score_plan._TWO_STAGE_MAX_QUERIES` queries are selected in two stages (`Plan.segment`):
the top-k of every segment of `score_plan._SEGMENT` scores, then the top-k of those candidates. Exact and
in the same order as one `lax.top_k` (a segment's top-k holds every global winner it contains;
both stages are stable and see positions in ascending order). Measured on one H200
(`benchmarks/retrieve_parts.py`, 10^6 scores per query): top-k + bottom-k of one query 3.8 ms in
one stage (a single long row runs on few threads), 0.89 ms in two; the whole 10^6 x 4096 bf16
search 5.3 -> 2.7 ms. At 64 queries one stage wins (4.1 vs 12.8 ms).

Precision (`Plan.precision`, `config.retrieval.precision`): "float32" (default) is exact to
float32 rounding on every platform; "tf32" scores float32 rows at `Precision.HIGH` (TF32 on
NVIDIA GPUs, 3 bf16 passes on TPU; XLA:CPU ignores it) and bfloat16 rows against a 2-term
query split (16 significand bits); "bf16" rounds the query (and float32 rows) to bfloat16,
one pass. Only "float32" is exact against the numpy reference.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Iterator, NamedTuple, Protocol, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from trackstar_jax.distributed import memory, multihost
from trackstar_jax.index import store as store_lib
from trackstar_jax.retrieval.kernel import SENTINEL, merge_fn, sharded_fn
from trackstar_jax.retrieval.score_plan import Plan, dtype_name, make_score_plan


class TopK(NamedTuple):
    """Exact retrieval result (host numpy arrays).

    Attributes:
      top_scores: `[Q, k]` float32, descending (proponents).
      top_ids: `[Q, k]` int64 row ids; equal scores in ascending id order.
      bottom_scores: `[Q, k]` float32, ascending (opponents: most negative first).
      bottom_ids: `[Q, k]` int64 row ids; equal scores in ascending id order.
    """

    top_scores: np.ndarray
    top_ids: np.ndarray
    bottom_scores: np.ndarray
    bottom_ids: np.ndarray


class RowSource(Protocol):
    """What retrieval needs from an index (implemented by `index.IndexReader`, `ArrayReader`)."""

    num_rows: int
    dim: int
    dtype: Any
    manifest: dict

    def read_block(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None]: ...


class ArrayReader:
    """An in-memory `RowSource` over an array (tests, benchmarks, notebooks).

    `read_block` returns views (no copy). `row_scale` plays the role of the int8 dequantisation
    scale of `index.IndexReader` (returned with every block).
    """

    def __init__(self, rows: np.ndarray, row_scale: np.ndarray | None = None, manifest: dict | None = None):
        rows = np.asarray(rows)
        if rows.ndim != 2:
            raise ValueError(f"rows must be [num_rows, dim], got shape {rows.shape}")
        if row_scale is not None:
            row_scale = np.asarray(row_scale, np.float32)
            if row_scale.shape != (rows.shape[0],):
                raise ValueError(f"row_scale has shape {row_scale.shape}, expected ({rows.shape[0]},)")
        self.rows, self.row_scale = rows, row_scale
        self.num_rows, self.dim = rows.shape
        self.dtype = rows.dtype
        self.manifest = dict(manifest or {})

    def read_block(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Rows `[start, stop)` and their scale (None when the reader has none)."""
        if not 0 <= start < stop <= self.num_rows:
            raise ValueError(f"row range [{start}, {stop}) is outside [0, {self.num_rows})")
        return self.rows[start:stop], None if self.row_scale is None else self.row_scale[start:stop]


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def _default_mesh() -> Mesh:
    from trackstar_jax.distributed import sharding  # noqa: PLC0415  (layer 0; imported late to keep import light)

    return sharding.make_mesh(devices=jax.devices()[:1])


def check_queries(queries: Any, dim: int) -> np.ndarray:
    q = np.asarray(queries, np.float32)
    if q.ndim != 2 or (q.shape[0] and q.shape[1] != dim):
        raise ValueError(f"queries must be [num_queries, {dim}] (the index dim), got shape {q.shape}")
    if q.shape[0] and not np.isfinite(q).all():
        bad = np.flatnonzero(~np.isfinite(q).all(axis=1))
        raise ValueError(f"queries contain NaN/inf (query index(es) {bad[:10].tolist()})")
    return q


def check_k(k: int, num_rows: int) -> int:
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if k <= 0:
        raise ValueError(f"k must be >= 1, got {k}")
    if k > num_rows:
        raise ValueError(f"k={k} is larger than the number of index rows ({num_rows})")
    return int(k)


def empty_topk(k: int) -> TopK:
    s, i = np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
    return TopK(s, i, s.copy(), i.copy())


def _finish(res: tuple[Any, ...], num_queries: int) -> TopK:
    """Device candidates -> host `TopK`; refuses non-finite scores (they would break exactness)."""
    ts, ti, nbs, bi = (np.asarray(x)[:num_queries] for x in jax.device_get(res))
    if not (np.isfinite(ts).all() and np.isfinite(nbs).all()) or (ti == SENTINEL).any() or (bi == SENTINEL).any():
        bad = sorted({int(i) for a, s in ((ti, ts), (bi, nbs)) for i in a[~np.isfinite(s)] if i != SENTINEL})
        raise ValueError(
            "non-finite retrieval scores (NaN/inf in index rows, queries or row_scale, or float32 "
            f"overflow); affected row id(s): {bad[:10]}"
        )
    return TopK(ts, ti.astype(np.int64), -nbs, bi.astype(np.int64))


def _host_rows(x: np.ndarray, n: int) -> np.ndarray:
    """`x` (rows first) as a C-contiguous, 64-byte-aligned array of `n` rows, zero-padded.

    Alignment lets `device_put` on CPU alias the buffer instead of copying it; the padded
    rows are masked as non-existent by the kernel. Returns `x` itself when it already fits.
    """
    x = np.asarray(x)
    if x.shape[0] == n and x.flags.c_contiguous and x.ctypes.data % 64 == 0:
        return x
    shape = (n,) + x.shape[1:]
    nbytes = int(np.prod(shape)) * x.dtype.itemsize
    buf = np.empty(nbytes + 64, np.uint8)
    off = (-buf.ctypes.data) % 64
    out = buf[off : off + nbytes].view(x.dtype).reshape(shape)
    out[: x.shape[0]] = x
    out[x.shape[0] :] = 0
    return out


def _put_rows(mesh: Mesh, rows: Any, scale: Any, plan: Plan) -> tuple[Any, Any]:
    """Rows `[n, d]` and scale `[n]` split over all mesh axes (rows must divide evenly).

    Host bfloat16 rows for a "bf16_pairs" plan are viewed as `[n, d/2]` uint32 (no copy).
    """
    axes = tuple(mesh.axis_names)
    if isinstance(rows, np.ndarray):
        rows = _host_rows(rows, rows.shape[0])
        if plan.upcast == "bf16_pairs" and rows.dtype == np.dtype(ml_dtypes.bfloat16):
            rows = rows.view(np.uint32)
    rows = jax.device_put(rows, NamedSharding(mesh, P(axes, None)))
    if scale is not None:
        scale = jax.device_put(np.asarray(scale, np.float32), NamedSharding(mesh, P(axes)))
    return rows, scale


def _put_replicated(mesh: Mesh, x: Any) -> jax.Array:
    return jax.device_put(x, NamedSharding(mesh, P()))


def _combine_scale(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
    if a is None:
        return None if b is None else np.asarray(b, np.float32)
    return np.asarray(a, np.float32) if b is None else np.asarray(a, np.float32) * np.asarray(b, np.float32)


def _scalars(mesh: Mesh, offset: int, n_valid: int) -> tuple[jax.Array, jax.Array]:
    return _put_replicated(mesh, np.int32(offset)), _put_replicated(mesh, np.int32(n_valid))


def topk(
    queries: Float[Array, "q d"],
    rows: Any,
    k: int,
    row_scale: Float[Array, " n"] | None = None,
    mesh: Mesh | None = None,
    *,
    plan: Plan | None = None,
    precision: str = "float32",
) -> TopK:
    """Exact top-k proponents and bottom-k opponents of every query over in-memory rows.

    score(query j, row m) = (queries[j] · rows[m]) * row_scale[m], accumulated in float32.

    Args:
      queries: `[Q, d]` float query vectors (cast to float32). `Q == 0` gives empty results.
      rows: `[n, d]` rows (numpy or jax array) in float32, bfloat16, float16 or int8.
      k: results per query and side, `1 <= k <= n`.
      row_scale: optional `[n]` per-row multiplier (int8 dequantisation scale times, e.g., the
        on-the-fly `1/||R^{-1/2} g_m||` of `index.prepare_scoring`).
      mesh: rows are split over all of its devices (default: one device).
      plan: kernel formulation (default `make_score_plan(..., precision=precision)`).
      precision: "float32" (exact) | "tf32" | "bf16" (`config.retrieval.precision`; ignored with `plan`).

    Returns:
      TopK with `[Q, k]` arrays: proponents by (score desc, id asc), opponents by (score asc, id asc).

    Raises:
      ValueError: bad shapes/dtypes, k out of range, non-finite queries or scores.
    """
    if getattr(rows, "ndim", 0) != 2:
        raise ValueError(f"rows must be [num_rows, dim], got shape {getattr(rows, 'shape', None)}")
    n, d = rows.shape
    dtype_name(rows.dtype)
    k = check_k(k, n)
    q = check_queries(queries, d)
    if row_scale is not None and tuple(np.shape(row_scale)) != (n,):
        raise ValueError(f"row_scale has shape {tuple(np.shape(row_scale))}, expected ({n},)")
    if q.shape[0] == 0:
        return empty_topk(k)
    mesh = mesh or _default_mesh()
    num_dev = mesh.devices.size
    n_pad = -(-n // num_dev) * num_dev
    if n_pad != n:  # shard_map needs equal shards; the extra rows are masked (costs one copy)
        rows = jnp.pad(rows, ((0, n_pad - n), (0, 0))) if isinstance(rows, jax.Array) else _host_rows(rows, n_pad)
        if row_scale is not None:
            row_scale = _host_rows(np.asarray(row_scale, np.float32), n_pad)
    plan = plan or make_score_plan(q.shape[0], d, rows.dtype, precision=precision)
    rows, scale = _put_rows(mesh, rows, row_scale, plan)
    fn = sharded_fn(mesh, k, plan, scale is not None)
    args = (_put_replicated(mesh, q), rows) + ((scale,) if scale is not None else ()) + _scalars(mesh, 0, n)
    return _finish(fn(*args), q.shape[0])


def _chunks(
    reader: RowSource, chunk_rows: int, row_scale: np.ndarray | None, mesh: Mesh, plan: Plan
) -> Iterator[tuple[int, jax.Array, jax.Array | None]]:
    """Yields `(start, rows, scale)` on the mesh, every chunk padded to `chunk_rows` rows.

    A background thread reads (and puts on the devices) chunk i+1 while the caller scores
    chunk i. The reader's errors are re-raised here, in the caller's thread.
    """
    starts = list(range(0, reader.num_rows, chunk_rows))

    def load(start: int):
        stop = min(start + chunk_rows, reader.num_rows)
        rows, scale = reader.read_block(start, stop)
        if tuple(rows.shape) != (stop - start, reader.dim):
            raise ValueError(
                f"reader returned shape {tuple(rows.shape)} for rows [{start}, {stop}), "
                f"expected {(stop - start, reader.dim)}"
            )
        scale = _combine_scale(scale, None if row_scale is None else row_scale[start:stop])
        rows = _host_rows(rows, chunk_rows)
        scale = None if scale is None else _host_rows(scale, chunk_rows)
        return (start,) + _put_rows(mesh, rows, scale, plan)

    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="retrieval-prefetch") as pool:
        pending = pool.submit(load, starts[0]) if starts else None
        for i in range(len(starts)):
            cur = pending.result()  # re-raises the reader's error (it names the row range)
            if i + 1 < len(starts):
                pending = pool.submit(load, starts[i + 1])
            yield cur


def stream_topk(
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
    """`topk` over an index streamed chunk by chunk (never held in memory as a whole).

    Each chunk of `chunk_rows` rows is read by a background thread while the previous one is
    scored on the mesh; every query batch is merged into its running result after each chunk.
    Equal to `topk(queries, all rows, k, row_scale)` (same ids, same order).

    Args:
      queries: `[Q, d]` query vectors.
      reader: an `RowSource` (`index.open_index(...)`, `ArrayReader`); its int8 per-row
        scale is applied automatically.
      k: results per query and side, `1 <= k <= reader.num_rows`.
      chunk_rows: rows read per step (rounded up to a multiple of the device count).
      mesh: devices to split each chunk over (default: one device).
      row_scale: optional `[num_rows]` extra per-row multiplier (on-the-fly scoring scales).
      query_batch_size: queries scored together (default: all); the last batch is padded.
      plan: kernel formulation (default `make_score_plan(..., precision=precision)`).
      precision: "float32" (exact) | "tf32" | "bf16" (`config.retrieval.precision`; ignored with `plan`).

    Returns:
      TopK (see `topk`).

    Raises:
      ValueError: bad shapes, k out of range, non-finite queries or scores.
      The reader's own error (e.g. `index.IndexCorruptError`, naming the row range) when a
      chunk is missing or corrupt.
    """
    n, d = int(reader.num_rows), int(reader.dim)
    dtype_name(reader.dtype)
    k = check_k(k, n)
    q = check_queries(queries, d)
    if row_scale is not None:
        row_scale = np.asarray(row_scale, np.float32)
        if row_scale.shape != (n,):
            raise ValueError(f"row_scale has shape {row_scale.shape}, expected ({n},) (one per index row)")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if q.shape[0] == 0:
        return empty_topk(k)
    mesh = mesh or _default_mesh()
    num_dev = mesh.devices.size
    chunk_rows, qbs = _stream_shapes(chunk_rows, n, num_dev, q.shape[0], query_batch_size)
    batches = [_host_rows(q[i : i + qbs], qbs) for i in range(0, q.shape[0], qbs)]
    plan = plan or make_score_plan(qbs, d, reader.dtype, precision=precision)
    merge = merge_fn(k)
    results: list[tuple[Any, ...] | None] = [None] * len(batches)
    q_dev = [_put_replicated(mesh, b) for b in batches]
    for start, rows_d, scale_d in _chunks(reader, chunk_rows, row_scale, mesh, plan):
        fn = sharded_fn(mesh, k, plan, scale_d is not None)
        tail = ((scale_d,) if scale_d is not None else ()) + _scalars(mesh, start, n)
        for b, qd in enumerate(q_dev):
            cand = multihost.settle(fn(qd, rows_d, *tail))  # gloo: one collective program at a time
            results[b] = cand if results[b] is None else merge(results[b], cand)
    out = [_finish(r, min(qbs, q.shape[0] - b * qbs)) for b, r in enumerate(results)]
    return TopK(*(np.concatenate([getattr(o, f) for o in out]) for f in TopK._fields))


def _stream_shapes(
    chunk_rows: int, num_rows: int, num_dev: int, num_queries: int, query_batch_size: int | None
) -> tuple[int, int]:
    """`(read chunk rows, query batch size)` as `stream_topk` runs them: the chunk at most the
    index, rounded up to whole rows per device; the batch at most the queries. One place, so
    `stream_memory` sizes exactly the step the stage compiles."""
    chunk_rows = -(-min(int(chunk_rows), int(num_rows)) // num_dev) * num_dev
    return chunk_rows, min(int(query_batch_size or num_queries), int(num_queries))


def stream_memory(
    num_queries: int,
    dim: int,
    dtype: Any,
    k: int,
    chunk_rows: int,
    mesh: Mesh,
    *,
    num_rows: int,
    query_batch_size: int | None = None,
    has_scale: bool = True,
    plan: Plan | None = None,
) -> dict:
    """Per-device bytes of `stream_topk` (same arguments), from shapes only: the scoring step of
    one read chunk AOT-compiled (`memory.compiled_memory`: the chunk's share of rows, the query
    batch, the score tiles, the candidates), plus the next chunk the prefetch thread has put on
    the devices (`prefetch_bytes`) and the running top-k / bottom-k of every query batch
    (`results_bytes`), both added to `peak_bytes`. The stage's own chunks reuse the compile."""
    num_dev = mesh.devices.size
    chunk_rows, qbs = _stream_shapes(chunk_rows, num_rows, num_dev, num_queries, query_batch_size)
    k = min(int(k), int(num_rows))
    plan = plan or make_score_plan(qbs, dim, dtype)
    axes = tuple(mesh.axis_names)
    dt = np.dtype(dtype)
    rows_shape, rows_dt = (chunk_rows, dim), dt
    if plan.upcast == "bf16_pairs" and dt == np.dtype(ml_dtypes.bfloat16):  # `_put_rows` views them as uint32 pairs
        rows_shape, rows_dt = (chunk_rows, dim // 2), np.dtype(np.uint32)
    rep = NamedSharding(mesh, P())
    args = (
        jax.ShapeDtypeStruct((qbs, dim), np.float32, sharding=rep),
        jax.ShapeDtypeStruct(rows_shape, rows_dt, sharding=NamedSharding(mesh, P(axes, None))),
    )
    if has_scale:
        args += (jax.ShapeDtypeStruct((chunk_rows,), np.float32, sharding=NamedSharding(mesh, P(axes))),)
    args += (jax.ShapeDtypeStruct((), np.int32, sharding=rep),) * 2
    mem = memory.compiled_memory(sharded_fn(mesh, k, plan, has_scale).lower(*args).compile())
    if not mem:
        return mem
    mem["prefetch_bytes"] = (chunk_rows * dim * dt.itemsize + (4 * chunk_rows if has_scale else 0)) // num_dev
    mem["results_bytes"] = -(-int(num_queries) // qbs) * 4 * qbs * k * 4  # (scores, ids) x (top, bottom), replicated
    mem["peak_bytes"] += mem["prefetch_bytes"] + mem["results_bytes"]
    mem.update(chunk_rows=chunk_rows, query_batch_size=qbs)
    return mem


def check_fits(
    num_queries: int,
    dim: int,
    dtype: Any,
    k: int,
    chunk_rows: int,
    mesh: Mesh,
    *,
    num_rows: int,
    query_batch_size: int | None = None,
) -> dict:
    """Refuses (`memory.DoesNotFitError`, naming `retrieval.read_chunk_rows` and the other knobs)
    a `stream_topk` whose read chunk, query batch and candidates do not fit in device memory
    (`stream_memory`); before any row is read.

    Returns:
      `stream_memory(...)`.
    """
    mem = stream_memory(
        num_queries, dim, dtype, k, chunk_rows, mesh, num_rows=num_rows, query_batch_size=query_batch_size
    )
    what = (
        f"read chunks of {mem.get('chunk_rows', chunk_rows)} rows x d={dim} {dtype_name(dtype)}, "
        f"{mem.get('query_batch_size', query_batch_size)} queries x k={k} on mesh {dict(mesh.shape)}"
    )
    memory.check_fits("retrieve", mem.get("peak_bytes"), what=what)
    return mem


def search(
    queries: Float[Array, "q d"],
    index: Any,
    k: int,
    *,
    row_scale: Any = None,
    mesh: Mesh | None = None,
    chunk_rows: int = 65_536,
    query_batch_size: int | None = 64,
) -> TopK:
    """Notebook API: exact top-k / bottom-k of query vectors over an index.

    Args:
      queries: `[Q, d]` query vectors already in the index's scoring space (e.g. from
        `index.Scoring.finalize_queries`), or `[d]` for one query.
      index: an index directory (opened with `index.open_index`), an `RowSource`, or an
        in-memory `[n, d]` array.
      k: results per query and side.
      row_scale: optional `[n]` per-row multiplier (e.g. `index.Scoring.row_scale`).
      mesh: devices (default: one device).
      chunk_rows: rows streamed per step when reading from an index.
      query_batch_size: queries scored together when streaming.

    Returns:
      TopK.
    """
    q = np.asarray(queries, np.float32)
    if q.ndim == 1:
        q = q[None, :]
    if isinstance(index, (np.ndarray, jax.Array)):
        return topk(q, index, k, row_scale=row_scale, mesh=mesh)
    if not hasattr(index, "read_block"):
        index = store_lib.open_index(index)
    return stream_topk(q, index, k, chunk_rows, mesh=mesh, row_scale=row_scale, query_batch_size=query_batch_size)


def reference_topk(
    queries: np.ndarray, rows: np.ndarray, k: int, row_scale: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Slow numpy reference: full float64 score matrix, lexsort by (score, id).

    Returns `(top_scores, top_ids, bottom_scores, bottom_ids)` like `TopK`. Used by tests and
    benchmarks; exact ties are resolved lowest id first.
    """
    x = np.asarray(rows).astype(np.float64)
    s = np.asarray(queries, np.float64) @ x.T
    if row_scale is not None:
        s = s * np.asarray(row_scale, np.float64)[None, :]
    ids = np.arange(s.shape[1])
    top_i = np.stack([np.lexsort((ids, -r))[:k] for r in s]) if len(s) else np.zeros((0, k), np.int64)
    bot_i = np.stack([np.lexsort((ids, r))[:k] for r in s]) if len(s) else np.zeros((0, k), np.int64)
    return (np.take_along_axis(s, top_i, 1), top_i, np.take_along_axis(s, bot_i, 1), bot_i)


__all__: Sequence[str] = (
    "TopK",
    "ArrayReader",
    "Plan",
    "make_score_plan",
    "topk",
    "stream_topk",
    "search",
    "reference_topk",
    "SENTINEL",
)
