"""Stage 2, the attribution index: `python -m launch.build_index --config=experiments/tiny.py --workdir=runs/tiny`.

One pass over the run's corpus with the fast featurizer, writing raw projected vectors to
`<workdir>/<config.index.dir>` (tensorstore zarr3) and R_train beside them. Rerunning resumes
an interrupted build; a build whose model, vectors, storage or corpus differ is refused.

Several independent processes (one per GPU via CUDA_VISIBLE_DEVICES, or hosts without
jax.distributed) can share the work: give each `--process_index=i --process_count=N`; each
writes whole R_train segments and the last one to finish finalises the index.
On a pod, run it on every host with `--distributed`: each host is one writer over its local
devices (index and count from jax.distributed) and process 0 finalises the index once.
Overrides: `--config.index.dtype=int8`, `--config.vectors.correction=False --config.index.dir=index_nocorr`.
"""

import json

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from launch import _config, _distributed

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config (experiments/*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory written by launch.train.")
_PROCESS_INDEX = flags.DEFINE_integer(
    "process_index",
    None,
    "This writer's index in [0, process_count) (default 0; under --distributed: jax.process_index()).",
)
_PROCESS_COUNT = flags.DEFINE_integer(
    "process_count", None, "Number of writer processes (default 1; under --distributed: jax.process_count())."
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    _distributed.initialize()
    from trackstar_jax import stages  # after jax.distributed: nothing may start JAX's backends first

    logging.info("process %d/%d, local devices: %s", jax.process_index(), jax.process_count(), jax.local_devices())
    summary = _distributed.run(
        lambda: stages.build_index(
            _config.settings(_CONFIG),
            _WORKDIR.value,
            process_index=_PROCESS_INDEX.value,
            process_count=_PROCESS_COUNT.value,
        )
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    jax.config.config_with_absl()
    _config.run(main)
