"""The paper's Figure 2 (left, centre) on a finished evaluation: a gradient row's MRR, recall@10
and tail-patch@10 against the projection dimension d, with the exact rerank as the d -> ∞
reference.

For each d of `--dims` (d = 2 * vectors.num_blocks * k^2, so k = vectors.proj_dim follows from
it) the row (default TrackStar) is retrieved again on an index of its own (`<index.dir>_d<d>`,
reused on a rerun), every new d's index written in one featurize pass (`vectors.shared_pass_error`:
settings that differ only in k share the forward and backward); the evaluation's own d reads its
top-10 lists (`eval/retrievals/<row>.jsonl`). Everything else is the evaluation's (V, R_train
from each index's own rows, R_eval and the automatic λ per d, the queries, the tail-patched
subset), so the points differ only in d. Tail-patch pairs come from the run's pair cache
(`pair_cache`): the lists of the d's share most of their proponents, so only the new pairs run.

With `--rerank`, the reference point: the row's `trackstar_rerank` (its top 100 at the
evaluation's d rescored by the exact unprojected corrected-gradient cosine, `retrieval.rerank`;
no R), ~1 h of 135M exact gradients on Run A.

    python tools/figure2.py runs/smollm2_table1 [--dims=1024,4096,16384] [--rerank]
        [--max_queries=150] [--row=trackstar] [--markdown]

Each point is appended to `<eval>/figure2_points.jsonl` as it finishes (a d measured twice: its
last line counts), with its wall seconds; `<eval>/figure2.png` is drawn from the file
(`evaluation.plots.dims_plot`); `--markdown` prints the measured points as docs/results.md's
table and runs nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import time
from typing import Any, Sequence

POINTS_FILE = "figure2_points.jsonl"
METRICS = ("mrr", "recall_at_10", "tailpatch_at_10")
REFERENCE_ROW = "trackstar_rerank"


def proj_dim_for(d: int, num_blocks: int) -> int:
    """k such that d = 2 * num_blocks * k^2 (`projection.layout`).

    Raises:
      ValueError: no such integer k (names the nearest d's that have one).
    """
    k = math.isqrt(max(d // (2 * num_blocks), 0))
    if k < 1 or 2 * num_blocks * k * k != d:
        near = sorted({2 * num_blocks * j * j for j in (max(k, 1), k + 1)})
        raise ValueError(
            f"d = {d} is not 2 * vectors.num_blocks * k^2 with num_blocks = {num_blocks} (nearest: {near})"
        )
    return k


def _plain(x: Any) -> Any:
    """JSON for what the records hold beyond JSON's types (numpy scalars and arrays)."""
    return x.tolist() if hasattr(x, "tolist") else str(x)


def _point(eq, retrieved, deltas, settings, method, **extra) -> dict:
    from trackstar_jax.evaluation import metrics as metrics_lib
    from trackstar_jax.evaluation import report as report_lib

    recs = report_lib.query_records(eq, retrieved, deltas, settings.tailpatch.top_ks, method)
    return {**extra, **metrics_lib.summarize(recs, METRICS, seed=settings.eval.bootstrap_seed)}


def report(
    workdir: pathlib.Path,
    dims: Sequence[int],
    max_queries: int,
    row: str = "trackstar",
    rerank: bool = False,
) -> dict:
    from trackstar_jax import files, stages
    from trackstar_jax import methods as methods_lib
    from trackstar_jax.evaluation import plots as plots_lib
    from trackstar_jax.evaluation import report as report_lib
    from trackstar_jax.evaluation import rows as rows_lib
    from trackstar_jax.evaluation import stage as stage_lib
    from trackstar_jax.index import build as build_lib

    rows_run = (row, REFERENCE_ROW) if rerank else (row,)
    ev = stages.reopen(workdir, {"tailpatch.methods": rows_run, "tailpatch.max_queries": max_queries})
    settings, run, mesh, eq = ev.settings, ev.loaded.run, ev.loaded.mesh, ev.eq
    method = methods_lib.method(row)
    if method.kind != "gradient":
        raise ValueError(f"--row={row}: not a gradient row (d applies to gradient rows only)")
    own_d = settings.vectors.dim
    ks = {d: proj_dim_for(d, settings.vectors.num_blocks) for d in dims}  # refuses a bad d before any work
    per_d = {
        d: settings.replace({"vectors.proj_dim": k, "index.dir": f"{settings.index.dir}_d{d}"})
        for d, k in ks.items()
        if d != own_d
    }
    points_file = ev.eval_dir / POINTS_FILE
    table = json.loads((ev.eval_dir / "table.json").read_text(encoding="utf-8"))

    def keep(point: dict) -> dict:
        point["loadavg_1m"] = round(os.getloadavg()[0], 2)
        with points_file.open("a", encoding="utf-8") as f:  # each point as it finishes
            f.write(json.dumps(point, default=_plain) + "\n")
        return point

    t0 = time.perf_counter()
    new = [rows_lib.method_settings(s, method) for s in per_d.values()]
    built = None  # the pass's build summary (the first new index's; `shared_pass` names the others)
    if new:  # every new d's index in one featurize pass (finished ones are reused)
        first, *rest = new
        build_lib.build_from_run(
            run,
            first.vectors,
            first.index,
            workdir,
            mesh_shape=settings.mesh.shape,
            mesh=mesh,
            companions=[(s.vectors, s.index) for s in rest],
        )  # a reused index keeps the summary of the pass that built it
        built = files.read_json(build_lib.index_dir(first.index, workdir) / "build_summary-p0000.json")
    build_seconds = time.perf_counter() - t0
    points = []
    for d in sorted(ks):
        t0 = time.perf_counter()
        if d == own_d:
            got = report_lib.read_retrievals(ev.eval_dir / "retrievals" / f"{row}.jsonl", len(eq.queries))
            scoring = next((r.get("scoring") or {} for r in table["rows"] if r["method"] == row), {})
            info = {"source": "the evaluation's own lists", "whitening": scoring.get("whitening")}
        else:
            ctx = rows_lib.Context(per_d[d], workdir, run, mesh)
            got = rows_lib.make_retriever(method, ctx).retrieve(eq, settings.eval.num_proponents)
            info = {k: got.info.get(k) for k in ("index", "whitening", "statistics")}
        t1 = time.perf_counter()
        deltas = stage_lib.tailpatch_all(run, eq, {row: got}, settings, mesh, workdir)
        t2 = time.perf_counter()
        points.append(
            keep(
                _point(
                    eq, got, deltas, settings, method, row=row, d=d, proj_dim=ks[d], info=info,
                    retrieve_seconds=round(t1 - t0, 1), tailpatch_seconds=round(t2 - t1, 1),
                )
            )
        )  # fmt: skip
    if rerank:
        ref = methods_lib.method(REFERENCE_ROW)
        t0 = time.perf_counter()
        got = rows_lib.make_retriever(ref, rows_lib.Context(settings, workdir, run, mesh)).retrieve(
            eq, settings.eval.num_proponents
        )
        t1 = time.perf_counter()
        deltas = stage_lib.tailpatch_all(run, eq, {REFERENCE_ROW: got}, settings, mesh, workdir)
        points.append(
            keep(
                _point(
                    eq, got, deltas, settings, ref, row=REFERENCE_ROW, d=own_d, reference=True,
                    label=ref.label, retrieve_seconds=round(t1 - t0, 1),
                    tailpatch_seconds=round(time.perf_counter() - t1, 1),
                )
            )
        )  # fmt: skip
    plots_lib.dims_plot(points, ev.eval_dir / "figure2.png")
    return {
        "workdir": str(workdir),
        "row": row,
        "evaluation_d": own_d,
        "new_indices_seconds": round(build_seconds, 1),
        "new_indices": None
        if built is None
        else {k: built[k] for k in ("index", "dim", "rows_written", "seconds", "shared_pass", "complete")},
        "num_queries": len(eq.queries),
        "tailpatched_queries": points[0]["tailpatch_at_10_n"] if points else 0,
        "points": points,
    }


def read_points(points_file: pathlib.Path) -> list[dict]:
    """The points of `points_file`, one per (row, d, reference): a point measured twice, its last line."""
    with points_file.open(encoding="utf-8") as f:
        got = {(p["row"], p["d"], bool(p.get("reference"))): p for p in map(json.loads, f) if p}
    return sorted(got.values(), key=lambda p: (bool(p.get("reference")), p["d"]))


def markdown(points: Sequence[dict]) -> str:
    """`points` as docs/results.md's table: each metric's mean [95% interval] (tail-patch in
    percentage points), the λ and the retrieval's wall seconds."""

    def cell(p: dict, m: str) -> str:
        s = 100.0 if m.startswith("tailpatch") else 1.0
        lo, hi = p.get(m + "_ci") or [None, None]
        if p.get(m) is None:
            return "–"
        ci = "" if lo is None else f" [{s * lo:.3f}, {s * hi:.3f}]"
        return f"{s * p[m]:.3f}{ci}"

    head = ["row", "d", "MRR", "recall@10", "tail-patch@10 (%)", "λ", "retrieve + tail-patch (s)"]
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for p in points:
        lam = ((p.get("info") or {}).get("whitening") or {}).get("mix_lambda")
        what = "exact rerank (d → ∞)" if p.get("reference") else f"{p['d']:,}"
        secs = f"{p.get('retrieve_seconds', 0):.0f} + {p.get('tailpatch_seconds', 0):.0f}"
        lam_s = "–" if lam is None else f"{lam:.3f}"
        out.append("| " + " | ".join([p["row"], what, *(cell(p, m) for m in METRICS), lam_s, secs]) + " |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("workdir", type=pathlib.Path)
    ap.add_argument("--dims", default="1024,4096,16384", help="projection dimensions d, comma-separated")
    ap.add_argument("--row", default="trackstar", help="the gradient row swept over d")
    ap.add_argument("--rerank", action="store_true", help="also the exact rerank of the top 100 (d -> ∞)")
    ap.add_argument("--max_queries", type=int, default=150, help="tail-patched queries (tailpatch.max_queries)")
    ap.add_argument("--markdown", action="store_true", help="print the measured points as a table and exit")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown(read_points(args.workdir / "eval" / POINTS_FILE)))
        return
    from trackstar_jax.distributed import runtime

    runtime.enable_compilation_cache()  # the tail-patch step's shapes compile once across reruns
    dims = [int(x) for x in args.dims.split(",") if x]
    print(json.dumps(report(args.workdir, dims, args.max_queries, args.row, args.rerank), indent=1, default=_plain))


if __name__ == "__main__":
    main()
