"""Pretraining throughput (tokens/s) of experiments/tiny.py and small.py on this machine, and
the parameter count of every experiments/*.py config. One JSON object per line.

    python -m benchmarks.train [--steps_tiny 50 --steps_small 10]

Tokens/s counts every position of the `[global_batch_size, max_len]` batch (the jitted train
step of `training.step.make_jit_train_step`, state donated, batch sharded over all devices).
Both configs are measured in the same process, one after the other, after a compile and
two warm-up steps; the timed loop blocks only once, at its end.
"""

import argparse
import importlib
import json
import os
import pathlib
import time

import jax
import numpy as np

from trackstar_jax import config as config_lib
from trackstar_jax.distributed import sharding
from trackstar_jax.distributed import sharding as sharding_lib
from trackstar_jax.models import lm as model
from trackstar_jax.training import loop
from trackstar_jax.training import step as step_lib
from trackstar_jax.training import step as train


def _throughput(name: str, steps: int) -> dict:
    config = importlib.import_module(f"experiments.{name}").get_config()
    model_cfg = config_lib.from_configdict(config).model
    opt = train.make_optimizer(config_lib.from_configdict(config).train.optimizer)
    mesh = sharding.make_mesh(tuple(config.mesh.shape))
    graphdef, state = loop.init_train_state(model_cfg, opt, 0, mesh)
    b, t = int(config.train.global_batch_size), model_cfg.max_len
    rng = np.random.default_rng(0)
    batch = {
        "tokens": rng.integers(4, model_cfg.vocab_size, (b, t)).astype(np.int32),
        "loss_mask": np.ones((b, t), np.int32),
        "example_id": np.arange(b, dtype=np.int32),
    }
    batch["tokens"][:, 0] = 2  # BOS
    batch["loss_mask"][:, 0] = 0
    batch = sharding_lib.device_batch(batch, mesh)
    step = step_lib.make_jit_train_step(graphdef, opt, mesh, state)
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    for _ in range(2):
        state, m = compiled(state, batch)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, m = compiled(state, batch)
    jax.block_until_ready((state, m))
    dt = (time.perf_counter() - t0) / steps
    return {
        "bench": "train_throughput",
        "config": name,
        "params": model.param_count(state.params),
        "batch": b,
        "seq_len": t,
        "steps": steps,
        "step_time_s": round(dt, 5),
        "tokens_per_sec": round(b * t / dt, 1),
        "compile_s": round(compile_s, 2),
        "final_loss": round(float(m["loss"]), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps_tiny", type=int, default=50)
    parser.add_argument("--steps_small", type=int, default=10)
    parser.add_argument("--configs", default="tiny,small", help="comma list of tiny, small")
    parser.add_argument("--param_counts", type=int, default=1, help="also list every config's parameter count")
    args = parser.parse_args()
    env = {
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "cpus": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    steps = {"tiny": args.steps_tiny, "small": args.steps_small}
    for name in args.configs.split(","):
        print(json.dumps({**_throughput(name, steps[name]), **env}), flush=True)
    if not args.param_counts:
        return
    exps = sorted(
        p.stem
        for p in (pathlib.Path(__file__).resolve().parents[1] / "experiments").glob("*.py")
        if p.stem != "__init__"
    )
    for name in exps:
        cfg = config_lib.from_configdict(importlib.import_module(f"experiments.{name}").get_config()).model
        _, params = model.abstract_params(cfg)
        embed = cfg.vocab_size * cfg.embed_dim
        print(
            json.dumps(
                {
                    "bench": "param_count",
                    "config": name,
                    "params": model.param_count(params),
                    "params_without_embedding": model.param_count(params) - embed,
                    "layers": cfg.num_layers,
                    "embed_dim": cfg.embed_dim,
                    "vocab": cfg.vocab_size,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
