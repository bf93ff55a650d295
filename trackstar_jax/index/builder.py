"""Writing an index: `IndexBuilder` (resumable, several writers) and `finalize` (R_train once).

See `store.py` for the on-disk layout and how R_train composes with resume and writers.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import pathlib
import time
from typing import Any, Callable, Generator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from trackstar_jax import files
from trackstar_jax.distributed import multihost
from trackstar_jax.index import manifest as manifest_lib
from trackstar_jax.index import store

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


class IndexBuilder:
    """Creates (or resumes) an index and fills this process's rows.

    Usage: `IndexBuilder(path, manifest, process_index=p, process_count=P).build(rows_fn)`.
    `rows_fn(start, stop)` must return the float32 vectors of example ids `start..stop-1`
    (jax or numpy array). It may return a device array without blocking: the builder
    overlaps computing chunk c+1 with moving chunk c to the host and writing it.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        manifest: Mapping[str, Any],
        *,
        process_index: int = 0,
        process_count: int = 1,
        max_writes_in_flight: int = 2,
        device: jax.Device | None = None,
    ):
        self.path = pathlib.Path(path)
        self.manifest = json.loads(json.dumps(dict(manifest)))
        if self.manifest.get("format") != manifest_lib.FORMAT:
            raise ValueError("manifest was not made by index.make_manifest")
        st = self.manifest["storage"]
        self.num_rows, self.chunk_rows = int(st["num_rows"]), int(st["chunk_rows"])
        self.dtype = st["dtype"]
        self.r_every = int(st["r_every_chunks"])
        self.dim = int(self.manifest["vectors"]["dim"])
        self.num_blocks_total = int(self.manifest["vectors"]["num_blocks_total"])
        self.num_chunks = -(-self.num_rows // self.chunk_rows)
        self.process_index, self.process_count = process_index, process_count
        self.chunks = store.process_chunk_range(self.num_chunks, self.r_every, process_index, process_count)
        self.max_writes_in_flight = max(1, max_writes_in_flight)
        # R partial sums run on one fixed device so that build and read-back give the same bits.
        self.device = device or jax.local_devices()[0]
        self._open_or_create()

    # -- setup ---------------------------------------------------------------------------

    def _open_or_create(self) -> None:
        p = files.check_tree(self.path)  # tensorstore writes its arrays by its own paths: no link below
        files.make_dirs(p)
        mpath = p / "manifest.json"
        if not mpath.exists():
            if (p / "vectors").exists():
                raise store.IndexMismatchError(f"{p} holds index data but no manifest.json: refusing to overwrite it")
            files.create_once(mpath, json.dumps(self.manifest, indent=1, sort_keys=True).encode())
        on_disk = store.read_manifest(p)
        store.check_manifest(on_disk, manifest_lib._identity(self.manifest), path=str(p), action="resume")
        # Fields present on disk but absent from ours also count as a mismatch.
        store.check_manifest(self.manifest, manifest_lib._identity(on_disk), path=str(p), action="resume")
        self.manifest = on_disk
        files.make_dirs(p / "progress")
        files.make_dirs(p / "r_train")
        part = json.dumps({"process_count": self.process_count}).encode()
        files.create_once(p / "progress" / "partition.json", part)
        started = store.read_partition(p)
        if started != self.process_count:
            raise store.IndexMismatchError(
                f"refusing to resume index {p}: it was started with process_count={started}, "
                f"not {self.process_count} (R_train partial sums are per process range)"
            )
        self._vectors, self._scale = store._open_arrays(p, self.manifest, create=True)

    # -- small pieces (tests patch _write_rows to simulate a full disk) --------------------

    def _writer_lock(self):
        """Holds `progress/writer-<i>-of-<n>.lock` (`files.exclusive_lock`) for the build: a second
        process that would write the same chunks is refused, naming the holder (pid and host)."""
        lock = self.path / "progress" / f"writer-{self.process_index:04d}-of-{self.process_count:04d}.lock"

        def busy(holder: str) -> Exception:
            return manifest_lib.IndexWriteError(
                f"index {self.path}: another build is writing the same chunks (writer {self.process_index} of "
                f"{self.process_count}; held by {holder}, lock {lock}); wait for it or stop it first"
            )

        return files.exclusive_lock(lock, "build", busy)

    def _chunk_files(self, c: int) -> list[pathlib.Path]:
        """The files holding chunk `c` (zarr3 default chunk keys: `c/<row chunk>/<col chunk>`)."""
        return store.chunk_files(self.path, c, self.dtype)

    def _missing_chunks(self, complete: frozenset[int]) -> list[int]:
        """Chunks of this writer marked complete whose files are gone (a stat per chunk)."""
        return [c for c in self.chunks if c in complete and not all(f.exists() for f in self._chunk_files(c))]

    def chunk_index(self, start: int) -> int:
        """The chunks before the one starting at row `start`, in this writer's range (progress)."""
        return start // self.chunk_rows - self.chunks.start

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
        return store._chunk_autocorrelation(stored, scale, num_blocks_total=self.num_blocks_total)

    def _part_files(self) -> dict[int, pathlib.Path]:
        out = {}
        for f in (self.path / "r_train").iterdir():
            m = store._PART_RE.match(f.name)
            if m and int(m.group(1)) == self.process_index and int(m.group(2)) == self.process_count:
                out[int(m.group(3))] = f
        return out

    def _save_running(self, upto: int, total: np.ndarray) -> None:
        name = f"part-{self.process_index:04d}-of-{self.process_count:04d}-upto-{upto:08d}.npy"
        files.atomic_write(self.path / "r_train" / name, files.npy_bytes(total))
        for u, f in self._part_files().items():  # older running sums are superseded
            if u < upto:
                f.unlink(missing_ok=True)

    # -- the build -------------------------------------------------------------------------

    def build(
        self, rows_fn: RowsFn, *, progress: Callable[[int, int], None] | None = None, finalize_when_done: bool = True
    ) -> BuildStats:
        """Writes every incomplete chunk of this process's range, then finalises if all are done.

        Args:
          rows_fn: `(start, stop) -> [stop-start, d]` float32 vectors of those example ids.
          progress: optional callback `(chunks_done, chunks_total)` after each chunk.
          finalize_when_done: call `finalize` at the end (False: the caller finalises once,
            e.g. process 0 of a multi-host job after a barrier).

        Returns:
          BuildStats.

        Raises:
          manifest_lib.IndexWriteError: a write failed (e.g. ENOSPC); every chunk before it is complete and
            intact, and calling `build` again resumes.
          ValueError: rows_fn returned the wrong shape or non-finite values (names the rows).
        """
        with self._writer_lock():
            steps = self._build(progress, finalize_when_done)
            try:
                request = next(steps)
                while True:
                    request = steps.send(rows_fn(*request))
            except StopIteration as done:
                return done.value
            finally:
                steps.close()  # a failing rows_fn: submitted writes land and are marked

    def _resume_point(self) -> tuple[frozenset[int], int, np.ndarray]:
        """`(complete chunks, chunk up to which R_train is summed, that running sum)`.

        Chunks marked complete whose files are gone are unmarked (and so rewritten).
        """
        complete = store._complete_chunks(self.path, self.num_chunks)
        missing = self._missing_chunks(complete)
        if missing:
            # Rows are a deterministic function of the run, so rewriting a lost chunk restores
            # its bytes; R_train (already summed over it) stays valid.
            logging.warning(
                "index %s: chunk(s) %s are marked complete but their files are missing; rewriting them",
                self.path,
                missing[:20],
            )
            for c in missing:
                self._marker(c).unlink(missing_ok=True)
            complete = complete - frozenset(missing)
        parts = self._part_files()
        upto = max((u for u in parts if self.chunks.start <= u <= self.chunks.stop), default=self.chunks.start)
        running = np.load(parts[upto], allow_pickle=False) if upto in parts else None
        k2 = self.dim // self.num_blocks_total
        if running is not None and running.shape != (self.num_blocks_total, k2, k2):
            raise store.IndexCorruptError(
                f"index {self.path}: R_train running sum {parts[upto].name} has shape {running.shape}"
            )
        if running is None:
            running = np.zeros((self.num_blocks_total, k2, k2), np.float64)
        return complete, upto, running

    def _build(
        self, progress: Callable[[int, int], None] | None, finalize_when_done: bool
    ) -> Generator[tuple[int, int], Any, BuildStats]:
        """The build's steps: what is already done (`_resume_point`), then per chunk either a
        read-back for R_train or featurize + quantise + write (`_ChunkWriter`), with the R_train
        running sum saved at every segment end (`_save_running`).

        A generator: it yields `(start, stop)` for each chunk it needs rows of and is sent the
        rows, so that one caller can drive several builders in step (`build_together`)."""
        stats = BuildStats()
        t_start = time.perf_counter()
        complete, upto, running = self._resume_point()
        seg_acc = None
        writer = _ChunkWriter(self, stats)
        pending = None  # (chunk, lo, hi, stored, scale, bad) computed but not yet on the host
        try:
            for c in self.chunks:
                lo, hi = self.chunk_rows_range(c)
                if c in complete:
                    stats.chunks_skipped += 1
                    if c >= upto:  # completed after the last saved running sum: re-read for R
                        t0 = time.perf_counter()
                        stored, scale = self._read_chunk(c)
                        part = self._partial(
                            self._pad(stored, hi - lo), None if scale is None else self._pad(scale, hi - lo)
                        )
                        seg_acc = part if seg_acc is None else seg_acc + part
                        stats.chunks_read_back += 1
                        stats.readback_seconds += time.perf_counter() - t0
                else:
                    rows = yield lo, hi
                    if tuple(rows.shape) != (hi - lo, self.dim):
                        raise ValueError(
                            f"rows_fn({lo}, {hi}) returned shape {tuple(rows.shape)}, expected {(hi - lo, self.dim)}"
                        )
                    stored, scale, bad = store._quantize_step(
                        self._pad(jnp.asarray(rows, jnp.float32), hi - lo), dtype=self.dtype
                    )
                    if c >= upto:
                        part = self._partial(stored, scale)
                        seg_acc = part if seg_acc is None else seg_acc + part
                    multihost.settle((stored, scale, bad, seg_acc))  # multi-device CPU: one at a time
                    if pending is not None:
                        writer.flush(pending)  # chunk c is queued on the device while c-1 goes to disk
                    pending = (c, lo, hi, stored, scale, bad)
                seg_end = (c + 1 - self.chunks.start) % self.r_every == 0 or c + 1 == self.chunks.stop
                if seg_end and c >= upto:
                    if pending is not None:
                        writer.flush(pending)
                        pending = None
                    writer.finish(block_all=True)
                    t0 = time.perf_counter()
                    running = running + np.asarray(seg_acc, np.float64)
                    seg_acc = None
                    self._save_running(c + 1, running)
                    upto = c + 1
                    stats.write_seconds += time.perf_counter() - t0
                if progress is not None:
                    progress(c + 1 - self.chunks.start, len(self.chunks))
            if pending is not None:
                writer.flush(pending)
            writer.finish(block_all=True)
        except BaseException:
            # Let writes that were already submitted land and be marked, so progress is kept.
            try:
                writer.finish(block_all=True)
            except manifest_lib.IndexWriteError:
                pass
            raise
        finally:
            writer.close()
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
            raise store.IndexCorruptError(
                f"index {self.path}: chunk {c}, rows [{lo}, {hi}) is marked complete but cannot be read: {e}"
            ) from e
        for f, want in zip(self._chunk_files(c), store.read_marker_crcs(self.path, c)):
            if (got := store.file_crc32c(f)) != want:  # R_train must sum the rows written at this position
                raise store.chunk_position_error(self.path, c, (lo, hi), f, got, want)
        return stored, scale

    def _write_failure(self, c: int, lo: int, hi: int, e: BaseException) -> str:
        full = (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "no space" in str(e).lower()
        why = "the disk is full" if full else "the write failed"
        return (
            f"index {self.path}: writing chunk {c}, rows [{lo}, {hi}) failed ({why}: {e}); chunks with "
            f"markers in progress/ are complete and intact; fix the cause and run the build again to resume"
        )


class _ChunkWriter:
    """Writes quantised chunks to disk while the next one is computed.

    `flush` checks a chunk, submits its writes, and hands the commit (wait for the writes, then
    the completion marker) to one background thread, so the build loop blocks only when more
    than `max_writes_in_flight` chunks are unfinished; `finish` collects finished chunks in
    order and re-raises the first failed write with its row range.
    """

    def __init__(self, builder: IndexBuilder, stats: BuildStats):
        self.b, self.stats = builder, stats
        self.committer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="index-commit")
        self.in_flight: list[tuple[int, concurrent.futures.Future]] = []  # in chunk order

    def _commit(self, c: int, futs: list) -> None:
        for f in futs:
            f.result()
        lo, hi = self.b.chunk_rows_range(c)
        crcs = []
        for f in self.b._chunk_files(c):
            try:  # the marker records the crc32c each file was written with: it binds the file to chunk c
                crcs.append(store.file_crc32c(f))
            except FileNotFoundError:
                raise OSError(f"the write of chunk {c} committed but left no file {f}") from None
        files.atomic_write(self.b._marker(c), json.dumps(store.marker_record(lo, hi, crcs)).encode())

    def finish(self, block_all: bool) -> None:
        """Collects finished chunks (oldest first); re-raises the first failed write."""
        t0 = time.perf_counter()
        failure = None
        while self.in_flight and (
            block_all
            or failure is not None
            or len(self.in_flight) > self.b.max_writes_in_flight
            or self.in_flight[0][1].done()
        ):
            c, fut = self.in_flight.pop(0)
            lo, hi = self.b.chunk_rows_range(c)
            try:
                fut.result()
            except Exception as e:  # noqa: BLE001 - re-raised below with the row range
                failure = failure or (c, lo, hi, e)
                continue
            self.stats.chunks_written += 1
            self.stats.rows_written += hi - lo
        self.stats.write_seconds += time.perf_counter() - t0
        if failure is not None:
            raise manifest_lib.IndexWriteError(self.b._write_failure(*failure)) from failure[3]

    def flush(self, item: tuple) -> None:
        """Checks one computed chunk `(c, lo, hi, stored, scale, bad)` and submits its writes."""
        c, lo, hi, stored, scale, bad = item
        bad = np.asarray(bad)[: hi - lo]
        if (bad == store.BAD_NON_FINITE).any():
            rows = (lo + np.flatnonzero(bad == store.BAD_NON_FINITE)).tolist()
            raise ValueError(
                f"non-finite vector(s) for example id(s) {rows[:10]} (rows [{lo}, {hi}); "
                f"NaN/inf from the featurizer or overflow of storage dtype {self.b.dtype})"
            )
        if bad.any():
            rows = (lo + np.flatnonzero(bad)).tolist()
            raise ValueError(
                f"zero vector(s) for example id(s) {rows[:10]}{' ...' if len(rows) > 10 else ''} (rows [{lo}, {hi})): "
                f"all zero as stored in {self.b.dtype}, so they would score 0 against every query; the model's "
                "gradients vanish there (a diverged or untrained model, or examples without loss tokens) or the "
                "values underflow the storage dtype (try --config.index.dtype=float32 or int8)"
            )
        stored_h = np.asarray(stored)[: hi - lo]
        scale_h = None if scale is None else np.asarray(scale)[: hi - lo]
        t0 = time.perf_counter()
        try:
            futs = self.b._write_rows(lo, hi, stored_h, scale_h)
        except Exception as e:  # noqa: BLE001
            self.stats.write_seconds += time.perf_counter() - t0
            self.finish(block_all=True)
            raise manifest_lib.IndexWriteError(self.b._write_failure(c, lo, hi, e)) from e
        self.in_flight.append((c, self.committer.submit(self._commit, c, futs)))
        self.stats.write_seconds += time.perf_counter() - t0
        self.finish(block_all=False)

    def close(self) -> None:
        self.committer.shutdown(wait=True)


# (start, stop, which) -> the rows of examples start..stop-1 for the builders `which` (indices
# into `build_together`'s builders), one [stop-start, d] array each, in that order
SharedRowsFn = Callable[[int, int, tuple[int, ...]], Sequence[Any]]


def build_together(
    builders: Sequence[IndexBuilder],
    rows_fn: SharedRowsFn,
    *,
    progress: Callable[[int, int], None] | None = None,
    finalize_when_done: bool = True,
) -> list[BuildStats]:
    """`IndexBuilder.build` for several indices of the same rows whose vectors come from one
    pass (`vectors.VectorFn` with companions): `rows_fn(start, stop, which)` returns the rows of
    examples `start..stop-1` for the builders `which` (those that still need that chunk, in
    order), and is called once per chunk that any of them needs.

    Each index keeps everything `build` gives it: its own resume, R_train, markers and writer
    lock (all taken before anything is written).

    Raises:
      ValueError: the builders' chunks differ (rows, chunk size or this writer's range);
        what `build` raises.
    """
    layout = {(b.num_rows, b.chunk_rows, b.chunks.start, b.chunks.stop) for b in builders}
    if len(layout) != 1:
        raise ValueError(f"indices built together must have the same rows, chunks and writer range, got {layout}")
    stats: list[BuildStats | None] = [None] * len(builders)
    with contextlib.ExitStack() as stack:
        for b in builders:
            stack.enter_context(b._writer_lock())
        steps = [b._build(None, finalize_when_done) for b in builders]
        for s in steps:
            stack.callback(s.close)  # a failure: every builder's submitted writes land and are marked
        requests: list[tuple[int, int] | None] = [None] * len(builders)

        def advance(i: int, rows: Any = None, first: bool = False) -> None:
            try:
                requests[i] = next(steps[i]) if first else steps[i].send(rows)
            except StopIteration as done:
                requests[i], stats[i] = None, done.value

        for i in range(len(builders)):
            advance(i, first=True)
        total = len(builders[0].chunks)
        while any(r is not None for r in requests):
            lo, hi = min(r for r in requests if r is not None)  # every builder walks its chunks in order
            which = tuple(i for i, r in enumerate(requests) if r == (lo, hi))
            rows = rows_fn(lo, hi, which)
            if len(rows) != len(which):
                raise ValueError(f"rows_fn({lo}, {hi}) returned {len(rows)} row sets for {len(which)} indices")
            for i, r in zip(which, rows):
                advance(i, r)
            if progress is not None:
                progress(builders[0].chunk_index(lo) + 1, total)
    return [s for s in stats if s is not None]


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
    manifest = store.read_manifest(p)
    st = manifest["storage"]
    num_rows, chunk_rows, r_every = st["num_rows"], st["chunk_rows"], st["r_every_chunks"]
    num_chunks = -(-num_rows // chunk_rows)
    if len(store._complete_chunks(p, num_chunks)) < num_chunks:
        return False
    pcount = store.read_partition(p)
    parts = {}
    for f in (p / "r_train").iterdir():
        m = store._PART_RE.match(f.name)
        if m and int(m.group(2)) == pcount:
            parts.setdefault(int(m.group(1)), {})[int(m.group(3))] = f
    total = None
    for i in range(pcount):
        rng = store.process_chunk_range(num_chunks, r_every, i, pcount)
        if not len(rng):
            continue
        f = parts.get(i, {}).get(rng.stop)
        if f is None:  # its chunks are complete but its final running sum is not saved yet
            return False
        part = np.load(f, allow_pickle=False)
        total = part if total is None else total + part
    table = [store.read_marker_crcs(p, c) for c in range(num_chunks)]
    files.create_once(
        p / store.CHUNK_TABLE,
        json.dumps({"index": store.manifest_fingerprint(manifest), "crc32c": table}).encode(),
    )
    files.create_once(p / "r_train.npy", files.npy_bytes(total))
    files.create_once(
        p / "r_train.json",
        json.dumps(
            {
                "count": num_rows,
                "shape": list(total.shape),
                "dtype": "float64",
                "sha256": hashlib.sha256(total.tobytes()).hexdigest(),
            }
        ).encode(),
    )
    files.create_once(
        p / "COMPLETE",
        json.dumps({"num_rows": num_rows, "finished_unix": time.time(), "finalized_by": finalized_by}).encode(),
    )
    return True


def finalized_by(path: str | os.PathLike) -> Any:
    """Who finalised the index at `path` (as recorded in COMPLETE), or None."""
    f = pathlib.Path(path) / "COMPLETE"
    return json.loads(f.read_text()).get("finalized_by") if f.exists() else None
