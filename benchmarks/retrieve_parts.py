"""Where exact retrieval's time goes on one device: the score GEMM alone, the top-k selection
alone (one `lax.top_k` over the whole score row against a two-stage exact selection), side by
side in one process. One JSON line per (dtype, queries) as soon as it is measured.

    python -m benchmarks.retrieve_parts --n=1000000 --d=4096 --queries=1,64 --dtypes=bfloat16,float32

Fields: `dot_s` (the plan's score formulation: float32 rows at HIGHEST, bfloat16 rows against
the query's three bfloat16 terms), `dot_gb_s` (row bytes read per second), `topk_s` (top-k and
bottom-k of `[Q, n]` scores with one `lax.top_k` each), `topk2_s` (the same, exact, through
per-segment top-k then a top-k of the candidates), `full_s` (dot + both selections, one jit); `dot_alt_s` a timing contrast (bfloat16: one
bfloat16 query term, not exact; float32: rows-major product).
Synthetic rows (a repeated random block; values do not change the timing of a GEMM or a sort).
"""

from __future__ import annotations

import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax import lax

from trackstar_jax.retrieval import kernel

_N = flags.DEFINE_integer("n", 1_000_000, "Rows.")
_D = flags.DEFINE_integer("d", 4096, "Row dimension.")
_Q = flags.DEFINE_list("queries", ["1", "64"], "Query counts.")
_DTYPES = flags.DEFINE_list("dtypes", ["bfloat16", "float32"], "Row dtypes.")
_K = flags.DEFINE_integer("k", 10, "k.")
_SEG = flags.DEFINE_integer("segment", 1024, "Two-stage selection: scores per segment.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls (median).")


def _time(fn, *args) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(_REPEATS.value):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _dot(q, rows):
    if rows.dtype == jnp.bfloat16:
        s = lax.dot_general(kernel.split3(q), rows, (((0,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return s.reshape(q.shape[0], 3, rows.shape[0]).sum(axis=1)
    return jnp.dot(q, rows.T, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _dot_alt(q, rows):
    """Timing contrast only: bfloat16 rows against one bfloat16 term (not exact); float32 rows
    rows-major (`rows @ q.T`, then transposed)."""
    if rows.dtype == jnp.bfloat16:
        return lax.dot_general(
            q.astype(jnp.bfloat16), rows, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
    return jnp.dot(rows, q.T, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32).T


def _topk(s, k):
    return lax.top_k(s, k), lax.top_k(-s, k)


def _topk2(s, k, seg):
    """The library's two-stage selection (`kernel.select`) of the top-k and the bottom-k."""
    return kernel.select(s, k, seg), kernel.select(-s, k, seg)


def main(argv):
    del argv
    n, d, k, seg = _N.value, _D.value, _K.value, _SEG.value
    dev = jax.devices()[0]
    rng = np.random.default_rng(0)
    for name in _DTYPES.value:
        dt = jnp.bfloat16 if name == "bfloat16" else jnp.float32
        block = jnp.asarray(rng.standard_normal((min(n, 65536), d), np.float32), dt)
        rows = jnp.tile(block, (-(-n // block.shape[0]), 1))[:n]
        jax.block_until_ready(rows)
        for nq in map(int, _Q.value):
            q = jnp.asarray(rng.standard_normal((nq, d), np.float32))
            s = jax.jit(_dot)(q, rows)
            dot_s = _time(jax.jit(_dot), q, rows)
            dot_alt_s = _time(jax.jit(_dot_alt), q, rows)
            topk_s = _time(jax.jit(_topk, static_argnums=1), s, k)
            topk2_s = _time(jax.jit(_topk2, static_argnums=(1, 2)), s, k, seg)
            one = jax.tree.leaves(jax.jit(_topk, static_argnums=1)(s, k))
            two = jax.tree.leaves(jax.jit(_topk2, static_argnums=(1, 2))(s, k, seg))
            full_s = _time(jax.jit(lambda q, r: _topk(_dot(q, r), k)), q, rows)
            full2_s = _time(jax.jit(lambda q, r: _topk2(_dot(q, r), k, seg)), q, rows)
            row = dict(
                bench="retrieve_parts",
                device=f"{dev.platform}:{dev.device_kind}",
                n=n,
                d=d,
                dtype=name,
                queries=nq,
                k=k,
                dot_s=dot_s,
                dot_gb_s=rows.nbytes / dot_s / 1e9,
                dot_alt_s=dot_alt_s,
                topk_s=topk_s,
                topk2_s=topk2_s,
                full_s=full_s,
                full2_s=full2_s,
                full_gb_s=rows.nbytes / full_s / 1e9,
                full2_gb_s=rows.nbytes / full2_s / 1e9,
                two_stage_equal=all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(one, two)),
            )
            print(
                json.dumps({k_: (float(f"{v:.5g}") if isinstance(v, float) else v) for k_, v in row.items()}),
                flush=True,
            )
        del rows, block


if __name__ == "__main__":
    app.run(main)
