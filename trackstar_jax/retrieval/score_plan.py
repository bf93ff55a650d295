"""The scoring plan of exact top-k retrieval (`Plan`, `make_score_plan`): how rows meet the
queries on each platform, chosen per regime (queries, dim, storage dtype) and precision.

The formulations and their measurements are in `topk.py`'s docstring ("CPU formulations",
"Accelerator formulations", "Precision"); `kernel.py` runs a plan.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import ml_dtypes
import numpy as np

from trackstar_jax.distributed import runtime
from trackstar_jax.index import manifest as manifest_lib
from trackstar_jax.retrieval import native

STORAGE_DTYPES = manifest_lib.STORAGE_DTYPES
UPCASTS = ("none", "convert", "bf16_pairs", "bf16_split3", "native")
CONTRACTS = ("dot", "reduce")
PRECISIONS = tuple(runtime.MATMUL_PRECISIONS)
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
# Up to this many queries the rows are the matmul's row operand (`rows @ q.T`, matvec-like).
_ROWS_MAJOR_MAX_QUERIES = 16
# Query counts for which rows on CPU go to the native kernel, by storage dtype (BUILD_NOTES
# "Issue 5"). bfloat16: faster than bf16_split3 at every count and than bf16_pairs up to 64
# queries (equal at 128, slower at 256). float32: equal to XLA's matvec at 1 query (kept),
# 1.3-1.9x faster at 2-16, equal at 32, slower at 64 (XLA's YNNPACK matmul).
_NATIVE_QUERIES = {"bfloat16": (1, 64), "float32": (2, 16)}


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
        and selected once; None: `kernel._SCORE_ALL` (the CPU's).
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
    name = dtype_name(dtype)
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


def dtype_name(dtype: Any) -> str:
    dt = np.dtype(dtype)
    if dt == np.dtype(ml_dtypes.bfloat16):
        return "bfloat16"
    name = dt.name
    if name not in STORAGE_DTYPES:
        raise ValueError(f"unsupported row dtype {name}; expected one of {STORAGE_DTYPES}")
    return name
