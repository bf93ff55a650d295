"""Linear datamodeling score: `python -m launch.validate --config=experiments/tiny_lds.py --workdir=runs/tiny`.

Retrains the run's model on `config.validate.num_subsets` random subsets of its corpus (each
`validate.fraction` of it), records each retrained model's loss on the fact queries, and
scores every row of `config.validate.methods` by the Spearman correlation between its
predicted subset sums and the negative losses (TRAK's LDS). Finished subsets are cached in
`<workdir>/validate/` and reused; a config or corpus that differs from the cached one is
refused naming the field. Several processes can share the subsets: `--process_index=i
--process_count=N` (the one that finishes the last subset writes `<eval dir>/lds.json` / `lds.md`;
a rerun of any one with all subsets done writes them too).
"""

import json
import pathlib

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from launch import _config
from trackstar_jax.distributed import multihost

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config (experiments/*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory written by launch.train.")
_PROCESS_INDEX = flags.DEFINE_integer(
    "process_index",
    0,
    "This process's index in [0, process_count): it retrains subsets i with i % process_count == process_index.",
)
_PROCESS_COUNT = flags.DEFINE_integer("process_count", 1, "Number of independent processes sharing the subsets.")
_SUBSET_COUNTS = flags.DEFINE_list(
    "subset_counts",
    [],
    "Also report each row's LDS from its first m subsets for these m (e.g. 10,20,30,50): how the interval narrows.",
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    multihost.require_single_process("launch.validate")  # processes share subsets via the flags, not jax.distributed
    from trackstar_jax import stages

    logging.info("devices: %s", jax.devices())
    out = stages.validate(
        _config.settings(_CONFIG),
        _WORKDIR.value,
        process_index=_PROCESS_INDEX.value,
        process_count=_PROCESS_COUNT.value,
        subset_counts=[int(m) for m in _SUBSET_COUNTS.value],
    )
    if "report" in out:
        print(pathlib.Path(out["report"]).read_text())
    for row in out.get("rows", []):
        print(json.dumps({k: v for k, v in row.items() if k != "per_query"}))
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}))


if __name__ == "__main__":
    jax.config.config_with_absl()
    _config.run(main)
