"""Reading and showing an evaluation's output (`workdir/eval/`), for the notebook and the CLI.

`load_results(workdir)` reads the query set, the per-row retrievals (PAIR-code schema) and
the table written by `evaluation.evaluate`. `proponent_rows` lists one query's proponents or
opponents with scores, gold / mention labels and tail-patch deltas; `highlight` marks the
query's subject and object surface forms in a passage (HTML); `side_by_side_html` compares
rows (methods) for one query; `format_proponents` is the plain-text form.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Sequence

from trackstar_jax import files
from trackstar_jax.evaluation import queries as queries_lib

EVAL_DIR = "eval"
SUBJECT_STYLE = "background:#cfe8ff"
OBJECT_STYLE = "background:#ffe3a8"


@dataclasses.dataclass
class Results:
    """An evaluation run's output.

    Attributes:
      queries: the query set (row i = query_id i).
      retrievals: `{method: [per-query dict in the PAIR-code schema]}`.
      table: table.json content.
      path: the eval folder.
    """

    queries: list[queries_lib.Query]
    retrievals: dict[str, list[dict]]
    table: dict
    path: pathlib.Path

    @property
    def methods(self) -> list[str]:
        """Rows in table order."""
        return [r["method"] for r in self.table["rows"] if r["method"] in self.retrievals]

    def label(self, method: str) -> str:
        """The row label of `method` (e.g. "Exp. 3")."""
        return next((r.get("label", method) for r in self.table["rows"] if r["method"] == method), method)


def load_results(workdir: str | pathlib.Path, name: str = EVAL_DIR) -> Results:
    """Reads `workdir/<name>/{queries.jsonl, table.json, retrievals/*.jsonl}`.

    Args:
      workdir: the run directory.
      name: the evaluation folder ("eval"; "eval_prediction", "eval_gold_t1", ... for other
        query modes / template variants, see `evaluation.report.eval_dir`).

    Raises:
      FileNotFoundError: no evaluation output there (names the missing file).
    """
    path = pathlib.Path(workdir) / name
    for f in ("queries.jsonl", "table.json"):
        if not (path / f).is_file():
            raise FileNotFoundError(
                f"no evaluation output: {path / f} is missing (run `python -m launch.evaluate` first)"
            )
    qs = queries_lib.load_queries(path / "queries.jsonl")
    retrievals = {}
    for f in sorted((path / "retrievals").glob("*.jsonl")):
        rows = [row for _, row in files.read_jsonl(f)]
        if len(rows) != len(qs):
            raise ValueError(f"{f} has {len(rows)} rows but the query set has {len(qs)}: mixed evaluation runs?")
        retrievals[f.stem] = rows
    return Results(
        qs,
        retrievals,
        files.read_json(
            path / "table.json",
            "evaluation table",
            "rerun `python -m launch.evaluate` with --config.retrieval.overwrite=True",
        ),
        path,
    )


def proponent_rows(results: Results, query_id: int, method: str, kind: str = "proponents", k: int = 10) -> list[dict]:
    """One query's top-k proponents (or opponents) under `method`, with labels.

    Returns:
      Dicts with rank, example_id, score, entailing (gold label), mentions (both entities
      mentioned), tailpatch (delta p of the target, proponents only) and text.

    Raises:
      KeyError: unknown method / no opponents for it (names what exists).
    """
    if method not in results.retrievals:
        raise KeyError(f"method {method!r} not in this evaluation (have {sorted(results.retrievals)})")
    row = results.retrievals[method][query_id]
    if kind == "opponents" and "opponent_ids" not in row:
        raise KeyError(f"method {method!r} has no opponents (only gradient methods do)")
    q = results.queries[query_id]
    gold, mention = set(q.entailing_ids), set(q.mention_ids)
    singular = kind[:-1]
    ids, scores, texts = row[f"{singular}_ids"][:k], row[f"{singular}_scores"][:k], row[kind][:k]
    patch = row.get("proponent_tailpatch", [None] * len(ids)) if kind == "proponents" else [None] * len(ids)
    return [
        {
            "rank": r + 1,
            "example_id": i,
            "score": s,
            "entailing": i in gold,
            "mentions": i in mention,
            "tailpatch": t,
            "text": x,
        }
        for r, (i, s, x, t) in enumerate(zip(ids, scores, texts, patch))
    ]


def highlight(text: str, subject_aliases: Sequence[str], object_aliases: Sequence[str]) -> str:
    """HTML of `text` with subject (blue) and object (orange) surface forms marked.

    Matching is case-insensitive on whole words, with aliases of >= 3 characters (as the
    frequency count and the looser label use, §A.4); longer aliases win over shorter ones.
    """
    spans = []
    for style, aliases in ((SUBJECT_STYLE, subject_aliases), (OBJECT_STYLE, object_aliases)):
        for a in queries_lib.matchable_aliases(aliases):
            for m in re.finditer(r"(?<!\w)" + re.escape(a) + r"(?!\w)", text, flags=re.IGNORECASE):
                spans.append((m.start(), m.end(), style))
    spans.sort(key=lambda s: (s[0], -(s[1] - s[0])))
    out, pos = [], 0
    for start, end, style in spans:
        if start < pos:
            continue  # overlaps an earlier (longer) match
        out.append(files.html_text(text[pos:start]))
        out.append(f'<mark style="{style}">{files.html_text(text[start:end])}</mark>')
        pos = end
    out.append(files.html_text(text[pos:]))
    return "".join(out)


def _number(value: object, spec: str, scale: float = 1.0) -> str:
    """`value * scale` formatted by `spec`; anything but a number (a tampered record) as escaped text."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value * scale, spec)
    return files.html_text(value)


def _cell(results: Results, q: queries_lib.Query, rows: list[dict]) -> str:
    items = []
    for r in rows:
        label = "✓" if r["entailing"] else ("~" if r["mentions"] else "")
        patch = "" if r["tailpatch"] is None else f", Δp {_number(r['tailpatch'], '+.2f', 100.0)}%"
        items.append(
            f"<li><b>{label}</b> [{files.html_text(r['example_id'])}] "
            f"<small>({_number(r['score'], '.3g')}{patch})</small> "
            f"{highlight(str(r['text']), q.subject_aliases, q.aliases)}</li>"
        )
    return "<ol style='margin:0;padding-left:1.2em'>" + "".join(items) + "</ol>"


def side_by_side_html(
    results: Results, query_id: int, methods: Sequence[str] | None = None, k: int = 5, kind: str = "proponents"
) -> str:
    """An HTML table: one column per method, its top-k proponents (or opponents) for one query.

    ✓ marks an entailing passage (gold), ~ one that only mentions both entities.
    """
    q = results.queries[query_id]
    methods = [
        m
        for m in (methods or results.methods)
        if kind == "proponents" or "opponent_ids" in results.retrievals[m][query_id]
    ]
    row0 = results.retrievals[methods[0]][query_id] if methods else {}
    head = (
        f"<p><b>{files.html_text(q.prompt)}</b> →<b>{files.html_text(q.target)}</b> "
        f"(relation {files.html_text(q.relation)}, {len(q.entailing_ids)} gold passages, "
        f"frequency {files.html_text(q.frequency)}; "
        f"model: {files.html_text(repr(row0.get('model_completion', '')))}, "
        f"{'correct' if row0.get('model_correct') else 'incorrect'})</p>"
    )
    cols = "".join(f"<th>{files.html_text(results.label(m))}</th>" for m in methods)
    cells = "".join(
        f"<td style='vertical-align:top'>{_cell(results, q, proponent_rows(results, query_id, m, kind, k))}</td>"
        for m in methods
    )
    return head + f"<table><tr>{cols}</tr><tr>{cells}</tr></table>"


def format_proponents(
    results: Results, query_id: int, method: str, kind: str = "proponents", k: int = 5, width: int = 120
) -> str:
    """Plain-text listing of one query's proponents under one method (for terminals / logs)."""
    q = results.queries[query_id]
    lines = [f"{results.label(method)} {kind} for {q.prompt!r} ->{q.target!r}:"]
    for r in proponent_rows(results, query_id, method, kind, k):
        mark = "✓" if r["entailing"] else ("~" if r["mentions"] else " ")
        patch = "" if r["tailpatch"] is None else f" dp={100 * r['tailpatch']:+.2f}%"
        lines.append(f"  {r['rank']:2d}. {mark} [{r['example_id']}] {r['score']:.4g}{patch}  {r['text'][:width]}")
    return "\n".join(lines)


def split_markdown(
    results: Results, split: str = "by_bucket", metrics: Sequence[str] = ("mrr", "recall_at_10", "tailpatch_at_10")
) -> str:
    """Markdown tables of `table.json`'s splits: one table per split value ("by_bucket" / "by_correctness")."""
    from trackstar_jax.evaluation import metrics as metrics_lib  # noqa: PLC0415

    rows = results.table["rows"]
    values = list(dict.fromkeys(v for r in rows for v in r.get(split, {})))
    out = []
    for v in values:
        sub = [
            {**r[split][v], "method": r.get("label", r["method"]), "gold_attribution": r.get("gold_attribution")}
            for r in rows
            if v in r.get(split, {})
        ]
        title = f"{split.replace('by_', '')} = {v}"  # escaped by markdown_table
        out.append(metrics_lib.markdown_table(sub, list(metrics), title=title))
    return "\n".join(out)
