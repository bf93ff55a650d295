"""Stage 2, `build_index`: the run's corpus featurized into its index (`index.build_from_run`)."""

from __future__ import annotations

import os

from trackstar_jax import config as config_lib
from trackstar_jax.distributed import multihost
from trackstar_jax.index import build as build_lib
from trackstar_jax.stages import run as run_lib
from trackstar_jax.training import logs


@multihost.writes_workdir("build_index")
def build_index(
    settings: config_lib.Settings,
    workdir: str | os.PathLike,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
    sync_timeout_s: float = build_lib.SYNC_TIMEOUT_S,
    step: int | None = None,
) -> dict:
    """Stage 2: featurize every example of the run's corpus into the index (§3, §A.1.3).

    Opens the run (`open_run`) on this process's devices, then `index.build_from_run`, which
    resumes an interrupted build, writes this writer's share (`process_index` /
    `process_count`, see there), or reuses a finished index.

    Args:
      step: the checkpoint (default the latest; e.g. TrackStar over training, Fig. 2 right).

    Returns:
      Summary (also written to `index/build_summary-pXXXX.json`): rows, examples/s, tokens/s,
      write_fraction, bytes per example.
    """
    logs.quiet_library_logs()
    mesh = build_lib.index_mesh(
        settings.mesh.shape, settings.vectors.batch_size
    )  # a batch the devices cannot split is refused before loading
    loaded = run_lib.open_run(settings, workdir, step=step, mesh=mesh)
    return build_lib.build_from_run(
        loaded.run,
        settings.vectors,
        settings.index,
        workdir,
        mesh_shape=settings.mesh.shape,
        mesh=mesh,
        process_index=process_index,
        process_count=process_count,
        sync_timeout_s=sync_timeout_s,
    )
