"""Stage 3, exact retrieval: `python -m launch.retrieve --config=experiments/tiny.py --workdir=runs/tiny`.

Featurizes the queries (prompt + target, loss on the target tokens only) with the run's model,
projection, optimizer correction and R, exactly as the index was built (its manifest is
checked), scores them against every index row, and writes the top-k proponents and bottom-k
opponents per query to `<workdir>/retrieval/<name>.jsonl` (PAIR-code/pretraining-tda schema)
with `<name>.manifest.json`.

Queries: by default the evaluation's fact queries (`config.eval`); or your own jsonl of
`{"prompt": ..., "target": " ..."}` lines: `--config.retrieval.queries=my_queries.jsonl`.
Other overrides: `--config.retrieval.top_k=100`, `--config.retrieval.output=name`,
`--config.retrieval.overwrite=True` (existing output is refused otherwise).
`--config.retrieval.token_scores=True` adds, per proponent, each token's share of its score
(`proponent_token_scores`: tokens and scores) and each query target token's (`target_tokens`,
`target_token_scores`), `retrieval.attribution`; `--config.retrieval.rerank_k=K` rescores the
index's top K with the exact unprojected corrected-gradient cosine (`retrieval.rerank`), keeping
the index's score as `proponent_index_scores`.
On a pod add `--distributed` on every host: each streams its own rows of the index, process 0 writes.
"""

import json

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from launch import _config, _distributed
from trackstar_jax import stages

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config (experiments/*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run directory (trained by launch.train, indexed by launch.build_index)."
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    _distributed.initialize()  # before anything starts JAX's backends
    logging.info("process %d/%d, devices: %s", jax.process_index(), jax.process_count(), jax.devices())
    settings = _config.settings(_CONFIG)
    # a query file, or the evaluation's fact queries; under --distributed every host takes a row range
    manifest = _distributed.run(lambda: stages.retrieve(settings, _WORKDIR.value))
    print(json.dumps({k: manifest[k] for k in ("output", "num_queries", "index_rows", "k") if k in manifest}))


if __name__ == "__main__":
    jax.config.config_with_absl()
    _config.run(main)
