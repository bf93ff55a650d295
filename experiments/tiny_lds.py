"""The linear datamodeling score on the quickstart's tiny run (CPU-sized).

    python -m launch.validate --config=experiments/tiny_lds.py --workdir=runs/quickstart \
        --subset_counts=10,20,30,50

Same run sections as experiments/tiny.py (it validates the tiny run in place); only the
`validate` section differs: M=50 subsets of half the corpus (TRAK's M and alpha), each
retrained from the run's initialisation for the run's full 600-step schedule, 4 at a time
side by side (vmap: 1.7x the subset-steps/s of one at a time on the 2-core CPU,
benchmarks/lds_retrain.py), scored on 40 fact queries, every row of the fact-tracing table.
"""

from experiments import tiny


def get_config(arg: str | None = None):
    c = tiny.get_config(arg)
    c.validate.num_subsets = 50
    c.validate.num_queries = 40
    c.validate.parallel_subsets = 4
    c.validate.methods = ("trex_gold", "bm25", "dense", "trak", "exp1", "exp2", "exp3", "exp4", "exp5", "trackstar")
    return c
