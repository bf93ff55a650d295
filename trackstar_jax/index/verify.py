"""`verify_index`: a whole index checked (manifest against arrays, every chunk readable, finite
values, R_train against a recomputation from the stored rows), for `launch/verify_index.py`-style
audits and the fault tests. Builds on `store.py`'s reader.
"""

from __future__ import annotations

import os
import pathlib

import jax
import numpy as np

from trackstar_jax.index.manifest import _INFO, IndexCorruptError, IndexStoreError, read_manifest
from trackstar_jax.index.store import (
    IndexReader,
    _chunk_autocorrelation,
    dequantize,
    load_r_train,
    process_chunk_range,
    read_partition,
)
from trackstar_jax.training import checkpoint as checkpoint_lib


def verify_index(path: str | os.PathLike, *, recompute_r: bool = True, require_complete: bool = True) -> dict:
    """Checks a whole index: manifest vs arrays, every chunk readable (crc32c, size, presence),
    finite values, R_train present and (optionally) equal to a recomputation from the stored rows.

    Args:
      path: index directory.
      recompute_r: re-derive R_train from the rows and compare with r_train.npy.
      require_complete: incomplete chunks are errors (else they are only reported).

    Returns:
      A JSON-able report.

    Raises:
      IndexCorruptError: listing every bad chunk by row range (and any R_train problem).
    """
    p = pathlib.Path(path)
    reader = IndexReader(p, read_manifest(p))
    problems: list[str] = []
    incomplete = sorted(set(range(reader.num_chunks)) - reader.complete_chunks)
    if incomplete and require_complete:
        for c in incomplete[:20]:
            lo, hi = reader.chunk_range(c)
            problems.append(f"chunk {c}, rows [{lo}, {hi}): not complete (no marker)")
    k2 = reader.block_dim
    recomputed = np.zeros((reader.num_blocks_total, k2, k2), np.float64)
    seg_acc = None
    device = jax.local_devices()[0]
    r_every = reader.manifest["storage"]["r_every_chunks"]
    pcount = 1
    if (p / "progress" / "partition.json").exists():
        pcount = read_partition(p)
    ranges = [process_chunk_range(reader.num_chunks, r_every, i, pcount) for i in range(pcount)]
    for c in sorted(reader.complete_chunks):
        lo, hi = reader.chunk_range(c)
        try:
            stored, scale = reader.read_block(lo, hi)
        except IndexStoreError as e:
            problems.append(str(e))
            seg_acc = None
            continue
        x = np.asarray(dequantize(stored, scale))
        if not np.isfinite(x).all():
            bad = lo + np.flatnonzero(~np.isfinite(x).all(axis=1))
            problems.append(f"chunk {c}, rows [{lo}, {hi}): non-finite values in rows {bad[:10].tolist()}")
        if recompute_r and not problems:
            pad = reader.chunk_rows - (hi - lo)
            stored_p = np.pad(stored, [(0, pad), (0, 0)])
            scale_p = None if scale is None else np.pad(scale, [(0, pad)])
            part = _chunk_autocorrelation(
                jax.device_put(stored_p, device),
                None if scale_p is None else jax.device_put(scale_p, device),
                num_blocks_total=reader.num_blocks_total,
            )
            seg_acc = part if seg_acc is None else seg_acc + part
            # Same grouping as the builder: float32 within a segment, float64 across segments.
            rng = next(r for r in ranges if c in r)
            if (c + 1 - rng.start) % r_every == 0 or c + 1 == rng.stop:
                recomputed += np.asarray(seg_acc, np.float64)
                seg_acc = None
    report = {
        "path": str(p),
        "num_rows": reader.num_rows,
        "dim": reader.dim,
        "dtype": reader.dtype_name,
        "chunks": reader.num_chunks,
        "complete_chunks": len(reader.complete_chunks),
        "bytes_on_disk": _du(p / "vectors") + (_du(p / "row_scale") if reader.dtype_name == "int8" else 0),
    }
    try:
        r = load_r_train(p) if reader.is_complete else None
    except IndexCorruptError as e:
        problems.append(str(e))
        r = None
    if reader.is_complete and r is None and not any("r_train" in x for x in problems):
        problems.append("all chunks complete but R_train is missing (run index.finalize)")
    if r is not None:
        if not np.isfinite(r.total).all():
            problems.append("R_train contains NaN/inf")
        elif recompute_r and not problems:
            err = float(np.max(np.abs(r.total - recomputed)) / max(np.max(np.abs(recomputed)), 1e-30))
            report["r_train_max_rel_diff"] = err
            if err > 1e-6:
                problems.append(f"R_train differs from a recomputation from the stored rows (max rel diff {err:.3g})")
    try:  # built from the checkpoint now on disk (its checksum digest, recorded at build time)
        report["checkpoint"] = checkpoint_lib.check_recorded_checkpoint(
            p, reader.manifest.get(_INFO, {}).get("checkpoint")
        )
    except checkpoint_lib.CheckpointCorruptError as e:
        problems.append(str(e))
    report["ok"] = not problems
    report["problems"] = problems
    if problems:
        raise IndexCorruptError(f"index {p} failed verification:\n  " + "\n  ".join(problems))
    return report


def _du(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0
