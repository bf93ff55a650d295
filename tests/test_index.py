"""index.py: zarr3 storage per dtype, manifest refusal, resumable/parallel builds (real subprocesses,
SIGKILL), corruption and disk-full handling, R_train vs numpy, both finalisation paths."""

import concurrent.futures
import dataclasses
import errno
import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trackstar_jax import index
from trackstar_jax.index import hessian, store

REPO = pathlib.Path(__file__).resolve().parents[1]
DIM, BLOCKS = 64, 4  # 4 blocks of k² = 16 (k = 4)


@jax.jit
def _rows_for_ids(ids):
    scale = 1.0 + (ids % 7).astype(jnp.float32)  # rows of different norms
    return jax.vmap(lambda i: jax.random.normal(jax.random.fold_in(jax.random.key(0), i), (DIM,)))(ids) * scale[:, None]


def synthetic_rows(lo: int, hi: int) -> jax.Array:
    """Deterministic per-example vectors (a stand-in featurizer): row i depends on i alone."""
    return _rows_for_ids(jnp.arange(lo, hi))


def make_manifest(num_rows=700, dtype="bfloat16", chunk_rows=64, r_every=4, **over):
    kw = dict(
        model={"checkpoint_step": 7, "fingerprint": "sha256:model"},
        vectors={"output_fn": "loss", "num_blocks": 2, "proj_dim": 4, "proj_seed": 0, "correction": True},
        corpus={"name": "synthetic", "fingerprint": "sha256:corpus", "num_examples": num_rows},
    )
    kw.update(over)
    return index.make_manifest(
        num_rows=num_rows,
        dim=DIM,
        num_blocks_total=BLOCKS,
        storage=index.StorageConfig(dtype=dtype, chunk_rows=chunk_rows, r_every_chunks=r_every),
        **kw,
    )


def build(path, **kw):
    return index.IndexBuilder(path, make_manifest(**kw)).build(synthetic_rows)


def array_files(path: pathlib.Path) -> dict[str, bytes]:
    """Every stored chunk and array metadata file (the bytes a byte-identity check compares)."""
    out = {}
    for sub in ("vectors", "row_scale"):
        for f in sorted((path / sub).rglob("*")):
            if f.is_file() and not f.name.endswith(".__lock") and not f.name.startswith("."):
                out[str(f.relative_to(path))] = f.read_bytes()
    return out


def _reference_autocorrelation(x, blocks):
    x = np.asarray(x, np.float64)
    k2 = x.shape[1] // blocks
    return np.stack([x[:, b * k2 : (b + 1) * k2].T @ x[:, b * k2 : (b + 1) * k2] for b in range(blocks)])


# ------------------------------------------------------------------------------------------
# Storage
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", index.STORAGE_DTYPES)
def test_each_dtype_round_trips_within_its_precision(tmp_path, dtype):
    stats = build(tmp_path / "ix", dtype=dtype)
    assert stats.rows_written == 700 and stats.chunks_written == 11 and stats.finalized
    reader = index.open_index(tmp_path / "ix")
    assert (reader.num_rows, reader.dim, reader.dtype_name, reader.dtype) == (700, DIM, dtype, index.NP_DTYPES[dtype])
    ref = np.asarray(synthetic_rows(0, 700))
    rows, scale = reader.read_block(0, 700)
    assert rows.dtype == reader.dtype and rows.shape == (700, DIM)
    assert (scale is None) == (dtype != "int8")
    got = reader.read_dequantized(0, 700)
    if dtype == "float32":
        np.testing.assert_array_equal(got, ref)
    elif dtype == "bfloat16":  # 8 significant bits: round to nearest, relative error <= 2^-8
        np.testing.assert_array_less(np.abs(got - ref), np.abs(ref) * 2.0**-8 * (1 + 1e-6) + 1e-30)
    elif dtype == "float16":  # 11 significant bits: relative error <= 2^-11 (normal range)
        np.testing.assert_array_less(np.abs(got - ref), np.abs(ref) * 2.0**-11 * (1 + 1e-6) + 1e-7)
    else:  # int8: absolute error <= half a step of max|row|/127
        step = np.abs(ref).max(axis=1, keepdims=True) / 127
        assert np.all(np.abs(got - ref) <= step / 2 * (1 + 1e-5))
        np.testing.assert_allclose(scale, np.abs(ref).max(axis=1) / 127, rtol=1e-6)
    # Row i is example i, also for ranges that straddle chunks.
    np.testing.assert_array_equal(reader.read_dequantized(100, 333), got[100:333])
    np.testing.assert_array_equal(reader.read_dequantized(699, 700), got[699:])


@pytest.mark.parametrize("dtype", index.STORAGE_DTYPES)
def test_direct_chunk_reads_equal_tensorstore_reads(tmp_path, dtype):
    """Reads go straight to the chunk files (crc32c checked); they return tensorstore's bytes."""
    build(tmp_path / "ix", dtype=dtype)
    reader = index.open_index(tmp_path / "ix")
    assert reader._direct  # the layout the builder writes
    rng = np.random.default_rng(0)
    ranges = [(0, 700), (0, 1), (63, 65), (64, 128), (699, 700), (100, 333)]
    ranges += [tuple(sorted(rng.choice(701, 2, replace=False))) for _ in range(10)]
    for lo, hi in ranges:
        rows, scale = reader.read_block(lo, hi)
        want = reader._vectors[lo:hi].read().result()  # tensorstore's zarr3 decode
        assert rows.dtype == want.dtype and rows.shape == (hi - lo, DIM)
        np.testing.assert_array_equal(rows.view(np.uint8), want.view(np.uint8))
        if dtype == "int8":
            np.testing.assert_array_equal(scale, reader._scale[lo:hi].read().result())
    # Any other layout (e.g. a different chunk key encoding) is read through tensorstore.
    meta = json.loads((tmp_path / "ix" / "vectors" / "zarr.json").read_text())
    meta["chunk_key_encoding"] = {"name": "v2"}
    (tmp_path / "ix" / "vectors" / "zarr.json").write_text(json.dumps(meta))
    assert not store._direct_layout(tmp_path / "ix" / "vectors", reader.manifest)


def test_bytes_per_example_matches_dtype(tmp_path):
    sizes = {}
    for dtype in index.STORAGE_DTYPES:
        build(tmp_path / dtype, dtype=dtype, num_rows=640)
        sizes[dtype] = index.verify_index(tmp_path / dtype)["bytes_on_disk"] / 640
    # Payload plus a crc32c per chunk, zarr.json and (int8) the float32 row scale.
    assert DIM * 4 <= sizes["float32"] < DIM * 4 + 8
    assert DIM * 2 <= sizes["bfloat16"] < DIM * 2 + 8 and DIM * 2 <= sizes["float16"] < DIM * 2 + 8
    assert DIM + 4 <= sizes["int8"] < DIM + 4 + 16


def test_r_train_equals_numpy_reference_of_stored_rows(tmp_path):
    build(tmp_path / "ix", dtype="int8", num_rows=500, chunk_rows=32, r_every=3)
    reader = index.open_index(tmp_path / "ix")
    r = reader.r_train()
    assert r.count == 500 and r.total.shape == (BLOCKS, 16, 16) and r.total.dtype == np.float64
    ref = _reference_autocorrelation(reader.read_dequantized(0, 500), BLOCKS)
    np.testing.assert_allclose(r.total, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    np.testing.assert_allclose(r.mean(), ref / 500, rtol=1e-5, atol=1e-8 * np.abs(ref).max())


def test_process_chunk_ranges_partition_whole_segments():
    for num_chunks in (1, 7, 40):
        for r_every in (1, 3, 8):
            for count in (1, 2, 3, 5):
                ranges = [index.process_chunk_range(num_chunks, r_every, i, count) for i in range(count)]
                assert [c for r in ranges for c in r] == list(range(num_chunks))
                assert all(r.start % r_every == 0 for r in ranges if len(r))


# ------------------------------------------------------------------------------------------
# Manifest and refusal
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("vectors.proj_seed", 1),
        ("vectors.dim", 128),
        ("storage.dtype", "float32"),
        ("model.fingerprint", "sha256:other"),
        ("model.checkpoint_step", 8),
        ("corpus.fingerprint", "sha256:new"),
    ],
)
def test_open_with_mismatched_manifest_is_refused(tmp_path, field, value):
    build(tmp_path / "ix", num_rows=100)
    index.open_index(tmp_path / "ix", expect={"vectors": {"proj_seed": 0, "dim": DIM}, "storage.dtype": "bfloat16"})
    with pytest.raises(
        index.IndexMismatchError, match=rf"refusing to open .*manifest field '{field}' is .* but {value!r} was expected"
    ):
        index.open_index(tmp_path / "ix", expect={field: value})
    with pytest.raises(index.IndexMismatchError, match="no field 'vectors.nope'"):
        index.open_index(tmp_path / "ix", expect={"vectors.nope": 1})


def test_resume_refused_when_corpus_or_model_changed(tmp_path):
    path = tmp_path / "ix"
    with pytest.raises(RuntimeError, match="stop"):
        index.IndexBuilder(path, make_manifest()).build(_stop_at(3))
    changed = make_manifest(corpus={"name": "synthetic", "fingerprint": "sha256:edited", "num_examples": 700})
    with pytest.raises(index.IndexMismatchError, match="refusing to resume .*'corpus.fingerprint'"):
        index.IndexBuilder(path, changed)
    with pytest.raises(index.IndexMismatchError, match="refusing to resume .*'vectors.proj_seed'"):
        index.IndexBuilder(
            path,
            make_manifest(
                vectors={"output_fn": "loss", "num_blocks": 2, "proj_dim": 4, "proj_seed": 3, "correction": True}
            ),
        )
    with pytest.raises(index.IndexMismatchError, match="refusing to resume .*'storage.chunk_rows'"):
        index.IndexBuilder(path, make_manifest(chunk_rows=32))
    with pytest.raises(index.IndexMismatchError, match="process_count=1, not 2"):
        index.IndexBuilder(path, make_manifest(), process_index=0, process_count=2)
    # info is recorded but never compared
    index.IndexBuilder(path, make_manifest(info={"command": "other"})).build(synthetic_rows)


def test_refuses_to_overwrite_data_without_manifest(tmp_path):
    build(tmp_path / "ix", num_rows=100)
    (tmp_path / "ix" / "manifest.json").unlink()
    with pytest.raises(index.IndexMismatchError, match="no manifest.json: refusing to overwrite"):
        index.IndexBuilder(tmp_path / "ix", make_manifest(num_rows=100))
    with pytest.raises(FileNotFoundError, match="not a trackstar index"):
        index.open_index(tmp_path / "ix")


# ------------------------------------------------------------------------------------------
# Interruption, resume, disk full
# ------------------------------------------------------------------------------------------


def _stop_at(chunk: int, chunk_rows: int = 64):
    def rows_fn(lo, hi):
        if lo == chunk * chunk_rows:
            raise RuntimeError("stop")
        return synthetic_rows(lo, hi)

    return rows_fn


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_interrupted_build_resumes_to_identical_bytes_and_r(tmp_path, dtype):
    ref_stats = build(tmp_path / "ref", dtype=dtype)
    path = tmp_path / "ix"
    with pytest.raises(RuntimeError, match="stop"):
        index.IndexBuilder(path, make_manifest(dtype=dtype)).build(_stop_at(6))
    reader = index.open_index(path)
    # Chunk 5 was computed but not yet written when chunk 6 failed; 0..4 are committed.
    assert reader.complete_chunks == frozenset(range(5)) and not reader.is_complete
    assert reader.r_train() is None
    reader.read_block(0, 320)
    with pytest.raises(index.IndexIncompleteError, match=r"rows \[320, 384\) \(chunk 5\) are not complete"):
        reader.read_block(300, 400)
    stats = index.IndexBuilder(path, make_manifest(dtype=dtype)).build(synthetic_rows)
    # R_train was saved after chunk 3 (segment of 4); chunk 4 is re-read for the running sum.
    assert (stats.chunks_skipped, stats.chunks_read_back, stats.chunks_written) == (5, 1, 6)
    assert ref_stats.chunks_written == 11
    assert array_files(path) == array_files(tmp_path / "ref")
    np.testing.assert_array_equal(index.load_r_train(path).total, index.load_r_train(tmp_path / "ref").total)
    index.verify_index(path)


class _FailingFuture(concurrent.futures.Future):
    def __init__(self, exc):
        super().__init__()
        self.set_exception(exc)


@pytest.mark.parametrize("how", ["submit", "commit"])
def test_disk_full_stops_with_complete_chunks_intact(tmp_path, monkeypatch, how):
    """A write that fails with ENOSPC (at submission or at commit) stops the build with an error
    naming the rows; every chunk before it stays complete and readable; a later build resumes."""
    build(tmp_path / "ref")
    path = tmp_path / "ix"
    real = index.IndexBuilder._write_rows

    def failing(self, lo, hi, stored, scale):
        if lo == 5 * 64:
            exc = OSError(errno.ENOSPC, "No space left on device")
            if how == "submit":
                raise exc
            return [_FailingFuture(exc)]
        return real(self, lo, hi, stored, scale)

    monkeypatch.setattr(index.IndexBuilder, "_write_rows", failing)
    with pytest.raises(index.IndexWriteError, match=r"chunk 5, rows \[320, 384\) failed \(the disk is full"):
        index.IndexBuilder(path, make_manifest()).build(synthetic_rows)
    reader = index.open_index(path)
    assert set(range(5)) <= reader.complete_chunks and 5 not in reader.complete_chunks
    index.verify_index(path, require_complete=False, recompute_r=False)
    np.testing.assert_array_equal(
        reader.read_dequantized(0, 320), index.open_index(tmp_path / "ref").read_dequantized(0, 320)
    )
    monkeypatch.setattr(index.IndexBuilder, "_write_rows", real)
    index.IndexBuilder(path, make_manifest()).build(synthetic_rows)
    assert array_files(path) == array_files(tmp_path / "ref")
    np.testing.assert_array_equal(index.load_r_train(path).total, index.load_r_train(tmp_path / "ref").total)


@pytest.mark.parametrize(
    "values, match",
    [
        (np.nan, r"non-finite vector\(s\) for example id\(s\) \[130\]"),
        (1e6, r"non-finite .*\[130\].*overflow of storage dtype float16"),
    ],
)
def test_non_finite_rows_are_refused(tmp_path, values, match):
    def rows_fn(lo, hi):
        x = np.array(synthetic_rows(lo, hi))
        if lo <= 130 < hi:
            x[130 - lo, 3] = values
        return x

    with pytest.raises(ValueError, match=match):
        index.IndexBuilder(tmp_path / "ix", make_manifest(dtype="float16")).build(rows_fn)
    with pytest.raises(ValueError, match=r"returned shape \(64, 3\)"):
        index.IndexBuilder(tmp_path / "iy", make_manifest()).build(lambda lo, hi: np.zeros((hi - lo, 3)))


# ------------------------------------------------------------------------------------------
# Corruption and verify
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupt_chunk_is_an_error_naming_its_rows(tmp_path, damage):
    build(tmp_path / "ix")
    index.verify_index(tmp_path / "ix")
    chunk = tmp_path / "ix" / "vectors" / "c" / "3" / "0"
    data = chunk.read_bytes()
    if damage == "flip":
        chunk.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif damage == "truncate":
        chunk.write_bytes(data[: len(data) // 2])
    else:
        chunk.unlink()
    reader = index.open_index(tmp_path / "ix")
    reader.read_block(0, 192)
    with pytest.raises(index.IndexCorruptError, match=r"chunk 3, rows \[192, 256\) cannot be read"):
        reader.read_block(0, 700)
    why = {"flip": "fails its crc32c", "truncate": "has 4098 bytes, not 8196", "delete": "is missing"}[damage]
    with pytest.raises(index.IndexCorruptError, match=why):
        reader.read_block(192, 193)
    reader = index.open_index(tmp_path / "ix", direct=False)  # tensorstore's read path names the same rows
    assert not reader._direct
    with pytest.raises(index.IndexCorruptError, match=r"chunk 3, rows \[192, 256\) cannot be read"):
        reader.read_block(0, 700)
    with pytest.raises(index.IndexCorruptError, match=r"failed verification:\n.*chunk 3, rows \[192, 256\)"):
        index.verify_index(tmp_path / "ix")


def test_verify_reports_incomplete_and_bad_r(tmp_path):
    path = tmp_path / "ix"
    with pytest.raises(RuntimeError):
        index.IndexBuilder(path, make_manifest()).build(_stop_at(6))
    with pytest.raises(index.IndexCorruptError, match=r"chunk 5, rows \[320, 384\): not complete"):
        index.verify_index(path)
    assert index.verify_index(path, require_complete=False)["complete_chunks"] == 5
    index.IndexBuilder(path, make_manifest()).build(synthetic_rows)
    r = np.load(path / "r_train.npy")
    np.save(path / "r_train.npy", r * 1.001)
    with pytest.raises(index.IndexCorruptError, match="r_train.npy does not match the sha256 recorded"):
        index.verify_index(path)
    # A wrong R_train with a matching checksum (e.g. a bug, not a damaged file): the recomputation catches it.
    meta = json.loads((path / "r_train.json").read_text())
    meta["sha256"] = hashlib.sha256((r * 1.001).tobytes()).hexdigest()
    (path / "r_train.json").write_text(json.dumps(meta))
    with pytest.raises(index.IndexCorruptError, match="R_train differs from a recomputation"):
        index.verify_index(path)


# ------------------------------------------------------------------------------------------
# Real processes: SIGKILL mid-build, two writers
# ------------------------------------------------------------------------------------------

_CHILD = textwrap.dedent("""
    import json, sys, time
    import jax, jax.numpy as jnp
    from trackstar_jax import index
    path, dtype, pi, pc, slow = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    DIM = %(dim)d
    @jax.jit
    def rows_for_ids(ids):
        scale = 1.0 + (ids %% 7).astype(jnp.float32)
        return jax.vmap(lambda i: jax.random.normal(jax.random.fold_in(jax.random.key(0), i), (DIM,)))(ids) * scale[:, None]
    def rows_fn(lo, hi):
        time.sleep(slow)
        return rows_for_ids(jnp.arange(lo, hi))
    manifest = index.make_manifest(num_rows=800, dim=DIM, num_blocks_total=%(blocks)d,
        storage=index.StorageConfig(dtype=dtype, chunk_rows=32, r_every_chunks=4),
        model={"checkpoint_step": 7, "fingerprint": "sha256:model"}, vectors={"proj_seed": 0},
        corpus={"name": "synthetic", "fingerprint": "sha256:corpus", "num_examples": 800})
    stats = index.IndexBuilder(path, manifest, process_index=pi, process_count=pc).build(rows_fn)
    print(json.dumps({"written": stats.chunks_written, "skipped": stats.chunks_skipped,
                      "read_back": stats.chunks_read_back, "finalized": stats.finalized}))
""") % {"dim": DIM, "blocks": BLOCKS}


def _spawn(tmp_path, path, dtype="bfloat16", pi=0, pc=1, slow=0.0):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, str(script), str(path), dtype, str(pi), str(pc), str(slow)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )


def _finish(proc, timeout=120):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reference_build(tmp_path_factory):
    """One uninterrupted single-process build in a child process (25 chunks of 32 rows)."""
    tmp = tmp_path_factory.mktemp("ref")
    stats = _finish(_spawn(tmp, tmp / "ix"))
    assert stats["written"] == 25 and stats["finalized"]
    return tmp / "ix"


def test_sigkill_mid_build_then_resume_is_byte_identical(tmp_path, reference_build):
    path = tmp_path / "ix"
    proc = _spawn(tmp_path, path, slow=0.1)  # 0.1 s per chunk: >= 1.5 s left when 10 are done
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if len(list(path.glob("progress/chunk_*.done"))) >= 10:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the build finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(list((path / "progress").glob("chunk_*.done")))
    assert 10 <= done < 25 and not (path / "COMPLETE").exists()
    stats = _finish(_spawn(tmp_path, path))
    assert stats["skipped"] == done and stats["written"] == 25 - done and stats["finalized"]
    assert array_files(path) == array_files(reference_build)
    np.testing.assert_array_equal(index.load_r_train(path).total, index.load_r_train(reference_build).total)
    index.verify_index(path)


def test_two_processes_writing_halves_equal_one(tmp_path, reference_build):
    path = tmp_path / "ix"
    procs = [_spawn(tmp_path, path, pi=i, pc=2) for i in range(2)]  # concurrently, same fresh directory
    results = [_finish(p) for p in procs]
    assert sum(r["written"] for r in results) == 25
    assert any(r["finalized"] for r in results)
    assert index.finalize(path)
    assert array_files(path) == array_files(reference_build)
    # Same float32 segment sums, grouped per process then added in float64.
    np.testing.assert_allclose(
        index.load_r_train(path).total, index.load_r_train(reference_build).total, rtol=1e-12, atol=0
    )
    index.verify_index(path)


# ------------------------------------------------------------------------------------------
# Scoring: on the fly vs finalised array
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize(
    "mode, unit_norm", [("none", False), ("none", True), ("train", True), ("mixed", True), ("mixed", False)]
)
def test_finalised_array_and_on_the_fly_give_the_same_scores(tmp_path, dtype, mode, unit_norm):
    build(tmp_path / "ix", dtype=dtype, num_rows=300)
    reader = index.open_index(tmp_path / "ix")
    q = np.asarray(synthetic_rows(10_000, 10_040))
    cfg = hessian.HessianConfig(mode=mode, lambda_component_fraction=4 / DIM, damping=1e-8, unit_norm=unit_norm)
    scoring = index.prepare_scoring(reader, cfg, q)
    # Path 1, on the fly: a plain matmul over the raw stored rows times the per-row scale.
    rows, scale = reader.read_block(0, 300)
    raw = rows.astype(np.float32)
    row_scale = scoring.row_scale * (scale if scale is not None else 1.0)
    on_the_fly = (scoring.finalize_queries(q) @ raw.T) * row_scale[None, :]
    # Path 2: a second index of finalised rows Ḡ_m, scored against Ḡ_q.
    fin = index.write_finalized(reader, scoring.whitening, tmp_path / "fin")
    assert fin.manifest["finalized"]["mode"] == mode
    w = None if scoring.whitening.matrix is None else jnp.asarray(scoring.whitening.matrix)
    finalised = np.asarray(hessian.finalize_rows(q, w, unit_norm)) @ fin.read_dequantized(0, 300).T
    # Reference: dense float64 Eq. 1-2 over the dequantised rows.
    g = reader.read_dequantized(0, 300).astype(np.float64)
    wd = np.eye(DIM) if w is None else _block_diag64(scoring.whitening.matrix)
    gq, gg = q.astype(np.float64) @ wd, g @ wd
    if unit_norm:
        gq /= np.linalg.norm(gq, axis=1, keepdims=True)
        gg /= np.linalg.norm(gg, axis=1, keepdims=True)
    ref = gq @ gg.T
    tol = 1e-5 * np.abs(ref).max()
    np.testing.assert_allclose(on_the_fly, finalised, rtol=1e-4, atol=tol)
    np.testing.assert_allclose(on_the_fly, ref, rtol=1e-4, atol=tol)
    if unit_norm:
        np.testing.assert_allclose(np.linalg.norm(fin.read_dequantized(0, 300), axis=1), 1.0, rtol=1e-5)
    if mode == "mixed":
        assert 0 < scoring.whitening.mix_lambda < 1 and scoring.whitening.component == 4


def _block_diag64(blocks):
    b, k, _ = blocks.shape
    out = np.zeros((b * k, b * k))
    for i in range(b):
        out[i * k : (i + 1) * k, i * k : (i + 1) * k] = blocks[i]
    return out


def test_row_scale_is_cached_per_whitening(tmp_path):
    build(tmp_path / "ix", num_rows=200)
    reader = index.open_index(tmp_path / "ix")
    s1 = index.prepare_scoring(reader, hessian.HessianConfig(mode="train"))
    files = list((tmp_path / "ix" / "scoring").glob("*.npy"))
    assert len(files) == 1
    s2 = index.prepare_scoring(reader, hessian.HessianConfig(mode="train"))
    np.testing.assert_array_equal(s1.row_scale, s2.row_scale)
    index.prepare_scoring(reader, hessian.HessianConfig(mode="none"))
    assert len(list((tmp_path / "ix" / "scoring").glob("*.npy"))) == 2
    g = reader.read_dequantized(0, 200)
    np.testing.assert_allclose(
        index.prepare_scoring(reader, hessian.HessianConfig(mode="none")).row_scale,
        1 / np.linalg.norm(g, axis=1),
        rtol=1e-5,
    )


def test_scoring_needs_a_complete_index(tmp_path):
    with pytest.raises(RuntimeError):
        index.IndexBuilder(tmp_path / "ix", make_manifest()).build(_stop_at(6))
    with pytest.raises(index.IndexIncompleteError, match="no R_train yet"):
        index.prepare_scoring(index.open_index(tmp_path / "ix"), hessian.HessianConfig(mode="train"))


def test_an_index_from_before_a_model_field_existed_still_opens(tmp_path):
    """Manifests written before `LMConfig` gained fields (arch, num_kv_heads, ...) open when the
    expected values are those fields' defaults; a non-default value is refused by name."""
    from trackstar_jax.models import lm

    cfg = dataclasses.asdict(lm.LMConfig())
    old = {k: v for k, v in cfg.items() if k not in ("arch", "num_kv_heads", "norm_eps", "activation")}
    index.check_manifest({"model": {"config": old}}, {"model": {"config": cfg}}, path="p", action="open")
    with pytest.raises(index.IndexMismatchError, match="no field 'model.config.arch'"):
        index.check_manifest(
            {"model": {"config": old}}, {"model": {"config": {**cfg, "arch": "llama"}}}, path="p", action="open"
        )


def test_an_index_from_before_exact_v_existed_still_opens():
    """`vectors.exact_v` (session 4) is absent from older manifests: expected at its default
    (False) they open; an index asked for with exact_v=True is refused by name."""
    from trackstar_jax.features import vectors as vectors_lib

    cfg = dataclasses.asdict(vectors_lib.VectorConfig())
    old = {k: v for k, v in cfg.items() if k != "exact_v"}
    index.check_manifest({"vectors": old}, {"vectors": cfg}, path="p", action="open")
    with pytest.raises(index.IndexMismatchError, match="no field 'vectors.exact_v'"):
        index.check_manifest({"vectors": old}, {"vectors": {**cfg, "exact_v": True}}, path="p", action="open")


def test_an_untied_index_from_before_vectors_unembed_is_refused():
    """`vectors.unembed` (session 5) defaults to False, but indices built before it attributed
    an untied model's unembedding: an untied manifest without the field reads as True and is
    refused for the default, opened for unembed=True. (Tied models do not record the field.)"""
    from trackstar_jax.features import vectors as vectors_lib

    cfg = dataclasses.asdict(vectors_lib.VectorConfig())
    old = {k: v for k, v in cfg.items() if k != "unembed"}
    with pytest.raises(index.IndexMismatchError, match="no field 'vectors.unembed', so it was built with True"):
        index.check_manifest({"vectors": old}, {"vectors": cfg}, path="p", action="open")
    index.check_manifest({"vectors": old}, {"vectors": {**cfg, "unembed": True}}, path="p", action="open")
