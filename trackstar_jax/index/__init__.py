"""Index: the on-disk vectors of a whole corpus, R (the Hessian approximation), and stage 2.

- `manifest`: the index's identity (format, `StorageConfig`, the manifest and its checks) and
  the index errors.
- `store`: the zarr3 layout, `IndexReader` / `open_index`, chunk files and their checksums.
- `verify`: `verify_index` (every chunk, R_train recomputed).
- `builder`: `IndexBuilder` (resumable, several writers), `finalize` (R_train once).
- `hessian`: R_train / R_eval / mixed R, R^{-1/2}, unit norm (§3, §A.1.3).
- `scoring`: per-row scales for on-the-fly R^{-1/2} + unit norm.
- `build`: `build_from_run`, the work of the `stages.build_index` stage.
"""

from trackstar_jax.index.build import build_from_run, index_dir
from trackstar_jax.index.builder import BuildStats, IndexBuilder, finalize, finalized_by
from trackstar_jax.index.manifest import (
    NP_DTYPES,
    STORAGE_DTYPES,
    IndexCorruptError,
    IndexIncompleteError,
    IndexMismatchError,
    IndexStoreError,
    IndexWriteError,
    StorageConfig,
    check_manifest,
    make_manifest,
    manifest_fingerprint,
    read_manifest,
    tree_fingerprint,
)
from trackstar_jax.index.scoring import Scoring, compute_row_scale, prepare_scoring, write_finalized
from trackstar_jax.index.store import IndexReader, load_r_train, open_index, process_chunk_range
from trackstar_jax.index.verify import verify_index
