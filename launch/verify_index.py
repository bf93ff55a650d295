"""Checks a whole index: `python -m launch.verify_index --path=runs/tiny/index`
(or `--config=experiments/tiny.py --workdir=runs/tiny`).

Reads every chunk (crc32c, size, presence), checks values are finite, that the arrays match
the manifest, recomputes R_train from the stored rows, and checks that the run's checkpoint is
the one the index was built from (its checksums, `training.checkpoint`). Prints a JSON report;
exits 1 and names the row range of every bad or incomplete chunk (or the checkpoint) otherwise.
"""

import json
import sys

from absl import app, flags
from ml_collections import config_flags

from launch import _config
from trackstar_jax import index

_PATH = flags.DEFINE_string("path", None, "Index directory (alternative to --config/--workdir).")
_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config (for index.dir).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory.")
_RECOMPUTE_R = flags.DEFINE_bool("recompute_r", True, "Recompute R_train from the rows and compare.")
_ALLOW_INCOMPLETE = flags.DEFINE_bool("allow_incomplete", False, "Report missing chunks instead of failing on them.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _PATH.value:
        path = _PATH.value
    elif _CONFIG.value is not None and _WORKDIR.value:
        path = index.index_dir(_config.settings(_CONFIG).index, _WORKDIR.value)
    else:
        raise app.UsageError("give --path, or --config and --workdir")
    try:
        report = index.verify_index(path, recompute_r=_RECOMPUTE_R.value, require_complete=not _ALLOW_INCOMPLETE.value)
    except (index.IndexStoreError, FileNotFoundError) as e:
        print(json.dumps({"path": str(path), "ok": False, "error": str(e)}))
        sys.exit(1)
    print(json.dumps(report))


if __name__ == "__main__":
    _config.run(main)
