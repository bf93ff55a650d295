"""Table rows by kind: a registry of row kinds, each making retrievers with one interface.

A row (`methods.Method`) names its kind ("gold", "bm25", "dense", "gradient"); a kind is
registered once, in this module or any module imported before use, with
`register(RowKind(name, make))`. `make(method, ctx)` returns a `Retriever`, and the three
consumers call only its interface, never the kind:

- the evaluation (`evaluation.stage`, `make_retrievers`): `retrieve(eq, k)`, the top-k
  proponents of every fact query (and the bottom-k opponents, for gradient rows);
- LDS (`evaluation.lds`): `scores(eq)`, the `[Q, N]` score of every (query, passage) pair;
- the explorer (`serving.engine`): `serve(r_eval)` once at start, a retriever prepared for
  typed queries (or `NotServed` saying why the row is not offered), then `retrieve(typed, k)`
  per typed query (`TypedQueries`).

Expensive state shared by rows (the BM25 index, the dense passage embeddings, featurizers) is
built once per `Context` (`Context.shared`). An unknown kind is refused by name, listing the
registered ones (`row_kind`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from typing import Any, Callable, Protocol

import jax
import numpy as np
from absl import logging

from trackstar_jax import data as data_lib
from trackstar_jax import files
from trackstar_jax.distributed import multihost
from trackstar_jax.distributed import sharding as sharding_lib
from trackstar_jax.evaluation import baselines as baselines_lib
from trackstar_jax.evaluation import embedding as embedding_lib
from trackstar_jax.evaluation import settings as settings_lib
from trackstar_jax.features import vectors as vectors_lib
from trackstar_jax.index import build as build_lib
from trackstar_jax.index import scoring as scoring_lib
from trackstar_jax.index import store as store_lib
from trackstar_jax.index import trak as trak_lib
from trackstar_jax.retrieval import stage as retrieval_stage
from trackstar_jax.retrieval import topk
from trackstar_jax.training import checkpoint as checkpoint_lib

DENSE_DIR = "dense_embeddings"  # workdir folder caching the dense row's passage embeddings


@dataclasses.dataclass
class Retrieved:
    """One method's ranked proponents (and opponents, for gradient methods) per query.

    `token_scores` (gradient rows, when asked): per query the record fields of
    `retrieval.stage.token_scores` for its proponents.
    """

    proponent_ids: list[list[int]]
    proponent_scores: list[list[float]]
    opponent_ids: list[list[int]] | None = None
    opponent_scores: list[list[float]] | None = None
    info: dict = dataclasses.field(default_factory=dict)
    token_scores: list[dict] | None = None


@dataclasses.dataclass
class Context:
    """What every row may need: the typed config, the run, its directory and the mesh, and
    the state rows share (`shared`), built once per context."""

    settings: settings_lib.TableSettings
    workdir: pathlib.Path
    run: checkpoint_lib.Run
    mesh: jax.sharding.Mesh
    cache: dict = dataclasses.field(default_factory=dict)

    def shared(self, key: Any, build: Callable[[], Any]) -> Any:
        """`build()` the first time `key` is asked for in this context, the same object after."""
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]


class QuerySet(Protocol):
    """What a retriever reads of its queries: `query_set.EvalQueries` (evaluation, LDS) or
    `TypedQueries` (the explorer)."""

    encoded: list[tuple[np.ndarray, np.ndarray]]  # (tokens, loss_mask) per query

    def text_queries(self, with_fact_fields: bool = False) -> list[retrieval_stage.TextQuery]: ...

    def r_eval_queries(self) -> list[retrieval_stage.TextQuery]: ...


@dataclasses.dataclass
class TypedQueries:
    """Queries typed by a user (the explorer): text and its encoding, no fact and no evidence
    (`gold` is None). R_eval of a served mixed row is fixed at `serve`, not taken from here."""

    queries: list[retrieval_stage.TextQuery]
    encoded: list[tuple[np.ndarray, np.ndarray]]

    @classmethod
    def encode(cls, run: checkpoint_lib.Run, queries: list[retrieval_stage.TextQuery]) -> TypedQueries:
        """Encodes like the evaluation (`data.encode_query`). Raises ValueError naming a query
        that cannot be encoded."""
        enc = [
            data_lib.encode_query(run.tokenizer, q.prompt, q.target, run.model_cfg.max_len, query_id=q.example_id)
            for q in queries
        ]
        return cls(list(queries), [(e["tokens"], e["loss_mask"]) for e in enc])

    def text_queries(self, with_fact_fields: bool = False) -> list[retrieval_stage.TextQuery]:
        return list(self.queries)

    def r_eval_queries(self) -> list[retrieval_stage.TextQuery]:
        return list(self.queries)


@dataclasses.dataclass
class REvalSet:
    """R_eval's examples for the explorer's mixed rows: the queries and what they are."""

    queries: list[retrieval_stage.TextQuery]
    source: dict


class NotServed(RuntimeError):
    """A row the explorer does not offer; the message says why (and what to do)."""


class Retriever:
    """A table row's retrieval: the one interface of every row kind.

    A kind implements `scores` (LDS) and, when it ranks otherwise than by those scores, `retrieve`;
    `serve` when serving needs state prepared once; `describe` for what the explorer shows of it.
    """

    splits_tokens = False  # whether `retrieve(..., token_scores=True)` works (gradient rows)

    def retrieve(self, qs: QuerySet, k: int, *, token_scores: bool = False) -> Retrieved:
        """Top-`k` proponents of every query of `qs` (default: the top of `scores`, ties by lower id)."""
        if token_scores:
            raise ValueError(f"{type(self).__name__} does not split its scores over tokens")
        s = self.scores(qs)
        ids = [baselines_lib.stable_topk(row, k) for row in s]
        return Retrieved([i.tolist() for i in ids], [row[i].tolist() for row, i in zip(s, ids)])

    def scores(self, qs: QuerySet) -> np.ndarray:
        """float `[Q, N]`: every query's score against every passage (LDS's datamodel)."""
        raise NotImplementedError(f"{type(self).__name__} gives no score matrix")

    def serve(self, r_eval: Callable[[], REvalSet]) -> Retriever:
        """This row prepared for typed queries (the explorer, at start). `r_eval()` gives the
        mixed rows' R_eval set (raising NotServed when there is none).

        Raises:
          NotServed: the row cannot answer a typed query (the message says why).
        """
        return self

    def describe(self) -> dict:
        """Extra fields of the row in the explorer's method list."""
        return {}


@dataclasses.dataclass(frozen=True, eq=False)
class RowKind:
    """One kind of table row, as registered (`register`).

    Attributes:
      name: the `methods.Method.kind` value.
      make: `(method, ctx) -> Retriever`; state shared by rows goes through `ctx.shared`.
      unavailable: `() -> str | None`: why the kind cannot run on this machine (a missing
        optional model, with the command that installs it), None when it can.
      gold_attribution: its proponents are the fact's evidence by definition (the gold row):
        the table shows "gold" for its attribution metrics instead of measuring them.
      check_fits: `(method, ctx) -> {step name: memory.compiled_memory}`: the row's compiled
        steps checked against device memory before an evaluation does any work (raising
        `memory.DoesNotFitError` naming the step and its knob); rows with no compiled step of
        their own check nothing.
    """

    name: str
    make: Callable[[baselines_lib.Method, Context], Retriever]
    unavailable: Callable[[], str | None] = lambda: None
    gold_attribution: bool = False
    check_fits: Callable[[baselines_lib.Method, Context], dict] = lambda m, ctx: {}


ROW_KINDS: dict[str, RowKind] = {}


def register(kind: RowKind) -> RowKind:
    """Adds `kind` to the registry (the explorer lists served rows by kind, in registration order).

    Raises:
      ValueError: another kind already has its name.
    """
    other = ROW_KINDS.get(kind.name)
    if other is not None and other.make is not kind.make:
        raise ValueError(f"row kind {kind.name!r} is already registered (by {other.make.__module__})")
    ROW_KINDS[kind.name] = kind
    return kind


def row_kind(name: str) -> RowKind:
    """The registered kind `name`.

    Raises:
      ValueError: no such kind (names the registered ones).
    """
    if name not in ROW_KINDS:
        raise ValueError(
            f"row kind {name!r} is not registered (known: {', '.join(ROW_KINDS)}; see evaluation.rows.register)"
        )
    return ROW_KINDS[name]


def make_retriever(method: baselines_lib.Method, ctx: Context) -> Retriever:
    """The retriever of one row, from its kind's factory (an unknown kind is refused by name)."""
    return row_kind(method.kind).make(method, ctx)


# `Context.cache` key: the settings of every gradient row of the table (`build_index` writes
# the indices that can share a featurize pass together)
GRADIENT_ROWS = "gradient_rows"


def make_retrievers(methods: list[baselines_lib.Method], ctx: Context) -> dict[str, Retriever]:
    """One retriever per row; BM25 and the dense index are built once per context and shared,
    and gradient indices that can share a featurize pass are written in one (`build_index`)."""
    ctx.cache[GRADIENT_ROWS] = [method_settings(ctx.settings, m) for m in methods if m.kind == "gradient"]
    return {m.name: make_retriever(m, ctx) for m in methods}


# ---------------------------------------------------------------------------------------
# The built-in kinds
# ---------------------------------------------------------------------------------------


class GoldRetriever(Retriever):
    """The fact's own entailing passages, in id order (T-REx gold row: tail-patch only)."""

    def __init__(self, ctx: Context):
        self.num_passages = len(ctx.run.corpus.examples)

    def retrieve(self, eq: QuerySet, k: int, *, token_scores: bool = False) -> Retrieved:
        if token_scores:
            raise ValueError("the gold row does not split its scores over tokens")
        ids = [list((q.gold or ())[:k]) for q in eq.text_queries(with_fact_fields=True)]
        return Retrieved(ids, [[1.0] * len(i) for i in ids])

    def scores(self, eq: QuerySet) -> np.ndarray:
        """1 on the fact's entailing passages, 0 elsewhere."""
        n = self.num_passages
        qs = eq.text_queries(with_fact_fields=True)
        out = np.zeros((len(qs), n), np.float32)
        for qi, q in enumerate(qs):
            out[qi, list(q.gold or ())] = 1.0
        return out

    def serve(self, r_eval: Callable[[], REvalSet]) -> Retriever:
        raise NotServed("the gold row is the fact's evidence passages; a typed query has no fact")


class TextRetriever(Retriever):
    """BM25 or dense embeddings over the passages; the query text is prompt + target (as the
    released retrievals' inputs + targets). `index` is built on first use (`Context.shared`)."""

    def __init__(self, index: Callable[[], Any], mesh: jax.sharding.Mesh | None = None):
        self._index, self.mesh = index, mesh

    @property
    def index(self) -> baselines_lib.BM25 | baselines_lib.DenseEmbedding:
        return self._index()

    def retrieve(self, eq: QuerySet, k: int, *, token_scores: bool = False) -> Retrieved:
        if token_scores:
            raise ValueError("text rows do not split their scores over tokens")
        texts = [q.prompt + q.target for q in eq.text_queries()]
        kw = {"mesh": self.mesh} if self.mesh is not None else {}
        scores, ids = self.index.topk(texts, k, **kw)
        return Retrieved(ids.tolist(), scores.tolist())

    def scores(self, eq: QuerySet) -> np.ndarray:
        index = self.index
        return np.stack([index.scores(q.prompt + q.target) for q in eq.text_queries()])


def _bm25(method: baselines_lib.Method, ctx: Context) -> Retriever:
    ev = ctx.settings.eval
    return TextRetriever(
        lambda: ctx.shared("bm25", lambda: baselines_lib.BM25(ctx.run.corpus.texts, k1=ev.bm25_k1, b=ev.bm25_b))
    )


def _dense(method: baselines_lib.Method, ctx: Context) -> Retriever:
    return TextRetriever(lambda: ctx.shared("dense", lambda: dense_index(ctx)), ctx.mesh)


def build_index(ctx: Context, settings: settings_lib.TableSettings) -> dict:
    """Builds (or reuses) the index of a row's `settings` from the run `ctx` holds (`index.build_from_run`),
    writing in the same pass every other row's unfinished index that can share it
    (`vectors.shared_pass_error`: Exp. 1's index with Exp. 4's, which differ only in the correction)."""
    companions = {}
    for other in ctx.cache.get(GRADIENT_ROWS, ()):
        d = other.index.dir
        if (
            d != settings.index.dir
            and d not in companions
            and other.index.storage == settings.index.storage
            and vectors_lib.shared_pass_error(settings.vectors, other.vectors) is None
            and not (build_lib.index_dir(other.index, ctx.workdir) / "COMPLETE").exists()
        ):
            companions[d] = (other.vectors, other.index)
    return build_lib.build_from_run(
        ctx.run,
        settings.vectors,
        settings.index,
        ctx.workdir,
        mesh_shape=settings.mesh.shape,
        mesh=ctx.mesh,
        companions=list(companions.values()),
    )


class GradientRetriever(Retriever):
    """A gradient row: builds (or reuses) its index, then retrieval's `retrieve_queries` (top / bottom k)."""

    def __init__(self, ctx: Context, method: baselines_lib.Method):
        self.ctx, self.method, self.settings = ctx, method, method_settings(ctx.settings, method)

    def retrieve(self, eq: QuerySet, k: int, *, token_scores: bool = False) -> Retrieved:
        if token_scores:
            raise ValueError("token scores are served by `serve`'s retriever, or retrieval.token_scores")
        summary = build_index(self.ctx, self.settings)
        recs, info = retrieval_stage.retrieve_queries(
            self.ctx.run,
            self.settings,
            self.ctx.workdir,
            eq.text_queries(),
            mesh=self.ctx.mesh,
            k=k,
            r_eval_queries=eq.r_eval_queries(),
            memo=self.ctx.shared,  # rows on one index (λ sweep, Exp. 4 / 5) featurize the queries once
        )
        # where a row's time goes (the stage line has only the total)
        logging.info(
            "retrieve %s: index %.1fs, featurize queries %.1fs, R / λ / row scales %.1fs, top-k %.1fs",
            self.settings.index.dir,
            summary.get("seconds") or 0.0,
            info.get("featurize_seconds", 0.0),
            info.get("scoring_prep_seconds", 0.0),
            info.get("retrieval_seconds", 0.0),
        )
        return Retrieved(
            [r["proponent_ids"] for r in recs],
            [r["proponent_scores"] for r in recs],
            [r["opponent_ids"] for r in recs],
            [r["opponent_scores"] for r in recs],
            info={
                "index": info["index"],
                "index_seconds": summary.get("seconds"),
                "whitening": info["whitening"],
                "statistics": info["statistics"],  # what V, R_train, R_eval, λ came from
                "retrieval_seconds": info.get("retrieval_seconds"),
            },
        )

    def scores(self, eq: QuerySet) -> np.ndarray:
        """The row's full score matrix `[Q, N]`, exactly as retrieval scores it.

        Builds (or reuses) the row's index, then score = (stored row · q') * row_scale (see
        `index.scoring.Scoring`), over the whole index read at once (small corpora only). R_eval
        of a mixed row is the queries themselves (LDS).
        """
        ctx, settings = self.ctx, self.settings
        build_index(ctx, settings)
        reader = retrieval_stage.open_checked_index(ctx.run, settings, ctx.workdir)
        vec_fn = vectors_lib.make_vector_fn(
            ctx.run.graphdef,
            ctx.run.model_cfg,
            settings.vectors,
            ctx.run.params,
            ctx.run.opt_state,
            mesh=ctx.mesh,
            role="query",
        )
        q_raw = retrieval_stage.query_vectors(ctx.run, vec_fn, eq.encoded)
        factor = trak_lib.row_factor(ctx.run, settings.vectors.output_fn, reader)  # TRAK's Q multiplies scores
        scoring = scoring_lib.prepare_scoring(reader, settings.hessian, q_raw, row_factor=factor)
        rows = reader.read_dequantized(0, reader.num_rows)
        return (scoring.finalize_queries(q_raw) @ np.asarray(rows, np.float32).T) * scoring.row_scale[None, :]

    def serve(self, r_eval: Callable[[], REvalSet]) -> Retriever:
        """The row on its finished index, with featurizer and scoring (R^{-1/2}, unit norm, row
        scales, R_eval of a mixed row from `r_eval()`) prepared once; featurizers and R_eval's
        vectors shared by rows of one index.

        Raises:
          NotServed: a reranked row (an offline stage), no index, no R_eval set for a mixed row.
        """
        ctx, ms, run = self.ctx, self.settings, self.ctx.run
        if self.method.rerank_k:  # K exact gradients per query: an offline stage
            raise NotServed("two-stage reranking is not served (launch.retrieve with retrieval.rerank_k)")
        path = build_lib.index_dir(ms.index, ctx.workdir)
        if not (path / "manifest.json").is_file():
            raise NotServed(f"no index at {path}")
        reader = retrieval_stage.open_checked_index(run, ms, ctx.workdir)
        key = (ms.vectors.output_fn, ms.vectors.correction, str(path))
        vec_fn = ctx.shared(
            ("query_vec_fn", key),
            lambda: vectors_lib.make_vector_fn(
                run.graphdef, run.model_cfg, ms.vectors, run.params, run.opt_state, mesh=ctx.mesh, role="query"
            ),
        )
        r_eval_set, r_eval_raw = None, None
        if ms.hessian.mode == "mixed":
            r_eval_set = r_eval()

            def featurize_r_eval() -> np.ndarray:
                t0 = time.perf_counter()
                out = retrieval_stage.featurize_text_queries(run, vec_fn, r_eval_set.queries)
                logging.info(
                    "serve: featurized R_eval's %d examples for %s in %.1fs",
                    len(r_eval_set.queries),
                    path,
                    time.perf_counter() - t0,
                )
                return out

            r_eval_raw = ctx.shared(("r_eval_raw", key), featurize_r_eval)
        factor = trak_lib.row_factor(run, ms.vectors.output_fn, reader)  # TRAK's Q multiplies scores
        scoring = scoring_lib.prepare_scoring(reader, ms.hessian, r_eval_raw, row_factor=factor)
        stats = scoring_lib.statistics_record(run, ms.vectors.correction, scoring.whitening)
        info = None
        if r_eval_set is not None:
            w = scoring.whitening
            info = {
                **r_eval_set.source,
                "num_examples": len(r_eval_set.queries),
                "mix_lambda": w.mix_lambda,
                "lambda": "automatic" if ms.hessian.mix_lambda < 0 else "fixed",
                "lambda_component": w.component,
            }
            logging.info(
                "serve: %s scores with R_eval from %s, λ = %.4g",
                self.method.name,
                r_eval_set.source["kind"],
                w.mix_lambda,
            )
        return ServedGradient(ctx, ms, reader, vec_fn, scoring, info, stats)


@dataclasses.dataclass
class ServedGradient(Retriever):
    """A gradient row prepared once (`GradientRetriever.serve`): a query runs the same steps as
    `retrieval.stage.retrieve_queries` (same padded batch, same `stream_topk`) with the scoring
    prepared at start, so its result equals the record of a retrieval made with the same R.
    `r_eval` (mode "mixed") says where R_eval came from and the λ used."""

    ctx: Context
    settings: settings_lib.TableSettings
    reader: Any
    vec_fn: vectors_lib.VectorFn
    scoring: scoring_lib.Scoring
    r_eval: dict | None = None
    statistics: dict | None = None  # what V, R_train, R_eval, λ came from (`scoring.statistics_record`)

    splits_tokens = True

    def retrieve(self, qs: QuerySet, k: int, *, token_scores: bool = False) -> Retrieved:
        run, st = self.ctx.run, self.settings.retrieval
        q_raw = retrieval_stage.query_vectors(run, self.vec_fn, qs.encoded)
        q_prime = self.scoring.finalize_queries(q_raw)
        res = topk.stream_topk(
            q_prime,
            self.reader,
            k,
            st.read_chunk_rows,
            mesh=self.ctx.mesh,
            row_scale=self.scoring.row_scale,
            query_batch_size=st.query_batch_size,
        )
        out = Retrieved(
            [list(map(int, x)) for x in res.top_ids],
            [list(map(float, x)) for x in res.top_scores],
            [list(map(int, x)) for x in res.bottom_ids],
            [list(map(float, x)) for x in res.bottom_scores],
        )
        if token_scores:
            out.token_scores = [
                retrieval_stage.token_scores(run, self.vec_fn, self.scoring, self.reader, q_prime[qi], pair, ids)
                for qi, (pair, ids) in enumerate(zip(qs.encoded, res.top_ids))
            ]
        return out

    def describe(self) -> dict:
        s = self.settings
        out = {
            "index": str(self.reader.path.relative_to(self.ctx.workdir)),
            "output_fn": s.vectors.output_fn,
            "correction": s.vectors.correction,
            "hessian": s.hessian.mode,
            "unit_norm": s.hessian.unit_norm,
        }
        if self.r_eval is not None:
            out.update(mix_lambda=self.r_eval["mix_lambda"], r_eval=self.r_eval)
        if self.statistics is not None:
            out.update(statistics=self.statistics, thin_notes=self.statistics["thin_notes"])
        return out


def _dense_unavailable() -> str | None:
    return None if embedding_lib.is_available() else f"model not installed ({embedding_lib.INSTALL_COMMAND})"


# Registration order is the explorer's order of rows: gradient rows, then the text baselines.
def _gradient_fits(m: baselines_lib.Method, ctx: Context) -> dict:
    """The gradient row's featurize step (`vectors.batch_size` rows of `model.max_len` tokens, on
    the mesh `build_index` uses, whose compile it then reuses) and its retrieval read chunk
    (`retrieval.read_chunk_rows`, one query batch, `eval.num_proponents` candidates)."""
    run, settings = ctx.run, ctx.settings
    index_mesh = sharding_lib.make_mesh(settings.mesh.shape, devices=jax.local_devices())  # as build_index's
    score_mesh = index_mesh if multihost.is_multiprocess() else ctx.mesh  # as retrieve_queries'
    ms = method_settings(settings, m)
    vec_fn = vectors_lib.make_vector_fn(
        run.graphdef, run.model_cfg, ms.vectors, run.params, run.opt_state, mesh=index_mesh, role="index"
    )
    qbs = settings.retrieval.query_batch_size
    return {
        f"featurize:{m.name}": vec_fn.check_fits(run.params),
        f"retrieve:{m.name}": topk.check_fits(
            qbs,
            vec_fn.dim,
            store_lib.NP_DTYPES[ms.index.dtype],
            settings.eval.num_proponents,
            settings.retrieval.read_chunk_rows,
            score_mesh,
            num_rows=len(run.corpus.examples),
            query_batch_size=qbs,
        ),
    }


register(RowKind("gradient", lambda m, ctx: GradientRetriever(ctx, m), check_fits=_gradient_fits))
register(RowKind("bm25", _bm25))
register(RowKind("dense", _dense, unavailable=_dense_unavailable))
register(RowKind("gold", lambda m, ctx: GoldRetriever(ctx), gold_attribution=True))


def method_settings(settings: settings_lib.TableSettings, m: baselines_lib.Method) -> settings_lib.TableSettings:
    """`settings` with the row's vectors / hessian settings and its own index directory
    (`methods.Method.overrides`: rows that share (output_fn, correction) share an index)."""
    return settings.replace(m.overrides(settings.index.dir))


def dense_index(ctx: Context) -> baselines_lib.DenseEmbedding:
    """The dense row's passage embeddings, cached in `workdir/dense_embeddings/`.

    The cache is reused when its manifest matches the corpus fingerprint and the model's
    weights / tokenizer (sha256); otherwise it is recomputed and replaced (logged).

    Raises:
      embedding.MissingModelError: the model package is not installed (names the pip command).
    """
    run = ctx.run
    enc = embedding_lib.make_encoder(mesh=ctx.mesh)
    want = {
        "model": embedding_lib.MODEL_NAME,
        "model_sha256": embedding_lib.model_fingerprint(enc.directory),
        "max_seq_length": enc.cfg.max_seq_length,
        "corpus_fingerprint": run.corpus.fingerprint,
        "num_rows": len(run.corpus.examples),
        "dim": enc.dim,
    }
    d = ctx.workdir / DENSE_DIR
    if (d / "manifest.json").is_file() and (d / "embeddings.npy").is_file():
        if json.loads((d / "manifest.json").read_text()) == want:
            logging.info("eval: dense row reuses the passage embeddings in %s", d)
            return baselines_lib.DenseEmbedding(run.corpus.texts, enc, embeddings=np.load(d / "embeddings.npy"))
        logging.info("eval: %s was made for another corpus or model; recomputing it", d)
    t0 = time.perf_counter()
    dense = baselines_lib.DenseEmbedding(run.corpus.texts, enc)
    logging.info(
        "eval: embedded %d passages with %s in %.1fs",
        len(run.corpus.examples),
        embedding_lib.MODEL_NAME,
        time.perf_counter() - t0,
    )
    if jax.process_index() == 0:
        files.atomic_write(d / "embeddings.npy", files.npy_bytes(dense.embeddings))
        files.atomic_write_json(d / "manifest.json", want)  # written last: marks the cache complete
    return dense
