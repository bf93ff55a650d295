"""The proponent explorer's loaded state and its one query: featurize + score + top-k.

`Engine` holds the run, checked and loaded once (`stages.open_engine`), and asks every table row's
retriever (`evaluation.rows`, by the row's registered kind) to `serve`: a gradient row opens
its index when the workdir has one that matches the run and keeps its featurizer and scoring
setup (R^{-1/2}, unit norm, row scales), prepared once at start; a row that cannot answer a
typed query says why (`skipped`). A query runs the same steps as
`retrieval.stage.retrieve_queries` for one `TextQuery` (same encoding, same padded batch, same
`stream_topk`) with that scoring, so its result equals the record of a retrieval made with the
same R.

Rows with hessian mode "mixed" (TrackStar, R = λ R_eval + (1-λ) R_train) need R_eval from a
task-specific set of examples (§3, §A.1.3), never from the one served query (its rank is too
low for the automatic λ, and the scores would depend on the query twice). At start the
engine takes the query set that retrieval with this config runs: the jsonl at
`config.retrieval.queries` when set (as `launch.retrieve`), else the evaluation's fact
queries (`evaluation.query_set.make_eval_queries`; their task prompts when
`hessian.r_eval_source = "task_prompts"`, `EvalQueries.r_eval_queries`). It featurizes them
with the row's featurizer (`retrieval.stage.featurize_text_queries`) and calls
`index.scoring.prepare_scoring` once, so a served evaluation query equals the evaluation's
record for it (and the automatic λ is the evaluation's). When that set cannot be built (a
corpus without facts and no query file), the mixed rows are not offered and `skipped` says
why: serving them with a per-query R_eval would be another method under TrackStar's name.
`describe()` reports, per mixed row, where R_eval came from and the λ used.

BM25 and the dense-embedding row (when its model is installed) rank by text with the
evaluation's own retriever; their index is built on the first query.

Queries are serialized by one lock: the device runs one query at a time.
"""

from __future__ import annotations

import os
import pathlib
import re
import threading
import time
from typing import Any

import jax
from absl import logging

from trackstar_jax import methods as methods_lib
from trackstar_jax.evaluation import queries as queries_lib
from trackstar_jax.evaluation import query_set
from trackstar_jax.evaluation import rows as rows_lib
from trackstar_jax.evaluation import settings as settings_lib
from trackstar_jax.models import generate as generate_lib
from trackstar_jax.retrieval import records
from trackstar_jax.retrieval import stage as retrieval_stage
from trackstar_jax.training import checkpoint as checkpoint_lib

MAX_K = 1000  # the API's largest k (also bounded by the index size)


class QueryError(ValueError):
    """A query the server refuses (bad prompt / target / method / k); the message says why."""


# Characters no prompt needs and tokenizers choke on: lone surrogates (not encodable as
# UTF-8), NUL and the other C0 / C1 controls except tab, newline and carriage return.
_BAD_CHARS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")


def check_text(field: str, text: str) -> None:
    """Raises QueryError naming `field` and the position of the first `_BAD_CHARS` character."""
    m = _BAD_CHARS.search(text)
    if m:
        raise QueryError(
            f"{field}: character {m.group()!r} at position {m.start()} is not allowed "
            "(lone surrogates and control characters other than tab / newline)"
        )


class _REvalUnavailable(rows_lib.NotServed):
    """The mixed rows' R_eval set cannot be built (the message says why and what to give)."""


class Engine:
    """A loaded run and its retrievers, answering one query at a time.

    Args:
      settings: the run's typed config (checked against the workdir).
      workdir: the run directory (trained, with at least one index or none for text rows only).
      mesh: the device mesh `run` is loaded on.
      run: the run, checked and loaded on `mesh` (`stages.open_run`; `stages.open_engine` makes
        the whole engine).
      dense: offer the dense-embedding row when its model is installed (its passage
        embeddings are computed, or reused from `workdir/dense_embeddings/`, on first use).
    """

    def __init__(
        self,
        settings: settings_lib.TableSettings,
        workdir: str | os.PathLike,
        *,
        mesh: jax.sharding.Mesh,
        run: checkpoint_lib.Run,
        dense: bool = True,
    ):
        disabled_kinds = () if dense else ("dense",)  # the dense row computes passage embeddings on first use
        self.settings, self.workdir = settings, pathlib.Path(workdir).resolve()
        self.mesh, self.run = mesh, run
        self._lock = threading.Lock()
        self._ctx = rows_lib.Context(self.settings, self.workdir, self.run, self.mesh)
        self._r_eval_set: rows_lib.REvalSet | Exception | None = None  # built on the first mixed row
        self._rows: dict[str, rows_lib.Retriever] = {}  # method -> its retriever, prepared to serve
        self.skipped: dict[str, str] = {}  # method -> why it is not offered
        order = list(rows_lib.ROW_KINDS)
        for name, m in sorted(methods_lib.METHODS.items(), key=lambda nm: order.index(nm[1].kind)):
            kind = rows_lib.row_kind(m.kind)
            why = "disabled" if m.kind in disabled_kinds else kind.unavailable()
            if why:
                self.skipped[name] = why
                continue
            try:
                self._rows[name] = rows_lib.make_retriever(m, self._ctx).serve(self.r_eval_set)
            except rows_lib.NotServed as e:
                self.skipped[name] = str(e)
                logging.info("serve: method %s not offered: %s", name, e)
            except Exception as e:  # noqa: BLE001 -- an unusable index is skipped, not fatal: say why
                self.skipped[name] = f"{type(e).__name__}: {e}"
                logging.warning("serve: method %s not offered: %s", name, self.skipped[name])

    def r_eval_set(self) -> rows_lib.REvalSet:
        """R_eval's examples for the mixed rows, built once (see the module docstring): the jsonl
        at `config.retrieval.queries` when set, else the evaluation's `r_eval_queries()`.

        Raises:
          _REvalUnavailable: neither can be built (the message says why and what to give).
        """
        if self._r_eval_set is None:
            t0 = time.perf_counter()
            s = self.settings
            try:
                if s.retrieval.queries:
                    qs = retrieval_stage.load_text_queries(s.retrieval.queries)
                    if not qs:
                        raise ValueError(f"{s.retrieval.queries} holds no query")
                    source = {"kind": "retrieval_queries", "path": str(s.retrieval.queries)}
                else:
                    eq = query_set.make_eval_queries(self.run, s)
                    qs = eq.r_eval_queries()
                    source = {
                        "kind": "task_prompts" if eq.r_eval_prompts else "eval_queries",
                        "query_mode": s.eval.query_mode,
                        "template_variant": s.eval.template_variant,
                    }
                self._r_eval_set = rows_lib.REvalSet(qs, source)
                logging.info(
                    "serve: R_eval of the mixed rows: %d %s (built in %.1fs)",
                    len(qs),
                    source["kind"],
                    time.perf_counter() - t0,
                )
            except Exception as e:  # noqa: BLE001 -- kept: every mixed row is skipped with this reason
                self._r_eval_set = _REvalUnavailable(
                    f"hessian mode 'mixed' needs R_eval from a task's examples, and none could be built: "
                    f"{type(e).__name__}: {e}. Give --config.retrieval.queries=<jsonl of prompt/target queries of "
                    "the task> (R_eval is then those queries, as in launch.retrieve), or use another method"
                )
        if isinstance(self._r_eval_set, Exception):
            raise self._r_eval_set
        return self._r_eval_set

    # ------------------------------------------------------------------------------------
    # What is offered
    # ------------------------------------------------------------------------------------

    @property
    def methods(self) -> list[str]:
        """Available method names, by kind in registration order: gradient rows with an index,
        then "bm25" (and "dense")."""
        return list(self._rows)

    def describe(self) -> dict:
        """`GET /api/methods`: every available method with its label and settings."""
        out = []
        for name in self.methods:
            m = methods_lib.METHODS[name]
            out.append({"name": name, "kind": m.kind, "label": m.label, **self._rows[name].describe()})
        default = "trackstar" if "trackstar" in self._rows else (self.methods[0] if self.methods else None)
        return {
            "methods": out,
            "default": default,
            "skipped": self.skipped,
            "num_passages": self.num_passages,
            "max_k": self.max_k,
            "max_len": self.run.model_cfg.max_len,
            "step": int(self.run.step),
        }

    @property
    def num_passages(self) -> int:
        return len(self.run.corpus.texts)

    @property
    def max_k(self) -> int:
        return min(MAX_K, self.num_passages)

    # ------------------------------------------------------------------------------------
    # Queries
    # ------------------------------------------------------------------------------------

    def complete(self, prompt: str) -> str:
        """The model's greedy completion of `prompt`, as a target (" answer"), cut like the
        evaluation's prediction-mode targets (`evaluation.queries.cut_completion`)."""
        c = generate_lib.complete_batched(
            self.run.graphdef,
            self.run.params,
            self.run.tokenizer,
            [prompt],
            self.settings.eval.max_new_tokens,
            self.run.model_cfg.max_len,
            batch_size=1,
        )[0]
        c = queries_lib.cut_completion(c)
        return " " + c if c else ""

    def check(self, prompt: Any, target: Any, k: Any, method: Any) -> tuple[str, str | None, int, str]:
        """Validates a request's fields; raises QueryError naming the bad one."""
        if not isinstance(prompt, str) or not prompt.strip():
            raise QueryError("prompt: must be a non-empty string")
        if target is not None and not isinstance(target, str):
            raise QueryError("target: must be a string (or absent for the model's own completion)")
        check_text("prompt", prompt)
        if target is not None:
            check_text("target", target)
        if method not in self.methods:
            why = f" ({self.skipped[method]})" if isinstance(method, str) and method in self.skipped else ""
            raise QueryError(f"method: {method!r} is not available{why}; available: {self.methods}")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.max_k:
            raise QueryError(f"k: must be an integer in [1, {self.max_k}], got {k!r}")
        tok, max_len = self.run.tokenizer, self.run.model_cfg.max_len
        n = 1 + len(tok.encode(prompt))
        if n >= max_len:
            raise QueryError(f"prompt: {n} tokens (with BOS) leave no room for a target below model.max_len={max_len}")
        if target is not None:
            if not target.strip() or not tok.encode(target):
                raise QueryError(f"target: {target!r} encodes to no tokens")
            if n + len(tok.encode(target)) > max_len:
                raise QueryError(
                    f"prompt + target: {n + len(tok.encode(target))} tokens exceed model.max_len={max_len}"
                )
        return prompt, target, k, method

    def query(
        self,
        prompt: Any,
        target: Any = None,
        k: Any = 10,
        method: Any = "trackstar",
        example_id: Any = 0,
        token_scores: Any = False,
    ) -> dict:
        """One query: `{"completion", "target", "proponents", "opponents", "method", "seconds", "record"}`.

        `record` is the query's PAIR-code-schema line (as `retrieve_queries` writes it). With
        `token_scores` (gradient rows only: `retrieval.attribution`), each proponent item has
        `token_scores` `{"tokens", "scores", "target_tokens", "target_scores"}` and the record
        the fields `retrieve_queries` writes with `retrieval.token_scores`.

        Raises:
          QueryError: bad input (the message names the field).
        """
        prompt, target, k, method = self.check(prompt, target, k, method)
        if not isinstance(token_scores, bool):
            raise QueryError(f"token_scores: must be true or false, got {token_scores!r}")
        if token_scores and not self._rows[method].splits_tokens:
            raise QueryError(f"token_scores: only gradient rows split their score over tokens, not {method!r}")
        with self._lock:  # one query on the device at a time
            t0 = time.perf_counter()
            completion = None
            if target is None:
                completion = self.complete(prompt)
                if not completion:
                    raise QueryError("target: absent, and the model's completion of the prompt is empty; give a target")
                target = completion
                self.check(prompt, target, k, method)
            q = retrieval_stage.TextQuery(example_id, prompt, target)
            rec = self._answer(q, k, method, token_scores)
            seconds = time.perf_counter() - t0

        def items(kind):
            return [
                {"example_id": i, "score": s, "text": t}
                for i, s, t in zip(rec.get(f"{kind}_ids", []), rec.get(f"{kind}_scores", []), rec.get(f"{kind}s", []))
            ]

        proponents = items("proponent")
        for i, (p, t) in enumerate(zip(rec.get("proponent_token_scores", []), rec.get("target_token_scores", []))):
            proponents[i]["token_scores"] = {
                "tokens": p["tokens"],
                "scores": p["scores"],
                "target_tokens": rec["target_tokens"],
                "target_scores": t,
            }
        return {
            "completion": completion,
            "target": target,
            "proponents": proponents,
            "opponents": items("opponent"),
            "method": method,
            "seconds": seconds,
            "record": rec,
        }

    def _answer(self, q: retrieval_stage.TextQuery, k: int, method: str, token_scores: bool = False) -> dict:
        """The row's retriever on one typed query (the device work), as a PAIR-code record."""
        try:
            typed = rows_lib.TypedQueries.encode(self.run, [q])
        except ValueError as e:
            raise QueryError(str(e)) from e
        r = self._rows[method].retrieve(typed, k, token_scores=token_scores)
        rec = records.pair_record(
            q.example_id,
            q.prompt,
            q.target,
            self.run.corpus.texts,
            r.proponent_ids[0],
            r.proponent_scores[0],
            r.opponent_ids[0] if r.opponent_ids is not None else None,
            r.opponent_scores[0] if r.opponent_scores is not None else None,
        )
        if r.token_scores is not None:
            rec.update(r.token_scores[0])
        return rec
