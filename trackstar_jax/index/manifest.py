"""The index's identity: its format, the `index` section's types (`StorageConfig`,
`IndexSettings`), the manifest (`make_manifest`, `check_manifest`, `read_manifest`, the
fingerprints) and the index errors every index module raises.

Below `store.py` (the arrays, the reader, the chunk files), which builds on it; the on-disk
layout is described there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import time
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import trackstar_jax
from trackstar_jax import files
from trackstar_jax.features import vectors as vectors_lib
from trackstar_jax.index import hessian
from trackstar_jax.models import lm

FORMAT = "trackstar_jax.index/2"
# Older formats: why they are refused (the fix is always a rebuild).
_OLD_FORMATS = {
    "trackstar_jax.index/1": "its chunk checksums are not bound to the chunks' positions (two swapped chunk "
    "files would pass)",
}
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
