"""One retriever per table row (T-REx gold, BM25, dense embeddings, gradient indices), one interface.

`make_retriever(method, context)` returns an object with `retrieve(eq, k) -> Retrieved`;
the evaluation stage loops over rows without knowing their kind.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from typing import Protocol

import jax
import numpy as np
from absl import logging

from trackstar_jax import config as config_lib
from trackstar_jax import files
from trackstar_jax.evaluation import baselines as baselines_lib
from trackstar_jax.evaluation import embedding as embedding_lib
from trackstar_jax.evaluation import query_set
from trackstar_jax.index import build as build_lib
from trackstar_jax.retrieval import stage as retrieval_stage
from trackstar_jax.training import checkpoint as checkpoint_lib

DENSE_DIR = "dense_embeddings"  # workdir folder caching the dense row's passage embeddings


@dataclasses.dataclass
class Retrieved:
    """One method's ranked proponents (and opponents, for gradient methods) per query."""

    proponent_ids: list[list[int]]
    proponent_scores: list[list[float]]
    opponent_ids: list[list[int]] | None = None
    opponent_scores: list[list[float]] | None = None
    info: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Context:
    """What every row may need: the typed config, the run, its directory and the mesh."""

    settings: config_lib.Settings
    workdir: pathlib.Path
    run: checkpoint_lib.Run
    mesh: jax.sharding.Mesh


class Retriever(Protocol):
    """A table row's retrieval: top-`k` proponents of every query of `eq`."""

    def retrieve(self, eq: query_set.EvalQueries, k: int) -> Retrieved: ...


class GoldRetriever:
    """The fact's own entailing passages, in id order (T-REx gold row: tail-patch only)."""

    def retrieve(self, eq: query_set.EvalQueries, k: int) -> Retrieved:
        ids = [list(q.entailing_ids[:k]) for q in eq.queries]
        return Retrieved(ids, [[1.0] * len(i) for i in ids])


class TextRetriever:
    """BM25 or dense embeddings over the passages; the query text is prompt + target (as the
    released retrievals' inputs + targets)."""

    def __init__(self, index: baselines_lib.BM25 | baselines_lib.DenseEmbedding, mesh: jax.sharding.Mesh | None = None):
        self.index, self.mesh = index, mesh

    def retrieve(self, eq: query_set.EvalQueries, k: int) -> Retrieved:
        texts = [q.prompt + q.target for q in eq.queries]
        kw = {"mesh": self.mesh} if isinstance(self.index, baselines_lib.DenseEmbedding) else {}
        scores, ids = self.index.topk(texts, k, **kw)
        return Retrieved(ids.tolist(), scores.tolist())


class GradientRetriever:
    """A gradient row: builds (or reuses) its index, then retrieval's `retrieve_queries` (top / bottom k)."""

    def __init__(self, ctx: Context, method: baselines_lib.Method):
        self.ctx, self.settings = ctx, method_settings(ctx.settings, method)

    def retrieve(self, eq: query_set.EvalQueries, k: int) -> Retrieved:
        summary = build_lib.build_from_run(self.ctx.run, self.settings, self.ctx.workdir, mesh=self.ctx.mesh)
        recs, info = retrieval_stage.retrieve_queries(
            self.ctx.run,
            self.settings,
            self.ctx.workdir,
            eq.text_queries(),
            mesh=self.ctx.mesh,
            k=k,
            r_eval_queries=eq.r_eval_queries(),
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
                "retrieval_seconds": info.get("retrieval_seconds"),
            },
        )


def method_settings(settings: config_lib.Settings, m: baselines_lib.Method) -> config_lib.Settings:
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


def make_retrievers(methods: list[baselines_lib.Method], ctx: Context) -> dict[str, Retriever]:
    """One retriever per row; BM25 and the dense index are built once and shared."""
    ev, shared = ctx.settings.eval, {}
    out: dict[str, Retriever] = {}
    for m in methods:
        if m.kind == "gold":
            out[m.name] = GoldRetriever()
        elif m.kind == "bm25":
            if "bm25" not in shared:
                shared["bm25"] = baselines_lib.BM25(ctx.run.corpus.texts, k1=ev.bm25_k1, b=ev.bm25_b)
            out[m.name] = TextRetriever(shared["bm25"])
        elif m.kind == "dense":
            if "dense" not in shared:
                shared["dense"] = dense_index(ctx)
            out[m.name] = TextRetriever(shared["dense"], ctx.mesh)
        else:
            out[m.name] = GradientRetriever(ctx, m)
    return out
