"""The run directory at the stage layer: its `config.json` and `open_run`, a stage's one way to
open a run, checked and loaded once.

`save_run_config` writes (or checks) the run's `config.json` (stage 1); `load_run` reads it and
restores the checkpoint, corpus and tokenizer (`training.checkpoint.restore_state`). Every stage
after training reads the same things: a mesh (`settings.mesh.shape`), the run's `config.json`
checked against the stage's settings (`config.check_matches_run`), and the run (`load_run`).
`open_run` does the three once and returns a `LoadedRun`, which a stage hands to the next
(evaluation -> its gradient rows' index builds -> retrieval) instead of calling the next
stage's front door again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Sequence

import jax
from absl import logging

from trackstar_jax import config as config_lib
from trackstar_jax import data as data_lib
from trackstar_jax import files
from trackstar_jax.data import candidates as candidates_lib
from trackstar_jax.distributed import sharding as sharding_lib
from trackstar_jax.training import checkpoint as checkpoint_lib


def save_run_config(workdir: str | os.PathLike, settings: config_lib.Settings, write: bool = True) -> None:
    """Creates `workdir/config.json` once, or checks an existing one against `settings`.

    One rule for the run directory: what is there is never rewritten by a rerun.

    - `seed`, `model`, `data` and the optimizer/batch keys of `train` define the run: a
      difference is refused, naming each field.
    - The resumable train keys (`config.RESUMABLE_TRAIN_KEYS`, e.g. a longer `num_steps`)
      are recorded: only the `train` section is updated, and only when they changed. While
      no checkpoint is saved (e.g. a first attempt that diverged at once), every train key
      is: nothing was trained with the old values.
    - Later stages' sections (vectors, index, eval, ...) are kept as first recorded: one
      trained run serves every table row, and each later stage takes its own settings from
      its flags. A difference is logged (naming the fields), never written.

    With `write=False` (the non-primary processes of a multi-host run) it only checks.

    Raises:
      ConfigError: the existing config.json describes a different run (names the fields).
    """
    path = pathlib.Path(workdir) / config_lib.CONFIG_FILE
    new = config_lib.to_dict(settings)
    if not path.exists():
        if write:
            files.create_once(path, json.dumps(new, indent=1, sort_keys=True))
        return
    saved = config_lib.read_json(path)
    trained = checkpoint_lib.has_checkpoint(workdir)
    bad = config_lib.mismatches(saved, new, **({} if trained else {"sections": config_lib.RUN_SECTIONS}))
    if bad:
        raise config_lib.ConfigError(
            f"{path} belongs to a different run; refusing to reuse the workdir. Differences: " + "; ".join(bad)
        )
    later = [
        s for s in config_lib.to_dict(config_lib.Settings()) if s not in config_lib.RUN_SECTIONS + ("train", "mesh")
    ]
    kept = config_lib.mismatches(saved, new, sections=later, ignore=())
    if kept:
        logging.warning(
            "%s keeps the later-stage settings it was created with (this stage does not use them; later "
            "stages take theirs from their own flags): %s",
            path,
            "; ".join(kept),
        )
    resumed = config_lib.mismatches(saved, new, sections=("train",), ignore=())
    if resumed and write:
        logging.info("%s: recording the changed resumable train keys: %s", path, "; ".join(resumed))
        files.atomic_write(path, json.dumps({**saved, "train": new["train"]}, indent=1, sort_keys=True))


def load_run(
    workdir: str | os.PathLike,
    step: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
    runtime: config_lib.Settings | None = None,
) -> checkpoint_lib.Run:
    """Loads config, tokenizer, corpus and a checkpoint (default: latest) of a run.

    Args:
      workdir: the run directory written by `train` / `import_model`.
      step: checkpoint step (None: latest).
      mesh: arrays are placed on it by `checkpoint.state_shardings` (split over its fsdp axis
        when that has size > 1; default mesh: all devices on the data axis). A checkpoint
        saved from any mesh restores into any other.
      runtime: the stage's settings, whose `config.RUNTIME_KEYS` (e.g. `model.remat`) replace the
        run's own (None: the run's values), and whose `config.candidates` makes `Run.corpus` the
        candidate view (`data.candidates.select`; None: every corpus passage).

    Raises:
      FileNotFoundError: a missing piece of the run (names the path).
      ValueError: the checkpoint's saved config differs from `config.json` in a run-defining field.
    """
    workdir = pathlib.Path(workdir)
    settings = config_lib.load_run_settings(workdir)
    if runtime is not None:
        settings = config_lib.with_runtime_keys(settings, runtime)
    # All run-defining fields (`config.mismatches`' defaults): a damaged config.json that still
    # parses is refused here.
    graphdef, step, params, opt_state, info = checkpoint_lib.restore_state(
        workdir,
        settings.model,
        settings.train.optimizer,
        step,
        mesh,
        check=lambda saved: config_lib.mismatches(saved, settings),
    )
    return checkpoint_lib.Run(
        model_cfg=settings.model,
        optimizer=settings.train.optimizer,
        data=settings.data,
        graphdef=graphdef,
        params=params,
        opt_state=opt_state,
        step=step,
        tokenizer=checkpoint_lib.load_run_tokenizer(workdir),
        corpus=candidates_lib.select(
            data_lib.load_corpus(workdir / checkpoint_lib.CORPUS_DIR),
            runtime.candidates if runtime is not None else settings.candidates,
        ),
        workdir=workdir,
        opt_state_info=info,
    )


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
        the loaded run (`load_run`'s `runtime`).
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
    run = load_run(workdir, step=step, mesh=mesh, runtime=settings)
    return LoadedRun(settings=settings, workdir=workdir, mesh=mesh, run=run)
