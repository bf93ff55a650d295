"""Two-stage retrieval (issue 39): top-10 overlap with the exact top-10, and its cost per query.

On a run of experiments/tiny.py (trained here unless `--workdir` holds one) whose corpus is
small enough that the exact score of every row is computable: the exact top-10 of each fact
query is the top-10 of the unprojected corrected-gradient cosine over *all* rows
(`retrieval.rerank.ExactScorer`, the score benchmarks/peer_race.py takes as exact). For two
projection sizes d (index per d, built here) and K in `--ks` (0 = the index's own top-10),
it retrieves with `retrieval.rerank_k = K` and reports the mean top-10 overlap with the exact
top-10 and the reranking's seconds per query (`rerank_seconds`; the machine's load average is
printed beside it: these are not clean timings on a shared machine).

    python benchmarks/rerank.py --workdir=/tmp/rerank_run [--num_queries=20 --proj_dims=8,16 --ks=0,100,1000]

Prints one JSON object: `{"rows": [{"hessian", "d", "K", "top10_overlap", "rerank_seconds_per_query"}],
"num_rows", "num_queries", "loadavg", ...}`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

import numpy as np


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/trackstar_rerank_bench")
    ap.add_argument("--num_queries", type=int, default=20)
    ap.add_argument("--num_distractors", type=int, default=1000, help="passages stating no fact (rows > max K)")
    ap.add_argument("--train_steps", type=int, default=600)
    ap.add_argument("--proj_dims", default="8,16", help="k per side; d = 2 * 2 * k^2")
    ap.add_argument("--ks", default="0,100,1000")
    ap.add_argument("--hessian", default="none,mixed", help="hessian.mode of the first stage")
    args = ap.parse_args(argv)

    from experiments import tiny
    from trackstar_jax import config as config_lib
    from trackstar_jax import stages
    from trackstar_jax.evaluation import query_set
    from trackstar_jax.retrieval import rerank
    from trackstar_jax.retrieval import stage as retrieval_stage

    c = tiny.get_config()
    c.data.embedded.num_distractors = args.num_distractors
    c.train.num_steps = args.train_steps
    c.index.dtype = "float32"
    settings = config_lib.from_configdict(c)
    wd = pathlib.Path(args.workdir)
    t0 = time.perf_counter()
    if not (wd / "config.json").exists():
        stages.train(settings, wd)
    train_s = time.perf_counter() - t0
    run = stages.load_run(wd)
    n = len(run.corpus.examples)
    eq = query_set.make_eval_queries(run, settings)
    queries = eq.text_queries()[: args.num_queries]
    pairs = [(e["tokens"], e["loss_mask"]) for e in retrieval_stage.encode_text_queries(run, queries)]

    t0 = time.perf_counter()
    scorer = rerank.ExactScorer(run.graphdef, run.model_cfg, run.params, run.opt_state, settings.vectors, True)
    exact = scorer.score_matrix(pairs, rerank.encode_rows(run, range(n)))
    exact_top = [np.lexsort((np.arange(n), -s))[:10] for s in exact]
    exact_s = time.perf_counter() - t0

    rows = []
    for k in (int(x) for x in args.proj_dims.split(",")):
        s_k = settings.replace({"vectors.proj_dim": k, "index.dir": f"index_k{k}"})
        stages.build_index(s_k, wd)
        for mode in args.hessian.split(","):
            s_m = s_k.replace({"hessian.mode": mode})
            for big_k in (int(x) for x in args.ks.split(",")):
                recs, info = retrieval_stage.retrieve_queries(
                    run,
                    s_m.replace({"retrieval.rerank_k": big_k}),
                    wd,
                    queries,
                    k=10,
                    r_eval_queries=eq.r_eval_queries(),
                )
                overlap = np.mean(
                    [len(set(r["proponent_ids"]) & set(e.tolist())) / 10 for r, e in zip(recs, exact_top)]
                )
                rows.append(
                    {
                        "hessian": mode,
                        "d": s_k.vectors.dim,
                        "K": min(big_k, n) if big_k else 0,
                        "top10_overlap": round(float(overlap), 4),
                        "rerank_seconds_per_query": round(info.get("rerank_seconds", 0.0) / len(queries), 4),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    print(
        json.dumps(
            {
                "rows": rows,
                "num_rows": n,
                "num_queries": len(queries),
                "exact_top10_seconds": round(exact_s, 2),
                "train_seconds": round(train_s, 2),
                "loadavg": os.getloadavg(),
                "cpu_count": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
