"""Stage 4, `evaluate`: the fact-tracing table (`evaluation.evaluate_run`); `reopen` (a finished
evaluation's run and queries, for tools that re-measure it); and `validate` (LDS)."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time
from typing import Any, Mapping, Sequence

from trackstar_jax import config as config_lib
from trackstar_jax.distributed import multihost
from trackstar_jax.evaluation import lds as lds_lib
from trackstar_jax.evaluation import query_set, report
from trackstar_jax.evaluation import rows as rows_lib
from trackstar_jax.evaluation import stage as evaluation_lib
from trackstar_jax.stages import run as run_lib
from trackstar_jax.training import logs


@multihost.writes_workdir("evaluate")
def evaluate(
    settings: config_lib.Settings, workdir: str | os.PathLike, *, loaded: run_lib.LoadedRun | None = None
) -> dict:
    """Stage 4: the fact-tracing table for every row in `config.eval.methods`.

    Refuses unknown rows before any work, reports a finished evaluation of these settings
    unchanged (`evaluation.stage.finished`), else opens the run once (`open_run`, unless the
    caller hands it over) and runs `evaluation.evaluate_run`: each gradient row builds or
    reuses its index from that loaded run.

    Returns:
      The table.json content.
    """
    started = time.perf_counter()
    workdir = pathlib.Path(workdir)
    logs.quiet_library_logs()
    methods = evaluation_lib.check_methods(settings)
    with multihost.step("evaluate:checked"):  # every process decides on the same files
        done = evaluation_lib.finished(settings, report.eval_dir(settings, workdir))
    if done is not None:
        return done
    t0 = time.perf_counter()
    loaded = loaded if loaded is not None else run_lib.open_run(settings, workdir)
    ctx = rows_lib.Context(settings, workdir, loaded.run, loaded.mesh)
    return evaluation_lib.evaluate_run(ctx, methods, started=started, load_seconds=time.perf_counter() - t0)


@dataclasses.dataclass
class Reopened:
    """A finished evaluation, opened again: its settings (table.json's, with the caller's
    overrides), the loaded run and its queries rebuilt (`query_set.make_eval_queries`)."""

    settings: config_lib.Settings
    loaded: run_lib.LoadedRun
    eq: query_set.EvalQueries

    @property
    def eval_dir(self) -> pathlib.Path:
        return report.eval_dir(self.settings, self.loaded.workdir)


def reopen(workdir: str | os.PathLike, overrides: Mapping[str, Any] | None = None) -> Reopened:
    """Opens the run of the finished evaluation in `workdir` (`eval/table.json`'s settings, then
    `overrides`, dotted keys that must not change the queries, e.g. `tailpatch.*`) and rebuilds
    its queries, checked against the `queries.jsonl` it wrote (deterministic, so they are the
    same unless the config or the code changed).

    Raises:
      FileNotFoundError: no finished evaluation there.
      ValueError: the rebuilt queries differ from the evaluation's own.
    """
    workdir = pathlib.Path(workdir)
    settings = config_lib.load_table_settings(workdir / report.EVAL_DIR / "table.json")
    if overrides:
        settings = settings.replace(dict(overrides))
    loaded = run_lib.open_run(settings, workdir)
    eq = query_set.make_eval_queries(loaded.run, settings)
    saved_file = report.eval_dir(settings, workdir) / "queries.jsonl"
    with saved_file.open(encoding="utf-8") as f:
        saved = [q for q in map(json.loads, f) if q]
    if [(q["prompt"], q["target"]) for q in saved] != [(q.prompt, q.target) for q in eq.queries]:
        raise ValueError(f"the rebuilt queries differ from {saved_file} (another config or code)")
    return Reopened(settings, loaded, eq)


@multihost.writes_workdir("validate")
def validate(
    settings: config_lib.Settings,
    workdir: str | os.PathLike,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
    subset_counts: Sequence[int] = (),
) -> dict:
    """The LDS stage: checks the settings (`evaluation.lds.check_settings`), opens the run once
    and runs `evaluation.lds.validate_run` (retrain this process's share of the subsets, then
    score every row through its kind's retriever)."""
    settings = lds_lib.check_settings(settings)
    loaded = run_lib.open_run(settings, workdir)
    ctx = rows_lib.Context(settings, loaded.workdir, loaded.run, loaded.mesh)
    return lds_lib.validate_run(
        ctx, process_index=process_index, process_count=process_count, subset_counts=subset_counts
    )
