"""The evaluation's outputs: per-query metric records, per-method retrieval files, table.md."""

from __future__ import annotations

import json
import os
import pathlib

from trackstar_jax import files
from trackstar_jax.evaluation import baselines as baselines_lib
from trackstar_jax.evaluation import metrics as metrics_lib
from trackstar_jax.evaluation import query_set
from trackstar_jax.evaluation import rows as rows_lib
from trackstar_jax.evaluation import settings as settings_lib
from trackstar_jax.evaluation.rows import Retrieved
from trackstar_jax.retrieval import records

EVAL_DIR = "eval"


def eval_dir(settings: settings_lib.TableSettings, workdir: str | os.PathLike) -> pathlib.Path:
    """`workdir/<eval.output_dir>` if set; else `workdir/eval` for gold targets with template 0
    and `eval_<mode>[_t<variant>]` otherwise.

    Query modes and template variants get their own folders, so one run can hold the main
    table, the prediction-mode table and the Table A.1 template variations side by side.
    """
    ev = settings.eval
    if ev.output_dir:
        return pathlib.Path(workdir) / ev.output_dir
    suffix = (
        ""
        if (ev.query_mode, ev.template_variant) == ("gold", 0)
        else f"_{ev.query_mode}" + (f"_t{ev.template_variant}" if ev.template_variant else "")
    )
    return pathlib.Path(workdir) / (EVAL_DIR + suffix)


def query_records(
    eq: query_set.EvalQueries,
    r: Retrieved,
    deltas: dict[tuple[int, int], float],
    top_ks: tuple[int, ...],
    m: baselines_lib.Method,
    statements: frozenset[int] = frozenset(),
) -> list[dict]:
    """Per-query metric values of one row (inputs of `metrics.method_row`).

    With `statements` (the corpus's templated statements), `statement_at_10` is the fraction
    of the first 10 proponents that are one: the template-mimicking passages TrackStar's mixed
    R is meant to down-weight (§3).

    Gold rows get only tail-patch (their proponents are the gold passages by definition).
    """
    out = []
    for qi, q in enumerate(eq.queries):
        ids = r.proponent_ids[qi]
        rec = {
            "query_id": q.query_id,
            "has_evidence": q.has_evidence,
            "correct": eq.correct[qi],
            "bucket": q.bucket,
            "relation": q.relation,
        }
        if statements and ids:
            rec["statement_at_10"] = sum(int(p) in statements for p in ids[:10]) / len(ids[:10])
        if not rows_lib.row_kind(m.kind).gold_attribution:
            rec.update(metrics_lib.query_metrics(ids, q.entailing_ids))
            rec.update(metrics_lib.query_metrics(ids, q.mention_ids, prefix="mention_"))
        ds = [deltas.get((qi, int(p))) for p in ids[: max(top_ks)]]  # absent: query or row not tail-patched
        rec.update(metrics_lib.tailpatch_at_k([] if None in ds else ds, top_ks))
        out.append(rec)
    return out


def retrieval_lines(
    texts: list[str],
    eq: query_set.EvalQueries,
    r: Retrieved,
    m: baselines_lib.Method,
    deltas: dict[tuple[int, int], float],
) -> list[dict]:
    """Per-query proponents in the PAIR-code/pretraining-tda schema (+ fact fields, tail-patch deltas)."""
    out = []
    for qi, q in enumerate(eq.queries):
        ids = [int(i) for i in r.proponent_ids[qi]]
        rec = records.pair_record(
            q.query_id,
            q.prompt,
            q.target,
            texts,
            ids,
            r.proponent_scores[qi],
            None if r.opponent_ids is None else r.opponent_ids[qi],
            None if r.opponent_scores is None else r.opponent_scores[qi],
            gold=q.entailing_ids,
            query_set=m.name,
            fact_id=q.fact_id,
            relation=q.relation,
            fact_frequency=q.frequency,  # the viewer's name for a non-C4 count (`c4_frequency ?? fact_frequency`)
            frequency_bucket=q.bucket,
            has_trex_sentence=q.has_evidence,
            model_completion=eq.completions[qi],
            model_correct=eq.correct[qi],
        )
        rec["proponent_tailpatch"] = [deltas.get((qi, i)) for i in ids]
        out.append(rec)
    return out


def write_retrievals(
    path: pathlib.Path,
    texts: list[str],
    eq: query_set.EvalQueries,
    r: Retrieved,
    m: baselines_lib.Method,
    deltas: dict[tuple[int, int], float],
) -> None:
    """`retrieval_lines` as a jsonl file (written atomically)."""
    files.atomic_write(
        path, "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in retrieval_lines(texts, eq, r, m, deltas))
    )


def read_retrievals(path: pathlib.Path, num_queries: int) -> Retrieved:
    """A row's proponents (ids and scores) as `write_retrievals` wrote them, query i at position
    i: an evaluation's own lists, read back to re-measure them (tools/v_2x2.py, tools/figure2.py).

    Raises:
      ValueError: a query of `range(num_queries)` has no line in the file (names the first).
    """
    with path.open(encoding="utf-8") as f:
        recs = {int(x["example_id"]): x for x in map(json.loads, f) if x}
    missing = [q for q in range(num_queries) if q not in recs]
    if missing:
        raise ValueError(f"{path}: no line for query {missing[0]} ({len(missing)} of {num_queries} missing)")
    ids = [[int(i) for i in recs[q]["proponent_ids"]] for q in range(num_queries)]
    return Retrieved(ids, [[float(s) for s in recs[q]["proponent_scores"]] for q in range(num_queries)])


def table_markdown(
    table: dict,
    eq: query_set.EvalQueries,
    retrieved: dict[str, Retrieved],
    texts: list[str],
    top_ks: tuple[int, ...],
    num_examples_shown: int,
) -> str:
    """table.md: the main table, the correct / incorrect split, and a few queries' top proponents."""
    rows = table["rows"]
    cols = list(metrics_lib.ATTRIBUTION_METRICS) + [f"tailpatch_at_{k}" for k in top_ks]
    shown = [{**r, "method": r["label"]} for r in rows]
    head = (
        f"Fact tracing on {table['corpus']['name']} ({table['corpus']['num_examples']} passages), "
        f"{table['num_queries']} queries ({table['query_mode']} targets, template {table['template_variant']}), "
        f"model {table['model']['num_params']:,} params at step {table['model']['checkpoint_step']}, "
        f"accuracy {table['model_accuracy']:.3f}. Mean [{table['ci']}]; tail-patch in percentage points.\n\n"
    )
    by_rel = table.get("model_accuracy_by_relation") or {}
    if by_rel:
        head += (
            "Accuracy per relation: "
            + ", ".join(
                f"{files.markdown_text(r)} {v['accuracy']:.3f} ({v['correct']}/{v['n']})" for r, v in by_rel.items()
            )
            + ".\n\n"
        )
    md = "# Fact tracing table\n\n" + head + metrics_lib.markdown_table(shown, cols)
    for label in ("correct", "incorrect"):
        sub = [
            {**r["by_correctness"][label], "method": r["label"], "gold_attribution": r["gold_attribution"]}
            for r in rows
            if label in r["by_correctness"]
        ]
        if sub:
            md += "\n" + metrics_lib.markdown_table(sub, cols, title=f"Facts the model predicts {label}ly (Table A.2)")
    md += "\n" + metrics_lib.markdown_table(
        [
            {
                "method": r["label"],
                "num_queries": r["num_queries"],
                **{k: r.get(k) for k in r if k.startswith("mention_")},
            }
            for r in rows
            if r["kind"] != "gold"
        ],
        [f"mention_{x}" for x in metrics_lib.ATTRIBUTION_METRICS],
        title="Looser label: proponent mentions both entities",
    )
    if any(r.get("statement_at_10") is not None for r in rows):
        md += "\n" + metrics_lib.markdown_table(
            [r for r in rows if r["kind"] != "gold"],
            ["statement_at_10"],
            title="Template-mimicking proponents: fraction of the top 10 that are templated statements",
        )
    md += "\n## Example queries\n"
    for qi, q in enumerate(eq.queries[:num_examples_shown]):
        md += (
            f"\n**{files.markdown_text(q.prompt)}** →{files.markdown_text(q.target)}  "
            f"(model: {files.markdown_text(repr(eq.completions[qi]))}, {'correct' if eq.correct[qi] else 'incorrect'}; "
            f"{len(q.entailing_ids)} gold passages)\n\n"
        )
        for name, r in retrieved.items():
            if rows_lib.row_kind(baselines_lib.METHODS[name].kind).gold_attribution:
                continue
            md += f"- {files.markdown_text(baselines_lib.METHODS[name].label)}:\n"
            for rank, (p, s) in enumerate(zip(r.proponent_ids[qi][:3], r.proponent_scores[qi][:3]), 1):
                mark = "✓" if p in set(q.entailing_ids) else " "
                md += f"  {rank}. {mark} [{p}] ({s:.3g}) {files.markdown_text(texts[p][:160])}\n"
    return md
