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

import logging
import os
import pathlib

import jax
from absl import logging as absl_logging

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
