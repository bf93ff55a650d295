"""Device memory limits: what a step may use per device, and the refusal that names the knob.

The limit is `TRACKSTAR_JAX_DEVICE_MEMORY_BYTES` when set (a forced limit: tests, or a share of
a device), else the device's own `bytes_limit` where JAX reports one (GPU / TPU), else none (CPU).
The planner (`trackstar_jax.plan`) and the stages (the train step, checked once it is compiled,
before the first step) use the same check.
"""

from __future__ import annotations

import os

import jax

MEMORY_ENV = "TRACKSTAR_JAX_DEVICE_MEMORY_BYTES"
# Knobs that lower each step's memory per device, named in warnings and refusals.
KNOBS = {
    "train": "config.train.global_batch_size (fewer rows per device), config.mesh.shape with a larger fsdp axis "
    "(e.g. --config.mesh.shape='(1,-1,1)'), config.model.dtype",
    "featurize": "config.vectors.batch_size, config.mesh.shape with a larger fsdp axis",
    "tailpatch": "config.tailpatch.batch_size (each pair holds a parameter copy), a larger fsdp axis",
    "retrieve": "config.retrieval.read_chunk_rows, config.retrieval.query_batch_size, config.index.dtype",
}


class DoesNotFitError(RuntimeError):
    """A step needs more device memory than the limit; the message names the knob."""


def device_memory_limit() -> int | None:
    """`TRACKSTAR_JAX_DEVICE_MEMORY_BYTES`, else this process's first device's `bytes_limit`, else
    None (CPU). A local device: on a pod, `jax.devices()[0]` may belong to another process, whose
    memory stats cannot be read from here."""
    if os.environ.get(MEMORY_ENV):
        return int(float(os.environ[MEMORY_ENV]))
    stats = jax.local_devices()[0].memory_stats() or {}
    return int(stats["bytes_limit"]) if "bytes_limit" in stats else None


def check_fits(step: str, peak_bytes: int, limit: int | None = None) -> None:
    """Raises `DoesNotFitError` (naming the knobs of `step`) when `peak_bytes` exceed the limit."""
    limit = device_memory_limit() if limit is None else limit
    if limit is not None and peak_bytes > limit:
        raise DoesNotFitError(
            f"the {step} step needs {peak_bytes / 2**30:.3f} GiB per device, more than the "
            f"{limit / 2**30:.3f} GiB limit ({MEMORY_ENV} or the device's own): lower {KNOBS[step]}"
        )
