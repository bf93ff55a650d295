"""Index: the on-disk vectors of a whole corpus, R (the Hessian approximation), and stage 2.

- `store`: zarr3 layout + manifest, `IndexReader` / `open_index`, `verify_index`.
- `builder`: `IndexBuilder` (resumable, several writers), `finalize` (R_train once).
- `hessian`: R_train / R_eval / mixed R, R^{-1/2}, unit norm (§3, §A.1.3).
- `scoring`: per-row scales for on-the-fly R^{-1/2} + unit norm.
- `build`: `build_from_run`, the work of the `stages.build_index` stage.
"""

from trackstar_jax.index.build import build_from_run, index_dir
from trackstar_jax.index.builder import BuildStats, IndexBuilder, finalize, finalized_by
from trackstar_jax.index.scoring import Scoring, compute_row_scale, prepare_scoring, write_finalized
from trackstar_jax.index.store import (
    NP_DTYPES,
    STORAGE_DTYPES,
    IndexCorruptError,
    IndexIncompleteError,
    IndexMismatchError,
    IndexReader,
    IndexStoreError,
    IndexWriteError,
    StorageConfig,
    check_manifest,
    load_r_train,
    make_manifest,
    manifest_fingerprint,
    open_index,
    process_chunk_range,
    read_manifest,
    tree_fingerprint,
    verify_index,
)
