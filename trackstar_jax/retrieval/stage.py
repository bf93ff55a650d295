"""Stage 3's work (`write_retrieval`; the stage is `stages.retrieve`): proponents and opponents of text queries over the whole index (exact, §4).

Each query (prompt + target, loss on the target tokens only) is featurized with the same
model, projection and correction as the index (checked against its manifest), finalised
with the same R (`config.hessian`), and scored against every row (`topk.stream_topk`).
Outputs go to `workdir/retrieval/<name>.jsonl` (PAIR-code schema, `records.py`) with a
`<name>.manifest.json` saying what produced them.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import pathlib
import time
from typing import Any, Callable, Protocol, Sequence

import jax
import numpy as np
from absl import logging

from trackstar_jax import data as data_lib
from trackstar_jax import files
from trackstar_jax.distributed import multihost, runtime
from trackstar_jax.distributed import sharding as sharding_lib
from trackstar_jax.features import vectors as vectors_lib
from trackstar_jax.index import build as build_lib
from trackstar_jax.index import hessian as hessian_lib
from trackstar_jax.index import manifest as manifest_lib
from trackstar_jax.index import scoring as scoring_lib
from trackstar_jax.index import store as store_lib
from trackstar_jax.index import trak as trak_lib
from trackstar_jax.retrieval import attribution, merge, records, topk
from trackstar_jax.retrieval import rerank as rerank_lib
from trackstar_jax.training import checkpoint as checkpoint_lib
from trackstar_jax.training import logs

RETRIEVAL_DIR = "retrieval"
RETRIEVAL_FORMAT = "trackstar_jax.retrieval/1"


@dataclasses.dataclass(frozen=True)
class RetrievalSettings:
    """`config.retrieval` (see experiments/base.py for the meaning of each key)."""

    top_k: int = 10
    query_batch_size: int = 64
    read_chunk_rows: int = 65_536
    queries: str = ""
    output: str = ""
    overwrite: bool = False
    token_scores: bool = False
    rerank_k: int = 0
    precision: str = "float32"

    def __post_init__(self):
        if self.precision not in runtime.MATMUL_PRECISIONS:
            raise ValueError(
                f"retrieval.precision must be one of {tuple(runtime.MATMUL_PRECISIONS)}, got {self.precision!r}"
            )
        for key in ("top_k", "query_batch_size", "read_chunk_rows"):
            if getattr(self, key) < 1:
                raise ValueError(f"retrieval.{key} must be >= 1, got {getattr(self, key)}")
        if self.rerank_k < 0:
            raise ValueError(f"retrieval.rerank_k must be >= 0 (0 = no reranking), got {self.rerank_k}")
        if self.output and (pathlib.Path(self.output).name != self.output or self.output.startswith(".")):
            raise ValueError(f"retrieval.output must be a plain file name stem, got {self.output!r}")


class RowSettings(Protocol):
    """The sections a gradient row's retrieval reads (`config.Settings` has them; a table row's
    `evaluation.rows.method_settings` too): typed by what is read, not by the whole config."""

    @property
    def vectors(self) -> vectors_lib.VectorConfig: ...

    @property
    def hessian(self) -> hessian_lib.HessianConfig: ...

    @property
    def index(self) -> manifest_lib.IndexSettings: ...

    @property
    def retrieval(self) -> RetrievalSettings: ...

    @property
    def mesh(self) -> sharding_lib.MeshSettings: ...


@dataclasses.dataclass(frozen=True)
class TextQuery:
    """A query given as text: `prompt` + `target` (the target starts with a space, " Paris").

    `extra` fields are copied into the query's output record (e.g. fact_id, model_correct);
    `gold` (entailing passage ids of a fact query) adds `proponent_correct`.
    """

    example_id: Any
    prompt: str
    target: str
    extra: tuple[tuple[str, Any], ...] = ()
    gold: tuple[int, ...] | None = None
    where: str = ""  # "file:line" of a query read from a file (for error messages)


QUERY_KEYS = ("prompt", "target", "example_id")


def load_text_queries(path: str | os.PathLike) -> list[TextQuery]:
    """Reads a jsonl of `{"prompt", "target"[, "example_id"]}` (example_id defaults to the line number).

    Checked like a corpus: every line names its file:line when it is refused.

    Raises:
      files.InputError / ValueError: a malformed line (bad UTF-8 or JSON, a missing, empty or
        unknown field, a NUL character, a repeated example_id), or no query at all.
    """
    out, seen = [], {}
    for where, rec in files.read_jsonl(path):
        if not isinstance(rec, dict) or not all(isinstance(rec.get(k), str) for k in ("prompt", "target")):
            raise ValueError(f"{where}: expected an object with string fields 'prompt' and 'target'")
        unknown = sorted(set(rec) - set(QUERY_KEYS))
        if unknown:
            near = difflib.get_close_matches(unknown[0], QUERY_KEYS, n=1)
            hint = f' (did you mean "{near[0]}"?)' if near else ""
            raise files.InputError(
                f"{where}: unknown field(s) {unknown}{hint}; a query has {list(QUERY_KEYS)} (example_id optional)"
            )
        if not rec["prompt"].strip():
            raise ValueError(f"{where}: the prompt is empty (a query needs a prompt before its target)")
        if not rec["target"].strip():
            raise ValueError(f"{where}: the target is empty (the query's loss is on the target tokens)")
        files.check_text(rec["prompt"], where, "prompt")
        files.check_text(rec["target"], where, "target")
        eid = rec.get("example_id", len(out))
        key = json.dumps(eid)
        if key in seen:
            raise files.InputError(
                f"{where}: example_id {eid!r} is already used at line {seen[key].rsplit(':', 1)[1]}; "
                "each query needs its own id (its output record is keyed by it)"
            )
        seen[key] = where
        out.append(TextQuery(eid, rec["prompt"], rec["target"], where=where))
    if not out:
        raise files.InputError(
            f'{path}: no queries (the file is empty or blank); give one {{"prompt", "target"}} object per line'
        )
    return out


def query_vectors(
    run: checkpoint_lib.Run, vec_fn: vectors_lib.VectorFn, encoded: list[tuple[np.ndarray, np.ndarray]]
) -> np.ndarray:
    """Raw query vectors `[Q, d]` (loss on the target tokens only), in batches of `vectors.batch_size`.

    On a mesh that spans several processes this is one SPMD program: every process builds the
    same batches, its devices featurize their rows, and the vectors are gathered to all.
    """
    bs = vec_fn.vec_cfg.batch_size
    seq_len = max(len(t) for t, _ in encoded)
    out = []
    starts = range(0, len(encoded), bs)
    for lo in logs.progress(starts, total=len(starts), desc="featurize queries", unit="batch"):
        items = encoded[lo : lo + bs]
        batch = data_lib.pad_batch(items, list(range(lo, lo + len(items))), bs, seq_len)
        if vec_fn.mesh.is_multi_process:
            placed = sharding_lib.device_batch({k: batch[k] for k in ("tokens", "loss_mask")}, vec_fn.mesh)
            vecs, aux = sharding_lib.to_host(vec_fn.jitted(run.params, vec_fn.precond, placed))
            vectors_lib.check_outputs(vecs, aux, batch["example_id"])
        else:
            vecs = vec_fn(run.params, vec_fn.precond, batch)
        out.append(np.asarray(vecs)[: len(items)])
    return np.concatenate(out)


def encode_text_queries(run: checkpoint_lib.Run, queries: Sequence[TextQuery]) -> list[dict]:
    """Text queries -> `data.encode_query` dicts (loss on the target tokens).

    Raises:
      ValueError: a query that cannot be encoded (names it: its file:line, else its id).
    """
    return [
        data_lib.encode_query(
            run.tokenizer, q.prompt, q.target, run.model_cfg.max_len, query_id=q.where or q.example_id
        )
        for q in queries
    ]


def _pairs(encoded: Sequence[dict]) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(e["tokens"], e["loss_mask"]) for e in encoded]


def featurize_text_queries(
    run: checkpoint_lib.Run, vec_fn: vectors_lib.VectorFn, queries: Sequence[TextQuery]
) -> np.ndarray:
    """Text queries -> raw query vectors `[Q, d]`: `encode_text_queries` then `query_vectors`.
    Used for the scored queries and for R_eval's examples (also by the explorer).

    Raises:
      ValueError: a query that cannot be encoded (names it: its file:line, else its id).
    """
    return query_vectors(run, vec_fn, _pairs(encode_text_queries(run, queries)))


def same_text(a: Sequence[TextQuery], b: Sequence[TextQuery]) -> bool:
    """Whether two query lists featurize alike: the same (prompt, target) in the same order."""
    return [(q.prompt, q.target) for q in a] == [(q.prompt, q.target) for q in b]


def open_checked_index(
    run: checkpoint_lib.Run, settings: RowSettings, workdir: str | os.PathLike
) -> store_lib.IndexReader:
    """The index of `settings`, refused (naming the manifest field) unless it was built from
    this run's model, optimizer state, vector settings and corpus."""
    path = build_lib.index_dir(settings.index, workdir)
    if not (path / "manifest.json").exists():
        raise FileNotFoundError(f"no index at {path} (run `python -m launch.build_index` with this config first)")
    try:
        reader = store_lib.open_index(
            path,
            expect=build_lib.expected_identity(run, settings.vectors, settings.index.storage, settings.vectors.dim),
        )
    except store_lib.IndexMismatchError as e:
        # The index records the checksum digest of the checkpoint it was built from: when the
        # run's checkpoint of that step has other files now, the checkpoint changed, not the index.
        built = store_lib.read_manifest(path).get("info", {}).get("checkpoint")
        now = checkpoint_lib.checkpoint_record(run.workdir, run.step)
        if built and now and built["step_dir"] == now["step_dir"] and built["digest"] != now["digest"]:
            raise store_lib.IndexMismatchError(
                f"the run's checkpoint {pathlib.Path(run.workdir) / now['step_dir']} is not the one index {path} was "
                "built from (its files' checksums changed since: it was replaced or re-saved); rebuild the index "
                f"(`python -m launch.build_index`), or put the indexed checkpoint back ({e})"
            ) from None
        raise
    if reader.dtype_name != settings.index.dtype:  # storage is not part of the identity, but the user asked for it
        raise store_lib.IndexMismatchError(
            f"config.index.dtype={settings.index.dtype!r}, but the index at {path} stores {reader.dtype_name!r}: pass "
            f"--config.index.dtype={reader.dtype_name} to use it, or build a {settings.index.dtype} index under another "
            "--config.index.dir"
        )
    return reader


def retrieve_queries(
    run: checkpoint_lib.Run,
    settings: RowSettings,
    workdir: str | os.PathLike,
    queries: Sequence[TextQuery],
    *,
    mesh: jax.sharding.Mesh | None = None,
    k: int | None = None,
    r_eval_queries: Sequence[TextQuery] | None = None,
    memo: Callable[[Any, Callable[[], np.ndarray]], np.ndarray] | None = None,
) -> tuple[list[dict], dict]:
    """Featurizes text queries like the index and retrieves their proponents / opponents.

    For hessian mode "mixed", R_eval comes from `r_eval_queries`, featurized the same way
    (§A.1.3: examples of the task, e.g. the evaluation's `EvalQueries.r_eval_queries()`);
    without them (or when they are the queries' texts) from `queries` themselves.

    `memo(key, compute)` (e.g. `rows.Context.shared`) keeps the raw query and R_eval vectors
    across calls: rows on the same index (TrackStar at several λ, Exp. 4 / 5) differ only in
    R, so their raw vectors are the same; the key is the index folder and the tokens.

    Notebook use: `records, info = retrieval.retrieve_queries(run, settings, workdir,
    [retrieval.TextQuery(0, "Paris is the capital of", " France")])`.

    Returns:
      `(records, info)`: one PAIR-code-schema dict per query, and what was used (index,
      whitening, timings).

    Raises:
      index.store.IndexMismatchError: the index was built from another model / projection /
        corpus (names the manifest field).
      ValueError: a query that cannot be encoded (names it), bad k.
    """
    st = settings.retrieval
    k = st.top_k if k is None else int(k)
    mesh = mesh if mesh is not None else sharding_lib.make_mesh(settings.mesh.shape)
    reader = open_checked_index(run, settings, workdir)
    if k < 1 or k > reader.num_rows:
        raise ValueError(
            f"config.retrieval.top_k={k} must be in [1, {reader.num_rows}] (the index has {reader.num_rows} rows)"
        )
    # the second stage's candidates: the index's top rerank_k (at least k, at most every row)
    k_index = min(max(k, st.rerank_k), reader.num_rows) if st.rerank_k else k
    if (st.rerank_k or st.token_scores) and multihost.is_multiprocess():
        raise files.ConfigError(
            "config.retrieval.rerank_k / token_scores run on one process only; retrieve without --distributed"
        )
    info = {"index": str(reader.path), "index_rows": reader.num_rows, "index_dtype": reader.dtype_name, "k": k}
    if not queries:
        return [], info
    t0 = time.perf_counter()
    encoded = encode_text_queries(run, queries)
    enc_r = []
    if r_eval_queries and settings.hessian.mode == "mixed" and not same_text(r_eval_queries, queries):
        enc_r = encode_text_queries(run, r_eval_queries)
    vec_fn = vectors_lib.make_vector_fn(
        run.graphdef, run.model_cfg, settings.vectors, run.params, run.opt_state, mesh=mesh, role="query"
    )
    # On a pod each process scores only its rows, on its own devices, and the candidates are merged.
    pod = multihost.is_multiprocess()
    score_mesh = sharding_lib.make_mesh(devices=jax.local_devices()) if pod else mesh
    # Refused before any query is featurized: a featurize step of the longest query batch, or
    # a read chunk + query batch + candidates, that cannot fit in device memory.
    vec_fn.check_fits(run.params, seq_len=max(len(e["tokens"]) for e in encoded + enc_r))
    topk.check_fits(
        len(queries),
        reader.dim,
        reader.dtype,
        k_index,
        st.read_chunk_rows,
        score_mesh,
        num_rows=reader.num_rows,
        query_batch_size=st.query_batch_size,
    )

    def raw_vectors(enc: list[dict]) -> np.ndarray:
        pairs = _pairs(enc)
        if memo is None:
            return query_vectors(run, vec_fn, pairs)
        digest = hashlib.sha256(b"".join(t.tobytes() + b"|" + m.tobytes() + b";" for t, m in pairs)).hexdigest()
        return memo(("raw_query_vectors", str(reader.path), digest), lambda: query_vectors(run, vec_fn, pairs))

    q_raw = raw_vectors(encoded)
    r_eval_raw = raw_vectors(enc_r) if enc_r else q_raw
    t1 = time.perf_counter()
    info["featurize_seconds"] = t1 - t0
    rows = merge.process_row_range(reader.num_rows, st.read_chunk_rows, jax.process_index(), jax.process_count())
    factor = trak_lib.row_factor(run, settings.vectors.output_fn, reader)  # TRAK's Q multiplies scores, after R
    scoring = scoring_lib.prepare_scoring(
        reader, settings.hessian, r_eval_raw, rows=rows if pod else None, row_factor=factor
    )
    q_prime = scoring.finalize_queries(q_raw)
    t2 = time.perf_counter()
    res = (merge.process_stream_topk if pod else topk.stream_topk)(
        q_prime,
        reader,
        k_index,
        st.read_chunk_rows,
        mesh=score_mesh,
        row_scale=scoring.row_scale,
        query_batch_size=st.query_batch_size,
        precision=st.precision,
    )
    if pod:
        info["process_rows"] = list(rows)
    t3 = time.perf_counter()
    info.update(
        whitening=scoring.whitening.describe(),
        statistics=scoring_lib.statistics_record(run, settings.vectors.correction, scoring.whitening),
        scoring_prep_seconds=t2 - t1,
        retrieval_seconds=t3 - t2,
        dots_per_s=len(queries) * reader.num_rows / max(t3 - t2, 1e-9),
    )
    top_ids = [list(map(int, x[:k])) for x in res.top_ids]
    top_scores = [list(map(float, x[:k])) for x in res.top_scores]
    index_scores = None
    if st.rerank_k:
        t4 = time.perf_counter()
        scorer = rerank_lib.ExactScorer(
            run.graphdef, run.model_cfg, run.params, run.opt_state, settings.vectors, settings.hessian.unit_norm
        )
        top_ids, top_scores, index_scores = map(
            list,
            zip(
                *(
                    rerank_lib.rerank(scorer, encoded_pairs, cand, scores, rerank_lib.encode_rows(run, cand), k)
                    for encoded_pairs, cand, scores in logs.progress(
                        zip(_pairs(encoded), res.top_ids, res.top_scores),
                        total=len(queries),
                        desc=f"rerank top {k_index}",
                        unit="query",
                    )
                )
            ),
        )
        info.update(rerank_k=k_index, rerank_seconds=time.perf_counter() - t4)
    out = [
        records.pair_record(
            q.example_id,
            q.prompt,
            q.target,
            run.corpus.texts,
            top_ids[qi],
            top_scores[qi],
            res.bottom_ids[qi][:k],
            res.bottom_scores[qi][:k],
            gold=q.gold,
            **dict(q.extra),
        )
        for qi, q in enumerate(queries)
    ]
    if index_scores is not None:
        for rec, s in zip(out, index_scores):
            rec["proponent_index_scores"] = s
    if st.token_scores:
        t5 = time.perf_counter()
        for qi, rec in enumerate(logs.progress(out, total=len(out), desc="token scores", unit="query")):
            with logs.inner_loops():  # each query featurizes its tokens and proponents: one bar for all
                rec.update(token_scores(run, vec_fn, scoring, reader, q_prime[qi], _pairs(encoded)[qi], top_ids[qi]))
        info["token_scores_seconds"] = time.perf_counter() - t5
    return out, info


def token_scores(
    run: checkpoint_lib.Run,
    vec_fn: vectors_lib.VectorFn,
    scoring: scoring_lib.Scoring,
    reader: store_lib.IndexReader,
    q_prime: np.ndarray,
    query: tuple[np.ndarray, np.ndarray],
    ids: Sequence[int],
) -> dict:
    """One query's token attribution against its proponents `ids` (`attribution.attribute`):
    the record fields `proponent_token_scores`, `target_tokens`, `target_token_scores`.

    `vec_fn` is the query featurizer; it serves the index rows too, since the role changes no
    row's objective (TRAK's Q is a factor on scores: `Scoring.row_factor`, `index.trak`)."""
    featurize = lambda pairs: query_vectors(run, vec_fn, pairs)  # noqa: E731
    return attribution.attribute(
        whitening=scoring.whitening,
        q_prime=q_prime,
        query=query,
        query_token_vecs=attribution.token_vectors(featurize, *query),
        rows=np.concatenate([reader.read_dequantized(int(i), int(i) + 1) for i in ids]),
        proponents=rerank_lib.encode_rows(run, ids),
        featurize_index=featurize,
        tokenizer=run.tokenizer,
        row_factors=None if scoring.row_factor is None else [float(scoring.row_factor[int(i)]) for i in ids],
    )


def output_paths(workdir: str | os.PathLike, name: str) -> tuple[pathlib.Path, pathlib.Path]:
    """`(workdir/retrieval/<name>.jsonl, <name>.manifest.json)`."""
    out_dir = pathlib.Path(workdir) / RETRIEVAL_DIR
    return out_dir / f"{name}.jsonl", out_dir / f"{name}.manifest.json"


# The parts of a retrieval's wall time (`seconds_by_part` in its manifest, the final log line):
# `retrieve_queries`' timings, by the part of the work they measure.
TIME_PARTS = {
    "featurize_queries": ("featurize_seconds",),
    "score_topk": ("scoring_prep_seconds", "retrieval_seconds"),
    "rerank": ("rerank_seconds",),
    "token_scores": ("token_scores_seconds",),
}


def seconds_by_part(info: dict, load_seconds: float) -> dict[str, float]:
    """`{"load_run", "featurize_queries", "score_topk"[, "rerank", "token_scores"]}` seconds of a
    `retrieve_queries` call's `info` (an option's part only when it ran); `write_output` is added
    when the output is written."""
    out = {"load_run": float(load_seconds)}
    for part, keys in TIME_PARTS.items():
        if any(k in info for k in keys):
            out[part] = float(sum(info.get(k, 0.0) for k in keys))
    return out


def write_retrieval(
    run: checkpoint_lib.Run,
    settings: RowSettings,
    workdir: str | os.PathLike,
    queries: Sequence[TextQuery],
    *,
    name: str,
    mesh: jax.sharding.Mesh,
    source: dict | None = None,
    r_eval_queries: Sequence[TextQuery] | None = None,
    load_seconds: float = 0.0,
    started: float | None = None,
) -> dict:
    """Stage 3's work on a loaded run (the stage is `stages.retrieve`): `retrieve_queries` for
    `queries`, then `workdir/retrieval/<name>.jsonl` and its manifest.

    Args:
      run: the loaded run (checked against `settings` by the caller).
      name: output name (`output_paths`).
      mesh: the mesh `run` is placed on.
      source: what the queries are (recorded in the manifest).
      r_eval_queries: R_eval's examples for hessian mode "mixed" (default: the queries), as in
        `retrieve_queries`.
      load_seconds: how long the caller took to open the run (`seconds_by_part["load_run"]`).
      started: `time.perf_counter()` when the stage started (default: now); the manifest's
        `seconds` counts from it.

    Returns:
      The manifest (also written), with counts, timings (`seconds`, and `seconds_by_part`:
      load run, featurize queries, score / top-k, write output) and what produced the output.
    """
    started = time.perf_counter() if started is None else started
    st = settings.retrieval
    out, man_path = output_paths(workdir, name)
    recs, info = retrieve_queries(run, settings, workdir, queries, mesh=mesh, r_eval_queries=r_eval_queries)
    info.pop("process_rows", None)  # differs per process; the outputs do not
    reader = store_lib.open_index(info["index"])
    parts = seconds_by_part(info, load_seconds)
    manifest = {
        "format": RETRIEVAL_FORMAT,
        "name": name,
        "queries": source or {"kind": "given"},
        "num_queries": len(recs),
        "output": str(out),
        "index_fingerprint": store_lib.manifest_fingerprint(reader.manifest),
        "checkpoint_step": int(run.step),
        "vectors": dataclasses.asdict(settings.vectors),
        "hessian": dataclasses.asdict(settings.hessian),
        "retrieval": dataclasses.asdict(st),
        "mesh": dict(mesh.shape),
        "devices": [str(d) for d in jax.devices()],
        "process_count": jax.process_count(),
        "jax_version": jax.__version__,
        **info,
        "seconds_by_part": parts,
    }
    # Process 0 writes (a pod's processes hold the same records); the others wait, so that a
    # failed write fails the job. The jsonl first, the manifest last: it marks the output done.
    with multihost.step("retrieve:written"):
        t0 = time.perf_counter()
        if multihost.is_primary():
            body = "".join(
                json.dumps(records.ordered({**r, "query_set": name}), ensure_ascii=False) + "\n" for r in recs
            )
            files.atomic_write(out, body)
        parts["write_output"] = time.perf_counter() - t0
        manifest["seconds"] = time.perf_counter() - started
        if multihost.is_primary():
            files.atomic_write(man_path, json.dumps(manifest, indent=1, default=str))
    logging.info(
        "retrieve: %d queries x %d rows in %.2fs (%s) -> %s",
        len(recs),
        info["index_rows"],
        manifest["seconds"],
        ", ".join(f"{part.replace('_', ' ')} {s:.2f}s" for part, s in parts.items()),
        out,
    )
    return manifest
