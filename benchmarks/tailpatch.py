"""Tail-patch throughput: (query, proponent) pairs per second of the jitted tail-patch step
(`evaluation.tailpatch.make_jit_tailpatch`: one Adafactor step on the proponent per pair, the
query's target log-probability before and after), one JSON line per config.

    python -m benchmarks.tailpatch [--configs tiny,small] [--batch 16] [--steps 3]

Random tokens (BOS first), every proponent position a target, the query's last quarter its
target; the model at its initialisation with the optimizer state after one train step (a
non-zero V). `compile_s` is apart from `step_s` (median of `--steps` calls after a warm-up).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np

from benchmarks import featurize as featurize_bench
from trackstar_jax import config as config_lib
from trackstar_jax.distributed import sharding
from trackstar_jax.evaluation import tailpatch
from trackstar_jax.models import lm as model_lib
from trackstar_jax.training import loop
from trackstar_jax.training import step as step_lib


def bench(name: str, batch: int, steps: int, prop_len: int, query_len: int) -> dict:
    settings = config_lib.from_configdict(featurize_bench._config(name))
    cfg = settings.model
    opt = step_lib.make_optimizer(settings.train.optimizer)
    mesh = sharding.make_mesh()
    graphdef, state = loop.init_train_state(cfg, opt, 0, mesh)
    prop_len, query_len = prop_len or cfg.max_len, query_len or min(cfg.max_len, 32)
    train_batch = sharding.device_batch(featurize_bench._batch(batch, prop_len, cfg.vocab_size), mesh)
    state, _ = step_lib.make_jit_train_step(graphdef, opt, mesh, state)(state, train_batch)
    props = featurize_bench._batch(batch, prop_len, cfg.vocab_size, seed=1)
    queries = featurize_bench._batch(batch, query_len, cfg.vocab_size, seed=2)
    queries["loss_mask"][:, : query_len - max(1, query_len // 4)] = 0
    pair = lambda b: {k: jax.numpy.asarray(b[k]) for k in ("tokens", "loss_mask")}  # noqa: E731
    fn = tailpatch.make_jit_tailpatch(mesh, graphdef=graphdef, opt=opt)
    t0 = time.perf_counter()
    compiled = tailpatch.compile_tailpatch(fn, state.params, state.opt_state, batch, prop_len, query_len)
    compile_s = time.perf_counter() - t0
    args = (state.params, state.opt_state, pair(props), pair(queries), np.float32(1.0))
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    secs = statistics.median(times)
    dev = jax.devices()[0]
    return {
        "bench": "tailpatch",
        "config": name,
        "params": model_lib.param_count(state.params),
        "pairs_per_call": batch,
        "prop_len": prop_len,
        "query_len": query_len,
        "compile_s": round(compile_s, 3),
        "step_s": float(f"{secs:.5g}"),
        "pairs_per_s": float(f"{batch / secs:.5g}"),
        "device": f"{dev.platform}:{dev.device_kind} x{jax.device_count()}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="tiny,small")
    parser.add_argument("--batch", type=int, default=16, help="pairs per call (tailpatch.batch_size)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prop_len", type=int, default=0, help="0: model.max_len")
    parser.add_argument("--query_len", type=int, default=0, help="0: min(model.max_len, 32)")
    args = parser.parse_args()
    for name in args.configs.split(","):
        print(json.dumps(bench(name, args.batch, args.steps, args.prop_len, args.query_len)), flush=True)


if __name__ == "__main__":
    main()
