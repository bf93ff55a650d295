"""The attribution index: raw projected vectors of a whole corpus in a tensorstore zarr3 array.

Paper §3 ("Random projection"): projected gradients are computed and stored once per training
example and reused for every future query. This module stores them, accumulates R_train
(§A.1.3) in the same pass, and prepares on-the-fly scoring (hessian.py).

On-disk layout of an index directory (local or mounted filesystem):

    manifest.json            identity of the index, written once (atomically), never modified
    vectors/                 zarr3 [num_rows, d], chunks [chunk_rows, d], codecs bytes + crc32c
    row_scale/               zarr3 [num_rows] float32, int8 storage only (dequantisation scale)
    progress/partition.json  process_count of the build (a resume must use the same)
    progress/chunk_XXXXXXXX.done   completion marker, written after that chunk's data is durable
    r_train/part-PPPP-of-QQQQ-upto-XXXXXXXX.npy   running R_train sum of process P's chunks
    r_train.npy, r_train.json      final R_train sum (float64) and row count
    chunks.json              crc32c of every chunk file, by position, and the manifest fingerprint
    COMPLETE                 written last; readers then skip the marker scan
    scoring/<key>.npy        cached per-row scales of on-the-fly scoring, one per whitening

Row i is example id i. Progress is committed in whole chunks: a chunk is complete iff its
marker exists; markers are written only after the chunk's write has committed, so readers never
treat half-written rows as complete, a killed build resumes from the first chunk without a
marker, and rewriting a chunk produces the same bytes (the featurizer is deterministic). Every
chunk carries a crc32c digest (zarr3 codec) and missing chunks are read errors
(`fill_missing_data_reads=False`), so truncation/corruption/deletion is an error naming the rows.
A chunk's crc32c only covers its bytes, so each marker (and, once complete, `chunks.json`, which
also records the manifest fingerprint) records the crc32c each chunk file ended with when it was
written: a file swapped with another chunk's, or copied from another index, passes its own crc32c
but not the one recorded for its position, and is an error naming the chunk (format 2; indices
of format 1 had no such record and are refused with "rebuild").
Reads of the vectors go straight to the chunk files (`c/<chunk>/0`: the raw little-endian rows,
then their crc32c), checked with a hardware crc32c (`google-crc32c`): on a 2-core CPU tensorstore's
decode path read a 33.5 MB block 3-6x slower under load, and streamed queries ran 1.1-1.6x slower
idle (BUILD_NOTES, issue 14). Any other layout, or no google-crc32c, reads through tensorstore.

R_train composes with resume and with several writer processes like this: each process owns a
contiguous range of whole "segments" (`r_every_chunks` chunks). Per chunk, the autocorrelation
is computed from the *stored* rows (dequantised), summed on device in float32 over a segment,
and added in float64 to the process's running sum, which is saved (atomically) at every segment
end. A resumed process reloads its running sum and recomputes the partial sums of chunks that
were completed after it by reading them back: the same bytes in, the same bits out. The final
R_train is the sum of the processes' running sums (float64). Using stored rather than
pre-quantisation rows makes R exactly the autocorrelation of what retrieval scores.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import math
import os
import pathlib
import re
import time
from concurrent import futures
from typing import Any, Iterator, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import tensorstore as ts
from absl import logging
from jaxtyping import Array, Float

try:  # hardware crc32c for direct chunk reads (`IndexReader._read_vectors_direct`)
    import google_crc32c
except ImportError:  # reads then go through tensorstore
    google_crc32c = None

import trackstar_jax
from trackstar_jax import files
from trackstar_jax.features import vectors as vectors_lib
from trackstar_jax.index import hessian
from trackstar_jax.models import lm
from trackstar_jax.training import checkpoint as checkpoint_lib

FORMAT = "trackstar_jax.index/2"
# Older formats: why they are refused (the fix is always a rebuild).
_OLD_FORMATS = {
    "trackstar_jax.index/1": "its chunk checksums are not bound to the chunks' positions (two swapped chunk "
    "files would pass)",
}
CHUNK_TABLE = "chunks.json"
STORAGE_DTYPES = ("float32", "bfloat16", "float16", "int8")


@dataclasses.dataclass(frozen=True)
class StorageConfig:
    """Storage part of the manifest (config section `index`).

    Attributes:
      dtype: "float32" | "bfloat16" | "float16" | "int8" (per-row absmax scale).
      chunk_rows: rows per zarr chunk: the unit of reads, writes and resumable progress.
      r_every_chunks: chunks per R_train segment (the running sum is saved once per segment);
        0 = automatic (saving R costs <= 2% of the segment's vector bytes).
    """

    dtype: str = "bfloat16"
    chunk_rows: int = 1024
    r_every_chunks: int = 0

    def __post_init__(self):
        if self.dtype not in STORAGE_DTYPES:
            raise ValueError(f"index.dtype must be one of {STORAGE_DTYPES}, got {self.dtype!r}")
        if self.chunk_rows <= 0:
            raise ValueError(f"index.chunk_rows must be positive, got {self.chunk_rows}")
        if self.r_every_chunks < 0:
            raise ValueError(f"index.r_every_chunks must be >= 0, got {self.r_every_chunks}")


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dict -> {"a.b.c": value}."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


@dataclasses.dataclass(frozen=True)
class IndexSettings(StorageConfig):
    """`config.index`: storage (`StorageConfig`) plus `dir`, the index's folder in the workdir."""

    dir: str = "index"

    def __post_init__(self):
        super().__post_init__()  # dtype / chunk_rows / r_every_chunks
        if not self.dir or pathlib.Path(self.dir).name != self.dir or self.dir.startswith("."):
            raise ValueError(f"index.dir must be a plain folder name inside the workdir, got {self.dir!r}")

    @property
    def storage(self) -> StorageConfig:
        """The storage keys alone (what an index's manifest records)."""
        return StorageConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(StorageConfig)})


NP_DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "int8": np.dtype(np.int8),
}
_INFO = "info"  # manifest section that is recorded but never compared
_MARKER_RE = re.compile(r"^chunk_(\d{8})\.done$")
_PART_RE = re.compile(r"^part-(\d{4})-of-(\d{4})-upto-(\d{8})\.npy$")
# Fraction of a segment's vector bytes that saving the running R_train sum may cost (auto segment size).
_R_SAVE_BUDGET = 0.02


class IndexStoreError(Exception):
    """Base class of index errors (not the builtin IndexError)."""


class IndexMismatchError(IndexStoreError):
    """The manifest on disk disagrees with what the caller expects (names the field)."""


class IndexIncompleteError(IndexStoreError):
    """Rows were requested from chunks that are not complete (names the row range)."""


class IndexCorruptError(IndexStoreError):
    """A chunk is missing, truncated or fails its checksum (names the row range)."""


class IndexWriteError(IndexStoreError):
    """A write failed (e.g. disk full); complete chunks stay intact and the build can resume."""


# ------------------------------------------------------------------------------------------
# Manifest
# ------------------------------------------------------------------------------------------


def auto_r_every_chunks(dim: int, num_blocks_total: int, dtype: str, chunk_rows: int) -> int:
    """Smallest segment (in chunks) for which saving the float64 R sum costs <= 2% of its data."""
    k2 = dim // num_blocks_total
    r_bytes = num_blocks_total * k2 * k2 * 8
    chunk_bytes = chunk_rows * dim * NP_DTYPES[dtype].itemsize
    return max(1, math.ceil(r_bytes / (_R_SAVE_BUDGET * chunk_bytes)))


def make_manifest(
    *,
    num_rows: int,
    dim: int,
    num_blocks_total: int,
    storage: StorageConfig,
    model: Mapping[str, Any],
    vectors: Mapping[str, Any],
    corpus: Mapping[str, Any],
    featurizer: Mapping[str, Any] | None = None,
    info: Mapping[str, Any] | None = None,
) -> dict:
    """Builds the manifest dict of a new index.

    Every section except `info` is part of the index identity: a resume, or a reader with
    `expect=`, is refused when any of those fields differs.

    Args:
      num_rows: number of examples (row i = example id i).
      dim: vector dimension d.
      num_blocks_total: diagonal blocks of R (2 * num_blocks).
      storage: dtype / chunking.
      model: e.g. {"checkpoint_step", "fingerprint", "config"}.
      vectors: e.g. {"output_fn", "num_blocks", "proj_dim", "proj_seed", "correction", "path"}.
      corpus: {"name", "fingerprint", "num_examples"}.
      featurizer: settings that change the exact bits (batch size, sequence length).
      info: recorded, never compared (creation time, command line, git commit).

    Returns:
      The manifest (JSON-able nested dict).
    """
    if num_rows <= 0 or dim <= 0:
        raise ValueError(f"index needs num_rows > 0 and dim > 0, got {num_rows}, {dim}")
    hessian.split_blocks(jnp.zeros((1, dim)), num_blocks_total)  # validates the block layout
    r_every = storage.r_every_chunks or auto_r_every_chunks(dim, num_blocks_total, storage.dtype, storage.chunk_rows)
    m = {
        "format": FORMAT,
        "code_version": trackstar_jax.__version__,
        "model": dict(model),
        "vectors": {
            **dict(vectors),
            "dim": int(dim),
            "num_blocks_total": int(num_blocks_total),
            "block_dim": int(dim // num_blocks_total),
        },
        "storage": {
            "dtype": storage.dtype,
            "chunk_rows": int(storage.chunk_rows),
            "r_every_chunks": int(r_every),
            "num_rows": int(num_rows),
        },
        "corpus": dict(corpus),
        "featurizer": dict(featurizer or {}),
        _INFO: {"created_unix": time.time(), **dict(info or {})},
    }
    return json.loads(json.dumps(m))  # normalise tuples -> lists, check JSON-ability


def check_manifest(actual: Mapping[str, Any], expected: Mapping[str, Any], *, path: str, action: str) -> None:
    """Raises IndexMismatchError naming the first differing field (the `info` section is ignored).

    Args:
      actual: the manifest on disk.
      expected: fields the caller requires (nested or dotted keys); fields the caller does not
        mention are not compared.
      path: index path (for the message).
      action: what is refused ("open", "resume"), for the message.
    """
    exp = flatten(json.loads(json.dumps(dict(expected))))
    act = flatten(actual)
    diffs = []
    for key in sorted(exp, key=_report_order):
        if key.split(".")[0] == _INFO:
            continue
        if key not in act:
            if _added_with_default(key, exp[key]):
                continue
            before = f", so it was built with {_VALUE_BEFORE_ADDED[key]!r}" if key in _VALUE_BEFORE_ADDED else ""
            diffs.append(f"its manifest has no field {key!r}{before} (expected {exp[key]!r})")
        elif act[key] != exp[key]:
            diffs.append(f"manifest field {key!r} is {act[key]!r} in the index but {exp[key]!r} was expected")
    if diffs:
        more = f" (and {len(diffs) - 1} more: " + "; ".join(diffs[1:6]) + ")" if len(diffs) > 1 else ""
        raise IndexMismatchError(f"refusing to {action} index {path}: {diffs[0]}{more}")


# Fields derived from others: a mismatch names the setting the user changed first
# (vectors.proj_dim before vectors.block_dim; vectors.correction before the model
# fingerprint, which covers the optimizer state only with the correction on).
_DERIVED = ("vectors.dim", "vectors.block_dim", "vectors.num_blocks_total", "model.fingerprint", "storage.num_rows")
_SECTION_ORDER = ("vectors", "storage", "corpus", "model")


def _report_order(key: str) -> tuple:
    sec = key.split(".")[0]
    return (key in _DERIVED, _SECTION_ORDER.index(sec) if sec in _SECTION_ORDER else len(_SECTION_ORDER), key)


# Manifest sections whose fields are a config dataclass: a field added later (with its default)
# is absent from the manifests of indices built before it.
_DEFAULTS_OF = {"model.config.": lm.LMConfig, "vectors.": vectors_lib.VectorConfig}


# Fields added with a default that differs from what the code did before them: an index
# without the field was built with this value. `vectors.unembed` (session 5): untied output
# embeddings were attributed (only untied models' manifests record the field).
_VALUE_BEFORE_ADDED = {"vectors.unembed": True}


def _added_with_default(key: str, expected: Any) -> bool:
    """A config field added after an index was built (e.g. `model.config.arch`,
    `vectors.exact_v`), expected at its default: the index was made with that default, so it
    still opens (unless the code did otherwise before the field existed: `_VALUE_BEFORE_ADDED`)."""
    if key in _VALUE_BEFORE_ADDED:
        return _VALUE_BEFORE_ADDED[key] == expected
    for prefix, cls in _DEFAULTS_OF.items():
        if key.startswith(prefix) and "." not in key[len(prefix) :]:
            defaults = {f.name: f.default for f in dataclasses.fields(cls)}
            field = key[len(prefix) :]
            return field in defaults and json.loads(json.dumps(defaults[field])) == expected
    return False


def _identity(manifest: Mapping[str, Any]) -> dict:
    return {k: v for k, v in manifest.items() if k != _INFO}


def manifest_fingerprint(manifest: Mapping[str, Any]) -> str:
    """sha256 of the identity part of a manifest (keys cached scoring files)."""
    return hashlib.sha256(json.dumps(_identity(manifest), sort_keys=True).encode()).hexdigest()


def tree_fingerprint(tree: Any) -> str:
    """sha256 over (path, dtype, shape, bytes) of every array leaf, in sorted path order.

    Used as the model checkpoint fingerprint in the manifest (params, and the optimizer state
    when the vectors use it). Leaves must be addressable from this process.
    """
    h = hashlib.sha256()
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    for path, leaf in sorted(leaves, key=lambda kv: jax.tree_util.keystr(kv[0])):
        a = np.asarray(jax.device_get(leaf))
        h.update(jax.tree_util.keystr(path).encode())
        h.update(str(a.dtype).encode() + str(a.shape).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return "sha256:" + h.hexdigest()


# ------------------------------------------------------------------------------------------
# Files
# ------------------------------------------------------------------------------------------


def read_manifest(path: str | os.PathLike) -> dict:
    """Loads `<path>/manifest.json` (clear error if the directory is not an index)."""
    p = pathlib.Path(path) / "manifest.json"
    if not p.exists():
        raise FileNotFoundError(f"{path} is not a trackstar index (no manifest.json)")
    try:
        m = files.read_json(p, "index manifest", "the index cannot be trusted: delete the index folder and rebuild it")
    except files.InputError as e:
        raise IndexCorruptError(str(e)) from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        got = m.get("format") if isinstance(m, dict) else type(m).__name__
        if got in _OLD_FORMATS:
            raise IndexMismatchError(
                f"index {path} has the older format {got!r}: {_OLD_FORMATS[got]}; rebuild it: delete {path} "
                "and rerun build_index"
            )
        raise IndexMismatchError(f"index {path}: format {got!r} is not {FORMAT!r}")
    return m


# ------------------------------------------------------------------------------------------
# Chunk files and their position-bound checksums
# ------------------------------------------------------------------------------------------


def chunk_files(path: pathlib.Path, c: int, dtype: str) -> list[pathlib.Path]:
    """The files holding chunk `c` (zarr3 default chunk keys): vectors, then the int8 row scale."""
    out = [path / "vectors" / "c" / str(c) / "0"]
    if dtype == "int8":
        out.append(path / "row_scale" / "c" / str(c))
    return out


def file_crc32c(f: pathlib.Path) -> int:
    """The crc32c a zarr3 chunk file ends with (4 bytes, little-endian), without reading the rest.

    Raises:
      FileNotFoundError: no such file.
    """
    with open(f, "rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        fh.seek(max(size - 4, 0))
        return int.from_bytes(fh.read(4), "little")


def marker_record(lo: int, hi: int, crcs: list[int]) -> dict:
    """What a chunk's completion marker holds: its rows and the crc32c its files were written with."""
    return {"rows": [lo, hi], "crc32c": [int(x) for x in crcs]}


def read_marker_crcs(path: pathlib.Path, c: int) -> list[int]:
    """The crc32c recorded for chunk `c` by its completion marker (named error if damaged)."""
    f = path / "progress" / f"chunk_{c:08d}.done"
    fix = f"delete {f} and rerun build_index to rewrite chunk {c}"
    try:
        return [int(x) for x in files.read_json(f, "index chunk marker", fix)["crc32c"]]
    except files.InputError as e:
        raise IndexCorruptError(str(e)) from None
    except (KeyError, TypeError, ValueError):
        raise IndexCorruptError(f"index chunk marker {f} records no crc32c: {fix}") from None


def load_chunk_table(path: pathlib.Path, manifest: Mapping[str, Any], num_chunks: int) -> list[list[int]]:
    """`chunks.json` of a complete index: per chunk, the crc32c of its files (named error if it is
    missing, damaged, the wrong length, or another index's)."""
    f = path / CHUNK_TABLE
    fix = f"delete {path / 'COMPLETE'} and rerun build_index to rewrite it from the chunk markers"
    try:
        t = files.read_json(f, "index chunk table", fix)
    except (files.InputError, FileNotFoundError) as e:
        raise IndexCorruptError(f"index {path}: {e}" if isinstance(e, FileNotFoundError) else str(e)) from None
    if not isinstance(t, dict) or t.get("index") != manifest_fingerprint(manifest):
        raise IndexCorruptError(f"index {path}: {f} belongs to another index (not this manifest's); {fix}")
    crcs = t.get("crc32c")
    if not isinstance(crcs, list) or len(crcs) != num_chunks:
        raise IndexCorruptError(f"index {path}: {f} does not list one crc32c per chunk ({num_chunks}); {fix}")
    return crcs


def chunk_position_error(
    path: pathlib.Path, c: int, rows: tuple[int, int], f: pathlib.Path, got: int, want: int
) -> IndexCorruptError:
    """The error for a chunk file whose own crc32c is not the one recorded for its position."""
    return IndexCorruptError(
        f"index {path}: chunk {c}, rows [{rows[0]}, {rows[1]}) cannot be read: {f} passes its crc32c but is not "
        f"the file written at this position (crc32c {got:08x}, recorded {want:08x}): it was swapped with another "
        f"chunk, copied from another index or rewritten; delete it and rerun build_index to rewrite it"
    )


def _array_spec(path: pathlib.Path, shape: list[int], chunk_shape: list[int], dtype: str) -> dict:
    """zarr3 on the local filesystem, uncompressed, with a crc32c digest per chunk."""
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(path)},
        "metadata": {
            "shape": shape,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk_shape}},
            "data_type": dtype,
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        },
    }


def _vectors_spec(path: pathlib.Path, manifest: Mapping[str, Any]) -> dict:
    s, d = manifest["storage"], manifest["vectors"]["dim"]
    return _array_spec(path / "vectors", [s["num_rows"], d], [s["chunk_rows"], d], s["dtype"])


def _scale_spec(path: pathlib.Path, manifest: Mapping[str, Any]) -> dict:
    s = manifest["storage"]
    return _array_spec(path / "row_scale", [s["num_rows"]], [s["chunk_rows"]], "float32")


def _open_arrays(
    path: pathlib.Path, manifest: Mapping[str, Any], *, create: bool
) -> tuple[ts.TensorStore, ts.TensorStore | None]:
    """Opens (or creates) the vectors and (int8) row-scale arrays.

    The full metadata is passed, so tensorstore refuses an existing array whose shape, dtype,
    chunking or codecs differ from the manifest. Missing chunks are read errors, not zeros.
    """

    def open_one(spec):
        spec = {**spec, "fill_missing_data_reads": False}
        try:
            return ts.open(spec, open=True, create=create).result()
        except ValueError as e:
            raise IndexMismatchError(
                f"index {path}: array {spec['kvstore']['path']} does not match the manifest "
                f"(or is missing/corrupt): {e}"
            ) from e

    vec = open_one(_vectors_spec(path, manifest))
    scale = open_one(_scale_spec(path, manifest)) if manifest["storage"]["dtype"] == "int8" else None
    return vec, scale


# ------------------------------------------------------------------------------------------
# Quantisation and per-chunk R (jitted; the same functions serve build and read-back)
# ------------------------------------------------------------------------------------------


def quantize(rows: Float[Array, "n d"], dtype: str) -> tuple[Array, Float[Array, " n"] | None]:
    """float32 rows -> storage dtype (+ per-row scale for int8: absmax/127, round half to even)."""
    rows = jnp.asarray(rows, jnp.float32)
    if dtype == "int8":
        scale = jnp.max(jnp.abs(rows), axis=1) / 127.0
        q = jnp.where(scale[:, None] > 0, rows / jnp.where(scale > 0, scale, 1.0)[:, None], 0.0)
        return jnp.clip(jnp.round(q), -127, 127).astype(jnp.int8), scale
    return rows.astype(NP_DTYPES[dtype]), None


def dequantize(stored: Array, scale: Float[Array, " n"] | None) -> Float[Array, "n d"]:
    """Storage dtype -> float32 (exact for bf16/f16; `q * scale` for int8)."""
    x = jnp.asarray(stored).astype(jnp.float32)
    return x if scale is None else x * jnp.asarray(scale, jnp.float32)[:, None]


BAD_NON_FINITE, BAD_ZERO = 1, 2  # codes of `_quantize_step`'s `bad`


@functools.partial(jax.jit, static_argnames=("dtype",))
def _quantize_step(rows, *, dtype):
    """`(stored, scale, bad)`: `bad` [n] int32 is 0 for a good row, `BAD_NON_FINITE`, or
    `BAD_ZERO` for a row that is all zero as stored (zero gradients, or underflow of the
    storage dtype): it would score 0 against every query, and a chunk of zeros equals the
    array's fill value, which tensorstore does not write."""
    stored, scale = quantize(rows, dtype)
    x = dequantize(stored, scale)
    nonfinite = ~jnp.all(jnp.isfinite(x), axis=1)
    if scale is not None:
        nonfinite = nonfinite | ~jnp.isfinite(scale)
    zero = ~jnp.any(x != 0, axis=1)
    return stored, scale, jnp.where(nonfinite, BAD_NON_FINITE, jnp.where(zero, BAD_ZERO, 0)).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("num_blocks_total",))
def _chunk_autocorrelation(stored, scale, *, num_blocks_total):
    return hessian.autocorrelation(dequantize(stored, scale), num_blocks_total)


# ------------------------------------------------------------------------------------------
# Reader
# ------------------------------------------------------------------------------------------


class IndexReader:
    """Read access to an index (complete or still being built).

    Attributes:
      path, manifest, num_rows, dim, dtype (numpy storage dtype), dtype_name, chunk_rows,
      num_blocks_total, block_dim.
    """

    def __init__(self, path: pathlib.Path, manifest: dict, direct: bool = True):
        self.path = path
        self.manifest = manifest
        st = manifest["storage"]
        self.num_rows = int(st["num_rows"])
        self.dim = int(manifest["vectors"]["dim"])
        self.dtype_name = st["dtype"]
        self.dtype = NP_DTYPES[self.dtype_name]
        self.chunk_rows = int(st["chunk_rows"])
        self.num_blocks_total = int(manifest["vectors"]["num_blocks_total"])
        self.block_dim = self.dim // self.num_blocks_total
        self.num_chunks = -(-self.num_rows // self.chunk_rows)
        self._vectors, self._scale = _open_arrays(path, manifest, create=False)
        self._direct = direct and _direct_layout(path / "vectors", manifest)
        self.refresh()

    def refresh(self) -> None:
        """Re-reads which chunks are complete (for an index that is still being built)."""
        self.complete_chunks = _complete_chunks(self.path, self.num_chunks)
        self._table = (
            load_chunk_table(self.path, self.manifest, self.num_chunks) if (self.path / "COMPLETE").exists() else None
        )
        self._marker_crcs: dict[int, list[int]] = {}

    def recorded_crcs(self, c: int) -> list[int]:
        """The crc32c chunk `c`'s files were written with (chunks.json, else its marker)."""
        if self._table is not None:
            return self._table[c]
        if c not in self._marker_crcs:
            self._marker_crcs[c] = read_marker_crcs(self.path, c)
        return self._marker_crcs[c]

    def check_positions(self, start: int, stop: int, *, vectors: bool = True) -> None:
        """Each chunk file of rows `[start, stop)` ends with the crc32c recorded for its position
        (reads only the files' last 4 bytes; `vectors=False` checks the int8 row scales only)."""
        for c in range(start // self.chunk_rows, -(-stop // self.chunk_rows)):
            want = self.recorded_crcs(c)
            for i, f in enumerate(chunk_files(self.path, c, self.dtype_name)):
                if i == 0 and not vectors:
                    continue
                try:
                    got = file_crc32c(f)
                except FileNotFoundError:
                    raise IndexCorruptError(
                        f"index {self.path}: chunk {c}, rows {list(self.chunk_range(c))} cannot be read: its file "
                        f"{f} is missing"
                    ) from None
                if got != want[i]:
                    raise chunk_position_error(self.path, c, self.chunk_range(c), f, got, want[i])

    @property
    def is_complete(self) -> bool:
        return len(self.complete_chunks) == self.num_chunks

    def chunk_range(self, chunk: int) -> tuple[int, int]:
        """Row range `[start, stop)` of a chunk."""
        return chunk * self.chunk_rows, min((chunk + 1) * self.chunk_rows, self.num_rows)

    def _check_range(self, start: int, stop: int) -> None:
        if not 0 <= start < stop <= self.num_rows:
            raise ValueError(f"row range [{start}, {stop}) is outside the index's [0, {self.num_rows})")
        missing = [
            c for c in range(start // self.chunk_rows, -(-stop // self.chunk_rows)) if c not in self.complete_chunks
        ]
        if missing:
            lo, hi = self.chunk_range(missing[0])
            raise IndexIncompleteError(
                f"index {self.path}: rows [{lo}, {hi}) (chunk {missing[0]}) are not complete "
                f"({len(missing)} incomplete chunk(s) in the requested rows [{start}, {stop}); resume the build)"
            )

    def read_block_async(self, start: int, stop: int) -> "_PendingBlock":
        """Starts reading rows `[start, stop)`; `.result()` returns what `read_block` returns."""
        self._check_range(start, stop)
        if self._direct:
            fut_v = _read_pool().submit(self._read_vectors_direct, start, stop)
        else:
            fut_v = self._vectors[start:stop].read()
        fut_s = self._scale[start:stop].read() if self._scale is not None else None
        return _PendingBlock(self, start, stop, fut_v, fut_s)

    def _read_vectors_direct(self, start: int, stop: int) -> np.ndarray:
        """Rows `[start, stop)` read straight from the chunk files, each checked against its crc32c.

        The same bytes tensorstore reads (the layout `_direct_layout` checked), without its
        per-chunk decode and copies: on the loaded 2-core CPU tensorstore delivered 0.3-0.9 GB/s
        from the page cache where the files read at 4-9 GB/s (BUILD_NOTES, issue 14).
        """
        out = np.empty((stop - start, self.dim), self.dtype)
        nbytes = self.chunk_rows * self.dim * self.dtype.itemsize
        for c in range(start // self.chunk_rows, -(-stop // self.chunk_rows)):
            lo, hi = self.chunk_range(c)
            f = self.path / "vectors" / "c" / str(c) / "0"
            try:
                data = f.read_bytes()
            except FileNotFoundError:
                raise IndexCorruptError(
                    f"index {self.path}: chunk {c}, rows [{lo}, {hi}) cannot be read: its file {f} is missing"
                ) from None
            if len(data) != nbytes + 4:
                raise IndexCorruptError(
                    f"index {self.path}: chunk {c}, rows [{lo}, {hi}) cannot be read: {f} has {len(data)} bytes, "
                    f"not {nbytes + 4} (truncated or overwritten)"
                )
            # CRC-32C of bytes + their own little-endian CRC-32C is this constant (its residue):
            # one pass over the file as read, no copy of the payload.
            if google_crc32c.value(data) != _CRC32C_RESIDUE:
                raise IndexCorruptError(
                    f"index {self.path}: chunk {c}, rows [{lo}, {hi}) cannot be read: {f} fails its crc32c"
                )
            got, want = int.from_bytes(data[-4:], "little"), self.recorded_crcs(c)[0]
            if got != want:
                raise chunk_position_error(self.path, c, (lo, hi), f, got, want)
            rows = np.frombuffer(data, self.dtype, count=self.chunk_rows * self.dim).reshape(self.chunk_rows, -1)
            a, b = max(lo, start), min(hi, stop)
            out[a - start : b - start] = rows[a - lo : b - lo]
        return out

    def read_block(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Rows `[start, stop)` in the storage dtype `[n, d]`, and the int8 per-row scale `[n]`
        (None for float dtypes).

        Raises:
          IndexIncompleteError: a chunk in the range is not complete (names the rows).
          IndexCorruptError: a chunk is missing, truncated or fails its crc32c (names the rows).
        """
        return self.read_block_async(start, stop).result()

    def read_dequantized(self, start: int, stop: int) -> np.ndarray:
        """Rows `[start, stop)` as float32."""
        rows, scale = self.read_block(start, stop)
        return np.asarray(dequantize(rows, scale))

    def iter_blocks(
        self, block_rows: int | None = None, start: int = 0, stop: int | None = None
    ) -> Iterator[tuple[int, np.ndarray, np.ndarray | None]]:
        """Yields `(start, rows, scale)` over `[start, stop)` with one block of read-ahead."""
        block_rows = block_rows or self.chunk_rows
        stop = self.num_rows if stop is None else stop
        starts = list(range(start, stop, block_rows))
        pending = self.read_block_async(starts[0], min(starts[0] + block_rows, stop)) if starts else None
        for i, s in enumerate(starts):
            cur = pending
            if i + 1 < len(starts):
                n = starts[i + 1]
                pending = self.read_block_async(n, min(n + block_rows, stop))
            rows, scale = cur.result()
            yield s, rows, scale

    def r_train(self) -> hessian.RStats | None:
        """The finished R_train (float64 sum + row count), or None while the build is incomplete."""
        return load_r_train(self.path)


class _PendingBlock:
    def __init__(self, reader, start, stop, fut_v, fut_s):
        self.reader, self.start, self.stop, self.fut_v, self.fut_s = reader, start, stop, fut_v, fut_s

    def result(self) -> tuple[np.ndarray, np.ndarray | None]:
        try:
            rows = self.fut_v.result()
            scale = self.fut_s.result() if self.fut_s is not None else None
        except ValueError as e:  # tensorstore reports DATA_LOSS / NOT_FOUND / FAILED_PRECONDITION as ValueError
            raise _locate_corruption(self.reader, self.start, self.stop, e) from e
        # Direct reads checked the vector files' positions as they read them.
        if not self.reader._direct or self.fut_s is not None:
            self.reader.check_positions(self.start, self.stop, vectors=not self.reader._direct)
        return rows, scale


# The vectors array layout `_array_spec` writes (zarr3 v3 "default" chunk keys `c/<i>/0`,
# uncompressed little-endian bytes, a 4-byte little-endian crc32c after each chunk's bytes;
# zarr.json records no endianness for 1-byte types).
_DIRECT_CODECS = (
    [{"configuration": {"endian": "little"}, "name": "bytes"}, {"name": "crc32c"}],
    [{"name": "bytes"}, {"name": "crc32c"}],
)


_CRC32C_RESIDUE = 0x48674BC7


@functools.cache
def _read_pool() -> futures.ThreadPoolExecutor:
    """One reader thread: a block is read while the device scores the previous one."""
    return futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="index-read")


def _direct_layout(path: pathlib.Path, manifest: Mapping[str, Any]) -> bool:
    """Whether the vectors at `path` have exactly the layout `IndexReader._read_vectors_direct`
    reads (else reads go through tensorstore, which reads any zarr3 layout)."""
    if google_crc32c is None or getattr(google_crc32c, "implementation", "c") != "c":
        logging.log_first_n(logging.INFO, "index reads go through tensorstore: google-crc32c (C) is absent", 1)
        return False
    try:
        meta = json.loads((path / "zarr.json").read_text())
    except (OSError, ValueError):
        return False
    s = manifest["storage"]
    key = meta.get("chunk_key_encoding", {})
    return (
        meta.get("codecs") == _DIRECT_CODECS[0 if NP_DTYPES[s["dtype"]].itemsize > 1 else 1]
        and key.get("name") == "default"
        and key.get("configuration", {}).get("separator", "/") == "/"
        and meta.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape")
        == [s["chunk_rows"], manifest["vectors"]["dim"]]
        and meta.get("data_type") == s["dtype"]
        and meta.get("shape") == [s["num_rows"], manifest["vectors"]["dim"]]
    )


def _locate_corruption(reader: IndexReader, start: int, stop: int, err: Exception) -> IndexCorruptError:
    """Re-reads a failed range chunk by chunk to name the first bad chunk's rows."""
    for c in range(start // reader.chunk_rows, -(-stop // reader.chunk_rows)):
        lo, hi = reader.chunk_range(c)
        try:
            reader._vectors[lo:hi].read().result()
            if reader._scale is not None:
                reader._scale[lo:hi].read().result()
        except ValueError as e:
            return IndexCorruptError(f"index {reader.path}: chunk {c}, rows [{lo}, {hi}) cannot be read: {e}")
    return IndexCorruptError(f"index {reader.path}: rows [{start}, {stop}) cannot be read: {err}")


def open_index(path: str | os.PathLike, expect: Mapping[str, Any] | None = None, *, direct: bool = True) -> IndexReader:
    """Opens an index for reading, checking the manifest against `expect`.

    Args:
      path: index directory.
      expect: manifest fields that must match, nested (`{"vectors": {"proj_seed": 0}}`) or
        dotted (`{"vectors.proj_seed": 0}`); e.g. the model fingerprint, seed, d and dtype the
        caller's queries were made with.
      direct: read vector chunks straight from their files (crc32c checked) where the layout
        is the one this module writes; False reads everything through tensorstore.

    Returns:
      IndexReader.

    Raises:
      IndexMismatchError: naming the first field that differs.
    """
    p = pathlib.Path(path)
    manifest = read_manifest(p)
    if expect:
        check_manifest(manifest, expect, path=str(p), action="open")
    return IndexReader(p, manifest, direct=direct)


def _complete_chunks(path: pathlib.Path, num_chunks: int) -> frozenset[int]:
    if (path / "COMPLETE").exists():
        return frozenset(range(num_chunks))
    prog = path / "progress"
    if not prog.is_dir():
        return frozenset()
    out = set()
    for name in os.listdir(prog):
        m = _MARKER_RE.match(name)
        if m and int(m.group(1)) < num_chunks:
            out.add(int(m.group(1)))
    return frozenset(out)


def load_r_train(path: str | os.PathLike) -> hessian.RStats | None:
    """R_train of a finished build (None if the build has not finished)."""
    p = pathlib.Path(path)
    if not (p / "r_train.json").exists():
        return None
    fix = f"delete {p / 'r_train.npy'} and {p / 'r_train.json'} and {p / 'COMPLETE'}, then rerun build_index to re-derive it"
    try:
        meta = files.read_json(p / "r_train.json", "R_train record", fix)
    except files.InputError as e:
        raise IndexCorruptError(str(e)) from None
    data = (p / "r_train.npy").read_bytes()
    want = meta.get("sha256") if isinstance(meta, dict) else None
    try:
        total = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise IndexCorruptError(f"index {p}: r_train.npy cannot be read ({e}); {fix}") from None
    # r_train.json records the sha256 of the array's bytes (written by builder.finalize).
    if want is not None and hashlib.sha256(np.ascontiguousarray(total).tobytes()).hexdigest() != want:
        raise IndexCorruptError(
            f"index {p}: r_train.npy does not match the sha256 recorded in r_train.json (the file was damaged); {fix}"
        )
    if list(total.shape) != meta.get("shape"):
        raise IndexCorruptError(
            f"index {p}: r_train.npy has shape {list(total.shape)}, r_train.json says {meta.get('shape')}"
        )
    return hessian.RStats(total, int(meta["count"]))


def read_partition(path: pathlib.Path) -> int:
    """`process_count` recorded in `<index>/progress/partition.json` (named error if damaged)."""
    f = pathlib.Path(path) / "progress" / "partition.json"
    try:
        rec = files.read_json(f, "index partition record", "delete the index folder and rebuild it")
        return int(rec["process_count"])
    except (files.InputError, KeyError, TypeError, ValueError) as e:
        raise IndexCorruptError(str(e) if isinstance(e, files.InputError) else f"{f}: no process_count ({e})") from None


def process_chunk_range(num_chunks: int, r_every_chunks: int, process_index: int, process_count: int) -> range:
    """The contiguous chunks process `process_index` of `process_count` writes (whole segments)."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    segments = -(-num_chunks // r_every_chunks)
    lo = segments * process_index // process_count
    hi = segments * (process_index + 1) // process_count
    return range(min(lo * r_every_chunks, num_chunks), min(hi * r_every_chunks, num_chunks))


# ------------------------------------------------------------------------------------------
# Verify
# ------------------------------------------------------------------------------------------


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
