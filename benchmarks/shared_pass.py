"""Three indices in one featurize pass vs one pass each, on a run's own candidates (side by side).

Exp. 4's index (correction on) and Exp. 1's (off) differ only in the correction, and TRAK's
(off, margin output function) in the output function too, so one forward can write all three
(`index.build_from_run(companions=...)`): the two loss settings share the backward as well,
TRAK's gets a backward of its own. This times the index builder's own row function
(`index.build.make_rows_fn`: encoding, length buckets, the jitted step, the device-to-host copy;
writing is < 1% of a build) over the first `--rows` candidates of a run: once per setting alone,
the two loss settings in one pass (`shared2`), then all three in one pass (`shared3`), in one
process, after a warm-up batch of every length bucket (compiles are reported apart). One JSON
line: `speedup` = on + off over shared2, `speedup_trak` = trak + shared2 over shared3 (the
session-28 lever), `speedup_all` = the three alone over shared3.

    python -m benchmarks.shared_pass --workdir=runs/smollm2_table1 --rows=512
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import numpy as np

from trackstar_jax import config as config_lib
from trackstar_jax import stages
from trackstar_jax.features import vectors as vectors_lib
from trackstar_jax.index import build as build_lib


def _warm(run, fn, rows: int) -> float:
    """Compiles `fn`'s step for every length bucket the row function forms over the first
    `rows` candidates (`index.build.length_batches`): one batch each."""
    t0 = time.perf_counter()
    seen = set()
    for _, b in build_lib.length_batches(run, 0, rows, fn.vec_cfg.batch_size):
        if b["tokens"].shape[1] not in seen:
            seen.add(b["tokens"].shape[1])
            jax.block_until_ready(fn.jitted(run.params, fn.precond, {k: b[k] for k in ("tokens", "loss_mask")}))
    return time.perf_counter() - t0


def _timed(run, fn, rows: int) -> tuple[float, np.ndarray]:
    counters = {"tokens": 0, "truncated": 0}
    t0 = time.perf_counter()
    out = np.asarray(jax.block_until_ready(build_lib.make_rows_fn(run, fn, counters)(0, rows)))
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", required=True, help="a run (trained or imported) with an optimizer state")
    ap.add_argument("--rows", type=int, default=512)
    args = ap.parse_args()
    settings = config_lib.load_run_settings(args.workdir)
    run = stages.load_run(args.workdir, runtime=settings)
    rows = min(args.rows, len(run.corpus.texts))
    on = dataclasses.replace(settings.vectors, correction=True, output_fn="loss")
    off = dataclasses.replace(on, correction=False)
    trak = dataclasses.replace(off, output_fn="trak")
    make = lambda vc, comp=(): vectors_lib.make_vector_fn(  # noqa: E731
        run.graphdef, run.model_cfg, vc, run.params, run.opt_state, role="index", companions=comp
    )
    out = {"workdir": str(args.workdir), "rows": rows, "d": on.dim, "batch_size": on.batch_size}
    vecs = {}
    passes = (("on", make(on)), ("off", make(off)), ("trak", make(trak)))
    passes += (("shared2", make(on, (off,))), ("shared3", make(trak, (on, off))))
    for name, fn in passes:
        out[f"{name}_compile_seconds"] = round(_warm(run, fn, rows), 1)
        out[f"{name}_seconds"], vecs[name] = _timed(run, fn, rows)
    out["speedup"] = (out["on_seconds"] + out["off_seconds"]) / out["shared2_seconds"]
    out["speedup_trak"] = (out["trak_seconds"] + out["shared2_seconds"]) / out["shared3_seconds"]
    out["speedup_all"] = (out["on_seconds"] + out["off_seconds"] + out["trak_seconds"]) / out["shared3_seconds"]
    out["examples_per_s_shared3"] = rows / out["shared3_seconds"]
    # the shared passes' rows are each setting's own (to float32 round-off)
    fns = dict(passes)
    for shared, names in (("shared2", ("on", "off")), ("shared3", ("trak", "on", "off"))):
        for name, part in zip(names, fns[shared].split(vecs[shared])):
            ref = vecs[name]
            out[f"max_rel_diff_{shared}_{name}"] = float(np.abs(part - ref).max() / np.abs(ref).max())
    dev = jax.devices()[0]
    out["device"] = f"{dev.platform}:{dev.device_kind} x{jax.device_count()}"
    out["loadavg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}), flush=True)


if __name__ == "__main__":
    main()
