"""Hand-written CPU kernels, registered with XLA through the FFI (`jax.ffi`).

One kernel so far, `kernels/scores.cc`: exact float32 scores of bfloat16 or float32 index
rows against float32 queries (`scores[q, r] = sum_j f32(rows[r, j]) * queries[q, j]`), used
by `retrieval.py`'s "native" plan. XLA:CPU's own bf16 dot is compute-bound at a few queries
(BUILD_NOTES "Issue 5"); this kernel widens bf16 rows with integer shifts in registers and
reads them at close to the machine's read rate for one query.

The C++ source ships with the package and is compiled at first use with the system C++
compiler (`$CXX`, else g++ / c++ / clang++) against `jax.ffi.include_dir()`, into
`$TRACKSTAR_JAX_CACHE/kernels/<key>/` (default `~/.cache/trackstar_jax`), where `<key>`
hashes the source, the jaxlib version, the compiler's identity, the flags and the machine
architecture. The .so holds an AVX-512 path chosen at run time by CPU feature checks and a
portable path, so a cached build never runs instructions the CPU lacks.

Cache safety: the library is written to a temporary name and renamed into place, and a
sidecar `<so>.sha256` (written after it, also by rename) must match the library's bytes
before it is loaded; a partial, corrupted or foreign file is rebuilt, never loaded. Builds
are serialised by a lock file across processes and a lock across threads.

Fallback: `available()` is False -- and `retrieval.make_score_plan` keeps its XLA formulations --
when `TRACKSTAR_JAX_NATIVE=0`, or (with one warning) when there is no compiler or the build
or load fails.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import threading
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging
from jaxtyping import Array, Float

from trackstar_jax import files

ENV_ENABLE = "TRACKSTAR_JAX_NATIVE"  # "0" forces the XLA fallback
ENV_CACHE = "TRACKSTAR_JAX_CACHE"
# FFI target names -> handler symbols in the library, by row dtype.
TARGETS = {
    "bfloat16": ("trackstar_bf16_scores", "TrackstarBf16Scores"),
    "float32": ("trackstar_f32_scores", "TrackstarF32Scores"),
}
SOURCE = pathlib.Path(__file__).resolve().parent / "kernels" / "scores.cc"
FLAGS = ("-O3", "-shared", "-fPIC", "-std=c++17")
_LIB_NAME = "libtrackstar_kernels.so"

_lock = threading.Lock()
_state: dict[str, Any] = {}  # "lib" (ctypes.CDLL) once loaded, "error" (str) once failed


def enabled() -> bool:
    """False when the environment forces the XLA fallback (`TRACKSTAR_JAX_NATIVE=0`)."""
    return os.environ.get(ENV_ENABLE, "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> pathlib.Path:
    """Root of the kernel build cache (`$TRACKSTAR_JAX_CACHE/kernels` or `~/.cache/...`)."""
    root = os.environ.get(ENV_CACHE) or os.path.join(os.path.expanduser("~"), ".cache", "trackstar_jax")
    return pathlib.Path(root) / "kernels"


def _compiler() -> str | None:
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx) or cxx
    return next((p for p in map(shutil.which, ("g++", "c++", "clang++")) if p), None)


def _build_key(compiler: str) -> str:
    """Hash of everything the binary depends on (source, FFI headers' jaxlib, compiler, flags)."""
    import jaxlib  # noqa: PLC0415  (only for its version)

    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60, check=True).stdout
    h = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        jaxlib.__version__.encode(),
        compiler.encode(),
        version.encode(),
        " ".join(FLAGS).encode(),
        platform.machine().encode(),
    ):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:20]


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _is_valid(so: pathlib.Path) -> bool:
    """The library exists and its bytes match the digest recorded after it was complete."""
    try:
        return so.with_name(so.name + ".sha256").read_text().strip() == _sha256(so)
    except OSError:
        return False


def build(*, force: bool = False) -> pathlib.Path:
    """Compiles the kernel library into the cache unless a valid build is there; returns its path.

    Args:
      force: rebuild even if a valid build exists.

    Raises:
      RuntimeError: no C++ compiler, or the compiler failed (its output in the message).
    """
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set $CXX, or install g++)")
    out_dir = cache_dir() / _build_key(compiler)
    so = out_dir / _LIB_NAME
    if not force and _is_valid(so):
        return so
    files.make_dirs(out_dir)
    import fcntl  # noqa: PLC0415  (POSIX only; elsewhere the failure means: XLA fallback)

    with os.fdopen(files.open_nofollow(out_dir / ".lock", os.O_WRONLY | os.O_CREAT), "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # one builder at a time; others then find its result
        if not force and _is_valid(so):
            return so

        def compile_to(tmp: str) -> None:
            cmd = [compiler, *FLAGS, "-I", jax.ffi.include_dir(), str(SOURCE), "-o", tmp]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if res.returncode != 0:
                raise RuntimeError(f"building {SOURCE.name} failed ({' '.join(cmd)}):\n{res.stderr[-4000:]}")

        files.atomic_write_with(so, compile_to)
        digest = _sha256(so)
        files.atomic_write(so.with_name(so.name + ".sha256"), digest)
    logging.info("built %s -> %s", SOURCE.name, so)
    return so


def _load() -> ctypes.CDLL:
    """Builds (if needed), loads and registers the kernels once per process."""
    so = build()
    try:
        lib = ctypes.CDLL(str(so))
        handlers = {target: getattr(lib, symbol) for target, symbol in TARGETS.values()}
    except (OSError, AttributeError):  # valid digest but unloadable (e.g. another libc): rebuild once
        so = build(force=True)
        lib = ctypes.CDLL(str(so))
        handlers = {target: getattr(lib, symbol) for target, symbol in TARGETS.values()}
    for target, handler in handlers.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    lib.TrackstarKernelIsa.restype = ctypes.c_int
    lib.TrackstarForcePortable.argtypes = [ctypes.c_int]
    return lib


def _library() -> ctypes.CDLL | None:
    with _lock:
        if "lib" not in _state and "error" not in _state:
            try:
                _state["lib"] = _load()
            except Exception as e:  # noqa: BLE001  (any failure means: use the XLA path)
                _state["error"] = f"{type(e).__name__}: {e}"
                logging.warning(
                    "trackstar_jax native CPU kernels unavailable, retrieval uses its slower XLA formulations: %s",
                    _state["error"],
                )
        return _state.get("lib")


def available() -> bool:
    """True when the kernels are enabled and built, loaded and registered (builds at first call)."""
    return enabled() and _library() is not None


def isa() -> str:
    """Code path the kernels take on this CPU: "avx512" or "portable" ("unavailable" if not built)."""
    lib = _library() if enabled() else None
    if lib is None:
        return "unavailable"
    return "avx512" if lib.TrackstarKernelIsa() == 1 else "portable"


def force_portable(on: bool) -> None:
    """Test hook: makes the kernels take their portable path (True) or the best one (False)."""
    lib = _library()
    if lib is None:
        raise RuntimeError(f"native kernels unavailable: {_state.get('error')}")
    lib.TrackstarForcePortable(int(on))


def scores(rows: Array, queries: Float[Array, "q d"]) -> Float[Array, "q b"]:
    """Exact float32 scores `queries @ rows.T` of bfloat16 or float32 rows (traceable; CPU only).

    Args:
      rows: `[b, d]` bfloat16 or float32.
      queries: `[Q, d]` float32.

    Returns:
      `[Q, b]` float32, each score a float32 sum of float32 products (bf16 widening is exact).

    Raises:
      RuntimeError: the kernels are disabled or could not be built.
      ValueError: other dtypes or mismatched shapes.
    """
    if not available():
        raise RuntimeError(
            f"native kernels unavailable ({ENV_ENABLE}={os.environ.get(ENV_ENABLE)!r}, "
            f"{_state.get('error')}); use an XLA plan"
        )
    name = jnp.dtype(rows.dtype).name
    if name not in TARGETS or rows.ndim != 2 or queries.ndim != 2 or queries.shape[1] != rows.shape[1]:
        raise ValueError(
            f"expected rows [b, d] in {tuple(TARGETS)} and queries [Q, d], got {rows.shape} "
            f"{rows.dtype} and {queries.shape}"
        )
    out = jax.ShapeDtypeStruct((queries.shape[0], rows.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(TARGETS[name][0], out, vmap_method="sequential")(rows, queries.astype(jnp.float32))
