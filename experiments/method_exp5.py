"""One row of Table 1: `baselines.METHODS["exp5"]` on the trex_table1 setup.

    python -m launch.evaluate --config=experiments/method_exp5.py[:gpu] --workdir=runs/trex_table1

The row's settings (vectors.output_fn / vectors.correction / hessian.mode / hessian.unit_norm
for gradient rows) are written into this config too, so that the other stages
(`launch.build_index`, `launch.retrieve`) run exactly this row. Reuses the run, indices and
queries of trex_table1 in the same workdir; writes a table with this row only.
"""

from experiments import trex_table1
from trackstar_jax import baselines

NAME = "exp5"


def get_config(arg: str | None = None):
    c = trex_table1.get_config(arg)
    c.eval.methods = (NAME,)
    for key, value in baselines.method(NAME).overrides().items():
        section, field = key.split(".")
        c[section][field] = value
    return c
