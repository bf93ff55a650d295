"""One row of Table 1: `baselines.METHODS["exp3"]` on the trex_table1 setup.

    python -m launch.evaluate --config=experiments/method_exp3.py[:gpu] --workdir=runs/trex_table1

The row's settings (vectors.output_fn / vectors.correction / hessian.mode / hessian.unit_norm
and the index folder, for gradient rows) are in this config too, so the other stages
(`launch.build_index`, `launch.retrieve`) run exactly this row. In the workdir of
trex_table1 it reuses the run and the indices; it writes a table with this row only.
"""

from experiments import trex_table1


def get_config(arg: str | None = None):
    return trex_table1.row_config("exp3", arg)
