"""Which V sets the sign of the optimizer correction's tail-patch effect (issue 57's 2 x 2).

On a finished evaluation of an imported model (Run A: V estimated per example at import), this
re-measures tail-patch@10 of Exp. 2-5 and TrackStar in four cells, V used for scoring ×
V used by the tail-patch step, each in {`per_example` (the import's V), `minibatch` (V as
Adafactor holds it, `training.second_moment`, estimated here from `--source`)}, plus one arm
with the embedding update frozen in the step (scoring and step V: the import's). It prints one
JSON object with every cell's mean tail-patch@10 per row, the correction's paired bootstrap
differences (Exp. 4 − Exp. 2, Exp. 5 − Exp. 3; `evaluation.claims.paired_difference`) per
cell, and `sign_set_by`: which factor, changed with the other held, flips the sign of the
mean difference (`sign_factor`).

- Scoring V: the uncorrected rows (Exp. 2, 3) do not depend on it; Exp. 4, 5 and TrackStar are
  re-retrieved with the minibatch V on their own indices (`<index.dir>_vmb...`, reused on a
  rerun); the per-example cells read the evaluation's own top-10 lists
  (`eval/retrievals/<row>.jsonl`).
- Step V: the tail-patch step (`evaluation.stage.tailpatch_all`, the evaluation's own settings)
  runs from the run with that V in its optimizer state; every pair is cached under the run's
  workdir (`pair_cache`, keyed on V's fingerprint), so a rerun resumes.
- Frozen embedding: the step's V of the embedding (`--freeze`, default `embed`, the token embedding, tied to the output in SmolLM2) is
  multiplied by 1e30 (`frozen_state`): Adafactor's update of that tensor is scaled by 1e-15
  (below float32 resolution of any weight), every other tensor's update is unchanged (clipping
  and parameter scaling act per tensor).

    python tools/v_2x2.py runs/smollm2_table1 [--source=lama:P108,...] [--batch_sequences=64]
        [--steps=16] [--max_queries=150] [--freeze=embed] [--markdown]

Each cell is appended to `<workdir>/eval/v_2x2_cells.jsonl` as it finishes, cheapest first
(the evaluation's own cell, the scoring V changed, the step V changed, both, the frozen arm), so a
run stopped part way keeps what it measured and a rerun computes only the missing pairs; the
minibatch V is kept at `eval/v_minibatch.npz` (`saved_estimate`) and the step's compiled shapes
in JAX's persistent cache, so a rerun starts in minutes. `--markdown` prints the cells measured so
far as docs/results.md's table (`markdown`) and runs nothing.

The queries are rebuilt from the run (`query_set.make_eval_queries`, deterministic; checked
against `eval/queries.jsonl`). Sizing for a 2-core machine: BUILD_NOTES §15.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
from typing import Any, Mapping, Sequence

import numpy as np

from experiments.smollm2_table1 import TWO_BY_TWO_ROWS as ROWS  # the `:2x2` variant evaluates them

CORRECTED = ("exp4", "exp5", "trackstar")  # the rows whose scores depend on V
CONTRASTS = (("exp4", "exp2"), ("exp5", "exp3"))  # the correction, one setting apart (Table 1)
V_KINDS = ("per_example", "minibatch")
FREEZE_SCALE = 1e30


def frozen_state(opt_state: Any, paths: Sequence[str]) -> Any:
    """`opt_state` with the Adafactor V of `paths` (their `v_col` and full `v`; `v_row` enters
    the update only through its mean-normalised shape) times `FREEZE_SCALE`: the step's update
    of those tensors becomes ~1e-15 of what it was, the others' stay exactly as they were.

    Raises:
      ValueError: a path has no Adafactor second moment in `opt_state`.
    """
    import jax

    from trackstar_jax.models import layers as layers_lib

    found: set[str] = set()

    def scale(key_path, leaf):
        segs = layers_lib.param_path_str(key_path).split("/")
        for field in ("v_col", "v"):
            if field in segs:
                rest = "/".join(segs[segs.index(field) + 1 :])
                if rest in paths and getattr(leaf, "size", 0) > 1:
                    found.add(rest)
                    return leaf * FREEZE_SCALE
        return leaf

    out = jax.tree_util.tree_map_with_path(scale, opt_state)
    missing = sorted(set(paths) - found)
    if missing:
        raise ValueError(f"--freeze: no Adafactor v_col / v for {missing} in the optimizer state")
    return out


def sign_factor(cells: Mapping[tuple[str, str], float]) -> str:
    """Given the mean difference per (scoring V, step V) cell, the factor whose change flips
    its sign with the other factor held at either value: "scoring", "step", "both" (each flips
    it somewhere), or "neither" (one sign in every cell). With cells missing (a run stopped
    part way) only the comparisons whose two cells exist count, and "(partial)" is appended."""
    sgn = {k: np.sign(v) for k, v in cells.items()}
    a, b = V_KINDS

    def flips(pairs) -> bool:
        return any(sgn[x] != sgn[y] for x, y in pairs if x in sgn and y in sgn)

    scoring = flips(((a, s), (b, s)) for s in V_KINDS)
    step = flips(((s, a), (s, b)) for s in V_KINDS)
    out = "both" if scoring and step else "scoring" if scoring else "step" if step else "neither"
    return out if len(sgn) == len(V_KINDS) ** 2 else out + " (partial)"


def saved_estimate(stem: pathlib.Path, settings: Mapping[str, Any], like: Any, estimate) -> tuple[Any, dict]:
    """`estimate()` (`(optimizer state, record)`), kept at `<stem>.npz` / `<stem>.json` and read
    back on a rerun whose V settings (`settings`, e.g. `second_moment.settings_record`) are the
    record's and whose leaves have `like`'s tree and shapes (the minibatch V of a 135M model
    takes ~12 min on 2 cores); otherwise estimated again and the files replaced."""
    import jax

    leaves_like, treedef = jax.tree.flatten(like)
    npz, meta = stem.with_suffix(".npz"), stem.with_suffix(".json")
    want = json.loads(json.dumps(dict(settings)))
    if npz.exists() and meta.exists():
        rec = json.loads(meta.read_text(encoding="utf-8"))
        with np.load(npz) as z:
            leaves = [z[f"l{i}"] for i in range(len(z.files))]
        same = {k: rec.get(k) for k in want} == want and len(leaves) == len(leaves_like)
        if same and all(np.shape(a) == np.shape(b) for a, b in zip(leaves, leaves_like)):
            return jax.tree.unflatten(treedef, [jax.numpy.asarray(x) for x in leaves]), rec
    state, rec = estimate()
    if jax.tree.structure(state) == treedef:  # else not kept (read back into `like`'s tree)
        tmp = stem.with_suffix(".tmp.npz")
        np.savez(tmp, **{f"l{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(state))})
        tmp.replace(npz)
        meta.write_text(json.dumps(rec), encoding="utf-8")
    return state, rec


def report(
    workdir: pathlib.Path,
    vec_overrides: Mapping[str, Any],
    max_queries: int,
    freeze: Sequence[str],
    rows: Sequence[str] = ROWS,
) -> dict:
    from trackstar_jax import methods as methods_lib
    from trackstar_jax import stages
    from trackstar_jax.evaluation import claims, metrics
    from trackstar_jax.evaluation import report as report_lib
    from trackstar_jax.evaluation import rows as rows_lib
    from trackstar_jax.evaluation import stage as stage_lib
    from trackstar_jax.training import second_moment as sm_lib
    from trackstar_jax.training import step as step_lib

    ev = stages.reopen(workdir, {"tailpatch.methods": tuple(rows), "tailpatch.max_queries": max_queries})
    settings, run, mesh, eq = ev.settings, ev.loaded.run, ev.loaded.mesh, ev.eq
    corrected = [r for r in rows if r in CORRECTED]
    contrasts = [(a, b) for a, b in CONTRASTS if a in rows and b in rows]

    vec = dataclasses.replace(settings.vectors, estimate_v_method="minibatch", **vec_overrides)
    opt_cfg = settings.train.optimizer
    v_mb, rec = saved_estimate(
        workdir / "eval" / "v_minibatch",
        sm_lib.settings_record(vec),
        run.opt_state,
        lambda: sm_lib.estimate(
            vec, run.graphdef, run.params, step_lib.make_optimizer(opt_cfg), opt_cfg, run.corpus, settings.data,
            run.tokenizer, run.model_cfg.max_len,
        ),
    )  # fmt: skip
    runs = {"per_example": run, "minibatch": dataclasses.replace(run, opt_state=v_mb, opt_state_info=rec)}

    retrieved = {
        "per_example": {
            r: report_lib.read_retrievals(ev.eval_dir / "retrievals" / f"{r}.jsonl", len(eq.queries)) for r in rows
        }
    }
    ctx = rows_lib.Context(
        settings.replace({"index.dir": settings.index.dir + "_vmb"}), workdir, runs["minibatch"], mesh
    )
    retrievers = rows_lib.make_retrievers([methods_lib.method(r) for r in corrected], ctx)
    retrieved["minibatch"] = {
        **{r: retrieved["per_example"][r] for r in rows if r not in corrected},
        **{r: retrievers[r].retrieve(eq, settings.eval.num_proponents) for r in corrected},
    }

    def per_query(ret: Mapping[str, Any], deltas: Mapping) -> dict[str, np.ndarray]:
        out = {}
        for r in rows:
            recs = report_lib.query_records(eq, ret[r], deltas, settings.tailpatch.top_ks, methods_lib.method(r))
            out[r] = np.asarray([x.get("tailpatch_at_10", np.nan) for x in recs], np.float64)
        return out

    cells: dict[str, dict] = {}
    values: dict[str, dict[str, np.ndarray]] = {}
    # Cheapest first, so a run stopped part way has the most comparisons: the evaluation's own
    # cell (its pairs cached), the scoring V changed (only the corrected rows' lists are new),
    # the step V changed (every pair new), both, then the frozen embedding.
    arms = [(s, t, False) for t in V_KINDS for s in V_KINDS] + (
        [("per_example", "per_example", True)] if freeze else []
    )
    cells_file = workdir / "eval" / "v_2x2_cells.jsonl"
    for scoring, step, frozen in arms:
        step_run = runs[step]
        if frozen:
            step_run = dataclasses.replace(step_run, opt_state=frozen_state(step_run.opt_state, freeze))
        deltas = stage_lib.tailpatch_all(step_run, eq, retrieved[scoring], settings, mesh, workdir)
        name = f"scoring={scoring}, step={step}" + (f", frozen={','.join(freeze)}" if frozen else "")
        values[name] = per_query(retrieved[scoring], deltas)
        cells[name] = {"tailpatch_at_10": {r: float(np.nanmean(v)) for r, v in values[name].items()}}
        for a, b in contrasts:
            x, y = values[name][a], values[name][b]
            ok = np.isfinite(x) & np.isfinite(y)
            ci = claims.paired_difference(x[ok], y[ok], seed=settings.eval.bootstrap_seed)
            cells[name][f"{a} - {b}"] = {"mean": ci.mean, "ci": [ci.lo, ci.hi], "n": ci.n}
        with cells_file.open("a", encoding="utf-8") as f:  # each cell as it finishes: a stopped run keeps it
            f.write(
                json.dumps(
                    {"cell": name, "minibatch_v": {k: v for k, v in rec.items() if k != "seconds"}, **cells[name]}
                )
                + "\n"
            )
    signs = {}
    for a, b in contrasts:
        per_cell = {(s, t): cells[f"scoring={s}, step={t}"][f"{a} - {b}"]["mean"] for s in V_KINDS for t in V_KINDS}  # fmt: skip
        signs[f"{a} - {b}"] = {
            "sign_set_by": sign_factor(per_cell),
            "means": {f"scoring={s}, step={t}": m for (s, t), m in per_cell.items()},
        }
    return {
        "workdir": str(workdir),
        "minibatch_v": {k: v for k, v in rec.items() if k != "seconds"},
        "per_example_v": run.opt_state_info,
        "num_queries": len(eq.queries),
        "tailpatched_queries": int(np.sum(np.isfinite(values[next(iter(values))][rows[0]]))),
        "cells": cells,
        "sign": signs,
        "metric": f"tail-patch@10 ({metrics.__name__}.tailpatch_at_k), paired bootstrap over queries",
    }


def markdown(cells_file: pathlib.Path, rows: Sequence[str] = ROWS) -> str:
    """The cells of `cells_file` (`eval/v_2x2_cells.jsonl`; a cell measured twice: its last line)
    as docs/results.md's table: tail-patch@10 per row and the correction's paired differences
    with their 95% intervals, in percentage points; a cell not in the file says so."""
    with cells_file.open(encoding="utf-8") as f:
        got = {c["cell"]: c for c in map(json.loads, f) if c}
    names = {"per_example": "per example", "minibatch": "minibatch"}
    contrasts = [(a, b) for a, b in CONTRASTS if a in rows and b in rows]
    head = [
        "scoring V",
        "step V",
        *(methods_title(r) for r in rows),
        *(f"{methods_title(a)} − {methods_title(b)}" for a, b in contrasts),
    ]
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]

    def pp(x: float) -> str:
        return f"{100 * x:+.3f}".replace("-", "−")

    arms = [(s, t, False) for t in V_KINDS for s in V_KINDS] + [("per_example", "per_example", True)]
    for s, t, frozen in arms:
        name = f"scoring={s}, step={t}"
        match = [c for n, c in got.items() if (n.startswith(name + ", frozen=") if frozen else n == name)]
        if frozen and not match:
            break  # no frozen arm in the file: the 2 x 2 alone
        cell = match[-1] if match else None
        step = names[t] + (f", {cell['cell'].split('frozen=')[1]} frozen" if frozen else "")
        if cell is None:
            out.append(f"| {names[s]} | {step} | not measured |" + " |" * (len(head) - 3))
            continue
        vals = [pp(cell["tailpatch_at_10"][r]) for r in rows]
        diffs = []
        for a, b in contrasts:
            d = cell[f"{a} - {b}"]
            diffs.append(f"{pp(d['mean'])} [{pp(d['ci'][0])}, {pp(d['ci'][1])}] (n = {d['n']})")
        out.append("| " + " | ".join([names[s], step, *vals, *diffs]) + " |")
    return "\n".join(out)


def methods_title(row: str) -> str:
    """The row's Table 1 label (`methods.method(row).label`) without its gloss: "Exp. 2", "TrackStar"."""
    from trackstar_jax import methods as methods_lib

    return methods_lib.method(row).label.split(" (")[0]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("workdir", type=pathlib.Path)
    ap.add_argument("--source", default="", help="vectors.estimate_v_source of the minibatch V (default: the config's)")
    ap.add_argument("--batch_sequences", type=int, default=0, help="B (default: the config's)")
    ap.add_argument("--steps", type=int, default=0, help="N (default: the config's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max_queries", type=int, default=150, help="tail-patched queries (tailpatch.max_queries)")
    ap.add_argument("--freeze", default="embed", help="parameters frozen in the extra arm ('' = no arm)")
    ap.add_argument("--rows", default=",".join(ROWS), help="rows re-measured (with retrieval files in eval/)")
    ap.add_argument("--markdown", action="store_true", help="print the measured cells as a table and exit")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown(args.workdir / "eval" / "v_2x2_cells.jsonl", [r for r in args.rows.split(",") if r]))
        return
    from trackstar_jax.distributed import runtime

    runtime.enable_compilation_cache()  # one compile per step shape across the cells (and reruns)
    over: dict[str, Any] = {"estimate_v_seed": args.seed}
    if args.source:
        over["estimate_v_source"] = args.source
    if args.batch_sequences:
        over["estimate_v_batch_sequences"] = args.batch_sequences
    if args.steps:
        over["estimate_v_steps"] = args.steps
    freeze = [p for p in args.freeze.split(",") if p]
    rows = [r for r in args.rows.split(",") if r]
    print(json.dumps(report(args.workdir, over, args.max_queries, freeze, rows), indent=1))


if __name__ == "__main__":
    main()
