"""Where an evaluation's `load` stage goes: opening the run, then `evaluation.stage.check_fits`.

Before any work, the evaluation compiles every row's featurize step and retrieval read chunk and
the tail-patch step to read their memory (`check_fits`, "refuse before any work"); that is most
of the `load` figure of a table (Run A: 65 s; Run B's GPU variant on an H200: 56 s). This times
the same calls one by one, in one process, on a run and the settings it was made with
(`<workdir>/config.json`; `--from_table` takes an evaluation's own from `eval/table.json`):
`open_run_s`, then per row `check_fits_s` (rows that share a step reuse its compile: JAX's cache)
and `tailpatch_s`. With `--cache=DIR` the persistent compilation cache is on (as in the
launch scripts); run twice on one DIR for the warm figures.

    python -m benchmarks.check_fits --workdir=runs/smollm2_table1 --from_table --cache=/tmp/cc
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

from trackstar_jax import config as config_lib
from trackstar_jax.distributed import runtime
from trackstar_jax.evaluation import rows as rows_lib
from trackstar_jax.evaluation import stage as stage_lib
from trackstar_jax.stages import run as run_lib


def measure(workdir: pathlib.Path, from_table: bool = False) -> dict:
    """`{"open_run_s", "check_fits_s": {row: s}, "tailpatch_s", "total_s"}` for the run in `workdir`."""
    if from_table:
        settings = config_lib.load_table_settings(workdir / "eval" / "table.json")
    else:
        settings = config_lib.load_run_settings(workdir)
    t0 = time.perf_counter()
    loaded = run_lib.open_run(settings, workdir)
    out = {"open_run_s": round(time.perf_counter() - t0, 2), "check_fits_s": {}}
    ctx = rows_lib.Context(settings, workdir, loaded.run, loaded.mesh)
    for m in stage_lib.check_methods(settings):
        t1 = time.perf_counter()
        rows_lib.row_kind(m.kind).check_fits(m, ctx)
        out["check_fits_s"][m.name] = round(time.perf_counter() - t1, 2)
    t1 = time.perf_counter()
    stage_lib.check_fits(ctx, [])  # no rows: the tail-patch step alone
    out["tailpatch_s"] = round(time.perf_counter() - t1, 2)
    out["total_s"] = round(time.perf_counter() - t0, 2)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=pathlib.Path, required=True)
    ap.add_argument("--from_table", action="store_true", help="the settings of eval/table.json")
    ap.add_argument("--cache", default="", help="persistent compilation cache folder (default: none)")
    args = ap.parse_args(argv)
    if args.cache:
        runtime.enable_compilation_cache(args.cache)
    print(json.dumps(measure(args.workdir, args.from_table)))


if __name__ == "__main__":
    main()
