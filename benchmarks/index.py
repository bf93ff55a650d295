"""Index build benchmark (issue 4): throughput, share of time spent writing, bytes per example
per storage dtype, and the MRR change of lower-precision storage vs float32.

    python -m benchmarks.index --config=experiments/tiny.py --workdir=/tmp/bench_embedded
    python -m benchmarks.index --config=experiments/tiny.py --workdir=/tmp/bench_lama \\
        --config.data.source=lama --config.data.path=../shared/data/lama --lama_dir=../shared/data/lama

Trains the config's model into `--workdir` if it holds no run yet (`--config.train.num_steps`),
then, with ONE compiled featurizer (every length bucket compiled before timing), builds the
full index once per dtype, side by side in one process. Prints one JSON object per line:

  {"kind": "build", "corpus", "examples", "tokens", "seconds", "examples_per_s", "tokens_per_s",
   "write_seconds", "write_fraction", "bytes_per_example", "dtype", "device", ...}
  {"kind": "mrr", "corpus", "dtype", "queries", "mrr", "recall_at_10", "mrr_delta_vs_float32",
   "top10_overlap_vs_float32", "device", ...}

`write_fraction` is the time the build loop spent blocked on writing (submitting chunk writes,
waiting for commits, completion markers, R_train saves) over the build's wall time.
`bytes_per_example` is measured on disk (vectors + int8 scales + per-chunk crc32c + metadata).
MRR uses TrackStar scoring (`config.hessian`) over the whole index, exact, with the embedded
corpus templates or LAMA's relations.jsonl (`--lama_dir`), gold = entailing passages.
"""

import functools
import json
import pathlib
import shutil
import time

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from trackstar_jax import config as config_lib
from trackstar_jax import data as data
from trackstar_jax import data as data_pkg
from trackstar_jax import index, stages
from trackstar_jax.distributed import sharding
from trackstar_jax.distributed import sharding as sharding_lib
from trackstar_jax.evaluation import metrics, queries
from trackstar_jax.features import vectors
from trackstar_jax.index import build
from trackstar_jax.retrieval import stage as retrieval_stage
from trackstar_jax.training import checkpoint

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/tiny.py", "Experiment config.", lock_config=False)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (trained here if empty).")
_DTYPES = flags.DEFINE_list("dtypes", list(index.STORAGE_DTYPES), "Storage dtypes to build.")
_MRR = flags.DEFINE_bool("mrr", True, "Also measure MRR per dtype.")
_MAX_QUERIES = flags.DEFINE_integer("max_queries", 500, "Queries for the MRR comparison (facts with evidence).")
_LAMA_DIR = flags.DEFINE_string("lama_dir", "", "LAMA folder with relations.jsonl (LAMA corpora).")
_KEEP = flags.DEFINE_bool("keep", False, "Keep the benchmark indices (default: delete after measuring).")
flags.mark_flags_as_required(["workdir"])


def _device() -> str:
    d = jax.devices()
    return f"{len(d)}x {d[0].device_kind} ({d[0].platform})"


def _emit(rec: dict) -> None:
    print(json.dumps(rec), flush=True)


def _warm_up(run, vec_fn, mesh) -> list[int]:
    """Compiles the featurizer for every length bucket the corpus uses (not timed)."""
    max_len, bs = run.model_cfg.max_len, vec_fn.vec_cfg.batch_size
    lengths = [len(t) + 2 for t in run.tokenizer.encode_batch(run.corpus.texts)]
    buckets = sorted({data_pkg.bucket_len(min(n, max_len), max_len) for n in lengths})
    for n in buckets:
        tokens = np.zeros((bs, n), np.int32)
        tokens[:, 0] = run.tokenizer.bos_id
        mask = np.ones((bs, n), np.int32)
        mask[:, 0] = 0
        vecs, _ = vec_fn.jitted(
            run.params, vec_fn.precond, sharding_lib.device_batch({"tokens": tokens, "loss_mask": mask}, mesh)
        )
        vecs.block_until_ready()
    return buckets


def _queries(run, config) -> tuple[list, list]:
    """(queries with evidence, encoded) for the MRR comparison."""
    facts = run.corpus.facts
    if run.corpus.templates:
        templates = run.corpus.templates
    else:
        if not _LAMA_DIR.value:
            raise app.UsageError("this corpus has no templates: give --lama_dir (folder with relations.jsonl)")
        templates = queries.load_templates(_LAMA_DIR.value, None, sorted({f.relation for f in facts}))
    ent = queries.entailing_ids(facts)
    facts = [f for f in facts if ent[f.fact_id] and f.relation in templates]
    rng = np.random.default_rng(0)
    facts = [facts[i] for i in sorted(rng.permutation(len(facts))[: _MAX_QUERIES.value])]
    qs = queries.build_queries(facts, templates, variant=0, entailing=ent, mentions={f.fact_id: () for f in facts})
    encode = functools.partial(data.encode_query, run.tokenizer, max_len=run.model_cfg.max_len)
    return queries.encode_queries(qs, encode)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config, workdir = _CONFIG.value, pathlib.Path(_WORKDIR.value)
    if not (workdir / checkpoint.CHECKPOINT_DIR).is_dir():
        t0 = time.perf_counter()
        stages.train(config_lib.from_configdict(config), workdir)
        _emit(
            {
                "kind": "train",
                "seconds": time.perf_counter() - t0,
                "steps": int(config.train.num_steps),
                "device": _device(),
            }
        )
    mesh = sharding.make_mesh(tuple(config.mesh.shape))
    run = stages.load_run(workdir, mesh=mesh)
    vec_cfg = config_lib.from_configdict(config).vectors
    vec_fn = vectors.make_vector_fn(
        run.graphdef, run.model_cfg, vec_cfg, run.params, run.opt_state, mesh=mesh, role="index"
    )
    corpus_name = run.corpus.name
    t0 = time.perf_counter()
    buckets = _warm_up(run, vec_fn, mesh)
    warm_s = time.perf_counter() - t0
    readers = {}
    for dtype in _DTYPES.value:
        storage = index.StorageConfig(
            dtype=dtype,
            chunk_rows=int(config.index.chunk_rows),
            r_every_chunks=int(config.index.get("r_every_chunks", 0)),
        )
        path = workdir / f"bench_index_{dtype}"
        shutil.rmtree(path, ignore_errors=True)
        manifest = build.index_manifest(run, vec_cfg, storage, vec_fn.dim)
        builder = index.IndexBuilder(path, manifest)
        index.store._quantize_step(
            np.zeros((builder.chunk_rows, vec_fn.dim), np.float32), dtype=dtype
        )  # compile outside timing
        counters = {"tokens": 0, "truncated": 0}
        stats = builder.build(build.make_rows_fn(run, vec_fn, counters))
        assert stats.finalized and stats.rows_written == builder.num_rows
        on_disk = index.store._du(path / "vectors") + index.store._du(path / "row_scale")
        _emit(
            {
                "kind": "build",
                "corpus": corpus_name,
                "examples": builder.num_rows,
                "tokens": counters["tokens"],
                "truncated": counters["truncated"],
                "seconds": stats.seconds,
                "examples_per_s": builder.num_rows / stats.seconds,
                "tokens_per_s": counters["tokens"] / stats.seconds,
                "write_seconds": stats.write_seconds,
                "write_fraction": stats.write_fraction,
                "bytes_per_example": on_disk / builder.num_rows,
                "payload_bytes_per_example": vec_fn.dim * index.NP_DTYPES[dtype].itemsize
                + (4 if dtype == "int8" else 0),
                "dtype": dtype,
                "dim": vec_fn.dim,
                "chunk_rows": builder.chunk_rows,
                "batch_size": vec_cfg.batch_size,
                "length_buckets": buckets,
                "compile_seconds_excluded": warm_s,
                "model_params": int(sum(x.size for x in jax.tree.leaves(run.params))),
                "device": _device(),
            }
        )
        readers[dtype] = index.open_index(path)

    if _MRR.value:
        kept, encoded = _queries(run, config)
        qfn = vectors.make_vector_fn(
            run.graphdef, run.model_cfg, vec_cfg, run.params, run.opt_state, mesh=mesh, role="query"
        )
        q_raw = retrieval_stage.query_vectors(run, qfn, encoded, mesh)
        hcfg = config_lib.from_configdict(config).hessian
        results = {}
        for dtype, reader in readers.items():
            scoring = index.prepare_scoring(reader, hcfg, q_raw, cache=False)
            rows = reader.read_dequantized(0, reader.num_rows)
            scores = (scoring.finalize_queries(q_raw) @ rows.T) * scoring.row_scale[None, :]
            order = np.lexsort((np.broadcast_to(np.arange(reader.num_rows), scores.shape), -scores), axis=1)[:, :10]
            per_q = [metrics.query_metrics(order[i].tolist(), q.entailing_ids) for i, q in enumerate(kept)]
            results[dtype] = (
                order,
                float(np.mean([m["mrr"] for m in per_q])),
                float(np.mean([m["recall_at_10"] for m in per_q])),
                scoring.whitening.describe(),
            )
        base = results.get("float32")
        for dtype, (order, mrr, rec, whit) in results.items():
            overlap = (
                None if base is None else float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(order, base[0])]))
            )
            _emit(
                {
                    "kind": "mrr",
                    "corpus": corpus_name,
                    "dtype": dtype,
                    "queries": len(kept),
                    "mrr": mrr,
                    "recall_at_10": rec,
                    "mrr_delta_vs_float32": None if base is None else mrr - base[1],
                    "top10_overlap_vs_float32": overlap,
                    "hessian": whit,
                    "device": _device(),
                }
            )
    if not _KEEP.value:
        for dtype in readers:
            shutil.rmtree(workdir / f"bench_index_{dtype}", ignore_errors=True)


if __name__ == "__main__":
    app.run(main)
