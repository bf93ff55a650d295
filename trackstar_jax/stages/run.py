"""`open_run`: a stage's one way to open a run directory, checked and loaded once.

Every stage after training reads the same things: a mesh (`settings.mesh.shape`), the run's
`config.json` checked against the stage's settings (`config.check_matches_run`), and the
checkpoint, corpus and tokenizer (`training.load_run`). `open_run` does the three once and
returns a `LoadedRun`, which a stage hands to the next (evaluation -> its gradient rows'
index builds -> retrieval) instead of calling the next stage's front door again.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Sequence

import jax

from trackstar_jax import config as config_lib
from trackstar_jax.distributed import sharding as sharding_lib
from trackstar_jax.training import checkpoint as checkpoint_lib


@dataclasses.dataclass(frozen=True)
class LoadedRun:
    """A checked, loaded run: what every stage after training works on.

    Attributes:
      settings: the stage's typed settings (checked against the run's `config.json`).
      workdir: the run directory.
      mesh: the mesh the run's arrays are placed on.
      run: the checkpoint (params, optimizer state, step), corpus (the candidates of
        `settings.candidates`) and tokenizer (`training.checkpoint.Run`).
    """

    settings: config_lib.Settings
    workdir: pathlib.Path
    mesh: jax.sharding.Mesh
    run: checkpoint_lib.Run


def open_run(
    settings: config_lib.Settings,
    workdir: str | os.PathLike,
    *,
    step: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
    sections: Sequence[str] = config_lib.RUN_SECTIONS,
) -> LoadedRun:
    """Makes the mesh, checks that `settings` describe the run in `workdir`, and loads it.

    Args:
      settings: the stage's settings; their `config.RUNTIME_KEYS` and `candidates` apply to
        the loaded run (`training.load_run`'s `runtime`).
      workdir: the run directory written by `train` / `import_model`.
      step: the checkpoint (None: the latest).
      mesh: the mesh to place the run on (default `settings.mesh.shape` over every device;
        `build_index` passes this process's devices).
      sections: the config sections that must match the run (`config.check_matches_run`).

    Raises:
      config.ConfigError: the settings differ from the run's (names the keys).
      FileNotFoundError: a missing piece of the run (names the path).
    """
    workdir = pathlib.Path(workdir)
    mesh = mesh if mesh is not None else sharding_lib.make_mesh(settings.mesh.shape)
    config_lib.check_matches_run(settings, workdir, sections=sections)
    run = checkpoint_lib.load_run(workdir, step=step, mesh=mesh, runtime=settings)
    return LoadedRun(settings=settings, workdir=workdir, mesh=mesh, run=run)
