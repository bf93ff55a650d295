"""Device memory limits: what a step may use per device, and the refusal that names the knob.

The limit is `TRACKSTAR_JAX_DEVICE_MEMORY_BYTES` when set (a forced limit: tests, or a share of
a device), else the device's own `bytes_limit` where JAX reports one (GPU / TPU), else none (CPU).
The planner (`trackstar_jax.plan`) and the stages use the same check, each on its step's
compiled memory (`compiled_memory`: XLA's `memory_analysis()` of the step AOT-compiled on
abstract shapes): the train step before the first step; the featurize step
(`features.vectors.VectorFn.check_fits`) before `build_index` writes anything and before
`retrieve` / `evaluate` featurize a query; the tail-patch step (`evaluation.tailpatch.check_fits`)
and the retrieval scoring step (`retrieval.topk.check_fits`) before `evaluate` / `retrieve` do
any work. `build_index` and `evaluate` check only where a limit is known: without one nothing
can be refused, and their checks compile programs the stage may never run (evaluate's never).
"""

from __future__ import annotations

import os
from typing import Any

import jax

MEMORY_ENV = "TRACKSTAR_JAX_DEVICE_MEMORY_BYTES"
# Knobs that lower each step's memory per device, named in warnings and refusals.
KNOBS = {
    "train": "config.train.global_batch_size (fewer rows per device), config.mesh.shape with a larger fsdp axis "
    "(e.g. --config.mesh.shape='(1,-1,1)'), config.model.remat=True (activations of one layer), config.model.dtype",
    "featurize": "config.vectors.batch_size (fewer rows per device), config.mesh.shape with a larger fsdp axis "
    "(e.g. --config.mesh.shape='(1,-1,1)'), config.vectors.path='fast' (the reference path materialises "
    "per-example gradients), config.model.remat=True, config.model.dtype",
    "tailpatch": "config.tailpatch.batch_size (proponents per step; the dense step holds a parameter copy "
    "each), config.tailpatch.step='lowrank', config.mesh.shape with a larger fsdp axis, "
    "config.model.remat=True, config.model.dtype",
    "retrieve": "config.retrieval.read_chunk_rows (index rows on the devices at once), "
    "config.retrieval.query_batch_size, config.index.dtype (narrower stored rows)",
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


def format_bytes(n: int) -> str:
    """`n` bytes in GiB, MiB or bytes, whichever reads best."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.3f} {unit}"
    return f"{int(n)} bytes"


def compiled_memory(compiled: Any) -> dict:
    """Per-device bytes of a compiled step (`jit(f).lower(...).compile()`): its arguments, outputs,
    temporaries, aliased (donated) bytes and `peak_bytes` = arguments + outputs + temporaries -
    aliased, what XLA holds at once for one call. `{}` where the backend gives no analysis."""
    m = compiled.memory_analysis()
    if m is None:
        return {}
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return {
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
        "alias_bytes": int(m.alias_size_in_bytes),
        "peak_bytes": int(peak),
    }


def check_fits(step: str, peak_bytes: int | None, limit: int | None = None, what: str = "") -> None:
    """Raises `DoesNotFitError` (naming the knobs of `step`) when `peak_bytes` exceed the limit
    (None: no analysis, nothing to check). `what` details the step in the message (its shapes)."""
    limit = device_memory_limit() if limit is None else limit
    if peak_bytes is not None and limit is not None and peak_bytes > limit:
        detail = f" ({what})" if what else ""
        raise DoesNotFitError(
            f"the {step} step{detail} needs {format_bytes(peak_bytes)} per device, more than the "
            f"{format_bytes(limit)} limit ({MEMORY_ENV} or the device's own): lower {KNOBS[step]}"
        )
