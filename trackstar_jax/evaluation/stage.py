"""Stage 4's work (`evaluate_run`; the stage is `stages.evaluate`): the fact-tracing table
(§4-5, Table 1 / A.1 / A.2) for every row of `config.eval.methods`.

Steps, each a function below: build the query set from the run's facts
(`query_set.make_eval_queries`), retrieve proponents per row (`rows.make_retrievers`: T-REx
gold, BM25, dense embeddings, gradient indices built or reused under
`workdir/<index.dir>[_<output_fn>_<corr|nocorr>]`), tail-patch every distinct (query, top-k
proponent) pair from the final checkpoint (`tailpatch_all`), and write the outputs
(`report.py`) to `report.eval_dir(settings, workdir)`: `queries.jsonl`,
`query_report.json`, `retrievals/<method>.jsonl`, `table.json`, `table.md`.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import jax
import numpy as np
from absl import logging

from trackstar_jax import data as data_lib
from trackstar_jax import files
from trackstar_jax.data import templates as templates_lib
from trackstar_jax.distributed import memory as memory_lib
from trackstar_jax.distributed import multihost
from trackstar_jax.distributed import sharding as sharding_lib
from trackstar_jax.evaluation import baselines as baselines_lib
from trackstar_jax.evaluation import claims as claims_lib
from trackstar_jax.evaluation import metrics as metrics_lib
from trackstar_jax.evaluation import pair_cache, query_set, report
from trackstar_jax.evaluation import plots as plots_lib
from trackstar_jax.evaluation import queries as queries_lib
from trackstar_jax.evaluation import rows as rows_lib
from trackstar_jax.evaluation import settings as settings_lib
from trackstar_jax.evaluation import tailpatch as tailpatch_lib
from trackstar_jax.models import lm as model_lib
from trackstar_jax.training import checkpoint as checkpoint_lib
from trackstar_jax.training import logs
from trackstar_jax.training import step as step_lib


def check_methods(settings: settings_lib.TableSettings) -> list[baselines_lib.Method]:
    """The table's rows, refused before any work: an unknown name, a row whose kind cannot run on
    this machine (`rows.RowKind.unavailable`: the dense row without its model) unless the row is
    in `eval.optional_methods`, then left out with a logged warning.

    Raises:
      ImportError: a row asked for that cannot run here (names it and how to install what it needs).
    """
    methods = [baselines_lib.method(n) for n in settings.eval.methods]  # raises naming an unknown row
    for n in settings.eval.optional_methods:
        baselines_lib.method(n)
    keep = []
    for m in methods:
        why = rows_lib.row_kind(m.kind).unavailable()
        if why is None:
            keep.append(m)
        elif m.name in settings.eval.optional_methods:
            logging.warning("eval: skipping the optional row %s: %s", m.name, why)
        else:
            raise ImportError(f"eval: row {m.name!r} cannot run here: {why}")
    return keep


def accuracy_by_relation(eq: query_set.EvalQueries) -> dict[str, dict]:
    """`{relation: {"n", "correct", "accuracy"}}` of the model's greedy answers to the queries (§4.2)."""
    out: dict[str, dict] = {}
    for q, ok in zip(eq.queries, eq.correct):
        r = out.setdefault(q.relation, {"n": 0, "correct": 0})
        r["n"] += 1
        r["correct"] += int(ok)
    return {k: {**v, "accuracy": v["correct"] / v["n"]} for k, v in sorted(out.items())}


def tailpatch_order(settings: settings_lib.TableSettings, num_queries: int) -> list[int]:
    """The seeded order in which queries are tail-patched: the subset of `n` queries is the
    first `n` of it, so a smaller `tailpatch.max_queries` reuses the cached pairs of a larger one."""
    return [int(i) for i in np.random.default_rng(settings.eval.bootstrap_seed + 17).permutation(num_queries)]


def tailpatch_queries(settings: settings_lib.TableSettings, num_queries: int) -> list[int]:
    """Indices of the tail-patched queries: all, or the first `tailpatch.max_queries` of
    `tailpatch_order` (sorted; the same for every row, so rows stay paired)."""
    n = settings.tailpatch.max_queries
    if not n or n >= num_queries:
        return list(range(num_queries))
    return sorted(tailpatch_order(settings, num_queries)[:n])


def tailpatch_all(
    run: checkpoint_lib.Run,
    eq: query_set.EvalQueries,
    retrieved: dict[str, rows_lib.Retrieved],
    settings: settings_lib.TableSettings,
    mesh: jax.sharding.Mesh,
    workdir: pathlib.Path | None = None,
) -> dict[tuple[int, int], float]:
    """Tail-patch delta p for every distinct (query, proponent) pair among the rows' top-k (§4.3).

    Only the rows of `tailpatch.methods` (default all) and the queries of `tailpatch_queries`
    are tail-patched. Pairs shared by several rows (BM25 and TrackStar often agree) are
    computed once; with `workdir`, finished pairs are cached there (`pair_cache`), so an
    interrupted evaluation resumes and a later one reuses the pairs it shares.
    """
    tp = settings.tailpatch
    kmax = max(tp.top_ks)
    rows = [r for name, r in retrieved.items() if not tp.methods or name in tp.methods]
    queries = tailpatch_queries(settings, len(eq.queries))
    pairs = sorted({(qi, int(p)) for r in rows for qi in queries for p in r.proponent_ids[qi][:kmax]})
    if not pairs:
        return {}
    opt_cfg = run.optimizer
    lr_scale = tailpatch_lib.learning_rate_scale(opt_cfg, run.step, tp.learning_rate)
    texts = run.corpus.texts
    keys = {(q, p): pair_cache.pair_key(eq.queries[q].prompt, eq.queries[q].target, texts[p]) for q, p in pairs}
    cache = (
        pair_cache.ResultCache(workdir, pair_cache.identity(run, lr_scale), write=multihost.is_primary())
        if workdir is not None
        else None
    )
    have = cache.values if cache is not None else {}
    rank = {q: i for i, q in enumerate(tailpatch_order(settings, len(eq.queries)))}
    # Every pair in one fixed order, grouped and batched as a whole (`run_pairs`): the cached
    # ones only decide which calls run, so a resumed evaluation computes the bits of an
    # uninterrupted one. Query by query in the seeded order.
    pairs = sorted(pairs, key=lambda pq: (rank[pq[0]], pq[1]))
    needed = np.asarray([keys[pq] not in have for pq in pairs], bool)
    logging.info(
        "eval: %d distinct tail-patch pairs, %d cached, %d to compute",
        len(pairs),
        len(pairs) - int(needed.sum()),
        int(needed.sum()),
    )
    out = {pq: have[keys[pq]] for pq in pairs if keys[pq] in have}
    if needed.any():
        props = sorted({p for _, p in pairs})
        row_of = {p: i for i, p in enumerate(props)}
        enc_props, _ = data_lib.encode_passages(run.tokenizer, [texts[p] for p in props], run.model_cfg.max_len)
        prop_rows = data_lib.pad_batch(enc_props, props, len(props), max(len(t) for t, _ in enc_props))
        query_rows = data_lib.pad_batch(
            eq.encoded, list(range(len(eq.encoded))), len(eq.encoded), max(len(t) for t, _ in eq.encoded)
        )
        bs, g = tailpatch_lib.pair_batch_size(settings.tailpatch.batch_size, mesh), tp.queries_per_step
        fn = tailpatch_lib.make_jit_tailpatch(
            mesh,
            graphdef=run.graphdef,
            opt=step_lib.make_optimizer(opt_cfg),
            opt_cfg=opt_cfg if tp.step == "lowrank" else None,
        )
        idx = np.asarray([(q, row_of[p]) for q, p in pairs], np.int64)
        logging.info(
            "eval: %d pairs in %d proponent steps (up to %d queries each)",
            len(pairs),
            len(tailpatch_lib.group_pairs(idx, g)),
            g,
        )
        bar = logs.progress(total=int(needed.sum()), desc="tail-patch", unit="pair")
        bar.set_postfix_str("compiling the step", refresh=True)  # shown before the first batch returns

        def on_call(done: np.ndarray, res: dict[str, np.ndarray]) -> None:  # each call's pairs reach the cache
            got = {pairs[i]: float(d) for i, d in zip(done.tolist(), res["delta_prob"])}
            out.update(got)
            if cache is not None:
                cache.add({keys[pq]: d for pq, d in got.items()})
            bar.set_postfix_str("", refresh=False)
            bar.update(len(done))

        tailpatch_lib.run_pairs(  # on a pod: one SPMD program, the groups split over every process's devices
            fn,
            run.params,
            run.opt_state,
            prop_rows,
            query_rows,
            idx,
            batch_size=bs,
            queries_per_step=g,
            lr_scale=lr_scale,
            mesh=mesh,
            needed=needed,
            on_call=on_call,
        )
        bar.close()
    return out


# Written (by process 0) before any retrieval file: the settings of the evaluation under way,
# so a rerun after a crash recognises its own unfinished work and redoes it.
STARTED_FILE = "started.json"


def _settings_record(settings: settings_lib.TableSettings) -> dict:
    return settings.replace({"retrieval.overwrite": False}).to_dict()


def _differs(saved: dict | None, settings: settings_lib.TableSettings, what: str) -> list[str]:
    if saved is None:
        return [f"({what} records no settings)"]
    return settings.differences(saved, sections=tuple(settings.to_dict()), ignore=("retrieval.overwrite",))


def finished(settings: settings_lib.TableSettings, out_dir: pathlib.Path) -> dict | None:
    """The previous evaluation in `out_dir` if it was made with these settings (it is only
    reported); None when there is none, when it is this configuration's own unfinished
    evaluation (its `started.json` records the same settings: it is redone), or when
    `retrieval.overwrite` is set.

    Same rule as `launch.retrieve`: finished outputs are replaced only with
    `--config.retrieval.overwrite=True`; a changed config is refused, naming the fields.

    Raises:
      FileExistsError: `out_dir` holds an evaluation made with other settings.
    """
    table_path = out_dir / "table.json"
    previous = sorted((out_dir / "retrievals").glob("*.jsonl")) + [f for f in (table_path,) if f.exists()]
    if not previous or settings.retrieval.overwrite:
        return None
    how = (
        "set --config.retrieval.overwrite=True to replace it, or --config.eval.output_dir=<another folder> to keep both"
    )
    if not table_path.exists():
        started = out_dir / STARTED_FILE
        if not started.exists():
            raise FileExistsError(f"{out_dir} holds an unfinished or foreign evaluation ({previous[0].name}): {how}")
        rec = files.read_json(started, "evaluation start record", how)
        bad = _differs(rec.get("settings") if isinstance(rec, dict) else None, settings, STARTED_FILE)
        if bad:
            raise FileExistsError(
                f"{out_dir} holds an unfinished evaluation made with other settings ({'; '.join(bad[:8])}): {how}"
            )
        logging.info("eval: %s holds an unfinished evaluation with these settings; redoing it", out_dir)
        return None
    table = files.read_json(table_path, "evaluation table", how)
    bad = _differs(table.get("settings"), settings, "table.json")
    if bad:
        raise FileExistsError(
            f"{out_dir} already holds an evaluation made with other settings ({'; '.join(bad[:8])}): {how}"
        )
    logging.info("eval: %s is already evaluated with these settings; reporting it unchanged", out_dir)
    return table


def check_fits(ctx: rows_lib.Context, methods: list[baselines_lib.Method]) -> dict:
    """Refuses (`memory.DoesNotFitError`, naming the step and its knob) an evaluation whose steps
    cannot fit in device memory, before any work: each row's own compiled steps (its kind's
    `RowKind.check_fits`: a gradient row's featurize step and retrieval read chunk), then the
    tail-patch step (`tailpatch.batch_size` proponents, each with `tailpatch.queries_per_step`
    queries, all of `model.max_len` tokens).

    Returns:
      `{step name: memory.compiled_memory}` of what was checked.
    """
    run, settings, out = ctx.run, ctx.settings, {}
    for m in methods:
        out.update(rows_lib.row_kind(m.kind).check_fits(m, ctx))
    opt_cfg = run.optimizer
    fn = tailpatch_lib.make_jit_tailpatch(
        ctx.mesh,
        graphdef=run.graphdef,
        opt=step_lib.make_optimizer(opt_cfg),
        opt_cfg=opt_cfg if settings.tailpatch.step == "lowrank" else None,
    )
    bs = tailpatch_lib.pair_batch_size(settings.tailpatch.batch_size, ctx.mesh)
    g = settings.tailpatch.queries_per_step
    out["tailpatch"] = tailpatch_lib.check_fits(fn, run.params, run.opt_state, bs, g, run.model_cfg.max_len)
    return out


def prepare(ctx: rows_lib.Context, methods: list[baselines_lib.Method]) -> pathlib.Path:
    """Before the evaluation of a loaded run writes anything: its steps' memory checks
    (`check_fits`, where a device memory limit is known), then the output folder (a previous
    evaluation's retrievals removed) and its `started.json`. Returns the output folder
    (`report.eval_dir`)."""
    settings = ctx.settings
    out_dir = report.eval_dir(settings, ctx.workdir)
    # Before anything is written or replaced. Without a limit (CPU, no TRACKSTAR_JAX_DEVICE_MEMORY_BYTES)
    # nothing can be refused, and its compiles (each row's own step and the tail-patch step at
    # model.max_len) are not the programs the stage runs (length buckets, shared passes): they
    # were ≈ 39 s of Run A's `load` for nothing (BUILD_NOTES section 13).
    if memory_lib.device_memory_limit() is not None:
        check_fits(ctx, methods)
    files.make_dirs(out_dir / "retrievals")
    stale = sorted((out_dir / "retrievals").glob("*.jsonl"))
    if stale and multihost.is_primary():  # overwrite: a previous evaluation's rows would not match this query set
        logging.info("eval: replacing the previous evaluation in %s (%d retrieval files)", out_dir, len(stale))
        for f in stale:
            f.unlink()
    if multihost.is_primary():
        files.atomic_write_json(out_dir / STARTED_FILE, {"settings": _settings_record(settings)})
    return out_dir


def _queries(ctx: rows_lib.Context, out_dir: pathlib.Path) -> query_set.EvalQueries:
    ev = ctx.settings.eval
    eq = query_set.make_eval_queries(ctx.run, ctx.settings)
    rep = eq.report.to_dict()
    if multihost.is_primary():  # every process holds the same query set; one writes it
        queries_lib.save_queries(eq.queries, out_dir / "queries.jsonl")
        files.atomic_write_json(out_dir / "query_report.json", rep)
    logging.info(
        "eval: %d queries (%s mode, template %d), model accuracy %.3f, %d without evidence, %d empty targets; "
        "buckets %s",
        len(eq.queries),
        ev.query_mode,
        ev.template_variant,
        sum(eq.correct) / len(eq.correct),
        rep["num_no_evidence"],
        rep["num_empty_target"],
        rep["per_bucket"],
    )
    if rep["num_no_evidence"]:
        logging.warning(
            "eval: %d queried facts have no entailing passage in the corpus; they are excluded from MRR / "
            "recall / precision (fact ids %s)",
            rep["num_no_evidence"],
            rep["no_evidence_fact_ids"][:10],
        )
    return eq


def evaluate_run(
    ctx: rows_lib.Context,
    methods: list[baselines_lib.Method],
    *,
    started: float | None = None,
    load_seconds: float = 0.0,
) -> dict:
    """Stage 4's work on a loaded run (the stage is `stages.evaluate`, which refuses or reports a
    finished evaluation first): the fact-tracing table for `methods` (see the module docstring).

    Args:
      ctx: the loaded run, checked against `ctx.settings`.
      methods: the table's rows (`check_methods`).
      started: `time.perf_counter()` when the stage started (the table's `seconds`; default now).
      load_seconds: how long the caller took to open the run (counted in stage "load").

    Returns:
      The table.json content.
    """
    t0 = time.perf_counter() if started is None else started
    settings, workdir = ctx.settings, ctx.workdir
    ev, tp = settings.eval, settings.tailpatch
    stage_seconds: dict[str, float] = {}  # wall time of each stage (logged as it ends)

    def timed(name, fn, *args):
        t1 = time.perf_counter()
        out = fn(*args)
        stage_seconds[name] = time.perf_counter() - t1 + (load_seconds if name == "load" else 0.0)
        logging.info("stage %s: %.1fs", name, stage_seconds[name])
        return out

    out_dir = timed("load", prepare, ctx, methods)
    run = ctx.run
    eq = timed("queries", _queries, ctx, out_dir)

    retrievers = rows_lib.make_retrievers(methods, ctx)
    retrieved, seconds = {}, {}
    for m in methods:  # a gradient row's time includes building (or reusing) its index
        retrieved[m.name] = timed(f"retrieve:{m.name}", retrievers[m.name].retrieve, eq, ev.num_proponents)
        seconds[m.name] = stage_seconds[f"retrieve:{m.name}"]
    deltas = timed("tailpatch", tailpatch_all, run, eq, retrieved, settings, ctx.mesh, workdir)
    tailpatch_seconds = stage_seconds["tailpatch"]
    logging.info("eval: tail-patched %d distinct (query, proponent) pairs in %.1fs", len(deltas), tailpatch_seconds)

    statements = templates_lib.statement_ids(run.corpus)
    names = (
        list(metrics_lib.ATTRIBUTION_METRICS)
        + [f"mention_{x}" for x in metrics_lib.ATTRIBUTION_METRICS]
        + [f"tailpatch_at_{k}" for k in tp.top_ks]
        + (["statement_at_10"] if statements else [])
    )
    table_rows, records = [], {}
    for m in methods:
        r = retrieved[m.name]
        row_deltas = deltas if not tp.methods or m.name in tp.methods else {}  # a row not tail-patched has none
        if multihost.is_primary():
            report.write_retrievals(out_dir / "retrievals" / f"{m.name}.jsonl", run.corpus.texts, eq, r, m, row_deltas)
        extra = {
            "label": m.label,
            "kind": m.kind,
            "settings": dataclasses.asdict(m),
            "gold_attribution": rows_lib.row_kind(m.kind).gold_attribution,
            "retrieval_seconds": seconds[m.name],
            **({"scoring": r.info} if r.info else {}),
        }
        records[m.name] = report.query_records(eq, r, row_deltas, tp.top_ks, m, statements)
        table_rows.append(
            metrics_lib.method_row(
                m.name,
                records[m.name],
                names,
                bucket_order=queries_lib.bucket_order(ev.bucket_edges),
                seed=ev.bootstrap_seed,
                extra=extra,
            )
        )
    table = {
        "rows": table_rows,
        "comparisons": claims_lib.compare(records, seed=ev.bootstrap_seed),
        "query_mode": ev.query_mode,
        "template_variant": ev.template_variant,
        "num_queries": len(eq.queries),
        "model_accuracy": sum(eq.correct) / len(eq.correct),
        "model_accuracy_by_relation": accuracy_by_relation(eq),
        "query_report": eq.report.to_dict(),
        "corpus": {
            "name": run.corpus.name,
            "num_examples": len(run.corpus.examples),
            "num_facts": len(run.corpus.facts),
        },
        "model": {
            "num_params": model_lib.param_count(run.params),
            "checkpoint_step": run.step,
            "config": dataclasses.asdict(run.model_cfg),
        },
        "tailpatch": {
            "learning_rate": tp.learning_rate,
            "top_ks": list(tp.top_ks),
            "num_pairs": len(deltas),
            "num_queries": len(tailpatch_queries(settings, len(eq.queries))),
            "methods": list(tp.methods) or [m.name for m in methods],
            "seconds": tailpatch_seconds,
        },
        "ci": f"{int(metrics_lib.CONFIDENCE * 100)}% percentile bootstrap over queries, {metrics_lib.NUM_RESAMPLES} resamples",
        "stage_seconds": stage_seconds,
        "seconds": time.perf_counter() - t0,
        "settings": _settings_record(settings),
    }
    if tp.checkpoint_steps:  # Fig. 2 right: TrackStar over training (Run B)
        table["checkpoints"] = timed("checkpoints", checkpoint_curve, settings, workdir, run, eq)
    # Process 0 writes; table.json last but one, table.md last (a table.json marks a finished
    # evaluation). The others wait for it, so a failed write fails the job.
    with multihost.step("evaluate:written"):
        if multihost.is_primary():
            table["plots"] = plots_lib.write_plots(table, out_dir)
            files.atomic_write_json(out_dir / "table.json", table)
            files.atomic_write(
                out_dir / "table.md",
                report.table_markdown(table, eq, retrieved, run.corpus.texts, tp.top_ks, ev.num_examples_shown)
                + "\n"
                + claims_lib.markdown(table["comparisons"], {m.name: m.label for m in methods})
                + "".join(f"\n![{p}]({p})\n" for p in table["plots"]),
            )
    logging.info("eval: wrote %s and table.md in %.1fs", out_dir / "table.json", table["seconds"])
    return table


def checkpoint_curve(
    settings: settings_lib.TableSettings, workdir: pathlib.Path, final: checkpoint_lib.Run, eq: query_set.EvalQueries
) -> list[dict]:
    """TrackStar's MRR, recall@10 and tail-patch@10 at each of `tailpatch.checkpoint_steps` (Fig. 2 right).

    The queries are the evaluation's (chosen with the final model); each checkpoint gets its
    own TrackStar index (`<index.dir>_step<N>`; the final step reuses the main one), `final`
    restored at that step (`checkpoint.reload`), and its
    tail-patch steps start from that checkpoint, on the same tail-patched queries.

    Raises:
      FileNotFoundError: a listed step has no checkpoint (names `train.checkpoint_every_steps`
        and `train.max_checkpoints_to_keep`, which decide what training keeps).
    """
    tp = settings.tailpatch
    mesh = sharding_lib.make_mesh(settings.mesh.shape)
    saved = checkpoint_lib.CheckpointManager(workdir / checkpoint_lib.CHECKPOINT_DIR, max_to_keep=None)
    try:
        steps, last = saved.all_steps(), saved.latest_step()
    finally:
        saved.close()
    missing = [s for s in tp.checkpoint_steps if s not in steps]
    if missing:
        raise FileNotFoundError(
            f"config.tailpatch.checkpoint_steps {missing} have no checkpoint in {workdir} (kept: {steps}); "
            "training keeps every train.checkpoint_every_steps, the last train.max_checkpoints_to_keep of them"
        )
    m = baselines_lib.method("trackstar")
    names = ["mrr", "recall_at_10", "tailpatch_at_10"]
    out = []
    for step in sorted(tp.checkpoint_steps):
        s = settings if step == last else settings.replace({"index.dir": f"{settings.index.dir}_step{step}"})
        run = checkpoint_lib.reload(final, step=step, mesh=mesh)
        ctx = rows_lib.Context(s, workdir, run, mesh)
        r = rows_lib.GradientRetriever(ctx, m).retrieve(eq, settings.eval.num_proponents)
        deltas = tailpatch_all(run, eq, {m.name: r}, s.replace({"tailpatch.methods": ()}), mesh, workdir)
        recs = report.query_records(eq, r, deltas, tp.top_ks, m)
        summary = metrics_lib.summarize(recs, names, seed=settings.eval.bootstrap_seed)
        out.append({"step": int(step), **summary, "mix_lambda": r.info.get("whitening", {}).get("mix_lambda")})
        logging.info(
            "eval: checkpoint %d: TrackStar MRR %.3f, tail-patch@10 %s",
            step,
            summary["mrr"] or 0,
            summary["tailpatch_at_10"],
        )
    return out
