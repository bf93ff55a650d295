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
    COMPLETE                 written last; readers then skip the marker scan
    scoring/<key>.npy        cached per-row scales of on-the-fly scoring, one per whitening

Row i is example id i. Progress is committed in whole chunks: a chunk is complete iff its
marker exists; markers are written only after the chunk's write has committed, so readers never
treat half-written rows as complete, a killed build resumes from the first chunk without a
marker, and rewriting a chunk produces the same bytes (the featurizer is deterministic). Every
chunk carries a crc32c digest (zarr3 codec) and missing chunks are read errors
(`fill_missing_data_reads=False`), so truncation/corruption/deletion is an error naming the rows.

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

import concurrent.futures
import dataclasses
import errno
import functools
import hashlib
import io
import json
import math
import os
import pathlib
import re
import socket
import time
from typing import Any, Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import tensorstore as ts
from jaxtyping import Array, Float

import trackstar_jax
from trackstar_jax.index import hessian
FORMAT = "trackstar_jax.index/1"
STORAGE_DTYPES = ("float32", "bfloat16", "float16", "int8")
_NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
              "float16": np.dtype(np.float16), "int8": np.dtype(np.int8)}
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


def auto_r_every_chunks(dim: int, num_blocks_total: int, dtype: str, chunk_rows: int) -> int:
    """Smallest segment (in chunks) for which saving the float64 R sum costs <= 2% of its data."""
    k2 = dim // num_blocks_total
    r_bytes = num_blocks_total * k2 * k2 * 8
    chunk_bytes = chunk_rows * dim * _NP_DTYPES[dtype].itemsize
    return max(1, math.ceil(r_bytes / (_R_SAVE_BUDGET * chunk_bytes)))


def make_manifest(*, num_rows: int, dim: int, num_blocks_total: int, storage: StorageConfig,
                  model: Mapping[str, Any], vectors: Mapping[str, Any], corpus: Mapping[str, Any],
                  featurizer: Mapping[str, Any] | None = None, info: Mapping[str, Any] | None = None) -> dict:
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
        "vectors": {**dict(vectors), "dim": int(dim), "num_blocks_total": int(num_blocks_total),
                    "block_dim": int(dim // num_blocks_total)},
        "storage": {"dtype": storage.dtype, "chunk_rows": int(storage.chunk_rows),
                    "r_every_chunks": int(r_every), "num_rows": int(num_rows)},
        "corpus": dict(corpus),
        "featurizer": dict(featurizer or {}),
        _INFO: {"created_unix": time.time(), **dict(info or {})},
    }
    return json.loads(json.dumps(m))  # normalise tuples -> lists, check JSON-ability


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
    for key in sorted(exp):
        if key.split(".")[0] == _INFO:
            continue
        if key not in act:
            raise IndexMismatchError(f"refusing to {action} index {path}: its manifest has no field {key!r} (expected {exp[key]!r})")
        if act[key] != exp[key]:
            raise IndexMismatchError(
                f"refusing to {action} index {path}: manifest field {key!r} is {act[key]!r} in the index "
                f"but {exp[key]!r} was expected")


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


def _write_tmp(path: pathlib.Path, data: bytes) -> pathlib.Path:
    """Writes `data` durably (fsync) to a temporary sibling of `path`; returns its path."""
    # Host and pid: writers on several hosts may share the filesystem (and a pid).
    tmp = path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def _atomic_write(path: pathlib.Path, data: bytes) -> None:
    """Writes `data` to `path` via a temporary file, fsync and rename (readers see old or new)."""
    os.replace(_write_tmp(path, data), path)


def _create_once(path: pathlib.Path, data: bytes) -> bool:
    """Atomically creates `path` with `data` unless it exists; returns True if this call created it."""
    tmp = _write_tmp(path, data)
    try:
        os.link(tmp, path)  # fails if another writer got there first
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink()


def _npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def read_manifest(path: str | os.PathLike) -> dict:
    """Loads `<path>/manifest.json` (clear error if the directory is not an index)."""
    p = pathlib.Path(path) / "manifest.json"
    if not p.exists():
        raise FileNotFoundError(f"{path} is not a trackstar index (no manifest.json)")
    m = json.loads(p.read_text())
    if m.get("format") != FORMAT:
        raise IndexMismatchError(f"index {path}: format {m.get('format')!r} is not {FORMAT!r}")
    return m


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


def _open_arrays(path: pathlib.Path, manifest: Mapping[str, Any], *, create: bool) -> tuple[ts.TensorStore, ts.TensorStore | None]:
    """Opens (or creates) the vectors and (int8) row-scale arrays.

    The full metadata is passed, so tensorstore refuses an existing array whose shape, dtype,
    chunking or codecs differ from the manifest. Missing chunks are read errors, not zeros.
    """
    def open_one(spec):
        spec = {**spec, "fill_missing_data_reads": False}
        try:
            return ts.open(spec, open=True, create=create).result()
        except ValueError as e:
            raise IndexMismatchError(f"index {path}: array {spec['kvstore']['path']} does not match the manifest "
                                     f"(or is missing/corrupt): {e}") from e

    vec = open_one(_vectors_spec(path, manifest))
    scale = open_one(_scale_spec(path, manifest)) if manifest["storage"]["dtype"] == "int8" else None
    return vec, scale


# ------------------------------------------------------------------------------------------
# Quantisation and per-chunk R (jitted; the same functions serve build and read-back)
# ------------------------------------------------------------------------------------------


def quantize(rows: Float[Array, "n d"], dtype: str) -> tuple[Array, Float[Array, "n"] | None]:
    """float32 rows -> storage dtype (+ per-row scale for int8: absmax/127, round half to even)."""
    rows = jnp.asarray(rows, jnp.float32)
    if dtype == "int8":
        scale = jnp.max(jnp.abs(rows), axis=1) / 127.0
        q = jnp.where(scale[:, None] > 0, rows / jnp.where(scale > 0, scale, 1.0)[:, None], 0.0)
        return jnp.clip(jnp.round(q), -127, 127).astype(jnp.int8), scale
    return rows.astype(_NP_DTYPES[dtype]), None


def dequantize(stored: Array, scale: Float[Array, "n"] | None) -> Float[Array, "n d"]:
    """Storage dtype -> float32 (exact for bf16/f16; `q * scale` for int8)."""
    x = jnp.asarray(stored).astype(jnp.float32)
    return x if scale is None else x * jnp.asarray(scale, jnp.float32)[:, None]


@functools.partial(jax.jit, static_argnames=("dtype",))
def _quantize_step(rows, *, dtype):
    stored, scale = quantize(rows, dtype)
    bad = ~jnp.all(jnp.isfinite(dequantize(stored, scale)), axis=1)
    if scale is not None:
        bad = bad | ~jnp.isfinite(scale)
    return stored, scale, bad


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

    def __init__(self, path: pathlib.Path, manifest: dict):
        self.path = path
        self.manifest = manifest
        st = manifest["storage"]
        self.num_rows = int(st["num_rows"])
        self.dim = int(manifest["vectors"]["dim"])
        self.dtype_name = st["dtype"]
        self.dtype = _NP_DTYPES[self.dtype_name]
        self.chunk_rows = int(st["chunk_rows"])
        self.num_blocks_total = int(manifest["vectors"]["num_blocks_total"])
        self.block_dim = self.dim // self.num_blocks_total
        self.num_chunks = -(-self.num_rows // self.chunk_rows)
        self._vectors, self._scale = _open_arrays(path, manifest, create=False)
        self.refresh()

    def refresh(self) -> None:
        """Re-reads which chunks are complete (for an index that is still being built)."""
        self.complete_chunks = _complete_chunks(self.path, self.num_chunks)

    @property
    def is_complete(self) -> bool:
        return len(self.complete_chunks) == self.num_chunks

    def chunk_range(self, chunk: int) -> tuple[int, int]:
        """Row range `[start, stop)` of a chunk."""
        return chunk * self.chunk_rows, min((chunk + 1) * self.chunk_rows, self.num_rows)

    def _check_range(self, start: int, stop: int) -> None:
        if not 0 <= start < stop <= self.num_rows:
            raise ValueError(f"row range [{start}, {stop}) is outside the index's [0, {self.num_rows})")
        missing = [c for c in range(start // self.chunk_rows, -(-stop // self.chunk_rows)) if c not in self.complete_chunks]
        if missing:
            lo, hi = self.chunk_range(missing[0])
            raise IndexIncompleteError(
                f"index {self.path}: rows [{lo}, {hi}) (chunk {missing[0]}) are not complete "
                f"({len(missing)} incomplete chunk(s) in the requested rows [{start}, {stop}); resume the build)")

    def read_block_async(self, start: int, stop: int) -> "_PendingBlock":
        """Starts reading rows `[start, stop)`; `.result()` returns what `read_block` returns."""
        self._check_range(start, stop)
        fut_v = self._vectors[start:stop].read()
        fut_s = self._scale[start:stop].read() if self._scale is not None else None
        return _PendingBlock(self, start, stop, fut_v, fut_s)

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

    def iter_blocks(self, block_rows: int | None = None, start: int = 0, stop: int | None = None) -> Iterator[tuple[int, np.ndarray, np.ndarray | None]]:
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
        return rows, scale


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


def open_index(path: str | os.PathLike, expect: Mapping[str, Any] | None = None) -> IndexReader:
    """Opens an index for reading, checking the manifest against `expect`.

    Args:
      path: index directory.
      expect: manifest fields that must match, nested (`{"vectors": {"proj_seed": 0}}`) or
        dotted (`{"vectors.proj_seed": 0}`); e.g. the model fingerprint, seed, d and dtype the
        caller's queries were made with.

    Returns:
      IndexReader.

    Raises:
      IndexMismatchError: naming the first field that differs.
    """
    p = pathlib.Path(path)
    manifest = read_manifest(p)
    if expect:
        check_manifest(manifest, expect, path=str(p), action="open")
    return IndexReader(p, manifest)


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
    meta = json.loads((p / "r_train.json").read_text())
    total = np.load(p / "r_train.npy", allow_pickle=False)
    if list(total.shape) != meta["shape"]:
        raise IndexCorruptError(f"index {p}: r_train.npy has shape {list(total.shape)}, r_train.json says {meta['shape']}")
    return hessian.RStats(total, int(meta["count"]))


# ------------------------------------------------------------------------------------------
# Builder
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class BuildStats:
    """What one `IndexBuilder.build` call did, and where its time went."""

    rows_written: int = 0
    chunks_written: int = 0
    chunks_skipped: int = 0  # already complete (resume)
    chunks_read_back: int = 0  # complete chunks re-read for the R_train running sum
    seconds: float = 0.0
    write_seconds: float = 0.0  # main loop blocked on writing (submits, commits, markers, R saves)
    readback_seconds: float = 0.0
    finalized: bool = False

    @property
    def write_fraction(self) -> float:
        return self.write_seconds / self.seconds if self.seconds > 0 else 0.0


RowsFn = Callable[[int, int], Any]  # (start, stop) -> float32 [stop-start, d] rows for example ids start..stop-1


def process_chunk_range(num_chunks: int, r_every_chunks: int, process_index: int, process_count: int) -> range:
    """The contiguous chunks process `process_index` of `process_count` writes (whole segments)."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    segments = -(-num_chunks // r_every_chunks)
    lo = segments * process_index // process_count
    hi = segments * (process_index + 1) // process_count
    return range(min(lo * r_every_chunks, num_chunks), min(hi * r_every_chunks, num_chunks))


class IndexBuilder:
    """Creates (or resumes) an index and fills this process's rows.

    Usage: `IndexBuilder(path, manifest, process_index=p, process_count=P).build(rows_fn)`.
    `rows_fn(start, stop)` must return the float32 vectors of example ids `start..stop-1`
    (jax or numpy array). It may return a device array without blocking: the builder
    overlaps computing chunk c+1 with moving chunk c to the host and writing it.
    """

    def __init__(self, path: str | os.PathLike, manifest: Mapping[str, Any], *, process_index: int = 0,
                 process_count: int = 1, max_writes_in_flight: int = 2, device: jax.Device | None = None):
        self.path = pathlib.Path(path)
        self.manifest = json.loads(json.dumps(dict(manifest)))
        if self.manifest.get("format") != FORMAT:
            raise ValueError("manifest was not made by index.make_manifest")
        st = self.manifest["storage"]
        self.num_rows, self.chunk_rows = int(st["num_rows"]), int(st["chunk_rows"])
        self.dtype = st["dtype"]
        self.r_every = int(st["r_every_chunks"])
        self.dim = int(self.manifest["vectors"]["dim"])
        self.num_blocks_total = int(self.manifest["vectors"]["num_blocks_total"])
        self.num_chunks = -(-self.num_rows // self.chunk_rows)
        self.process_index, self.process_count = process_index, process_count
        self.chunks = process_chunk_range(self.num_chunks, self.r_every, process_index, process_count)
        self.max_writes_in_flight = max(1, max_writes_in_flight)
        # R partial sums run on one fixed device so that build and read-back give the same bits.
        self.device = device or jax.local_devices()[0]
        self._open_or_create()

    # -- setup ---------------------------------------------------------------------------

    def _open_or_create(self) -> None:
        p = self.path
        p.mkdir(parents=True, exist_ok=True)
        mpath = p / "manifest.json"
        if not mpath.exists():
            if (p / "vectors").exists():
                raise IndexMismatchError(f"{p} holds index data but no manifest.json: refusing to overwrite it")
            _create_once(mpath, json.dumps(self.manifest, indent=1, sort_keys=True).encode())
        on_disk = read_manifest(p)
        check_manifest(on_disk, _identity(self.manifest), path=str(p), action="resume")
        # Fields present on disk but absent from ours also count as a mismatch.
        check_manifest(self.manifest, _identity(on_disk), path=str(p), action="resume")
        self.manifest = on_disk
        (p / "progress").mkdir(exist_ok=True)
        (p / "r_train").mkdir(exist_ok=True)
        part = json.dumps({"process_count": self.process_count}).encode()
        _create_once(p / "progress" / "partition.json", part)
        started = json.loads((p / "progress" / "partition.json").read_text())["process_count"]
        if started != self.process_count:
            raise IndexMismatchError(f"refusing to resume index {p}: it was started with process_count={started}, "
                                     f"not {self.process_count} (R_train partial sums are per process range)")
        self._vectors, self._scale = _open_arrays(p, self.manifest, create=True)

    # -- small pieces (tests patch _write_rows to simulate a full disk) --------------------

    def chunk_rows_range(self, c: int) -> tuple[int, int]:
        return c * self.chunk_rows, min((c + 1) * self.chunk_rows, self.num_rows)

    def _marker(self, c: int) -> pathlib.Path:
        return self.path / "progress" / f"chunk_{c:08d}.done"

    def _write_rows(self, lo: int, hi: int, stored: np.ndarray, scale: np.ndarray | None) -> list:
        futs = [self._vectors[lo:hi].write(stored).commit]
        if scale is not None:
            futs.append(self._scale[lo:hi].write(scale).commit)
        return futs

    def _pad(self, x: Any, n: int) -> Any:
        if n == self.chunk_rows:
            return x
        pad = [(0, self.chunk_rows - n)] + [(0, 0)] * (np.ndim(x) - 1)
        return jnp.pad(x, pad) if isinstance(x, jax.Array) else np.pad(x, pad)

    def _partial(self, stored: Any, scale: Any) -> jax.Array:
        stored = jax.device_put(stored, self.device)
        scale = None if scale is None else jax.device_put(scale, self.device)
        return _chunk_autocorrelation(stored, scale, num_blocks_total=self.num_blocks_total)

    def _part_files(self) -> dict[int, pathlib.Path]:
        out = {}
        for f in (self.path / "r_train").iterdir():
            m = _PART_RE.match(f.name)
            if m and int(m.group(1)) == self.process_index and int(m.group(2)) == self.process_count:
                out[int(m.group(3))] = f
        return out

    def _save_running(self, upto: int, total: np.ndarray) -> None:
        name = f"part-{self.process_index:04d}-of-{self.process_count:04d}-upto-{upto:08d}.npy"
        _atomic_write(self.path / "r_train" / name, _npy_bytes(total))
        for u, f in self._part_files().items():  # older running sums are superseded
            if u < upto:
                f.unlink(missing_ok=True)

    # -- the build -------------------------------------------------------------------------

    def build(self, rows_fn: RowsFn, *, progress: Callable[[int, int], None] | None = None,
              finalize_when_done: bool = True) -> BuildStats:
        """Writes every incomplete chunk of this process's range, then finalises if all are done.

        Args:
          rows_fn: `(start, stop) -> [stop-start, d]` float32 vectors of those example ids.
          progress: optional callback `(chunks_done, chunks_total)` after each chunk.
          finalize_when_done: call `finalize` at the end (False: the caller finalises once,
            e.g. process 0 of a multi-host job after a barrier).

        Returns:
          BuildStats.

        Raises:
          IndexWriteError: a write failed (e.g. ENOSPC); every chunk before it is complete and
            intact, and calling `build` again resumes.
          ValueError: rows_fn returned the wrong shape or non-finite values (names the rows).
        """
        stats = BuildStats()
        t_start = time.perf_counter()
        complete = _complete_chunks(self.path, self.num_chunks)
        parts = self._part_files()
        upto = max((u for u in parts if self.chunks.start <= u <= self.chunks.stop), default=self.chunks.start)
        running = np.load(parts[upto], allow_pickle=False) if upto in parts else None
        k2 = self.dim // self.num_blocks_total
        if running is not None and running.shape != (self.num_blocks_total, k2, k2):
            raise IndexCorruptError(f"index {self.path}: R_train running sum {parts[upto].name} has shape {running.shape}")
        if running is None:
            running = np.zeros((self.num_blocks_total, k2, k2), np.float64)
        seg_acc = None
        # A background thread waits for each chunk's commit and then writes its marker, so the
        # build loop only blocks when more than `max_writes_in_flight` chunks are unfinished.
        committer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="index-commit")
        in_flight: list[tuple[int, concurrent.futures.Future]] = []  # in chunk order
        pending = None  # (chunk, lo, hi, stored, scale, bad) computed but not yet on the host

        def commit(c: int, futs: list) -> None:
            for f in futs:
                f.result()
            lo, hi = self.chunk_rows_range(c)
            _atomic_write(self._marker(c), json.dumps({"rows": [lo, hi]}).encode())

        def finish_writes(block_all: bool) -> None:
            """Collects finished chunks (oldest first); re-raises the first failed write."""
            t0 = time.perf_counter()
            failure = None
            while in_flight and (block_all or failure is not None or len(in_flight) > self.max_writes_in_flight
                                 or in_flight[0][1].done()):
                c, fut = in_flight.pop(0)
                lo, hi = self.chunk_rows_range(c)
                try:
                    fut.result()
                except Exception as e:  # noqa: BLE001 - re-raised below with the row range
                    failure = failure or (c, lo, hi, e)
                    continue
                stats.chunks_written += 1
                stats.rows_written += hi - lo
            stats.write_seconds += time.perf_counter() - t0
            if failure is not None:
                raise IndexWriteError(self._write_failure(*failure)) from failure[3]

        def flush(item) -> None:
            c, lo, hi, stored, scale, bad = item
            bad = np.asarray(bad)[: hi - lo]
            if bad.any():
                rows = (lo + np.flatnonzero(bad)).tolist()
                raise ValueError(f"non-finite vector(s) for example id(s) {rows[:10]} (rows [{lo}, {hi}); "
                                 f"NaN/inf from the featurizer or overflow of storage dtype {self.dtype})")
            stored_h = np.asarray(stored)[: hi - lo]
            scale_h = None if scale is None else np.asarray(scale)[: hi - lo]
            t0 = time.perf_counter()
            try:
                futs = self._write_rows(lo, hi, stored_h, scale_h)
            except Exception as e:  # noqa: BLE001
                stats.write_seconds += time.perf_counter() - t0
                finish_writes(block_all=True)
                raise IndexWriteError(self._write_failure(c, lo, hi, e)) from e
            in_flight.append((c, committer.submit(commit, c, futs)))
            stats.write_seconds += time.perf_counter() - t0
            finish_writes(block_all=False)

        try:
            for c in self.chunks:
                lo, hi = self.chunk_rows_range(c)
                if c in complete:
                    stats.chunks_skipped += 1
                    if c >= upto:  # completed after the last saved running sum: re-read for R
                        t0 = time.perf_counter()
                        stored, scale = self._read_chunk(c)
                        part = self._partial(self._pad(stored, hi - lo), None if scale is None else self._pad(scale, hi - lo))
                        seg_acc = part if seg_acc is None else seg_acc + part
                        stats.chunks_read_back += 1
                        stats.readback_seconds += time.perf_counter() - t0
                else:
                    rows = rows_fn(lo, hi)
                    if tuple(rows.shape) != (hi - lo, self.dim):
                        raise ValueError(f"rows_fn({lo}, {hi}) returned shape {tuple(rows.shape)}, expected {(hi - lo, self.dim)}")
                    stored, scale, bad = _quantize_step(self._pad(jnp.asarray(rows, jnp.float32), hi - lo), dtype=self.dtype)
                    if c >= upto:
                        part = self._partial(stored, scale)
                        seg_acc = part if seg_acc is None else seg_acc + part
                    if pending is not None:
                        flush(pending)  # chunk c is queued on the device while c-1 goes to disk
                    pending = (c, lo, hi, stored, scale, bad)
                seg_end = (c + 1 - self.chunks.start) % self.r_every == 0 or c + 1 == self.chunks.stop
                if seg_end and c >= upto:
                    if pending is not None:
                        flush(pending)
                        pending = None
                    finish_writes(block_all=True)
                    t0 = time.perf_counter()
                    running = running + np.asarray(seg_acc, np.float64)
                    seg_acc = None
                    self._save_running(c + 1, running)
                    upto = c + 1
                    stats.write_seconds += time.perf_counter() - t0
                if progress is not None:
                    progress(c + 1 - self.chunks.start, len(self.chunks))
            if pending is not None:
                flush(pending)
            finish_writes(block_all=True)
        except BaseException:
            # Let writes that were already submitted land and be marked, so progress is kept.
            try:
                finish_writes(block_all=True)
            except IndexWriteError:
                pass
            raise
        finally:
            committer.shutdown(wait=True)
        if finalize_when_done:
            stats.finalized = finalize(self.path, finalized_by=f"writer {self.process_index} of {self.process_count}")
        stats.seconds = time.perf_counter() - t_start
        return stats

    def _read_chunk(self, c: int) -> tuple[np.ndarray, np.ndarray | None]:
        lo, hi = self.chunk_rows_range(c)
        try:
            stored = self._vectors[lo:hi].read().result()
            scale = self._scale[lo:hi].read().result() if self._scale is not None else None
        except ValueError as e:
            raise IndexCorruptError(f"index {self.path}: chunk {c}, rows [{lo}, {hi}) is marked complete but cannot be read: {e}") from e
        return stored, scale

    def _write_failure(self, c: int, lo: int, hi: int, e: BaseException) -> str:
        full = (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "no space" in str(e).lower()
        why = "the disk is full" if full else "the write failed"
        return (f"index {self.path}: writing chunk {c}, rows [{lo}, {hi}) failed ({why}: {e}); chunks with "
                f"markers in progress/ are complete and intact; fix the cause and run the build again to resume")


def finalize(path: str | os.PathLike, finalized_by: Any = None) -> bool:
    """If every chunk is complete, sums the processes' R_train running sums into r_train.npy and
    writes COMPLETE (recording `finalized_by`). Returns True when complete.

    Idempotent and safe to call from any process, also concurrently: each output file is
    created once (link, create-if-absent) with deterministic content, so two writers that
    finish together never write the same file, and a finaliser that died half-way is
    completed by the next call."""
    p = pathlib.Path(path)
    if (p / "COMPLETE").exists():
        return True
    manifest = read_manifest(p)
    st = manifest["storage"]
    num_rows, chunk_rows, r_every = st["num_rows"], st["chunk_rows"], st["r_every_chunks"]
    num_chunks = -(-num_rows // chunk_rows)
    if len(_complete_chunks(p, num_chunks)) < num_chunks:
        return False
    pcount = json.loads((p / "progress" / "partition.json").read_text())["process_count"]
    parts = {}
    for f in (p / "r_train").iterdir():
        m = _PART_RE.match(f.name)
        if m and int(m.group(2)) == pcount:
            parts.setdefault(int(m.group(1)), {})[int(m.group(3))] = f
    total = None
    for i in range(pcount):
        rng = process_chunk_range(num_chunks, r_every, i, pcount)
        if not len(rng):
            continue
        f = parts.get(i, {}).get(rng.stop)
        if f is None:  # its chunks are complete but its final running sum is not saved yet
            return False
        part = np.load(f, allow_pickle=False)
        total = part if total is None else total + part
    _create_once(p / "r_train.npy", _npy_bytes(total))
    _create_once(p / "r_train.json", json.dumps({"count": num_rows, "shape": list(total.shape), "dtype": "float64",
                                                 "sha256": hashlib.sha256(total.tobytes()).hexdigest()}).encode())
    _create_once(p / "COMPLETE", json.dumps({"num_rows": num_rows, "finished_unix": time.time(),
                                             "finalized_by": finalized_by}).encode())
    return True


def finalized_by(path: str | os.PathLike) -> Any:
    """Who finalised the index at `path` (as recorded in COMPLETE), or None."""
    f = pathlib.Path(path) / "COMPLETE"
    return json.loads(f.read_text()).get("finalized_by") if f.exists() else None


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
        pcount = json.loads((p / "progress" / "partition.json").read_text())["process_count"]
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
            part = _chunk_autocorrelation(jax.device_put(stored_p, device), None if scale_p is None else jax.device_put(scale_p, device),
                                          num_blocks_total=reader.num_blocks_total)
            seg_acc = part if seg_acc is None else seg_acc + part
            # Same grouping as the builder: float32 within a segment, float64 across segments.
            rng = next(r for r in ranges if c in r)
            if (c + 1 - rng.start) % r_every == 0 or c + 1 == rng.stop:
                recomputed += np.asarray(seg_acc, np.float64)
                seg_acc = None
    report = {"path": str(p), "num_rows": reader.num_rows, "dim": reader.dim, "dtype": reader.dtype_name,
              "chunks": reader.num_chunks, "complete_chunks": len(reader.complete_chunks),
              "bytes_on_disk": _du(p / "vectors") + (_du(p / "row_scale") if reader.dtype_name == "int8" else 0)}
    r = load_r_train(p) if reader.is_complete else None
    if reader.is_complete and r is None:
        problems.append("all chunks complete but R_train is missing (run index.finalize)")
    if r is not None:
        if not np.isfinite(r.total).all():
            problems.append("R_train contains NaN/inf")
        elif recompute_r and not problems:
            err = float(np.max(np.abs(r.total - recomputed)) / max(np.max(np.abs(recomputed)), 1e-30))
            report["r_train_max_rel_diff"] = err
            if err > 1e-6:
                problems.append(f"R_train differs from a recomputation from the stored rows (max rel diff {err:.3g})")
    report["ok"] = not problems
    report["problems"] = problems
    if problems:
        raise IndexCorruptError(f"index {p} failed verification:\n  " + "\n  ".join(problems))
    return report


def _du(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


# ------------------------------------------------------------------------------------------
# Scoring preparation: per-row scales for on-the-fly R^{-1/2} + unit norm (hessian.py)
# ------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("unit_norm",))
def _row_scale_step(stored, scale, w, *, unit_norm):
    return hessian.row_scale(dequantize(stored, scale), w, unit_norm)


def compute_row_scale(reader: IndexReader, whitening: hessian.Whitening, *, cache: bool = True) -> np.ndarray:
    """Per-row scale `1/||W g_m||` of on-the-fly scoring over the whole index (one streamed pass).

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
    h = hashlib.sha256(manifest_fingerprint(reader.manifest).encode())
    h.update(b"none" if whitening.matrix is None else np.ascontiguousarray(whitening.matrix).tobytes())
    f = reader.path / "scoring" / f"{h.hexdigest()[:32]}.npy"
    if cache and f.exists():
        out = np.load(f, allow_pickle=False)
        if out.shape == (reader.num_rows,):
            return out
    w = None if whitening.matrix is None else jnp.asarray(whitening.matrix)
    out = np.empty(reader.num_rows, np.float32)
    for start, rows, scale in reader.iter_blocks():
        out[start:start + len(rows)] = np.asarray(_row_scale_step(rows, scale, w, unit_norm=True))
    if cache:
        f.parent.mkdir(exist_ok=True)
        _atomic_write(f, _npy_bytes(out))
    return out


@dataclasses.dataclass(frozen=True)
class Scoring:
    """Everything retrieval needs to score raw rows as TrackStar (Eq. 1-3).

    score(query, row m) = (stored_row_m (dequantised) · finalize_queries(q)) * row_scale[m]
    """

    whitening: hessian.Whitening
    row_scale: np.ndarray  # [num_rows] float32

    def finalize_queries(self, q_raw: Float[Array, "q d"]) -> np.ndarray:
        """Raw query vectors -> q' = W normalise(W q) (float32)."""
        w = None if self.whitening.matrix is None else jnp.asarray(self.whitening.matrix)
        return np.asarray(hessian.finalize_queries(jnp.asarray(q_raw, jnp.float32), w, self.whitening.unit_norm))


def prepare_scoring(reader: IndexReader, cfg: hessian.HessianConfig, query_vectors: Float[Array, "q d"] | None = None,
                    *, cache: bool = True) -> Scoring:
    """Resolves R (none / train / mixed with automatic λ), R^{-1/2} and the per-row scales.

    Args:
      reader: a complete index (R_train comes from it).
      cfg: hessian config.
      query_vectors: raw query vectors (R_eval for mode "mixed").
      cache: cache the per-row scales under the index.

    Returns:
      Scoring.
    """
    r_train = reader.r_train() if cfg.mode != "none" else None
    if cfg.mode != "none" and r_train is None:
        raise IndexIncompleteError(f"index {reader.path} has no R_train yet (build incomplete: "
                                   f"{len(reader.complete_chunks)}/{reader.num_chunks} chunks)")
    r_ev = hessian.r_eval(query_vectors, reader.num_blocks_total) if cfg.mode == "mixed" else None
    whit = hessian.make_whitening(cfg, r_train, r_ev)
    return Scoring(whit, compute_row_scale(reader, whit, cache=cache))


def write_finalized(reader: IndexReader, whitening: hessian.Whitening, out_path: str | os.PathLike, *,
                    dtype: str = "float32", process_index: int = 0, process_count: int = 1) -> IndexReader:
    """The other finalisation path: a second index whose rows are Ḡ_m = normalise(W g_m).

    Retrieval over it is a plain dot product with `hessian.finalize_rows(q, W, unit_norm)`.
    Resumable like any build. Its manifest copies the source's and records the whitening.

    Returns:
      A reader of the new index.
    """
    src = reader.manifest
    w = None if whitening.matrix is None else jnp.asarray(whitening.matrix)
    storage = StorageConfig(dtype=dtype, chunk_rows=reader.chunk_rows)
    manifest = make_manifest(
        num_rows=reader.num_rows, dim=reader.dim, num_blocks_total=reader.num_blocks_total, storage=storage,
        model=src["model"], vectors=src["vectors"], corpus=src["corpus"], featurizer=src.get("featurizer", {}),
        info={"source_index": str(reader.path)})
    manifest["finalized"] = {**whitening.describe(), "source": manifest_fingerprint(src),
                             "whitening_sha256": None if whitening.matrix is None else hashlib.sha256(np.ascontiguousarray(whitening.matrix).tobytes()).hexdigest()}
    fn = jax.jit(lambda rows, scale: hessian.finalize_rows(dequantize(rows, scale), w, whitening.unit_norm))

    def rows_fn(lo, hi):
        rows, scale = reader.read_block(lo, hi)
        return fn(rows, scale)

    IndexBuilder(out_path, manifest, process_index=process_index, process_count=process_count).build(rows_fn)
    return open_index(out_path)
