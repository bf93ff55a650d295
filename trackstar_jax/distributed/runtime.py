"""Process-level JAX settings the stages share: the persistent XLA compilation cache, and the
platform the steps shape their programs for (`target_platform`).

Every launcher (`launch/_config.parse_flags`) and the race benchmark's stages call
`enable_compilation_cache()` before anything is compiled. A stage's jitted steps (train,
featurize, scoring) compile to the same executable for the same model, shapes, mesh and
jax / jaxlib version, so a second run of the stage (a resumed build, a rebuilt index, a writer
process started after another has compiled) loads them from disk instead of compiling: on the 2-core CPU this took ~3 s off a 32 s build at the pythia-14m shape
(BUILD_NOTES, issue 13). JAX keys the cache on the HLO, the compile options, the backend and
its version, so a stale entry is never used.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import signal
import sys
import threading
from typing import Iterator

import jax
from absl import logging as absl_logging

# The one line a stage stopped by Ctrl-C ends with: every stage resumes its own unfinished work.
RESUME_HINT = "interrupted; rerun the same command to resume"
# Exit status of a process ended by SIGINT (128 + 2, what a shell reports for Ctrl-C).
INTERRUPTED_EXIT = 130
# Seconds a Ctrl-C'd process has to unwind before `exit_on_interrupt` ends it anyway: the
# KeyboardInterrupt reaches Python only between bytecodes, so an XLA compile or a device step
# under way (an index chunk of a 135M model: tens of seconds on a CPU) would hold it that long.
INTERRUPT_GRACE_S = 2.0

# `TRACKSTAR_COMPILATION_CACHE`: the cache folder; "" or "off" disables it.
ENV = "TRACKSTAR_COMPILATION_CACHE"
# `TRACKSTAR_TARGET_PLATFORM`: "cpu", "gpu" or "tpu"; unset or "": JAX's default backend.
TARGET_ENV = "TRACKSTAR_TARGET_PLATFORM"
PLATFORMS = ("cpu", "gpu", "tpu")
DEFAULT_DIR = pathlib.Path.home() / ".cache" / "trackstar_jax" / "xla"
# GEMM precision knobs (`vectors.matmul_precision`, `retrieval.precision`) -> the value of
# `jax.default_matmul_precision` the featurize step is traced under. "float32": exact float32
# products on every chip (`Precision.HIGHEST`); "tf32": `Precision.HIGH` (TF32 on NVIDIA GPUs,
# 3 bf16 passes on TPU); "bf16": operands rounded to bfloat16, float32 accumulation (the
# BF16_BF16_F32 dot algorithm). XLA:CPU computes float32 dots in float32 whatever is asked
# (the featurize step rounds its operands itself there: `vectors.PRECISION_BY_OPERANDS`).
# GEMMs whose operands are already bfloat16 (a bf16 model) are bf16 at every setting.
MATMUL_PRECISIONS = {"float32": "highest", "tf32": "tensorfloat32", "bf16": "BF16_BF16_F32"}


def enable_compilation_cache(path: str | os.PathLike | None = None) -> pathlib.Path | None:
    """Turns on JAX's persistent compilation cache at `path` (default: `$TRACKSTAR_COMPILATION_CACHE`,
    else `~/.cache/trackstar_jax/xla`) for executables that took >= 0.1 s to compile. Leaves an
    already configured `jax_compilation_cache_dir` (the user's own) as it is.

    Returns:
      The folder in use, or None when disabled.
    """
    if jax.config.jax_compilation_cache_dir:
        return pathlib.Path(jax.config.jax_compilation_cache_dir)
    spec = os.environ.get(ENV) if path is None else str(path)
    if spec is not None and spec.strip().lower() in ("", "off", "0", "false"):
        return None
    folder = pathlib.Path(spec) if spec else DEFAULT_DIR
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: run uncached rather than fail a stage
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return folder


class _LibraryChatter(logging.Filter):
    """Drops INFO lines that say nothing to a user: orbax's lines on every checkpoint save and
    restore, and JAX's probe of a TPU library that is not installed (every start on CPU / GPU).
    Warnings and errors of either library pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO:
            return True
        if f"{os.sep}orbax{os.sep}" in record.pathname:
            return False
        msg = record.getMessage()
        return not (msg.startswith("Unable to initialize backend 'tpu'") and "libtpu" in msg)


_CHATTER = _LibraryChatter()


def quiet_library_logs() -> None:
    """Filters library chatter (`_LibraryChatter`) out of absl's handler (what the launchers print
    through) and logger. Process-global and idempotent: `launch/_config.parse_flags` calls it, and
    every stage at its start (`training.logs`)."""
    for target in (absl_logging.get_absl_handler(), absl_logging.get_absl_logger()):
        if _CHATTER not in target.filters:
            target.addFilter(_CHATTER)


def target_platform() -> str:
    """The platform whose program structure the steps take where it differs by platform (the
    fused head's chunk and vocabulary blocks, the exact-V path's per-example loop, the dense
    layers' form, the retrieval kernel's choice):
    `$TRACKSTAR_TARGET_PLATFORM` when set, else JAX's default backend. The planner sets it
    (`launch.plan --target_platform=gpu`) to compile an accelerator's steps on fake CPU devices
    for their memory; a run that sets it on a CPU runs the accelerator's structure, correctly but
    not at the CPU's best speed. It is read when a step is traced, so set it before the process
    traces any (a step already traced keeps the structure it was traced with).

    Raises:
      ValueError: if the variable names no platform of `PLATFORMS`.
    """
    name = os.environ.get(TARGET_ENV, "").strip().lower()
    if not name:
        return jax.default_backend()
    if name not in PLATFORMS:
        raise ValueError(f"${TARGET_ENV}={name!r} is not a platform; choose from {PLATFORMS} (or unset it)")
    return name


class Interrupted(KeyboardInterrupt):
    """A stage stopped by a signal after keeping what resumes it (training: a checkpoint at the
    step it stopped at); its message says what was kept and how to go on."""


def _exit_interrupted(message: str) -> None:
    absl_logging.flush()
    sys.stdout.flush()
    print(message, file=sys.stderr, flush=True)
    os._exit(INTERRUPTED_EXIT)  # no interpreter teardown: worker threads could hold it for seconds


@contextlib.contextmanager
def exit_on_interrupt(grace_s: float = INTERRUPT_GRACE_S) -> Iterator[None]:
    """For a launcher's `main`: a Ctrl-C ends the process with one line on stderr
    (`RESUME_HINT`, or an `Interrupted`'s own message) and exit status `INTERRUPTED_EXIT`, not a
    traceback, and promptly: when the KeyboardInterrupt has not unwound the stage within
    `grace_s` (XLA holds it until a compile or step returns), a watcher thread woken by the
    signal (`signal.set_wakeup_fd`) ends the process. Every stage's work is safe to stop at
    any point (index chunks, checkpoints, tail-patch pairs and retrievals are written
    atomically), so a rerun resumes.

    A SIGINT whose handler is not Python's default is left alone: training installs its own
    (`training.loop.StopRequest`) to save a checkpoint first. Outside the main thread this
    only converts the KeyboardInterrupt (signals reach the main thread only).
    """
    main = threading.current_thread() is threading.main_thread()
    done = threading.Event()
    old_fd = None
    if main:
        r, w = os.pipe()
        os.set_blocking(w, False)
        old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)

        def watch() -> None:
            try:
                while (b := os.read(r, 1)) and not done.is_set():
                    if b[0] != signal.SIGINT or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
                        continue  # SIGTERM kills by default; a handler of the stage's own decides
                    if not done.wait(grace_s):
                        _exit_interrupted(RESUME_HINT)
            finally:
                os.close(r)

        threading.Thread(target=watch, name="trackstar-interrupt-watch", daemon=True).start()
    try:
        yield
    except KeyboardInterrupt as e:
        done.set()
        _exit_interrupted(str(e) if isinstance(e, Interrupted) and str(e) else RESUME_HINT)
    finally:
        done.set()
        if main:
            signal.set_wakeup_fd(old_fd)
            os.close(w)  # the watcher reads end-of-file and stops
