"""Tail-patch throughput: (query, proponent) pairs per second of the jitted tail-patch step
(`evaluation.tailpatch.make_jit_tailpatch`: one Adafactor step per proponent, then the target
log-probability of each of its G queries before and after), one JSON line per config, step kind
(`--kinds`: the exact low-rank step and the dense reference, `tailpatch.step`) and G, then per
config the ratios measured side by side in this run: each G's pairs/s over the first G's, and
the low-rank step's over the dense one's.

    python -m benchmarks.tailpatch [--configs tiny,small] [--batch 16] [--queries_per_step 1,8] [--steps 3]
    python -m benchmarks.tailpatch --configs=run:runs/smollm2_table1   # a run's own checkpoint

pairs/s counts every query slot as a pair (full groups); an evaluation's groups are shorter
when a proponent serves fewer than G queries. The step is timed without the queries' unpatched
log-probabilities, which `run_pairs` computes once per query.

Random tokens (BOS first), every proponent position a target, the query's last quarter its
target; the model at its initialisation with the optimizer state after one train step (a
non-zero V), or a run's checkpoint and optimizer state (`run:<workdir>`). `compile_s` is apart
from `step_s` (median of `--steps` calls after a warm-up).
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
from trackstar_jax import stages
from trackstar_jax.distributed import sharding
from trackstar_jax.evaluation import tailpatch
from trackstar_jax.models import lm as model_lib
from trackstar_jax.training import loop
from trackstar_jax.training import step as step_lib

_STATES: dict = {}


def _state(name: str, batch: int, prop_len: int):
    """`(model config, optimizer config, graphdef, state)`: a run directory's checkpoint (`name` =
    "run:<workdir>", e.g. an imported SmolLM2), else the config at init after one train step.
    Made once per (name, batch, prop_len)."""
    key = (name, batch, prop_len)
    if key in _STATES:
        return _STATES[key]
    mesh = sharding.make_mesh()
    if name.startswith("run:"):
        run = stages.load_run(name[4:], mesh=mesh)
        out = (
            run.model_cfg,
            run.optimizer,
            run.graphdef,
            step_lib.TrainState(run.step, run.params, run.opt_state),
        )
    else:
        settings = config_lib.from_configdict(featurize_bench._config(name))
        cfg = settings.model
        opt = step_lib.make_optimizer(settings.train.optimizer)
        graphdef, state = loop.init_train_state(cfg, opt, 0, mesh)
        batch_rows = featurize_bench._batch(batch, prop_len or cfg.max_len, cfg.vocab_size)
        state, _ = step_lib.make_jit_train_step(graphdef, opt, mesh, state)(
            state, sharding.device_batch(batch_rows, mesh)
        )
        out = (cfg, settings.train.optimizer, graphdef, state)
    _STATES.clear()
    _STATES[key] = out
    return out


def bench(name: str, batch: int, queries_per_step: int, steps: int, prop_len: int, query_len: int, kind: str) -> dict:
    cfg, opt_cfg, graphdef, state = _state(name, batch, prop_len)
    opt = step_lib.make_optimizer(opt_cfg)
    mesh = sharding.make_mesh()
    prop_len, query_len = prop_len or cfg.max_len, query_len or min(cfg.max_len, 32)
    g = queries_per_step
    props = featurize_bench._batch(batch, prop_len, cfg.vocab_size, seed=1)
    queries = featurize_bench._batch(batch * g, query_len, cfg.vocab_size, seed=2)
    queries["loss_mask"][:, : query_len - max(1, query_len // 4)] = 0
    rows = lambda b, *shape: {k: jax.numpy.asarray(b[k].reshape(*shape, -1)) for k in ("tokens", "loss_mask")}  # noqa: E731
    fn = tailpatch.make_jit_tailpatch(mesh, graphdef=graphdef, opt=opt, opt_cfg=opt_cfg if kind == "lowrank" else None)
    t0 = time.perf_counter()
    compiled = tailpatch.compile_tailpatch(fn, state.params, state.opt_state, batch, g, prop_len, query_len)
    compile_s = time.perf_counter() - t0
    before = np.zeros((batch, g), np.float32)  # run_pairs computes these once per query, not per step
    args = (state.params, state.opt_state, rows(props, batch), rows(queries, batch, g), np.float32(1.0), before)
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
        "step": kind,
        "proponents_per_call": batch,
        "queries_per_step": g,
        "prop_len": prop_len,
        "query_len": query_len,
        "compile_s": round(compile_s, 3),
        "step_s": float(f"{secs:.5g}"),
        "pairs_per_s": float(f"{batch * g / secs:.5g}"),
        "device": f"{dev.platform}:{dev.device_kind} x{jax.device_count()}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="tiny,small")
    parser.add_argument("--batch", type=int, default=16, help="proponents per call (tailpatch.batch_size)")
    parser.add_argument("--queries_per_step", default="1,8", help="G values, comma-separated (the first is the base)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prop_len", type=int, default=0, help="0: model.max_len")
    parser.add_argument("--query_len", type=int, default=0, help="0: min(model.max_len, 32)")
    parser.add_argument("--kinds", default="lowrank,dense", help="tail-patch steps (tailpatch.step), comma-separated")
    args = parser.parse_args()
    gs = [int(g) for g in args.queries_per_step.split(",")]
    kinds = args.kinds.split(",")
    for name in args.configs.split(","):
        rates = {}
        for kind in kinds:
            for g in gs:
                line = bench(name, args.batch, g, args.steps, args.prop_len, args.query_len, kind)
                rates[kind, g] = line["pairs_per_s"]
                print(json.dumps(line), flush=True)
        ratios = {}
        for kind in kinds:
            ratios.update({f"{kind}_G{g}_over_G{gs[0]}": round(rates[kind, g] / rates[kind, gs[0]], 3) for g in gs[1:]})
        if "lowrank" in kinds and "dense" in kinds:
            ratios.update({f"lowrank_over_dense_G{g}": round(rates["lowrank", g] / rates["dense", g], 3) for g in gs})
        if ratios:
            print(json.dumps({"bench": "tailpatch_ratio", "config": name, **ratios}), flush=True)


if __name__ == "__main__":
    main()
