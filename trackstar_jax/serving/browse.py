"""Browsing an evaluation's output (`workdir/eval*/`) for the explorer: queries, filters, ranks.

Reads what `evaluation.evaluate` wrote, through `evaluation.results.load_results` (queries,
per-row retrievals in the PAIR-code schema with tail-patch deltas, table.json), and answers

- `summary(...)`: the metrics table, the filter values on offer, and per query (after the
  relation / frequency-bucket / model-correctness filters) its gold passages, the model's
  completion and correctness, and for each method the 1-based rank of its first gold passage
  (None: no gold passage among the retrieved) and the tail-patch deltas of its proponents;
- `query_detail(...)`: one query's proponents per method (`results.proponent_rows`) and the
  raw retrieval records (for export);
- `plot(...)`: the bytes of one of the evaluation's pictures (`evaluation.plots`: rows.png,
  lambda.png, checkpoints.png, beside table.md), and `plots(...)` which of them can be shown.

Bad filter values, and evaluation records of the wrong types (`check_record`, ids that are
not passages of the corpus), raise `BrowseError` (the API answers 400); a missing evaluation
raises FileNotFoundError (404). JSON has no NaN: non-finite floats become None.

Every file the explorer reads passes one rule, `servable` (the API answers 403 otherwise): a
path relative to the workdir that stays in it, with no symbolic link on it below the workdir,
neither a folder nor the file (`files.symlink_below`, the test every write of a stage passes
too), even one pointing inside the workdir; `read_servable` then opens it without following a
link or waiting on a FIFO, and reads at most a bound.
"""

from __future__ import annotations

import math
import os
import pathlib
import re
import stat
import threading
from typing import Any, Callable, Mapping, Sequence

from trackstar_jax import files
from trackstar_jax.evaluation import metrics as metrics_lib
from trackstar_jax.evaluation import plots as plots_lib
from trackstar_jax.evaluation import queries as queries_lib
from trackstar_jax.evaluation import results as results_lib

FILTERS = ("relation", "bucket", "correct")
CORRECT_VALUES = {"true": True, "false": False}
# The only files `plot` reads: the pictures evaluate writes beside table.md (a fixed allow-list,
# never a path from the request).
PLOT_FILES = tuple(plots_lib.PLOTS)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_PLOT_BYTES = 16 << 20  # the written pictures are ~50 KB; anything this large is not one of them
NO_PLOTS = "no plots were written for this evaluation (`python -m launch.evaluate` writes {files} beside table.md)"


class BrowseError(ValueError):
    """A browse request the server refuses (unknown evaluation name / filter / value, or an
    evaluation whose records are malformed)."""


class TooLargeError(ValueError):
    """A file over the bound its endpoint reads (the API answers 413, or 500 for a plot)."""


def servable(workdir: pathlib.Path, rel: str) -> pathlib.Path:
    """`workdir / rel` under the explorer's one rule for every file it reads: `rel` is relative,
    stays in the workdir once `..` is folded, and no folder on it below the workdir, nor the file,
    is a symbolic link (`files.symlink_below`; a link is refused wherever it points).

    Raises:
      PermissionError: naming `rel` (and the link).
    """
    if (
        not rel
        or pathlib.PurePosixPath(rel).is_absolute()
        or pathlib.PureWindowsPath(rel).is_absolute()
        or "\x00" in rel
    ):
        raise PermissionError(f"path {rel!r}: give a path relative to the workdir")
    norm = os.path.normpath(rel)
    if norm in (".", "..") or norm.startswith("../"):
        raise PermissionError(f"path {rel!r} leaves the workdir")
    path = workdir / norm
    link = files.symlink_below(workdir, path)
    if link is not None:
        raise PermissionError(
            f"{rel}: {link.relative_to(os.path.abspath(workdir)).as_posix()} is a symbolic link; the explorer "
            "serves only files in the workdir, never through a link"
        )
    return path


def read_servable(workdir: pathlib.Path, rel: str, limit: int) -> bytes:
    """The bytes of the regular file `rel` (`servable`), at most `limit` of them.

    Opened with O_NOFOLLOW / O_NONBLOCK: a link swapped in after the check is not followed, a
    FIFO not waited on.

    Raises:
      PermissionError: `servable` refuses it. FileNotFoundError: no such file.
      ValueError: not a regular file. TooLargeError: over `limit` bytes (nothing is read).
    """
    path = servable(workdir, rel)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise FileNotFoundError(f"path {rel!r}: no such file in the workdir") from None
    except OSError as e:
        raise PermissionError(f"{rel}: cannot be opened ({e.strerror}); not served") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # a folder, a FIFO, a device
        os.close(fd)
        raise ValueError(f"{rel}: not a regular file; not served")
    with os.fdopen(fd, "rb") as f:
        if st.st_size > limit:
            raise TooLargeError(f"{rel}: {st.st_size} bytes, over the {limit} bytes this endpoint reads; not served")
        data = f.read(limit + 1)  # a file that grew since the fstat is refused alike
    if len(data) > limit:
        raise TooLargeError(f"{rel}: over the {limit} bytes this endpoint reads; not served")
    return data


def _is_id(x: Any) -> bool:
    return isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_score(x: Any) -> bool:
    return x is None or (isinstance(x, (int, float)) and not isinstance(x, bool))


def _list_of(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda x: isinstance(x, list) and all(ok(v) for v in x)


# The fields of a retrieval record (PAIR-code schema, `retrieval.records`) the page shows or
# uses, each optional: field -> (check, what it must be). Other fields pass through unread.
RECORD_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "example_id": (_is_id, "an integer or a string"),
    "query_set": (lambda x: isinstance(x, str), "a string"),
    "inputs_plaintext": (lambda x: isinstance(x, str), "a string"),
    "targets_plaintext": (lambda x: isinstance(x, str), "a string"),
    "model_completion": (lambda x: x is None or isinstance(x, str), "a string or null"),
    "model_correct": (lambda x: x is None or isinstance(x, bool), "true, false or null"),
    "proponent_correct": (_list_of(lambda x: isinstance(x, bool)), "a list of true / false"),
    "proponent_tailpatch": (_list_of(_is_score), "a list of numbers / null"),
    # token attribution (`retrieval.attribution`): the page's heat-maps
    "proponent_token_scores": (
        _list_of(
            lambda p: (
                isinstance(p, dict)
                and _list_of(lambda x: isinstance(x, str))(p.get("tokens"))
                and _list_of(_is_score)(p.get("scores"))
                and len(p["tokens"]) == len(p["scores"])
            )
        ),
        'a list of {"tokens": [strings], "scores": [numbers]} of equal lengths',
    ),
    "target_tokens": (_list_of(lambda x: isinstance(x, str)), "a list of strings"),
    "target_token_scores": (_list_of(_list_of(_is_score)), "a list of lists of numbers / null"),
    **{
        f: check
        for kind in ("proponent", "opponent")
        for f, check in (
            (f"{kind}_ids", (_list_of(_is_id), "a list of integers / strings")),
            (f"{kind}s", (_list_of(lambda x: isinstance(x, str)), "a list of strings")),
            (f"{kind}_scores", (_list_of(_is_score), "a list of numbers / null")),
        )
    },
}


def check_record(rec: Any) -> str | None:
    """Why `rec` is not a retrieval record the page can show (None: it is): not an object, a
    `RECORD_FIELDS` field of another type, or ids / texts / scores lists of unequal lengths."""
    if not isinstance(rec, dict):
        return "not a retrieval record (a JSON object)"
    for field, (ok, what) in RECORD_FIELDS.items():
        if field in rec and not ok(rec[field]):
            return f"{field} must be {what}"
    for kind in ("proponent", "opponent"):
        if f"{kind}_ids" in rec:
            lengths = {f: len(rec.get(f, ())) for f in (f"{kind}_ids", f"{kind}s", f"{kind}_scores")}
            if len(set(lengths.values())) > 1:
                return f"{kind} lists of unequal lengths {lengths}"
    return None


def check_eval_record(rec: Any, num_passages: int) -> str | None:
    """`check_record`, and what an evaluation's record must be beyond it: its proponent /
    opponent ids are passages of the corpus (integers in [0, num_passages)), the lists the
    browse view reads are present."""
    why = check_record(rec)
    if why is not None:
        return why
    for field in ("proponent_ids", "proponents", "proponent_scores"):
        if field not in rec:
            return f"{field} is missing"
    for field in ("proponent_ids", "opponent_ids"):
        ids = rec.get(field, [])
        bad = next((i for i in ids if not (_is_int(i) and 0 <= i < num_passages)), None)
        if bad is not None:
            return f"{field} must be corpus passage ids, integers in [0, {num_passages}); it holds {bad!r}"
    return None


def parse_int(name: str, text: str, lo: int, hi: int) -> int:
    """The integer a URL parameter `name` spells in ASCII digits (no sign, space, `_` or other
    scripts' digits, which `str.isdigit` / `int` accept) within [lo, hi]; BrowseError otherwise."""
    if not (isinstance(text, str) and re.fullmatch(r"[0-9]{1,18}", text) and lo <= int(text) <= hi):
        raise BrowseError(f"{name}: must be an integer in [{lo}, {hi}], got {text!r}")
    return int(text)


def finite(x: Any) -> Any:
    """`x` with every non-finite float (NaN, inf) replaced by None, recursively (strict JSON)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, Mapping):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def list_evals(workdir: pathlib.Path) -> list[str]:
    """Evaluation folders directly under `workdir` (those with table.json and queries.jsonl), sorted;
    a symbolic link is none (`servable`)."""
    return sorted(
        p.name
        for p in workdir.iterdir()
        if not p.is_symlink() and p.is_dir() and (p / "table.json").is_file() and (p / "queries.jsonl").is_file()
    )


def first_gold_rank(proponent_ids: Sequence[int], gold: Sequence[int]) -> int | None:
    """1-based rank of the first proponent in `gold` (the reciprocal of the query's MRR term); None: none."""
    gold = set(int(g) for g in gold)
    return next((r + 1 for r, pid in enumerate(proponent_ids) if int(pid) in gold), None)


def tailpatch_means(deltas: Sequence[float | None], ks: Sequence[int]) -> dict[str, float | None]:
    """`metrics.tailpatch_at_k` over the stored deltas of the top max(ks) proponents; None
    for every k when one of those deltas was not computed."""
    top = list(deltas[: max(ks)])
    if any(d is None for d in top):
        return {f"tailpatch_at_{k}": None for k in ks}
    return finite(metrics_lib.tailpatch_at_k(top, ks))


class Browser:
    """The evaluations of one workdir, each loaded once (reloaded when its table.json changes).

    Args:
      workdir: the run directory (resolved).
      texts: the corpus passages (gold passage texts).
    """

    def __init__(self, workdir: pathlib.Path, texts: Sequence[str]):
        self.workdir, self.texts = workdir, texts
        self._cache: dict[str, tuple[int, results_lib.Results]] = {}
        self._lock = threading.Lock()

    def folder(self, name: str) -> pathlib.Path:
        """`workdir / name` when `name` is an evaluation `list_evals` lists (never a path).

        Raises:
          FileNotFoundError: no such evaluation (names those that exist).
          PermissionError: `name` is a symbolic link (`servable`).
        """
        available = list_evals(self.workdir) if self.workdir.is_dir() else []
        if name not in available and name and "/" not in name and (self.workdir / name).is_symlink():
            servable(self.workdir, name)  # raises, naming the link
        if name not in available:
            raise FileNotFoundError(
                f"no evaluation named {name!r} in the workdir (have {available}; run `python -m launch.evaluate`)"
                if available
                else "no evaluation output in the workdir (run `python -m launch.evaluate` first)"
            )
        return self.workdir / name

    def results(self, name: str) -> results_lib.Results:
        """The loaded evaluation `name` (a folder listed by `list_evals`).

        Raises:
          FileNotFoundError: no such evaluation (names those that exist).
          PermissionError: one of its files (or `retrievals/`) is a symbolic link (`servable`).
          BrowseError: a file that does not read back, or a record the page cannot show
            (`check_eval_record`), naming `<name>/<file>:<line>`.
        """
        self.folder(name)
        for f in ("table.json", "queries.jsonl", "retrievals"):
            servable(self.workdir, f"{name}/{f}")
        for f in sorted((self.workdir / name / "retrievals").glob("*.jsonl")):
            servable(self.workdir, f"{name}/retrievals/{f.name}")
        stamp = (self.workdir / name / "table.json").stat().st_mtime_ns
        with self._lock:
            hit = self._cache.get(name)
            if hit is None or hit[0] != stamp:
                hit = (stamp, self._load(name))
                self._cache[name] = hit
        return hit[1]

    def _load(self, name: str) -> results_lib.Results:
        """`results.load_results`, then every record and query checked for what the views read."""
        root = f"{os.path.abspath(self.workdir)}/"
        try:
            res = results_lib.load_results(self.workdir, name)
        except (files.InputError, ValueError) as e:  # the server's own paths stay out of the message
            raise BrowseError(str(e).replace(root, "")) from None
        rows = res.table.get("rows") if isinstance(res.table, dict) else None
        if not (isinstance(rows, list) and all(isinstance(r, dict) and isinstance(r.get("method"), str) for r in rows)):
            raise BrowseError(f"{name}/table.json: rows must be a list of objects each with a method name")
        n = len(self.texts)
        for i, q in enumerate(res.queries):
            if not all(_is_int(g) and 0 <= g < n for g in (*q.entailing_ids, *q.mention_ids)):
                raise BrowseError(
                    f"{name}/queries.jsonl:{i + 1}: entailing_ids / mention_ids must be corpus passage ids, "
                    f"integers in [0, {n})"
                )
        for m, recs in res.retrievals.items():
            for i, rec in enumerate(recs):
                why = check_eval_record(rec, n)
                if why is not None:
                    raise BrowseError(f"{name}/retrievals/{m}.jsonl:{i + 1}: {why}")
        return res

    def summary(self, name: str = results_lib.EVAL_DIR, filters: Mapping[str, str] | None = None) -> dict:
        """`GET /api/eval`: table, facets and the filtered queries (see the module docstring).

        Args:
          name: the evaluation folder.
          filters: `{"relation" | "bucket" | "correct": value}` (strings, as in a URL): a relation
            or bucket the evaluation has, correct "true" / "false"; all given must hold.

        Raises:
          BrowseError: unknown filter or a value the evaluation does not have (names the choices).
          FileNotFoundError: no such evaluation.
        """
        res = self.results(name)
        filters = dict(filters or {})
        unknown = sorted(set(filters) - set(FILTERS))
        if unknown:
            raise BrowseError(f"unknown filters {unknown}; expected some of {list(FILTERS)}")
        first = next(iter(res.retrievals.values()), None)
        correct = [None if first is None else first[i].get("model_correct") for i in range(len(res.queries))]
        completion = [None if first is None else first[i].get("model_completion") for i in range(len(res.queries))]
        buckets_present = {q.bucket for q in res.queries}
        facets = {
            "relation": sorted({q.relation for q in res.queries}),
            "bucket": [b for b in _bucket_order(res) if b in buckets_present],
            "correct": sorted({c for c in correct if c is not None}, reverse=True),
        }
        want: dict[str, Any] = {}
        for key, value in filters.items():
            if key == "correct":  # either value is meaningful, even when no query has it
                if value not in CORRECT_VALUES:
                    raise BrowseError(f"correct: {value!r} is not one of {list(CORRECT_VALUES)}")
                want[key] = CORRECT_VALUES[value]
            elif value not in facets[key]:
                raise BrowseError(f"{key}: {value!r} is not one of this evaluation's values {facets[key]}")
            else:
                want[key] = value
        top_ks = tuple(res.table.get("tailpatch", {}).get("top_ks", metrics_lib.DEFAULT_TAILPATCH_KS))
        queries = []
        for i, q in enumerate(res.queries):
            if any(
                (key == "relation" and q.relation != v)
                or (key == "bucket" and q.bucket != v)
                or (key == "correct" and correct[i] is not v)
                for key, v in want.items()
            ):
                continue
            per_method = {}
            for m in res.methods:
                rec = res.retrievals[m][i]
                deltas = rec.get("proponent_tailpatch") or []
                per_method[m] = {
                    "first_gold_rank": first_gold_rank(rec.get("proponent_ids", []), q.entailing_ids),
                    "tailpatch": deltas,
                    **tailpatch_means(deltas, top_ks),
                }
            queries.append(
                {
                    "query_id": q.query_id,
                    "fact_id": q.fact_id,
                    "relation": q.relation,
                    "subject": q.subject,
                    "object": q.object,
                    "subject_aliases": list(q.subject_aliases),
                    "aliases": list(q.aliases),
                    "prompt": q.prompt,
                    "target": q.target,
                    "bucket": q.bucket,
                    "frequency": q.frequency,
                    "model_completion": completion[i],
                    "model_correct": correct[i],
                    "gold": [{"example_id": int(g), "text": self.texts[int(g)]} for g in q.entailing_ids],
                    "methods": per_method,
                }
            )
        t = res.table
        return finite(
            {
                "name": name,
                "evals": list_evals(self.workdir),
                "methods": [{"name": m, "label": res.label(m)} for m in res.methods],
                "table": {
                    "columns": list(metrics_lib.ATTRIBUTION_METRICS) + [f"tailpatch_at_{k}" for k in top_ks],
                    "rows": t["rows"],
                    **{k: t.get(k) for k in ("num_queries", "model_accuracy", "query_mode", "template_variant", "ci")},
                    "corpus": t.get("corpus"),
                    "checkpoint_step": t.get("model", {}).get("checkpoint_step"),
                },
                "plots": self.plots(name),
                "facets": facets,
                "filters": {k: filters[k] for k in FILTERS if k in filters},
                "num_queries": len(res.queries),
                "queries": queries,
            }
        )

    def plot(self, name: str, file: str) -> bytes:
        """`GET /api/eval/plot`: the PNG `file` (one of `PLOT_FILES`) of evaluation `name`.

        The file must pass `servable` (no symlink, even to a file beside it; the folder none
        either), be a regular file of at most `MAX_PLOT_BYTES`, and start with the PNG
        signature; nothing of a file that fails is returned.

        Raises:
          FileNotFoundError: no such evaluation, `file` not in `PLOT_FILES`, or not written.
          PermissionError: a symlink (`servable`).
          ValueError: not a regular file, too large, or not a PNG.
        """
        if file not in PLOT_FILES:
            raise FileNotFoundError(f"file {file!r}: the explorer serves only the evaluation plots {list(PLOT_FILES)}")
        self.folder(name)
        where = f"{name}/{file}"
        try:
            data = read_servable(self.workdir, where, MAX_PLOT_BYTES)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{where}: not written (`python -m launch.evaluate` writes it beside table.md when the table has its data)"
            ) from None
        except TooLargeError:
            raise ValueError(
                f"{where}: larger than {MAX_PLOT_BYTES} bytes, not a picture evaluate wrote; not served"
            ) from None
        if not data.startswith(PNG_SIGNATURE):
            raise ValueError(
                f"{where}: not a PNG file (it does not start with the PNG signature); not served "
                "(rerun `python -m launch.evaluate` to rewrite the plots)"
            )
        return data

    def plots(self, name: str) -> dict:
        """Which of `PLOT_FILES` evaluation `name` has: `{"files": [servable], "errors": [why
        one present is not], "none": message when there are neither}`."""
        shown, errors = [], []
        for file in PLOT_FILES:
            try:
                self.plot(name, file)
                shown.append(file)
            except FileNotFoundError:
                continue
            except (PermissionError, ValueError, OSError) as e:
                errors.append(str(e))
        none = None if shown or errors else NO_PLOTS.format(files=", ".join(PLOT_FILES))
        return {"files": shown, "errors": errors, "none": none}

    def query_detail(self, name: str, query_id: str, k: int = 10) -> dict:
        """`GET /api/eval/query`: one query's top-`k` proponents per method (`results.proponent_rows`:
        rank, id, score, gold / mention labels, tail-patch delta, text) and its raw records.

        Raises:
          BrowseError: `query_id` is not an id of this evaluation.
          FileNotFoundError: no such evaluation.
        """
        res = self.results(name)
        qi = parse_int("query_id", str(query_id), 0, len(res.queries) - 1)
        return finite(
            {
                "name": name,
                "query_id": qi,
                "proponents": {m: results_lib.proponent_rows(res, qi, m, k=k) for m in res.methods},
                "records": {m: res.retrievals[m][qi] for m in res.methods},
            }
        )


def _bucket_order(res: results_lib.Results) -> list[str]:
    """Bucket names in increasing frequency (the evaluation's own bucket edges), then any others sorted."""
    edges = res.table.get("settings", {}).get("eval", {}).get("bucket_edges") or queries_lib.DEFAULT_BUCKET_EDGES
    order = queries_lib.bucket_order(edges)
    return order + sorted({q.bucket for q in res.queries} - set(order))
