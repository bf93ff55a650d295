"""Proponent-explorer latency (issue 15): end-to-end `POST /api/query` through Starlette's TestClient.

    python -m benchmarks.serve                                  # trains + indexes a tiny run in a temp dir
    python -m benchmarks.serve --workdir=runs/quickstart --n=100   # its settings: workdir/config.json

Prints one JSON object: p50 / p95 / mean / max seconds of `--n` queries per method (after one
warm-up query per method and per distinct query length, so compiles are not counted), the
index size and the device. Queries are the corpus passages split into prompt + last word,
cycled (passages that do not fit model.max_len are skipped). Wall time on a shared machine measures the contention too: say how loaded it was.
"""

import json
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

_WORKDIR = flags.DEFINE_string("workdir", None, "A trained + indexed run (default: train a tiny one in a temp dir).")
_N = flags.DEFINE_integer("n", 100, "Timed queries per method.")
_K = flags.DEFINE_integer("k", 10, "Proponents per query.")
_MIX_LAMBDA = flags.DEFINE_float(
    "mix_lambda",
    None,
    "Fixed hessian.mix_lambda for the served rows (default: the run's own; an automatic λ is chosen "
    "once at start from the evaluation's R_eval).",
)
_METHODS = flags.DEFINE_list("methods", ["trackstar", "exp5", "bm25"], "Methods to time (those available).")


def _tiny_run(workdir):
    from experiments import tiny
    from trackstar_jax import config as config_lib
    from trackstar_jax import stages

    c = tiny.get_config()
    c.data.embedded.num_facts, c.data.embedded.num_distractors = 12, 30
    c.train.num_steps, c.train.warmup_steps = 60, 10
    c.train.log_every_steps = c.train.eval_every_steps = c.train.checkpoint_every_steps = 60
    c.train.num_completions, c.train.max_new_tokens = 0, 2  # as tests/test_serve.py
    settings = config_lib.from_configdict(c)
    stages.train(settings, workdir)
    stages.build_index(settings, workdir)
    return settings


def main(argv):
    del argv
    from starlette.testclient import TestClient

    from trackstar_jax import config as config_lib
    from trackstar_jax import stages
    from trackstar_jax.serving import app as app_lib

    if _WORKDIR.value:
        workdir = _WORKDIR.value
        settings = config_lib.load_run_settings(workdir)
        if _MIX_LAMBDA.value is not None:
            settings = settings.replace({"hessian.mix_lambda": _MIX_LAMBDA.value})
    else:
        workdir = tempfile.mkdtemp(prefix="serve_bench_")
        settings = _tiny_run(workdir)
    t_start = time.perf_counter()
    engine = stages.open_engine(settings, workdir, dense=False)
    start_s = time.perf_counter() - t_start  # load run + indices + scoring (incl. R_eval of mixed rows)
    client = TestClient(app_lib.make_app(engine), base_url="http://127.0.0.1")  # a loopback Host (the guard)
    texts = engine.run.corpus.texts
    queries = []
    for t in texts:
        words = t.rstrip(". ").split(" ")
        p, t = " ".join(words[:-1]), " " + words[-1]
        # passages longer than model.max_len (truncated in the index) cannot be asked whole: skip them
        if len(words) > 1 and 1 + len(engine.run.tokenizer.encode(p + t)) < engine.run.model_cfg.max_len:
            queries.append((p, t))
    out = {
        "workdir": str(workdir),
        "num_passages": len(texts),
        "num_distinct_queries": len(queries),
        "n": _N.value,
        "k": _K.value,
        "mix_lambda": settings.hessian.mix_lambda,
        "engine_start_s": start_s,
        "offered": engine.methods,
        "skipped": engine.skipped,
        "rows": [e for e in engine.describe()["methods"] if e["name"] in _METHODS.value],
        "device": str(jax.devices()[0]),
        "num_devices": jax.device_count(),
        "methods": {},
    }
    for method in [m for m in _METHODS.value if m in engine.methods]:

        def ask(p, t, method=method):
            r = client.post("/api/query", json={"prompt": p, "target": t, "k": _K.value, "method": method})
            assert r.status_code == 200, r.text

        for p, t in queries[: _N.value]:  # warm-up: one compile per distinct padded length
            ask(p, t)
        lat = []
        for i in range(_N.value):
            p, t = queries[i % len(queries)]
            t0 = time.perf_counter()
            ask(p, t)
            lat.append(time.perf_counter() - t0)
        lat = np.asarray(lat)
        out["methods"][method] = {
            "p50_s": float(np.percentile(lat, 50)),
            "p95_s": float(np.percentile(lat, 95)),
            "mean_s": float(lat.mean()),
            "max_s": float(lat.max()),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    app.run(main)
