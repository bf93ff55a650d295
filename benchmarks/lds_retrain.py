"""LDS retraining throughput: one subset at a time vs K subsets side by side (vmap + scan).

    python -m benchmarks.lds_retrain --workdir=runs/quickstart [--config=experiments/tiny.py --steps 100 --ks 2,4,8]

Retrains the first subsets of `launch.validate` (`evaluation.retrain.retrain_subset`, the
training loop's own compiled step, one model at a time; and `retrain_subsets`, K models in
one program) for `--steps` steps each, after a warm-up call of each shape (compile excluded).
Prints one JSON object per line: subset-steps per second of each and its ratio to the
sequential path, all measured in this process one after the other.
"""

import argparse
import importlib.util
import json
import time

import jax

from trackstar_jax import config as config_lib
from trackstar_jax import stages
from trackstar_jax.distributed import sharding as sharding_lib
from trackstar_jax.evaluation import lds, retrain


def _settings(path: str) -> config_lib.Settings:
    spec = importlib.util.spec_from_file_location("cfg", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return config_lib.from_configdict(mod.get_config(), source=path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--config", default="experiments/tiny.py")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--ks", default="2,4,8")
    args = ap.parse_args()
    settings = _settings(args.config)
    mesh = sharding_lib.make_mesh(settings.mesh.shape)
    run = stages.load_run(args.workdir, mesh=mesh)
    ks = [int(k) for k in args.ks.split(",")]
    n = len(run.corpus.examples)
    masks = [lds.draw_subset(n, settings.validate.fraction, settings.validate.seed, i) for i in range(max(ks + [1]))]

    def seq(k: int) -> None:
        for m in masks[:k]:
            jax.block_until_ready(retrain.retrain_subset(settings, run.corpus, run.tokenizer, m, args.steps, mesh)[1])

    def par(k: int) -> None:
        jax.block_until_ready(
            retrain.retrain_subsets(settings, run.corpus, run.tokenizer, masks[:k], args.steps, mesh)[1]
        )

    rows = [("sequential", 1, seq)] + [("vmap", k, par) for k in ks]
    base = None
    for name, k, fn in rows:
        fn(k)  # compile + warm-up
        t0 = time.perf_counter()
        fn(k)
        dt = time.perf_counter() - t0
        rate = k * args.steps / dt
        base = base or rate
        print(
            json.dumps(
                {
                    "bench": "lds_retrain",
                    "path": name,
                    "k": k,
                    "steps": args.steps,
                    "seconds": round(dt, 3),
                    "subset_steps_per_s": round(rate, 2),
                    "vs_sequential": round(rate / base, 3),
                    "devices": str(jax.devices()[0].platform),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
