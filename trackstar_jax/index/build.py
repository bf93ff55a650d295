"""Stage 2's work (`build_from_run`; the stage is `stages.build_index`): one pass over the corpus with the fast featurizer -> zarr3 index + R_train.

Paper §3 ("Random projection"), §A.1.3: every training example's projected, corrected
gradient is computed once and stored (`store.py`, `builder.py`); R_train accumulates in the
same pass. The stage resumes an interrupted build, splits over writer processes, and
refuses an index of another model, projection, storage or corpus.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
from typing import Any, Iterator, Sequence

import jax
import numpy as np
from absl import logging

from trackstar_jax import data as data_lib
from trackstar_jax import files
from trackstar_jax.distributed import memory as memory_lib
from trackstar_jax.distributed import multihost
from trackstar_jax.distributed import sharding as sharding_lib
from trackstar_jax.features import vectors as vectors_lib
from trackstar_jax.index import builder as builder_lib
from trackstar_jax.index import hessian as hessian_lib
from trackstar_jax.index import manifest as manifest_lib
from trackstar_jax.index import store as store_lib
from trackstar_jax.index import trak as trak_lib
from trackstar_jax.training import checkpoint as checkpoint_lib
from trackstar_jax.training import logs

# How long the processes of a pod build wait for each other at a barrier (a failing process
# makes the others fail at once; this bounds a silent hang).
SYNC_TIMEOUT_S = 4 * 3600

# How each key of the sections an index is featurized with (`model`, `vectors`) enters the
# index's manifest (`index_manifest`): IDENTITY keys are its identity (a reader and a resume
# must match them), FEATURIZER keys are recorded for a resume only (under `featurizer`), OTHER
# keys never. The other sections reach an index only through the run or apply after it
# (`config.INDEX_SECTIONS`). tests/test_index_identity.py fails on an unclassified key, so a
# new knob cannot change (or miss) the identity silently.
IDENTITY, FEATURIZER, OTHER = "identity", "featurizer", "other"
_MODEL_SHAPE = (
    "vocab_size", "num_layers", "embed_dim", "num_heads", "head_dim", "mlp_dim", "max_len", "tie_embeddings",
    "norm", "rope_base", "dtype", "param_dtype", "arch", "num_kv_heads", "norm_eps", "norm_bias", "rotary_pct",
    "qkv_bias", "out_bias", "mlp_bias", "parallel_residual", "activation",
)  # fmt: skip
INDEX_KEYS = {
    **{f"model.{k}": IDENTITY for k in _MODEL_SHAPE},
    "model.source": IDENTITY,  # where the weights came from (left out when "": pretrained runs' manifests predate it)
    "model.matmul_dtype": FEATURIZER,  # changes the rows' bits, not what they are (recorded when set)
    "model.remat": OTHER,  # the same results, recomputed
    "vectors.output_fn": IDENTITY,
    "vectors.num_blocks": IDENTITY,
    "vectors.proj_dim": IDENTITY,
    "vectors.proj_seed": IDENTITY,
    "vectors.correction": IDENTITY,
    "vectors.path": IDENTITY,
    "vectors.exact_v": IDENTITY,
    "vectors.unembed": IDENTITY,  # (left out for tied models: no output embedding of their own)
    "vectors.batch_size": FEATURIZER,
    "vectors.matmul_precision": FEATURIZER,  # the GEMMs' precision: the rows' bits (recorded when not float32)
    "vectors.estimate_v_examples": OTHER,  # import-time keys: the run's own record of V goes in instead
    "vectors.estimate_v_seed": OTHER,
    "vectors.estimate_v_method": OTHER,
    "vectors.estimate_v_source": OTHER,
    "vectors.estimate_v_batch_sequences": OTHER,
    "vectors.estimate_v_steps": OTHER,
}


def index_dir(index: manifest_lib.IndexSettings, workdir: str | os.PathLike) -> pathlib.Path:
    """Where the index of `index` (`config.index`) lives: `workdir/<index.dir>` (default `index`).

    Use a separate `index.dir` per vector setting (e.g. `index_nocorr` for correction off);
    R and unit-norm ablations reuse one index (they apply at scoring time).
    """
    return pathlib.Path(workdir) / index.dir


def _identity_keys(section: str, values: Any) -> dict:
    """The fields of a `model` / `vectors` section that define an index (`INDEX_KEYS`)."""
    return {k: v for k, v in dataclasses.asdict(values).items() if INDEX_KEYS[f"{section}.{k}"] == IDENTITY}


def index_manifest(
    run: checkpoint_lib.Run, vec_cfg: vectors_lib.VectorConfig, storage: manifest_lib.StorageConfig, dim: int
) -> dict:
    """The manifest of the index of `run` under `vec_cfg` (what a resume or a reader must match)."""
    fp_tree = {"params": run.params, "opt_state": run.opt_state} if vec_cfg.correction else {"params": run.params}
    num_blocks_total, _ = vectors_lib.block_layout(vec_cfg)
    vec, model_cfg = _identity_keys("vectors", vec_cfg), _identity_keys("model", run.model_cfg)
    if run.model_cfg.tie_embeddings:  # no output embedding of its own: manifests stay as before the field
        del vec["unembed"]
    if vec_cfg.output_fn == "trak":  # rows hold plain margin gradients; Q multiplies scores (index/trak.py)
        vec["trak_q"] = "scores"  # refuses a trak index built when Q was folded into the rows
    if not model_cfg["source"]:  # pretrained runs: manifests stay as they were before imports existed
        del model_cfg["source"]
    model = {
        "checkpoint_step": int(run.step),
        "fingerprint": manifest_lib.tree_fingerprint(fp_tree),
        "config": model_cfg,
    }
    if vec_cfg.correction and run.opt_state_info is not None:  # V estimated at import (sample size, seed)
        model["second_moment"] = {k: v for k, v in run.opt_state_info.items() if k != "seconds"}  # timing: not identity
    return manifest_lib.make_manifest(
        num_rows=len(run.corpus.examples),
        dim=dim,
        num_blocks_total=num_blocks_total,
        storage=storage,
        model=model,
        vectors=vec,
        corpus={
            "name": run.corpus.name,
            "fingerprint": run.corpus.fingerprint,
            "num_examples": len(run.corpus.examples),
        },
        featurizer={
            "batch_size": int(vec_cfg.batch_size),
            "max_len": int(run.model_cfg.max_len),
            "length_buckets": data_lib.LENGTH_BUCKETS,
            # `model.matmul_dtype` (a runtime key, so not in model.config) changes the rows' bits
            **({"matmul_dtype": run.model_cfg.matmul_dtype} if run.model_cfg.matmul_dtype else {}),
            # `vectors.matmul_precision` below float32 (tf32 / bf16 operands) changes them too
            **({"matmul_precision": vec_cfg.matmul_precision} if vec_cfg.matmul_precision != "float32" else {}),
        },
        info={
            "workdir": str(run.workdir),
            "devices": [str(d) for d in jax.local_devices()],
            "jax_version": jax.__version__,
            # the checkpoint's checksum digest: `verify_index` compares it with the one on disk
            **({"checkpoint": ck} if (ck := checkpoint_lib.checkpoint_record(run.workdir, run.step)) else {}),
        },
    )


def expected_identity(
    run: checkpoint_lib.Run, vec_cfg: vectors_lib.VectorConfig, storage: manifest_lib.StorageConfig, dim: int
) -> dict:
    """Manifest sections an index must match for queries featurized by `run` under `vec_cfg`
    (model weights + optimizer state fingerprint, vector settings, corpus)."""
    m = index_manifest(run, vec_cfg, storage, dim)
    return {section: m[section] for section in ("model", "vectors", "corpus")}


def length_batches(
    run: checkpoint_lib.Run, start: int, stop: int, batch_size: int, counters: dict | None = None
) -> Iterator[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """The padded batches the index featurizes for corpus rows `[start, stop)`: in order of
    length (`data.length_groups`), each `batch_size` rows padded to its longest row's step of
    `data.bucket_len`. Yields `(positions within the range, data.pad_batch dict)`; with
    `counters`, adds the truncated passages and the non-padding tokens to it."""
    max_len = run.model_cfg.max_len
    items, truncated = data_lib.encode_passages(run.tokenizer, run.corpus.texts[start:stop], max_len)
    if counters is not None:
        counters["truncated"] += truncated
        counters["tokens"] += sum(len(t) for t, _ in items)
    for pos in data_lib.length_groups([len(t) for t, _ in items], batch_size):
        part = [items[i] for i in pos]
        seq_len = data_lib.bucket_len(max(len(t) for t, _ in part), max_len)
        yield pos, data_lib.pad_batch(part, (start + pos).tolist(), batch_size, seq_len)


def make_rows_fn(run: checkpoint_lib.Run, vec_fn: vectors_lib.VectorFn, counters: dict) -> Any:
    """`rows_fn(start, stop)` for `IndexBuilder`: featurizes examples `[start, stop)`.

    Batches never straddle the call's row range (so a resumed or split build forms the same
    batches); within it rows are batched in order of length (`data.length_groups`), padded to
    `vectors.batch_size` rows and to their longest row's step of `data.bucket_len`, and put back
    in row order on the device. Batches are dispatched without blocking: the device works on
    them while the builder writes the previous chunk (on a multi-device CPU each batch is waited
    for: `multihost.settle`). `counters["tokens"]` accumulates the non-padding tokens;
    `counters["mean_prob"]`, when present (`[num_rows]`), receives each featurized row's p̄
    (TRAK's rows, `vectors.vector_step`).
    """
    bs = vec_fn.vec_cfg.batch_size

    def rows_fn(start: int, stop: int) -> jax.Array:
        groups, outs = [], []
        for pos, batch in length_batches(run, start, stop, bs, counters):
            groups.append(pos)
            host = {"tokens": batch["tokens"], "loss_mask": batch["loss_mask"]}  # `jitted` places it on vec_fn.mesh
            # CPU with several devices: one collective program at a time (`multihost.settle`)
            vecs, aux = multihost.settle(vec_fn.jitted(run.params, vec_fn.precond, host))
            if "mean_prob" in aux and "mean_prob" in counters:  # TRAK's p̄ from this forward
                counters["mean_prob"][start + pos] = np.asarray(aux["mean_prob"])[: len(pos)]
            outs.append(vecs[: len(pos)])
        vecs = outs[0] if len(outs) == 1 else jax.numpy.concatenate(outs)
        order = np.concatenate(groups)
        if np.array_equal(order, np.arange(len(order))):
            return vecs
        return vecs[jax.numpy.asarray(np.argsort(order))]  # row i of the range back at position i

    return rows_fn


def index_mesh(mesh_shape: tuple[int, ...], batch_size: int) -> jax.sharding.Mesh:
    """The mesh an index is featurized on: `mesh_shape` (`config.mesh.shape`) over this process's devices
    (per-example vectors need no communication, so on a pod each host is an independent
    writer; in a single process these are all devices).

    Raises:
      config.ConfigError: `batch_size` (`config.vectors.batch_size`) cannot be split over the
        mesh (names the knob).
    """
    mesh = sharding_lib.make_mesh(mesh_shape, devices=jax.local_devices())
    bad_split = sharding_lib.batch_split_error(batch_size, mesh, "config.vectors.batch_size")
    if bad_split:
        raise files.ConfigError(bad_split)
    return mesh


def build_from_run(
    run: checkpoint_lib.Run,
    vec_cfg: vectors_lib.VectorConfig,
    index: manifest_lib.IndexSettings,
    workdir: str | os.PathLike,
    *,
    mesh_shape: tuple[int, ...],
    mesh: jax.sharding.Mesh | None = None,
    companions: Sequence[tuple[vectors_lib.VectorConfig, manifest_lib.IndexSettings]] = (),
    process_index: int | None = None,
    process_count: int | None = None,
    sync_timeout_s: float = SYNC_TIMEOUT_S,
) -> dict:
    """Stage 2's work on a loaded run: featurize every example of `run.corpus` under `vec_cfg`
    (`config.vectors`) into the index `index` (`config.index`) (§3, §A.1.3), or reuse it when
    it is finished.

    The caller has checked `run` against its settings (`stages.open_run`); the vector and
    index settings may differ from the ones it was opened with (a table row's
    `method_settings`). A finished index (`COMPLETE`) is checked against the manifest and
    reused without compiling the featurize step.

    `companions` are other indices of the same rows whose settings share the featurize pass
    (`vectors.shared_pass_error`: they differ only in the correction, as Exp. 1's and Exp. 4's):
    the unfinished ones are written in the same pass (`builder.build_together`), one forward and
    backward per batch for all of them. Each is an ordinary index (its own manifest, resume and
    R_train), the same as when built alone.

    Resumes an interrupted build (refusing one whose model, vectors, storage or corpus
    differ); with `process_count > 1`, this call writes only its share of whole R_train
    segments. Each writer featurizes over its own (process-local) devices (`index_mesh`).

    - Independent processes (single-process JAX each, e.g. one per GPU): pass
      `process_index` / `process_count`; the last one to finish finalises R_train.
    - A `jax.distributed` job (a pod): every process is one writer (`process_index` /
      `process_count` default to jax's, see `multihost.writer_partition`); after all have
      written, process 0 finalises R_train once, waiting at most `sync_timeout_s` for the
      others (a failing process makes the others fail at once).

    Args:
      run: the loaded run (its checkpoint is the index's).
      vec_cfg: the vectors' settings (`config.vectors`).
      index: where and how the index is stored (`config.index`).
      workdir: the run directory.
      mesh_shape: `config.mesh.shape`, over this process's devices (`index_mesh`).
      mesh: the mesh `run`'s arrays are on; when it spans several processes (a pod's
        evaluation) the run is loaded again onto this process's devices.
      companions: `(vectors, index)` settings of indices written in the same pass.

    Returns:
      This call's summary of `index` (also written to `index/build_summary-pXXXX.json`, and
      each companion's to its own folder, except that a call which featurized nothing keeps the
      file of the pass that built the rows): rows, examples/s, tokens/s, write_fraction, bytes
      per example, and `shared_pass` (the other indices written in the same pass).

    Raises:
      ValueError: a companion that cannot share the pass (saying why) or has the same folder.
    """
    targets = [(vec_cfg, index), *companions]
    paths = [index_dir(ix, workdir) for _, ix in targets]
    if len(set(paths)) != len(paths):
        raise ValueError(f"indices built in one pass need folders of their own, got {[str(p) for p in paths]}")
    for c_vec, _ in companions:
        why = vectors_lib.shared_pass_error(vec_cfg, c_vec)
        if why:
            raise ValueError(f"index {paths[0]}: cannot write a companion index in its pass: {why}")
    process_index, process_count = multihost.writer_partition(process_index, process_count)
    spmd = multihost.is_multiprocess()
    local = index_mesh(mesh_shape, vec_cfg.batch_size)
    if mesh is not None and mesh.is_multi_process:  # its arrays span processes; a writer needs its own copy
        run = checkpoint_lib.reload(run, mesh=local)
    todo = [i for i, p in enumerate(paths) if not (p / "COMPLETE").exists()]

    @functools.cache
    def featurizer(which: tuple[int, ...]) -> vectors_lib.VectorFn:  # made only when a chunk is to be written
        first, *rest = (targets[i][0] for i in which)
        return vectors_lib.make_vector_fn(
            run.graphdef, run.model_cfg, first, run.params, run.opt_state, mesh=local, role="index", companions=rest
        )

    manifests = [index_manifest(run, v, ix.storage, v.dim) for v, ix in targets]
    # Under jax.distributed a writer that fails here (a refused manifest, a full disk) tells
    # the others, which then fail at once instead of waiting for it at the barrier.
    with multihost.step("build_index:written", sync_timeout_s):
        if todo and memory_lib.device_memory_limit() is not None:
            # A featurize step of the longest batch that cannot fit is refused before anything is
            # written (the compile is the one the longest batches reuse). Without a limit (CPU)
            # nothing can be refused, and a corpus whose rows never reach `model.max_len` would
            # never run that compile.
            featurizer(tuple(todo)).check_fits(run.params)
        builders = [
            builder_lib.IndexBuilder(p, m, process_index=process_index, process_count=process_count)
            for p, m in zip(paths, manifests)
        ]
        counters = {"tokens": 0, "truncated": 0}
        if any(v.output_fn == "trak" for v, _ in targets):
            counters["mean_prob"] = np.full(builders[0].num_rows, np.nan, np.float32)
        rows_fn = functools.cache(lambda which: make_rows_fn(run, featurizer(which), counters))

        def shared_rows(lo: int, hi: int, which: tuple[int, ...]) -> list:
            """The rows of the indices `which` from one pass (side by side for several,
            `VectorFn.split`); normally the unfinished ones, or a finished index's lost chunk on
            its own."""
            vecs = rows_fn(which)(lo, hi)
            return [vecs] if len(which) == 1 else featurizer(which).split(vecs)

        for i, (b, (v, ix)) in enumerate(zip(builders, targets)):
            logging.info(
                "index %s: %d rows x d=%d (%s), chunks of %d rows, this process writes chunks [%d, %d)%s",
                b.path,
                b.num_rows,
                v.dim,
                ix.storage.dtype,
                b.chunk_rows,
                b.chunks.start,
                b.chunks.stop,
                "; finished, reused"
                if i not in todo
                else (f"; in one pass with {len(todo) - 1} other(s)" if len(todo) > 1 else ""),
            )
        with logs.progress(total=len(builders[0].chunks), desc="index", unit="chunk") as bar:
            stats = builder_lib.build_together(
                builders,
                shared_rows,
                progress=lambda done, total: bar.update(done - bar.n),
                finalize_when_done=not spmd,
            )
    if spmd:  # every writer is done: finalise exactly once, on process 0
        with multihost.step("build_index:finalized", sync_timeout_s):
            if multihost.is_primary():
                for p in paths:
                    builder_lib.finalize(p, finalized_by=f"process {process_index} of {process_count}")
        for p, st in zip(paths, stats):
            st.finalized = (p / "COMPLETE").exists()
    for b, st, (v, _) in zip(builders, stats, targets):
        # TRAK's Q = 1 - p̄ from the pass's own forward, when this call featurized every row
        # (else `trak.candidate_q` runs its own forward pass when a row first scores)
        p = counters.get("mean_prob")
        if v.output_fn == "trak" and st.finalized and st.rows_written == b.num_rows and np.isfinite(p).all():
            trak_lib.save_q(b.path, b.manifest, 1.0 - p)
    if counters["truncated"]:
        logging.warning(
            "%d passages were truncated to model.max_len=%d tokens", counters["truncated"], run.model_cfg.max_len
        )
    summaries = [
        _write_summary(
            b.path, b, st, counters, v.dim, ix.storage, process_index, process_count,
            shared_pass=[str(paths[j]) for j in todo if j != i] if i in todo else [],
            statistics=index_statistics(run, v, b.num_rows),
        )
        for i, (b, st, (v, ix)) in enumerate(zip(builders, stats, targets))
    ]  # fmt: skip
    return summaries[0]


def index_statistics(run: checkpoint_lib.Run, vec_cfg: vectors_lib.VectorConfig, num_rows: int) -> dict:
    """What the index's statistics are estimated from, against what they need: V (the
    correction's second moment, `checkpoint.second_moment_record`) and R_train (its rows
    against the block width, `hessian.r_train_counts`); `thin_notes` names each too thin to trust."""
    _, block_width = vectors_lib.block_layout(vec_cfg)
    v = checkpoint_lib.second_moment_record(run, vec_cfg.correction)
    r = hessian_lib.r_train_counts(num_rows, block_width)
    notes = [v["note"]] if v.get("thin") else []
    if r["thin"]:
        notes.append(
            f"R_train is estimated from {num_rows} examples, fewer than the block width {block_width} "
            f"(rank-deficient): retrieval shrinks it toward its mean eigenvalue (hessian.r_train_shrinkage)"
        )
    return {"v": v, "r_train": r, "thin_notes": notes}


def _read_summary(path: pathlib.Path) -> dict | None:
    """The build summary at `path` written by an earlier call, or None (absent or unreadable).
    A call that featurized nothing keeps it: the file is the summary of the pass that built the
    rows (its rate, its `shared_pass`), which a reuse would otherwise overwrite with zeros."""
    try:
        kept = files.read_json(path, "build summary")
    except (OSError, files.InputError):  # absent or damaged: this call's summary replaces it
        return None
    return kept if isinstance(kept, dict) else None


def _write_summary(
    path: pathlib.Path,
    builder: builder_lib.IndexBuilder,
    stats: builder_lib.BuildStats,
    counters: dict,
    dim: int,
    storage: manifest_lib.StorageConfig,
    process_index: int,
    process_count: int,
    shared_pass: list[str],
    statistics: dict,
) -> dict:
    itemsize = np.dtype(store_lib.NP_DTYPES[storage.dtype]).itemsize
    summary = {
        "index": str(path),
        "process_index": process_index,
        "process_count": process_count,
        "rows": builder.num_rows,
        "dim": dim,
        "dtype": storage.dtype,
        "rows_written": stats.rows_written,
        "chunks_written": stats.chunks_written,
        "chunks_skipped": stats.chunks_skipped,
        "chunks_read_back": stats.chunks_read_back,
        "tokens": counters["tokens"],
        "seconds": stats.seconds,
        "examples_per_s": stats.rows_written / stats.seconds if stats.seconds else None,
        "tokens_per_s": counters["tokens"] / stats.seconds if stats.seconds else None,
        "write_seconds": stats.write_seconds,
        "write_fraction": stats.write_fraction,
        "bytes_per_example": dim * itemsize + (4 if storage.dtype == "int8" else 0),
        "complete": stats.finalized,
        "finalized_by": builder_lib.finalized_by(path) if stats.finalized else None,
        "shared_pass": shared_pass,  # the other indices this pass wrote (their time is this one's)
        "statistics": statistics,  # what V and R_train are estimated from (`index_statistics`)
    }
    out = path / f"build_summary-p{process_index:04d}.json"
    kept = _read_summary(out) if not stats.rows_written else None
    if kept is None:
        files.atomic_write_json(out, summary)
    elif kept.get("complete") != stats.finalized:  # a reuse that finalised: only that is news
        files.atomic_write_json(out, {**kept, "complete": stats.finalized, "finalized_by": summary["finalized_by"]})
    in_range = sum(hi - lo for lo, hi in map(builder.chunk_rows_range, builder.chunks))
    built = in_range - stats.rows_written  # rows of this writer's range an earlier call wrote
    if not stats.rows_written:  # nothing featurized: no rate to report
        logging.info("index %s reused: %d rows already built%s", path, built, "; complete" if stats.finalized else "")
        return summary
    logging.info(
        "index: wrote %d rows in %.1fs (%.1f examples/s, %.0f tokens/s, writing %.1f%% of the time)%s%s",
        stats.rows_written,
        stats.seconds,
        summary["examples_per_s"] or 0,
        summary["tokens_per_s"] or 0,
        100 * stats.write_fraction,
        f"; resumed: {built} rows were already built" if built else "",
        "; complete" if stats.finalized else "",
    )
    logging.info("index %s: %s", path, hessian_lib.describe_statistics(statistics))
    for note in statistics["thin_notes"]:
        logging.warning("index %s: %s", path, note)
    return summary
