"""How far an estimated V can be trusted: both estimates against a run's true Adafactor V.

A model imported without optimizer state gets V estimated (`training.second_moment`). On a run
of our own model the truth is known: the Adafactor state its training left. This tool
estimates V from the run's final weights both ways (`per_example`: the mean of squared
per-example gradients; `minibatch`: Adafactor's own EMA of squared minibatch-mean gradients,
B sequences per step, N steps) from the same source text, and prints one JSON object with

- per factored kernel (optax keeps `v_row` / `v_col`), the Pearson correlation over its rows
  and over its columns of the log factors of each estimate against the true V's (what
  `features.preconditioner` divides by); medians and minima over kernels;
- the top-10 overlap (mean over queries of |top10(est) ∩ top10(true)| / 10) of TrackStar
  (`methods.method("trackstar")`: corrected, R mixed, unit norm) retrieving with each V against
  TrackStar with the true V, and the same for Exp. 4 (corrected, no R); each V's index is built
  under `<workdir>/vcheck_<method>_<hash of the estimate>` (reused on a rerun with the same estimate), queries from the finished
  evaluation's `eval/queries.jsonl` (R_eval of the mixed row: the queries, as in LDS).

    python tools/v_estimates.py runs/trex_table1_tiny [--source=heldout] [--batch_sequences=16]
        [--steps=8] [--examples=64] [--seed=0] [--rows=trackstar,exp4]

Needs a run with its own optimizer state (`launch.train`) and a finished evaluation.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import pathlib
from typing import Any, Mapping, Sequence

import numpy as np

K = 10


def log_factor_corr(true_state: Any, est_state: Any) -> dict:
    """Per factored kernel (a non-[1] `v_row` in both states), the correlation of log `v_row`
    and of log `v_col` between the two states; `{"kernels", "median_rows_cols", "min_rows_cols",
    "per_kernel"}`."""
    import optax

    from trackstar_jax.models import layers as layers_lib

    def factors(state: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        rows = layers_lib.flat_params(optax.tree_utils.tree_get(state, "v_row"))
        cols = layers_lib.flat_params(optax.tree_utils.tree_get(state, "v_col"))
        return {p: (np.asarray(r, np.float64), np.asarray(cols[p], np.float64)) for p, r in rows.items() if r.size > 1}

    t, e = factors(true_state), factors(est_state)
    per = {}
    for p, (tr, tc) in sorted(t.items()):
        er, ec = e[p]
        per[p] = [float(np.corrcoef(np.log(a), np.log(b))[0, 1]) for a, b in ((tr, er), (tc, ec))]
    c = np.asarray(list(per.values()))
    return {
        "kernels": len(per),
        "median_rows_cols": np.median(c, 0).round(3).tolist(),
        "min_rows_cols": c.min(0).round(3).tolist(),
        "per_kernel": {p: [round(x, 3) for x in v] for p, v in per.items()},
    }


def _short_hash(record: Mapping[str, Any]) -> str:
    """8 hex digits of the estimate's record (timing left out): one index directory per estimate."""
    body = json.dumps({k: v for k, v in record.items() if k != "seconds"}, sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:8]


def top_overlap(a: np.ndarray, b: np.ndarray, k: int = K) -> float:
    """Mean over rows of |top-k(a) ∩ top-k(b)| / k of two `[Q, N]` score matrices."""
    ta = np.argsort(-a, axis=1, kind="stable")[:, :k]
    tb = np.argsort(-b, axis=1, kind="stable")[:, :k]
    return float(np.mean([len(set(x) & set(y)) / k for x, y in zip(ta.tolist(), tb.tolist())]))


def estimates(run: Any, settings: Any, vec_overrides: Mapping[str, Any]) -> dict[str, tuple[Any, dict]]:
    """`{method: (opt_state, record)}` of V estimated from `run`'s weights both ways."""
    from trackstar_jax.training import second_moment as sm_lib
    from trackstar_jax.training import step as step_lib

    opt_cfg = settings.train.optimizer
    opt = step_lib.make_optimizer(opt_cfg)
    out = {}
    for method in sm_lib.ESTIMATORS:
        vec = dataclasses.replace(settings.vectors, estimate_v_method=method, **vec_overrides)
        out[method] = sm_lib.estimate(
            vec, run.graphdef, run.params, opt, opt_cfg, run.corpus, settings.data, run.tokenizer, run.model_cfg.max_len
        )
    return out


def report(workdir: pathlib.Path, vec_overrides: Mapping[str, Any], rows: Sequence[str]) -> dict:
    from trackstar_jax import config as config_lib
    from trackstar_jax import methods as methods_lib
    from trackstar_jax.evaluation import rows as rows_lib
    from trackstar_jax.retrieval import stage as retrieval_stage
    from trackstar_jax.stages import run as run_lib

    settings = config_lib.load_table_settings(workdir / "eval" / "table.json")
    loaded = run_lib.open_run(settings, workdir)
    run = loaded.run
    if run.opt_state_info is not None:
        raise ValueError(f"{workdir} is an import (its V is itself estimated): this tool needs a trained run's own V")
    with (workdir / "eval" / "queries.jsonl").open(encoding="utf-8") as f:
        qrecs = [q for q in map(json.loads, f) if q]
    qs = rows_lib.TypedQueries.encode(
        run, [retrieval_stage.TextQuery(int(q["query_id"]), q["prompt"], q["target"]) for q in qrecs]
    )
    est = estimates(run, settings, vec_overrides)
    states = {"true": (run.opt_state, {"kind": "measured", "step": run.step}), **est}
    scores: dict[str, dict[str, np.ndarray]] = {}
    for name, (opt_state, rec) in states.items():
        run_v = dataclasses.replace(run, opt_state=opt_state, opt_state_info=None if name == "true" else rec)
        s_v = settings if name == "true" else settings.replace({"index.dir": f"vcheck_{name}_{_short_hash(rec)}"})
        ctx = rows_lib.Context(s_v, workdir, run_v, loaded.mesh)
        scores[name] = {r: rows_lib.make_retriever(methods_lib.method(r), ctx).scores(qs) for r in rows}
    return {
        "workdir": str(workdir),
        "true_v": f"the run's Adafactor state at step {run.step}",
        "estimates": {m: {k: v for k, v in rec.items() if k != "seconds"} for m, (_, rec) in est.items()},
        "log_factor_corr": {m: log_factor_corr(run.opt_state, st) for m, (st, _) in est.items()},
        "top10_overlap_with_true": {m: {r: top_overlap(scores[m][r], scores["true"][r]) for r in rows} for m in est},
        "num_queries": len(qrecs),
    }


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("workdir", type=pathlib.Path)
    ap.add_argument("--source", default="heldout", help="vectors.estimate_v_source (second_moment.V_SOURCES)")
    ap.add_argument("--batch_sequences", type=int, default=16, help="minibatch: B")
    ap.add_argument("--steps", type=int, default=8, help="minibatch: N")
    ap.add_argument("--examples", type=int, default=64, help="per_example: texts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows", default="trackstar,exp4", help="rows whose top 10 are compared")
    args = ap.parse_args(argv)
    overrides = {
        "estimate_v_source": args.source,
        "estimate_v_batch_sequences": args.batch_sequences,
        "estimate_v_steps": args.steps,
        "estimate_v_examples": args.examples,
        "estimate_v_seed": args.seed,
    }
    print(json.dumps(report(args.workdir, overrides, [r for r in args.rows.split(",") if r]), indent=1))


if __name__ == "__main__":
    main()
