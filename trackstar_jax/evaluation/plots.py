"""PNG pictures of an evaluation, written beside `table.md` (matplotlib, Agg backend).

* `rows.png`: every row's MRR, recall@10 and tail-patch@10 with their 95% bootstrap intervals
  (Table 1 as bars; the gold row has tail-patch only).
* `lambda.png`: TrackStar over the mixing weight λ (rows `trackstar` = automatic λ, and the
  fixed-λ rows `trackstar_l050` / `_l090` / `_l099`): MRR and tail-patch@10 (§A.1.3).
* `checkpoints.png`: TrackStar's MRR and tail-patch@10 at each of
  `tailpatch.checkpoint_steps` (the paper's Figure 2 right).
* `dims_plot` (not from a table: tools/figure2.py's points): MRR and tail-patch@10 against the
  projection dimension d (the paper's Figure 2 left, centre).

A picture whose data the table lacks is not written. Returns the file names written.
"""

from __future__ import annotations

import io
import math
import pathlib
from typing import Any, Mapping

from trackstar_jax import files

METRICS = (("mrr", "MRR", 1.0), ("recall_at_10", "recall@10", 1.0), ("tailpatch_at_10", "tail-patch@10 (%)", 100.0))


def _pyplot():
    try:
        import matplotlib  # noqa: PLC0415  (only the report needs it)
    except ImportError as e:
        raise ImportError("the evaluation's pictures need matplotlib: pip install 'matplotlib>=3.7'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def _val(row: Mapping[str, Any], name: str, scale: float) -> tuple[float, float, float] | None:
    v = row.get(name)
    if v is None or not math.isfinite(v):
        return None
    lo, hi = (row.get(name + "_ci") or [None, None])[:2]
    lo = v if lo is None else lo
    hi = v if hi is None else hi
    return v * scale, (v - lo) * scale, (hi - v) * scale


def _save(fig, path: pathlib.Path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    files.atomic_write(path, buf.getvalue())


def _bars(plt, ax, labels, vals, title):
    xs = [i for i, v in enumerate(vals) if v is not None]
    ax.bar(
        xs,
        [vals[i][0] for i in xs],
        yerr=[[vals[i][1] for i in xs], [vals[i][2] for i in xs]],
        capsize=3,
        color="#4c72b0",
    )
    ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.axhline(0, color="black", linewidth=0.5)


def rows_plot(table: Mapping[str, Any], path: pathlib.Path) -> bool:
    rows = table.get("rows") or []
    if not rows:
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(METRICS), figsize=(4.2 * len(METRICS), 3.8))
    labels = [r.get("label", r["method"]) for r in rows]
    for ax, (name, title, scale) in zip(axes, METRICS):
        _bars(plt, ax, labels, [_val(r, name, scale) for r in rows], title)
    fig.suptitle(f"{table.get('num_queries', '?')} queries, 95% bootstrap intervals", fontsize=10)
    _save(fig, path)
    plt.close(fig)
    return True


LAMBDA_ROWS = {"trackstar_l050": 0.5, "trackstar_l090": 0.9, "trackstar_l099": 0.99}


def lambda_plot(table: Mapping[str, Any], path: pathlib.Path) -> bool:
    points = []
    for r in table.get("rows") or []:
        lam = LAMBDA_ROWS.get(r["method"])
        auto = r["method"] == "trackstar"
        if auto:
            lam = ((r.get("scoring") or {}).get("whitening") or {}).get("mix_lambda")
        if lam is not None:
            points.append((float(lam), auto, r))
    if len(points) < 2:
        return False
    plt = _pyplot()
    points.sort(key=lambda p: p[0])
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.4))
    for ax, (name, title, scale) in zip(axes, (METRICS[0], METRICS[2])):
        for lam, auto, r in points:
            v = _val(r, name, scale)
            if v is None:
                continue
            ax.errorbar(
                [lam],
                [v[0]],
                yerr=[[v[1]], [v[2]]],
                fmt="*" if auto else "o",
                capsize=3,
                color="#c44e52" if auto else "#4c72b0",
                label=f"auto λ = {lam:.3f}" if auto else None,
            )
        ax.set_xlabel("λ (mixed R = λ R_eval + (1-λ) R_train)")
        ax.set_title(title, fontsize=10)
        if any(a for _, a, _ in points):
            ax.legend(fontsize=8)
    _save(fig, path)
    plt.close(fig)
    return True


def _metric_panels(axes, pts: list[Mapping[str, Any]], x_key: str):
    """MRR and tail-patch@10 of `pts` against `p[x_key]`, a line with error bars per panel of
    `axes` (points without the metric left out); yields `(ax, name, title, scale)` for the
    caller's labels."""
    for ax, (name, title, scale) in zip(axes, (METRICS[0], METRICS[2])):
        got = [(p[x_key], _val(p, name, scale)) for p in pts]
        got = [(x, v) for x, v in got if v is not None]
        if got:
            ax.errorbar(
                [x for x, _ in got],
                [v[0] for _, v in got],
                yerr=[[v[1] for _, v in got], [v[2] for _, v in got]],
                fmt="o-",
                capsize=3,
            )
        yield ax, name, title, scale


def checkpoints_plot(table: Mapping[str, Any], path: pathlib.Path) -> bool:
    pts = table.get("checkpoints") or []
    if not pts:
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.4))
    for ax, _, title, _ in _metric_panels(axes, pts, "step"):
        ax.set_xlabel("training step")
        ax.set_title(f"TrackStar {title}", fontsize=10)
    _save(fig, path)
    plt.close(fig)
    return True


def dims_plot(points: list[Mapping[str, Any]], path: pathlib.Path) -> bool:
    """The paper's Figure 2 (left, centre): a row's MRR and tail-patch@10 against the projection
    dimension d (`points`: `{"d", <metric>, <metric>_ci}` each, tools/figure2.py), a point with
    `"reference"` (the exact rerank, d -> ∞) as a dashed line with its interval shaded."""
    pts = sorted((p for p in points if not p.get("reference")), key=lambda p: p["d"])
    refs = [p for p in points if p.get("reference")]
    if not pts:
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.4))
    for ax, name, title, scale in _metric_panels(axes, pts, "d"):
        for r in refs:
            v = _val(r, name, scale)
            if v is not None:
                ax.axhline(v[0], color="#c44e52", linestyle="--", linewidth=1, label=r.get("label", "exact"))
                ax.axhspan(v[0] - v[1], v[0] + v[2], color="#c44e52", alpha=0.1)
                ax.legend(fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("projection dimension d")
        ax.set_title(title, fontsize=10)
    _save(fig, path)
    plt.close(fig)
    return True


PLOTS = {"rows.png": rows_plot, "lambda.png": lambda_plot, "checkpoints.png": checkpoints_plot}


def write_plots(table: Mapping[str, Any], out_dir: str | pathlib.Path) -> list[str]:
    """Writes every picture the table has data for into `out_dir`; returns their file names."""
    out_dir = pathlib.Path(out_dir)
    return [name for name, fn in PLOTS.items() if fn(table, out_dir / name)]
