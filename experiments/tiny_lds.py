"""The linear datamodeling score on the quickstart's tiny run (CPU-sized).

    python -m launch.validate --config=experiments/tiny_lds.py --workdir=runs/quickstart

Same run sections as experiments/tiny.py (it validates the tiny run in place); only the
`validate` section differs: 20 subsets of half the corpus, each retrained for the run's
600 steps (--config.validate.num_steps=300 halves the time), 40 fact queries.
"""

from experiments import tiny


def get_config(arg: str | None = None):
    c = tiny.get_config(arg)
    c.validate.num_subsets = 20
    c.validate.num_queries = 40
    c.validate.methods = ("trex_gold", "bm25", "exp1", "exp2", "trackstar")
    return c
