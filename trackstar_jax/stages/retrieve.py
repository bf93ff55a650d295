"""Stage 3, `retrieve`: proponents and opponents of a query set, written to `workdir/retrieval/`.

The queries are the jsonl at `config.retrieval.queries` (or given from Python), else the
evaluation's fact queries (`retrieve_fact_queries`); the work is `retrieval.write_retrieval`.
"""

from __future__ import annotations

import os
import pathlib
import time
from typing import Sequence

from trackstar_jax import config as config_lib
from trackstar_jax import files
from trackstar_jax.distributed import multihost
from trackstar_jax.evaluation import query_set
from trackstar_jax.retrieval import stage as retrieval_lib
from trackstar_jax.stages import run as run_lib
from trackstar_jax.training import logs


def _refuse_existing(settings: config_lib.Settings, workdir: str | os.PathLike, name: str) -> None:
    out, man = retrieval_lib.output_paths(workdir, name)
    for f in (out, man):  # a linked `retrieval/` or output is refused before any work (`files.check_writable`)
        files.check_writable(f)
    if not settings.retrieval.overwrite and (out.exists() or man.exists()):
        raise FileExistsError(
            f"{out} already exists: set --config.retrieval.overwrite=True to replace it, "
            "or --config.retrieval.output=<another name>"
        )


def _open(
    settings: config_lib.Settings, workdir: str | os.PathLike, loaded: run_lib.LoadedRun | None
) -> tuple[run_lib.LoadedRun, float]:
    """The loaded run (opened now unless the caller has it) and the seconds that took."""
    t0 = time.perf_counter()
    loaded = loaded if loaded is not None else run_lib.open_run(settings, workdir)
    return loaded, time.perf_counter() - t0


@multihost.writes_workdir("retrieve")
def retrieve(
    settings: config_lib.Settings,
    workdir: str | os.PathLike,
    queries: Sequence[retrieval_lib.TextQuery] | None = None,
    *,
    name: str | None = None,
    source: dict | None = None,
    loaded: run_lib.LoadedRun | None = None,
    r_eval_queries: Sequence[retrieval_lib.TextQuery] | None = None,
) -> dict:
    """Stage 3 (`launch.retrieve`): retrieve for a query set and write its jsonl + manifest.

    Args:
      settings: the experiment's typed config.
      workdir: the run directory.
      queries: the queries; None reads the jsonl at `config.retrieval.queries`, or, when that
        is empty, retrieves for the evaluation's fact queries (`retrieve_fact_queries`).
      name: output name (default `config.retrieval.output`, else the query file's stem).
      source: what the queries are (recorded in the manifest).
      loaded: the opened run (`open_run`), if the caller has it.
      r_eval_queries: R_eval's examples for hessian mode "mixed" (default: the queries), as in
        `retrieval.retrieve_queries`.

    Returns:
      The manifest (also written), with counts and timings (`seconds_by_part`).

    Raises:
      FileExistsError: the output exists and `config.retrieval.overwrite` is not set.
    """
    started = time.perf_counter()
    logs.quiet_library_logs()
    st = settings.retrieval
    if queries is None:
        if not st.queries:
            return retrieve_fact_queries(settings, workdir, loaded=loaded)
        queries = retrieval_lib.load_text_queries(st.queries)  # a bad file is refused before the run loads
        source = source or {"kind": "jsonl", "path": str(st.queries)}
        name = name or st.output or pathlib.Path(st.queries).stem
    name = name or st.output  # an explicit name wins over the config's (as documented above)
    if not name:
        raise config_lib.ConfigError("no output name: set config.retrieval.output")
    _refuse_existing(settings, workdir, name)
    loaded, load_seconds = _open(settings, workdir, loaded)
    return retrieval_lib.write_retrieval(
        loaded.run,
        settings,
        workdir,
        queries,
        name=name,
        mesh=loaded.mesh,
        source=source,
        r_eval_queries=r_eval_queries,
        load_seconds=load_seconds,
        started=started,
    )


@multihost.writes_workdir("retrieve")
def retrieve_fact_queries(
    settings: config_lib.Settings, workdir: str | os.PathLike, *, loaded: run_lib.LoadedRun | None = None
) -> dict:
    """Stage 3 for the evaluation's fact queries (`launch.retrieve` without `retrieval.queries`).

    Writes `workdir/retrieval/eval_<mode>_t<variant>.jsonl` with fact fields and
    `proponent_correct`; refuses an existing output before any work (unless overwrite).
    """
    started = time.perf_counter()
    logs.quiet_library_logs()
    ev = settings.eval
    name = settings.retrieval.output or f"eval_{ev.query_mode}_t{ev.template_variant}"
    _refuse_existing(settings, workdir, name)
    loaded, load_seconds = _open(settings, workdir, loaded)
    eq = query_set.make_eval_queries(loaded.run, settings)
    return retrieval_lib.write_retrieval(
        loaded.run,
        settings,
        workdir,
        eq.text_queries(with_fact_fields=True),
        name=name,
        mesh=loaded.mesh,
        source={"kind": "eval", "query_mode": ev.query_mode, "template_variant": ev.template_variant},
        r_eval_queries=eq.r_eval_queries(),
        load_seconds=load_seconds,
        started=started,
    )
