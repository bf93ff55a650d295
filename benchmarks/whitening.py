"""Resolving R for the table's rows: R^{-1/2}, automatic λ and the mixing diagnostics (host numpy).

Every row with R (Exp. 3 / 5, TrackStar at each λ) calls `hessian.make_whitening` before it
scores. On one H200 (session 29, d = 8,192 = 8 blocks of 1,024) each TrackStar row spent
20-28 s there and Exp. 3 ~7 s more than Exp. 1: numpy's three-operand einsum that formed
V diag(w^-1/2) Vᵀ ran an unblocked loop, twice per mixed row (R_train's for the diagnostics,
the mixture's for W), and every row recomputed the R_train / R_eval spectra.

Side by side in one process, for each `--shapes` (blocks x k²) on random SPD blocks:
`einsum_s` (that formula) against `inverse_sqrt_s` (`hessian.inverse_sqrt`: one batched GEMM),
then `first_row_s` (`make_whitening`, mode "mixed", automatic λ, nothing memoized) and
`next_row_s` (the same R_train / R_eval at another λ: the spectra and R_train^{-1/2} reused).

    python -m benchmarks.whitening --shapes=8x1024,16x256
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from trackstar_jax.index import hessian


def _spd(rng: np.random.Generator, blocks: int, k2: int, n: int) -> hessian.RStats:
    """An autocorrelation of `n` random vectors with a few strong shared directions."""
    x = rng.standard_normal((n, blocks * k2)).astype(np.float32)
    x[:, : blocks * k2 : 7] += 3.0 * rng.standard_normal((n, 1)).astype(np.float32)
    return hessian.r_eval(x, blocks)


def _einsum_inverse_sqrt(r: np.ndarray, damping: float) -> np.ndarray:
    """The formula `inverse_sqrt` used before session 29 (same eigh, same floor)."""
    r = 0.5 * (r + np.swapaxes(r, 1, 2))
    w, v = np.linalg.eigh(r)
    wd = np.maximum(w, damping * float(w.max()))
    return np.einsum("bij,bj,bkj->bik", v, wd**-0.5, v).astype(np.float32)


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="8x1024,16x256", help="blocks x k² per R, comma-separated")
    parser.add_argument("--damping", type=float, default=1e-6)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        blocks, k2 = (int(x) for x in shape.split("x"))
        rt, re = _spd(rng, blocks, k2, 2 * k2), _spd(rng, blocks, k2, 2 * k2)
        r = rt.mean()
        hessian._MEMO.clear()
        ref, einsum_s = _timed(_einsum_inverse_sqrt, r, args.damping)
        got, inv_s = _timed(hessian.inverse_sqrt, r, args.damping)
        err = float(np.abs(got.matrix - ref).max() / np.abs(ref).max())
        cfg = hessian.HessianConfig(mode="mixed", lambda_component_fraction=1000 / 65536, damping=args.damping)
        hessian._MEMO.clear()
        first, first_s = _timed(hessian.make_whitening, cfg, rt, re)
        cfg_next = hessian.HessianConfig(mode="mixed", mix_lambda=0.9, damping=args.damping)
        _, next_s = _timed(hessian.make_whitening, cfg_next, rt, re)
        print(
            json.dumps(
                {
                    "bench": "whitening",
                    "blocks": blocks,
                    "k2": k2,
                    "d": blocks * k2,
                    "einsum_s": round(einsum_s, 4),
                    "inverse_sqrt_s": round(inv_s, 4),
                    "inverse_sqrt_speedup": round(einsum_s / inv_s, 2),
                    "rel_err_vs_einsum": err,
                    "first_row_s": round(first_s, 4),
                    "next_row_s": round(next_s, 4),
                    "next_over_first": round(next_s / first_s, 3),
                    "mix_lambda": first.mix_lambda,
                    "loadavg_1m": os.getloadavg()[0],
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
