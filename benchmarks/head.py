"""The output head + next-token loss, side by side in one process: the old `[B, T, V]` logits
path (3-axis einsum, as the dense layers were written before session 9), the same with the
leading axes flattened (`layers.matmul_2d`), and the fused, chunked head (`head.head_nll_sum`).

    python -m benchmarks.head [--shape 14m] [--batch 16] [--seq_len 128] [--steps 5]

One JSON line per (variant, what is differentiated): `grad` = "x,w" (a training step: the
input and the output matrix), "x" (featurisation: the input only) or "none" (the loss alone);
median ms of `--steps` calls after a compile and a warm-up, tokens/s over `batch * (seq_len-1)`
targets, and `speedup_vs_einsum_3d` against the first variant measured in the same run.
Shapes are the peer race's (`benchmarks/peer_race.py`): width 128 / 512, vocabulary 50,304.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from trackstar_jax.models import head as head_lib
from trackstar_jax.models import layers

WIDTHS = {"14m": 128, "70m": 512}
VOCAB = 50_304


def _time(fn, args, steps: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="14m", choices=sorted(WIDTHS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq_len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    b, t, d = args.batch, args.seq_len - 1, WIDTHS[args.shape]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32) * 0.3
    w = jnp.asarray(rng.standard_normal((d, VOCAB)), jnp.float32) * 0.3
    y = jnp.asarray(rng.integers(0, VOCAB, (b, t)), jnp.int32)
    wt = jnp.ones((b, t), jnp.float32)

    def einsum_3d(x, w):
        logits = jnp.einsum("btd,dv->btv", x, w)
        return -jnp.sum(layers.token_log_probs(logits, y) * wt)

    def matmul_2d(x, w):
        return -jnp.sum(layers.token_log_probs(layers.matmul_2d(x, w), y) * wt)

    def fused(x, w, weight_grad=True):
        return head_lib.head_nll_sum(x, w, y, wt, weight_grad=weight_grad)

    base = {}
    for grad in ("x,w", "x", "none"):
        for name, fn in (("einsum_3d", einsum_3d), ("matmul_2d", matmul_2d), ("fused", fused)):
            if grad == "x,w":
                f = jax.grad(fn, argnums=(0, 1))
            elif grad == "x":
                f = jax.grad((lambda x, w: fused(x, w, weight_grad=False)) if name == "fused" else fn)
            else:
                f = fn
            secs = _time(jax.jit(f), (x, w), args.steps)
            base.setdefault(grad, secs)
            row = {
                "bench": "head",
                "shape": args.shape,
                "variant": name,
                "grad": grad,
                "ms": round(secs * 1e3, 1),
                "tokens_per_s": round(b * t / secs),
                "speedup_vs_einsum_3d": round(base[grad] / secs, 2),
                "loadavg_1m": round(os.getloadavg()[0], 2),
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
