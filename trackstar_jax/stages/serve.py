"""The explorer's loading (`launch.serve`): a run and its indices behind `serving.engine.Engine`."""

from __future__ import annotations

import os

from trackstar_jax import config as config_lib
from trackstar_jax.serving import engine as engine_lib
from trackstar_jax.stages import run as run_lib
from trackstar_jax.training import logs


def open_engine(settings: config_lib.Settings, workdir: str | os.PathLike, **kwargs) -> engine_lib.Engine:
    """The explorer's engine over the run in `workdir`, opened once by `open_run` and handed to
    `serving.engine.Engine` (`kwargs` go to it)."""
    logs.quiet_library_logs()
    loaded = run_lib.open_run(settings, workdir, mesh=kwargs.pop("mesh", None))
    return engine_lib.Engine(settings, loaded.workdir, mesh=loaded.mesh, run=loaded.run, **kwargs)
