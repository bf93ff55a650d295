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

Accelerator formulations (GPU / TPU, `_accelerator_plan`; issue 36):
plain matmuls on the rows in their stored dtype with float32 accumulation
(`preferred_element_type`), scores laid out `[queries, rows]` (query-major), so `lax.top_k`
selects along the minor axis; float32 rows at `Precision.HIGHEST`, bfloat16 rows against the
query split into bfloat16 terms (tensor-core GEMMs, no widened copy of the rows), other dtypes
widened inside the fused dot. Score tiles are far larger than on the CPU (HBM, no page-fault
cost per buffer): a shard is scored whole up to 2^27 scores, else in blocks of 2^26 scores.
On a GPU, up to `_TWO_STAGE_MAX_QUERIES` queries are selected in two stages (`Plan.segment`):
the top-k of every segment of `_SEGMENT` scores, then the top-k of those candidates. Exact and
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
import dataclasses
import functools
import math
from typing import Any, Iterator, NamedTuple, Protocol, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from trackstar_jax.distributed import memory, multihost, runtime
from trackstar_jax.index import store as store_lib
from trackstar_jax.retrieval import native

# Id of a row that does not exist (padding); larger than any real id, so it also loses ties.
SENTINEL = int(np.iinfo(np.int32).max)
STORAGE_DTYPES = store_lib.STORAGE_DTYPES
UPCASTS = ("none", "convert", "bf16_pairs", "bf16_split3", "native")
CONTRACTS = ("dot", "reduce")
PRECISIONS = tuple(runtime.MATMUL_PRECISIONS)
# bfloat16 terms the query is split into against bfloat16 rows ("bf16_split3"), by precision:
# 3 terms carry float32's 24 significand bits, 2 carry 16 (more than TF32's 11), 1 is bf16.
_SPLIT_TERMS = {"float32": 3, "tf32": 2, "bf16": 1}
_DOT_PRECISION = {"float32": lax.Precision.HIGHEST, "tf32": lax.Precision.HIGH}
# Accelerator tiles (HBM; a fresh buffer costs no page faults there): scores per block, scores
# per shard scored whole, widened-rows elements per block.
_ACCEL_SCORE_TILE = 1 << 26
_ACCEL_SCORE_ALL = 1 << 27
_ACCEL_UPCAST_TILE = 1 << 28
# GPU two-stage selection (module docstring): up to this many queries, segments of this many
# scores. H200 crossover estimated from 1 and 64 queries (0.69 + 0.19 Q ms against ~3.8 ms):
# near 16; 8 keeps a margin. Unmeasured on TPU, whose plan keeps one stage.
_TWO_STAGE_MAX_QUERIES = 8
_SEGMENT = 1024
# Scores tile per block (queries x rows, float32) and widened-rows tile budgets, in elements.
# 2M floats = 8 MB: small enough to be recycled by malloc (no page faults per call), large
# enough that per-block overhead is negligible (BUILD_NOTES "Issue 5").
_SCORE_TILE = 1 << 21
_UPCAST_TILE = 1 << 20
# Up to this many scores per device (64 MB) a shard is scored whole and selected once.
_SCORE_ALL = 1 << 24
# Up to this many queries the rows are the matmul's row operand (`rows @ q.T`, matvec-like).
_ROWS_MAJOR_MAX_QUERIES = 16
# Query counts for which rows on CPU go to the native kernel, by storage dtype (BUILD_NOTES
# "Issue 5"). bfloat16: faster than bf16_split3 at every count and than bf16_pairs up to 64
# queries (equal at 128, slower at 256). float32: equal to XLA's matvec at 1 query (kept),
# 1.3-1.9x faster at 2-16, equal at 32, slower at 64 (XLA's YNNPACK matmul).
_NATIVE_QUERIES = {"bfloat16": (1, 64), "float32": (2, 16)}


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


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static choices of the scoring kernel (hashable; part of the jit cache key).

    Attributes:
      block_rows: rows per device per inner step when a shard is scored block by block
        (bounds the score tile and the widened-row copy).
      query_major: score as `q @ rows.T` (True) or `(rows @ q.T).T` (False).
      upcast: how rows meet the float32 query: "none" (float32 rows), "convert" (`astype`),
        "bf16_pairs" (bfloat16 read as uint32 pairs, widened by shifts), "bf16_split3"
        (native bf16 dot against the query split into three bf16 terms), "native" (the
        `native.scores` FFI kernel on CPU; bfloat16 or float32 rows). All exact to float32
        rounding.
      contract: "dot" (a matmul) or "reduce" (a fused multiply + sum; benchmarks only).
      precision: "float32" (exact), "tf32" or "bf16" (module docstring, "Precision").
      score_all: a shard with at most this many scores (queries x rows) is scored in one dot
        and selected once; None: `_SCORE_ALL` (the CPU's).
      segment: None selects with one `lax.top_k` per score row; an int, in two stages: the
        top-k of each segment of that many scores, then of the candidates (same result).
    """

    block_rows: int
    query_major: bool
    upcast: str
    contract: str = "dot"
    precision: str = "float32"
    score_all: int | None = None
    segment: int | None = None

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"retrieval.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.precision != "float32" and self.upcast in ("bf16_pairs", "native"):
            raise ValueError(f"upcast={self.upcast!r} scores in float32 only, not at precision={self.precision!r}")
        if self.contract not in CONTRACTS:
            raise ValueError(f"contract must be one of {CONTRACTS}, got {self.contract!r}")
        if self.upcast not in UPCASTS:
            raise ValueError(f"upcast must be one of {UPCASTS}, got {self.upcast!r}")
        if self.contract == "reduce" and self.precision != "float32":
            raise ValueError("contract='reduce' scores in float32 only")
        if self.contract == "reduce" and self.upcast in ("bf16_pairs", "bf16_split3", "native"):
            raise ValueError("contract='reduce' widens inside the fused reduce; use upcast='convert'")
        if self.block_rows < 1:
            raise ValueError(f"block_rows must be >= 1, got {self.block_rows}")
        if self.segment is not None and self.segment < 1:
            raise ValueError(f"segment must be >= 1 or None, got {self.segment}")


def make_score_plan(
    num_queries: int,
    dim: int,
    dtype: Any,
    *,
    backend: str | None = None,
    block_rows: int | None = None,
    query_major: bool | None = None,
    upcast: str | None = None,
    contract: str | None = None,
    precision: str = "float32",
    segment: int | None | str = "auto",
) -> Plan:
    """Chooses the fastest known formulation for a regime and platform (`_PLATFORM_PLANS`; see
    the module docstring).

    Args:
      num_queries: queries scored together.
      dim: vector dimension.
      dtype: storage dtype of the rows.
      backend: "cpu", "gpu", "tpu" (default: `runtime.target_platform()`, JAX's default backend
        unless the planner targets another).
      block_rows, query_major, upcast, contract: overrides (benchmarks compare formulations with them).
      precision: "float32" | "tf32" | "bf16" (`config.retrieval.precision`).
      segment: two-stage selection's segment (None: one stage); "auto": the platform's choice.

    Returns:
      Plan.
    """
    name = _dtype_name(dtype)
    backend = backend or runtime.target_platform()
    if precision not in PRECISIONS:
        raise ValueError(f"retrieval.precision must be one of {PRECISIONS}, got {precision!r}")
    choose = _PLATFORM_PLANS.get(backend, _accelerator_plan)
    chosen, major, tile, upcast_tile, score_all, seg = choose(num_queries, dim, name, precision)
    upcast = chosen if upcast is None else upcast
    if upcast == "native" and name not in native.TARGETS:
        raise ValueError(f"upcast='native' scores {tuple(native.TARGETS)} rows, not {name}")
    if block_rows is None:
        rows = tile // max(num_queries, 1)
        if upcast in ("convert", "bf16_pairs"):  # these materialise widened float32 rows per block
            rows = min(rows, upcast_tile // max(dim, 1))
        block_rows = 1 << max(6, int(math.log2(max(rows, 1))))
    return Plan(
        block_rows=int(block_rows),
        query_major=bool(major if query_major is None else query_major),
        upcast=upcast,
        contract=contract or "dot",
        precision=precision,
        score_all=score_all,
        segment=seg if segment == "auto" else segment,
    )


_Choice = tuple[str, bool, int, int, "int | None", "int | None"]


def _cpu_plan(num_queries: int, dim: int, name: str, precision: str) -> _Choice:
    """XLA:CPU (module docstring, "CPU formulations"): `(upcast, query_major, score tile,
    widened-rows tile, score_all, segment)`. The native kernel and bf16 pairs score in float32
    only."""
    lo, hi = _NATIVE_QUERIES.get(name, (0, -1))
    exact = precision == "float32"
    if exact and lo <= num_queries <= hi and native.available() and native.isa() == "avx512":
        upcast = "native"  # the FFI kernel (only its AVX-512 path was measured faster)
    elif name == "float32":
        upcast = "none"
    elif name == "bfloat16" and exact and num_queries > _ROWS_MAJOR_MAX_QUERIES and dim % 2 == 0:
        upcast = "bf16_pairs"  # many queries on CPU: widen once per block, then a float32 matmul
    elif name == "bfloat16":
        upcast = "bf16_split3"  # native bf16 x bf16 -> f32 dot against the query's bf16 terms
    else:
        upcast = "convert"
    return upcast, num_queries > _ROWS_MAJOR_MAX_QUERIES, _SCORE_TILE, _UPCAST_TILE, None, None


def _accelerator_plan(num_queries: int, dim: int, name: str, precision: str) -> _Choice:
    """GPU / TPU (module docstring, "Accelerator formulations"): the rows' stored dtype into the
    GEMM, float32 accumulation, query-major scores, HBM-sized tiles, one-stage selection."""
    del num_queries, dim, precision
    upcast = {"float32": "none", "bfloat16": "bf16_split3"}.get(name, "convert")
    return upcast, True, _ACCEL_SCORE_TILE, _ACCEL_UPCAST_TILE, _ACCEL_SCORE_ALL, None


def _gpu_plan(num_queries: int, dim: int, name: str, precision: str) -> _Choice:
    """The accelerator plan, with two-stage selection for few queries (measured on an H200)."""
    *rest, _ = _accelerator_plan(num_queries, dim, name, precision)
    return (*rest, _SEGMENT if num_queries <= _TWO_STAGE_MAX_QUERIES else None)


# backend -> plan chooser (unknown backends take the accelerator plan)
_PLATFORM_PLANS = {"cpu": _cpu_plan, "gpu": _gpu_plan, "tpu": _accelerator_plan}


# --------------------------------------------------------------------------------------------
# The per-device kernel
# --------------------------------------------------------------------------------------------


def _dtype_name(dtype: Any) -> str:
    dt = np.dtype(dtype)
    if dt == np.dtype(ml_dtypes.bfloat16):
        return "bfloat16"
    name = dt.name
    if name not in STORAGE_DTYPES:
        raise ValueError(f"unsupported row dtype {name}; expected one of {STORAGE_DTYPES}")
    return name


def _widen(blk: Array, upcast: str) -> tuple[Array, ...]:
    """Float32 operands of a row block: `(rows,)`, or `(even, odd)` columns for bf16 pairs."""
    if upcast == "none":
        return (blk,)
    if upcast == "convert":
        return (blk.astype(jnp.float32),)
    # blk is uint32 [b, d/2]: the low half-word is bf16 column 2j, the high one column 2j+1
    # (little-endian). A bf16 is the top 16 bits of the float32 with the same value.
    even = lax.bitcast_convert_type(blk << 16, jnp.float32)
    odd = lax.bitcast_convert_type(blk & jnp.uint32(0xFFFF0000), jnp.float32)
    return even, odd


def _split3(q: Float[Array, "q d"], terms: int = 3) -> Array:
    """`[Q, d]` float32 -> `[d, terms * Q]` bfloat16 with columns (query j, term t):
    q = q1 + q2 + q3 for 3 terms (fewer terms: the leading ones).

    Each term is the bfloat16 rounding of what the previous ones left (8 significand bits
    each, 24 in all = float32); the remainder is below float32 rounding of q.
    """
    qt = q.T
    parts, r = [], qt
    for _ in range(terms):
        t = r.astype(jnp.bfloat16)
        parts.append(t)
        r = r - t.astype(jnp.float32)
    return jnp.stack(parts, axis=-1).reshape(qt.shape[0], -1)


def _block_scores(q_parts: tuple[Array, ...], blk: Array, plan: Plan) -> Float[Array, "q b"]:
    """Scores `[Q, b]` of a row block against the queries, accumulated in float32."""
    if plan.upcast == "native":
        (q,) = q_parts
        return native.scores(blk, q)
    if plan.upcast == "bf16_split3":
        # q_parts = (w,) with w [d, 3Q] bfloat16: the query split into three bfloat16 terms per
        # column (q = q1 + q2 + q3 to float32 precision). bf16 x bf16 products are exact in
        # float32 and accumulate in float32, so this equals a float32 dot, and XLA:CPU runs it
        # natively on the bf16 rows (no widened copy; bf16 dot instructions where available).
        (w,) = q_parts
        terms = _SPLIT_TERMS[plan.precision]
        if plan.query_major:  # scores come out [terms * Q, b]: no transpose of the score tile
            s = lax.dot_general(w, blk, (((0,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            return s.reshape(-1, terms, blk.shape[0]).sum(axis=1)
        s = jnp.dot(blk, w, preferred_element_type=jnp.float32)  # [b, terms * Q]
        return s.reshape(blk.shape[0], -1, terms).sum(axis=-1).T
    if plan.contract == "reduce":
        # One fused multiply-reduce (XLA:CPU hands it, widening included, to its YNNPACK path).
        (qp,) = q_parts
        return jnp.sum(blk[None, :, :].astype(jnp.float32) * qp[:, None, :], axis=-1)
    out = None
    prec = _DOT_PRECISION.get(plan.precision)  # None: "bf16", both operands rounded to bfloat16
    for qp, rp in zip(q_parts, _widen(blk, plan.upcast)):
        if prec is None:
            qp, rp = qp.astype(jnp.bfloat16), rp.astype(jnp.bfloat16)
        if plan.query_major:
            s = jnp.dot(qp, rp.T, precision=prec, preferred_element_type=jnp.float32)
        else:
            s = jnp.dot(rp, qp.T, precision=prec, preferred_element_type=jnp.float32).T
        out = s if out is None else out + s
    return out


def _select(s: Float[Array, "q n"], k: int, segment: int | None) -> tuple[Array, Array]:
    """`lax.top_k(s, k)`: values and positions, ties to the lower position; with `segment`, in
    two stages (the top-k of each segment, then of the candidates), the same result."""
    nq, n = s.shape
    if segment is None or n <= segment:
        return lax.top_k(s, k)
    pad = -n % segment
    # -inf padding sits after every real position, so a real entry wins any tie with it
    xs = jnp.pad(s, ((0, 0), (0, pad)), constant_values=-jnp.inf).reshape(nq, -1, segment)
    v, p = lax.top_k(xs, min(k, segment))  # [Q, n / segment, k1]
    p = p + (jnp.arange(xs.shape[1], dtype=p.dtype) * segment)[None, :, None]
    v2, q2 = lax.top_k(v.reshape(nq, -1), k)
    return v2, jnp.take_along_axis(p.reshape(nq, -1), q2, axis=1)


def _merge(carry: tuple[Array, ...], cand: tuple[Array, ...], k: int, segment: int | None = None) -> tuple[Array, ...]:
    """Stable merge of two candidate lists; `carry` must hold the lower ids.

    Both lists are `(top_scores, top_ids, neg_bottom_scores, bottom_ids)`, each `[Q, *]` and
    sorted by (value desc, id asc); bottoms are kept negated so one rule serves both.
    `segment`: `_select`'s two-stage selection.
    """
    out = []
    for (cs, ci), (ns, ni) in ((carry[0:2], cand[0:2]), (carry[2:4], cand[2:4])):
        s = jnp.concatenate([cs, ns], axis=1)
        i = jnp.concatenate([ci, ni], axis=1)
        v, p = _select(s, min(k, s.shape[1]), segment)
        out += [v, jnp.take_along_axis(i, p, axis=1)]
    return tuple(out)


def _device_topk(
    q: Float[Array, "q d"],
    rows: Array,
    scale: Float[Array, " m"] | None,
    base: Int[Array, ""],
    n_valid: Int[Array, ""],
    *,
    k: int,
    plan: Plan,
) -> tuple[Array, ...]:
    """Running top-k / bottom-k of one device's rows `[m, d]` (ids `base + local index`).

    Returns `(top_s, top_i, neg_bot_s, bot_i)`, each `[Q, min(k, m)]`, sorted (value desc, id asc).
    """
    m = rows.shape[0]
    nq = q.shape[0]
    if plan.upcast == "bf16_pairs":
        # Rows as [m, d/2] uint32 words, each holding bf16 columns (2j, 2j+1). Host arrays arrive
        # already viewed that way (`_put_rows`, free); a device bf16 array is repacked here
        # (XLA emits a full pass for this bitcast). The query splits into even / odd columns.
        if rows.dtype != jnp.uint32:
            rows = lax.bitcast_convert_type(rows.reshape(m, rows.shape[1] // 2, 2), jnp.uint32)
        q_parts = (q[:, 0::2], q[:, 1::2])
    elif plan.upcast == "bf16_split3":
        q_parts = (_split3(q, _SPLIT_TERMS[plan.precision]),)
    else:
        q_parts = (q,)
    bs = min(plan.block_rows, m)
    num_blocks = -(-m // bs)
    kk = min(k, m)

    score_all = _SCORE_ALL if plan.score_all is None else plan.score_all
    if num_blocks == 1 or (nq * m <= score_all and plan.upcast in ("none", "bf16_split3", "native")):
        # Few queries and no widened copy of the rows: the whole shard is one dot whose scores
        # fit one buffer; select once. (Looping over blocks would add a dynamic-slice copy of
        # every row block, and a per-block selection, for no gain. Widening upcasts keep
        # blocks: filling a score buffer block by block measured slower than merging.)
        s = _block_scores(q_parts, rows, plan)
        if scale is not None:
            s = s * scale[None, :]
        ids = base + jnp.arange(m, dtype=jnp.int32)
        valid = ids < n_valid
        s = jnp.where(s == 0, jnp.float32(0), s)
        ids = jnp.broadcast_to(jnp.where(valid, ids, SENTINEL)[None, :], (nq, m))
        empty = (jnp.zeros((nq, 0), jnp.float32), jnp.zeros((nq, 0), jnp.int32)) * 2
        return _merge(
            empty,
            (jnp.where(valid[None, :], s, -jnp.inf), ids, jnp.where(valid[None, :], -s, -jnp.inf), ids),
            kk,
            plan.segment,
        )

    def block(i, carry):
        # The last block is clamped to end at m; rows it shares with the previous block are masked.
        start = jnp.minimum(i * bs, m - bs)
        blk = lax.dynamic_slice_in_dim(rows, start, bs) if num_blocks > 1 else rows
        s = _block_scores(q_parts, blk, plan)
        if scale is not None:
            s = s * (lax.dynamic_slice_in_dim(scale, start, bs) if num_blocks > 1 else scale)[None, :]
        local = start + jnp.arange(bs, dtype=jnp.int32)
        ids = base + local
        valid = (local >= i * bs) & (ids < n_valid)
        s = jnp.where(s == 0, jnp.float32(0), s)  # -0.0 -> +0.0 (ties must not depend on the sign of zero)
        top = jnp.where(valid[None, :], s, -jnp.inf)
        bot = jnp.where(valid[None, :], -s, -jnp.inf)
        ids = jnp.broadcast_to(jnp.where(valid, ids, SENTINEL)[None, :], (nq, bs))
        return _merge(carry, (top, ids, bot, ids), kk, plan.segment)

    neg_inf = jnp.full((nq, kk), -jnp.inf, jnp.float32)
    none = jnp.full((nq, kk), SENTINEL, jnp.int32)
    # Block 0 outside the loop: its output is device-varying, as the loop carry must be.
    carry = block(0, (neg_inf, none, neg_inf, none))
    return carry if num_blocks == 1 else lax.fori_loop(1, num_blocks, block, carry)


@functools.lru_cache(maxsize=128)
def _sharded_fn(mesh: Mesh, k: int, plan: Plan, has_scale: bool):
    """jit(shard_map(...)) computing the global top-k of one row array over `mesh`."""
    axes = tuple(mesh.axis_names)

    def per_device(q, rows, *rest):
        scale = rest[0] if has_scale else None
        offset, n_valid = rest[-2:]
        base = offset + lax.axis_index(axes) * rows.shape[0]
        local = _device_topk(q, rows, scale, base, n_valid, k=k, plan=plan)
        # [D, Q, kk] -> [Q, D*kk] in device order, i.e. ascending-id order of the lists.
        gathered = [
            jnp.moveaxis(lax.all_gather(x, axes, axis=0, to="invarying"), 0, 1).reshape(x.shape[0], -1) for x in local
        ]
        kk = local[0].shape[1]
        heads = tuple(g[:, :kk] for g in gathered)
        tails = tuple(g[:, kk:] for g in gathered)
        return _merge(heads, tails, k) if gathered[0].shape[1] > kk else heads

    in_specs = (P(), P(axes, None)) + ((P(axes),) if has_scale else ()) + (P(), P())
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=P()))


@functools.lru_cache(maxsize=16)
def _merge_fn(k: int):
    return jax.jit(functools.partial(_merge, k=k))


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def _default_mesh() -> Mesh:
    from trackstar_jax.distributed import sharding  # noqa: PLC0415  (layer 0; imported late to keep import light)

    return sharding.make_mesh(devices=jax.devices()[:1])


def _check_queries(queries: Any, dim: int) -> np.ndarray:
    q = np.asarray(queries, np.float32)
    if q.ndim != 2 or (q.shape[0] and q.shape[1] != dim):
        raise ValueError(f"queries must be [num_queries, {dim}] (the index dim), got shape {q.shape}")
    if q.shape[0] and not np.isfinite(q).all():
        bad = np.flatnonzero(~np.isfinite(q).all(axis=1))
        raise ValueError(f"queries contain NaN/inf (query index(es) {bad[:10].tolist()})")
    return q


def _check_k(k: int, num_rows: int) -> int:
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if k <= 0:
        raise ValueError(f"k must be >= 1, got {k}")
    if k > num_rows:
        raise ValueError(f"k={k} is larger than the number of index rows ({num_rows})")
    return int(k)


def _empty(k: int) -> TopK:
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
    _dtype_name(rows.dtype)
    k = _check_k(k, n)
    q = _check_queries(queries, d)
    if row_scale is not None and tuple(np.shape(row_scale)) != (n,):
        raise ValueError(f"row_scale has shape {tuple(np.shape(row_scale))}, expected ({n},)")
    if q.shape[0] == 0:
        return _empty(k)
    mesh = mesh or _default_mesh()
    num_dev = mesh.devices.size
    n_pad = -(-n // num_dev) * num_dev
    if n_pad != n:  # shard_map needs equal shards; the extra rows are masked (costs one copy)
        rows = jnp.pad(rows, ((0, n_pad - n), (0, 0))) if isinstance(rows, jax.Array) else _host_rows(rows, n_pad)
        if row_scale is not None:
            row_scale = _host_rows(np.asarray(row_scale, np.float32), n_pad)
    plan = plan or make_score_plan(q.shape[0], d, rows.dtype, precision=precision)
    rows, scale = _put_rows(mesh, rows, row_scale, plan)
    fn = _sharded_fn(mesh, k, plan, scale is not None)
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
    _dtype_name(reader.dtype)
    k = _check_k(k, n)
    q = _check_queries(queries, d)
    if row_scale is not None:
        row_scale = np.asarray(row_scale, np.float32)
        if row_scale.shape != (n,):
            raise ValueError(f"row_scale has shape {row_scale.shape}, expected ({n},) (one per index row)")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if q.shape[0] == 0:
        return _empty(k)
    mesh = mesh or _default_mesh()
    num_dev = mesh.devices.size
    chunk_rows, qbs = _stream_shapes(chunk_rows, n, num_dev, q.shape[0], query_batch_size)
    batches = [_host_rows(q[i : i + qbs], qbs) for i in range(0, q.shape[0], qbs)]
    plan = plan or make_score_plan(qbs, d, reader.dtype, precision=precision)
    merge = _merge_fn(k)
    results: list[tuple[Any, ...] | None] = [None] * len(batches)
    q_dev = [_put_replicated(mesh, b) for b in batches]
    for start, rows_d, scale_d in _chunks(reader, chunk_rows, row_scale, mesh, plan):
        fn = _sharded_fn(mesh, k, plan, scale_d is not None)
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
    mem = memory.compiled_memory(_sharded_fn(mesh, k, plan, has_scale).lower(*args).compile())
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
        f"read chunks of {mem.get('chunk_rows', chunk_rows)} rows x d={dim} {_dtype_name(dtype)}, "
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
    "process_stream_topk",
    "local_candidates",
    "process_row_range",
    "merge_candidates",
    "search",
    "reference_topk",
    "SENTINEL",
)


# --------------------------------------------------------------------------------------------
# Several processes (a pod): each streams its own row range, candidates merged on the host
# --------------------------------------------------------------------------------------------


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
    k = _check_k(k, n)
    q = _check_queries(queries, int(reader.dim))
    lo, hi = process_row_range(n, int(chunk_rows), process_index, process_count)
    if hi == lo:
        return _pad_candidates(_empty(0), q.shape[0], k)
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
