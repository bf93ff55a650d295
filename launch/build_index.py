"""Stage 2, the attribution index: `python -m launch.build_index --config=experiments/tiny.py --workdir=runs/tiny`.

One pass over the run's corpus with the fast featurizer, writing raw projected vectors to
`<workdir>/<config.index.dir>` (tensorstore zarr3) and R_train beside them. Rerunning resumes
an interrupted build; a build whose model, vectors, storage or corpus differ is refused.

Several independent processes (hosts, or one per GPU via CUDA_VISIBLE_DEVICES) can share the
work: give each `--process_index=i --process_count=N`; each writes whole R_train segments and
the last one to finish finalises the index. Overrides: `--config.index.dtype=int8`,
`--config.vectors.correction=False --config.index.dir=index_nocorr`.
"""

import json

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from trackstar_jax import pipeline

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config (experiments/*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory written by launch.train.")
_PROCESS_INDEX = flags.DEFINE_integer("process_index", 0, "This writer's index in [0, process_count).")
_PROCESS_COUNT = flags.DEFINE_integer("process_count", 1, "Number of independent writer processes.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.info("writer %d/%d, devices: %s", _PROCESS_INDEX.value, _PROCESS_COUNT.value, jax.devices())
    summary = pipeline.build_index(_CONFIG.value, _WORKDIR.value, process_index=_PROCESS_INDEX.value,
                                   process_count=_PROCESS_COUNT.value)
    print(json.dumps(summary))


if __name__ == "__main__":
    jax.config.config_with_absl()
    app.run(main)
