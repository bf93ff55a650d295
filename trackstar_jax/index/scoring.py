"""Scoring preparation: per-row scales for on-the-fly R^{-1/2} + unit norm (hessian.py, §3 Eq. 1-2)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jaxtyping import Array, Float

from trackstar_jax import files
from trackstar_jax.index import builder, hessian, store
from trackstar_jax.index import manifest as manifest_lib
from trackstar_jax.training import checkpoint as checkpoint_lib

# ------------------------------------------------------------------------------------------
# Scoring preparation: per-row scales for on-the-fly R^{-1/2} + unit norm (hessian.py)
# ------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("unit_norm",))
def _row_scale_step(stored, scale, w, *, unit_norm):
    return hessian.row_scale(store.dequantize(stored, scale), w, unit_norm)


def compute_row_scale(
    reader: store.IndexReader,
    whitening: hessian.Whitening,
    *,
    cache: bool = True,
    rows: tuple[int, int] | None = None,
) -> np.ndarray:
    """Per-row scale `1/||W g_m||` of on-the-fly scoring over the whole index (one streamed pass).

    With `rows=(lo, hi)` only those rows are read (a process of a multi-host retrieval
    scores only its range); the others are NaN, so using them by mistake is an error.

    The scale applies to the *dequantised* rows: for int8 storage, scores against the raw int8
    values are `(int8_row · q') * int8_scale * row_scale`.

    Args:
      reader: a complete index.
      whitening: from `hessian.make_whitening`.
      cache: store/reuse `<index>/scoring/<key>.npy`, keyed by the index identity and W.

    Returns:
      float32 `[num_rows]`.
    """
    if not whitening.unit_norm:
        return np.ones(reader.num_rows, np.float32)
    h = hashlib.sha256(store.manifest_fingerprint(reader.manifest).encode())
    h.update(b"none" if whitening.matrix is None else np.ascontiguousarray(whitening.matrix).tobytes())
    lo, hi = (0, reader.num_rows) if rows is None else (int(rows[0]), int(rows[1]))
    part = "" if (lo, hi) == (0, reader.num_rows) else f"-rows{lo}-{hi}"
    f = reader.path / "scoring" / f"{h.hexdigest()[:32]}{part}.npy"
    if cache and f.exists():
        out = np.full(reader.num_rows, np.nan, np.float32)
        out[lo:hi] = _load_cached_scale(f, hi - lo)
        return out
    w = None if whitening.matrix is None else jnp.asarray(whitening.matrix)
    out = np.full(reader.num_rows, np.nan, np.float32)
    for start, block, scale in reader.iter_blocks(start=lo, stop=hi) if hi > lo else ():
        out[start : start + len(block)] = np.asarray(_row_scale_step(block, scale, w, unit_norm=True))
    if cache and hi > lo:
        out_part = out[lo:hi]
        data = files.npy_bytes(np.ascontiguousarray(out_part))
        # The checksum first: a cache file without its checksum beside it is never trusted.
        files.atomic_write(f.with_suffix(".sha256"), files.sha256_bytes(data))
        files.atomic_write(f, data)
    return out


def _load_cached_scale(f: pathlib.Path, num_rows: int) -> np.ndarray:
    """A cached row-scale file, checked against the sha256 written beside it.

    Raises:
      store.IndexCorruptError: damaged, unchecked or of the wrong shape (names the file;
        deleting it makes the next retrieval recompute it).
    """
    fix = f"delete {f} (and {f.with_suffix('.sha256').name}) and it is recomputed"
    data = f.read_bytes()
    sums = f.with_suffix(".sha256")
    if not sums.exists():
        raise store.IndexCorruptError(f"cached row scales {f} have no checksum file {sums.name}; {fix}")
    if files.sha256_bytes(data) != sums.read_text().strip():
        raise store.IndexCorruptError(f"cached row scales {f} do not match their sha256 (the file was damaged); {fix}")
    out = np.load(io.BytesIO(data), allow_pickle=False)
    if out.shape != (num_rows,) or out.dtype != np.float32:
        raise store.IndexCorruptError(
            f"cached row scales {f} have shape {out.shape} {out.dtype}, expected ({num_rows},) float32; {fix}"
        )
    return out


@dataclasses.dataclass(frozen=True)
class Scoring:
    """Everything retrieval needs to score raw rows as TrackStar (Eq. 1-3).

    score(query, row m) = (stored_row_m (dequantised) · finalize_queries(q)) * row_scale[m]

    `row_scale` is `1/||W g_m||` (unit norm; 1 without) times a per-row factor applied after R
    when the row has one (TRAK's Q = 1 - p̄, `index/trak.py`).
    """

    whitening: hessian.Whitening
    row_scale: np.ndarray  # [num_rows] float32
    row_factor: np.ndarray | None = None  # [num_rows] the factor inside row_scale (TRAK's Q); None = 1

    def finalize_queries(self, q_raw: Float[Array, "q d"]) -> np.ndarray:
        """Raw query vectors -> q' = W normalise(W q) (float32)."""
        w = None if self.whitening.matrix is None else jnp.asarray(self.whitening.matrix)
        return np.asarray(hessian.finalize_queries(jnp.asarray(q_raw, jnp.float32), w, self.whitening.unit_norm))


def prepare_scoring(
    reader: store.IndexReader,
    cfg: hessian.HessianConfig,
    query_vectors: Float[Array, "q d"] | None = None,
    *,
    cache: bool = True,
    rows: tuple[int, int] | None = None,
    row_factor: np.ndarray | None = None,
) -> Scoring:
    """Resolves R (none / train / mixed with automatic λ), R^{-1/2} and the per-row scales.

    Args:
      reader: a complete index (R_train comes from it).
      cfg: hessian config.
      query_vectors: raw query vectors (R_eval for mode "mixed").
      cache: cache the per-row scales under the index.
      rows: only these rows get their scales (`compute_row_scale`); default all.
      row_factor: `[num_rows]` factor multiplying each row's score after R and the unit norm
        (TRAK's Q, `trak.row_factor`); None = 1.

    Returns:
      Scoring.
    """
    r_train = reader.r_train() if cfg.mode != "none" else None
    if cfg.mode != "none" and r_train is None:
        raise store.IndexIncompleteError(
            f"index {reader.path} has no R_train yet (build incomplete: "
            f"{len(reader.complete_chunks)}/{reader.num_chunks} chunks)"
        )
    r_ev = hessian.r_eval(query_vectors, reader.num_blocks_total) if cfg.mode == "mixed" else None
    whit = hessian.make_whitening(cfg, r_train, r_ev)
    scale = compute_row_scale(reader, whit, cache=cache, rows=rows)
    factor = None
    if row_factor is not None:
        factor = np.asarray(row_factor, np.float32)
        if factor.shape != scale.shape:
            raise ValueError(f"row_factor has shape {factor.shape}, the index {reader.path} has {scale.shape[0]} rows")
        scale = scale * factor
    return Scoring(whit, scale, factor)


def statistics_record(run: checkpoint_lib.Run, correction: bool, whitening: hessian.Whitening) -> dict:
    """What every statistic of a gradient retrieval was estimated from, against what it needs:
    `v` (`checkpoint.second_moment_record`), and where R is used `r_train`, `r_eval`, `lambda`
    (`hessian.make_whitening`); `thin_notes`, one line per statistic too thin to trust (V's is
    logged here; R's and λ's were logged when the whitening was made)."""
    v = checkpoint_lib.second_moment_record(run, correction)
    out = {"v": v, **{k: x for k, x in (whitening.statistics or {}).items() if k != "thin_notes"}}
    notes = ([v["note"]] if v.get("thin") else []) + hessian.thin_notes(whitening.statistics)
    if v.get("thin"):
        logging.warning("%s", v["note"])
    logging.info("scoring: %s", hessian.describe_statistics(out))
    return {**out, "thin_notes": notes}


def write_finalized(
    reader: store.IndexReader,
    whitening: hessian.Whitening,
    out_path: str | os.PathLike,
    *,
    dtype: str = "float32",
    process_index: int = 0,
    process_count: int = 1,
) -> store.IndexReader:
    """The other finalisation path: a second index whose rows are Ḡ_m = normalise(W g_m).

    Retrieval over it is a plain dot product with `hessian.finalize_rows(q, W, unit_norm)`.
    Resumable like any build. Its manifest copies the source's and records the whitening.

    Returns:
      A reader of the new index.
    """
    src = reader.manifest
    w = None if whitening.matrix is None else jnp.asarray(whitening.matrix)
    storage = manifest_lib.StorageConfig(dtype=dtype, chunk_rows=reader.chunk_rows)
    manifest = manifest_lib.make_manifest(
        num_rows=reader.num_rows,
        dim=reader.dim,
        num_blocks_total=reader.num_blocks_total,
        storage=storage,
        model=src["model"],
        vectors=src["vectors"],
        corpus=src["corpus"],
        featurizer=src.get("featurizer", {}),
        info={"source_index": str(reader.path)},
    )
    manifest["finalized"] = {
        **whitening.describe(),
        "source": store.manifest_fingerprint(src),
        "whitening_sha256": None
        if whitening.matrix is None
        else hashlib.sha256(np.ascontiguousarray(whitening.matrix).tobytes()).hexdigest(),
    }
    fn = jax.jit(lambda rows, scale: hessian.finalize_rows(store.dequantize(rows, scale), w, whitening.unit_norm))

    def rows_fn(lo, hi):
        rows, scale = reader.read_block(lo, hi)
        return fn(rows, scale)

    builder.IndexBuilder(out_path, manifest, process_index=process_index, process_count=process_count).build(rows_fn)
    return store.open_index(out_path)
