"""Mesh construction and sharding specs: the only place that creates a `Mesh`.

Axis names are fixed constants so that the same code runs on 1 CPU and on a pod; a size-1
axis costs nothing. `make_mesh` always passes `axis_types` explicitly (jax.make_mesh defaults
to Explicit axes on jax >= 0.10, which changes how top_k and reshard behave).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA, FSDP, TENSOR = "data", "fsdp", "tensor"
AXES = (DATA, FSDP, TENSOR)

# logical axis -> mesh axes (t5x / lm1b form) for batches and index rows, split over
# (data, fsdp). Parameters and optimizer state are placed by shape with `fsdp_spec` below
# (replicated unless the fsdp axis is > 1), not by these rules.
LOGICAL_AXIS_RULES = (
    ("batch", (DATA, FSDP)),
    ("example", (DATA, FSDP)),
    ("embed", None),
    ("mlp", None),
    ("heads", None),
    ("kv", None),
    ("vocab", None),
    ("length", None),
    ("proj", None),
)


@dataclasses.dataclass(frozen=True)
class MeshSettings:
    """`config.mesh`: `shape` (data, fsdp, tensor); -1 = all remaining devices."""

    shape: tuple[int, ...] = (-1, 1, 1)


def make_mesh(
    shape: Sequence[int] | None = None,
    axis_names: Sequence[str] = AXES,
    devices: Sequence[jax.Device] | None = None,
    axis_type: AxisType = AxisType.Auto,
) -> Mesh:
    """Builds a device mesh over `axis_names`.

    Args:
      shape: sizes per axis; `None` or a `-1` entry puts all (remaining) devices there,
        default `(num_devices, 1, 1)` = pure data parallelism.
      axis_names: mesh axis names, by default `("data", "fsdp", "tensor")`.
      devices: devices to use (default: all of `jax.devices()`).
      axis_type: axis type for every axis (Auto by default: XLA propagates shardings).

    Returns:
      A `jax.sharding.Mesh`.

    Raises:
      ValueError: if the shape does not multiply out to the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if shape is None:
        shape = (n,) + (1,) * (len(axis_names) - 1)
    shape = list(shape)
    if len(shape) != len(axis_names):
        raise ValueError(f"mesh shape {shape} does not match axis names {tuple(axis_names)}")
    if shape.count(-1) > 1:
        raise ValueError(f"mesh shape {shape} has more than one -1")
    if -1 in shape:
        rest = int(np.prod([s for s in shape if s != -1]))
        if n % rest:
            raise ValueError(f"cannot fill mesh shape {shape} with {n} devices")
        shape[shape.index(-1)] = n // rest
    if int(np.prod(shape)) != n:
        raise ValueError(f"mesh shape {tuple(shape)} needs {int(np.prod(shape))} devices, have {n}")
    return jax.make_mesh(tuple(shape), tuple(axis_names), axis_types=(axis_type,) * len(axis_names), devices=devices)


def logical_to_spec(logical: Sequence[str | None]) -> P:
    """Maps logical axis names to a PartitionSpec with `LOGICAL_AXIS_RULES`."""
    rules = dict(LOGICAL_AXIS_RULES)
    return P(*[rules.get(name) if name is not None else None for name in logical])


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Sharding of a batch array `[batch, ...]`: leading axis over (data, fsdp)."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1)))


def replicated(mesh: Mesh) -> NamedSharding:
    """Fully replicated sharding on `mesh`."""
    return NamedSharding(mesh, P())


# Arrays with fewer elements than this stay replicated under `fsdp_spec` (biases, norm scales,
# Adafactor's factored v_row / v_col of small models): splitting them saves nothing and adds
# a collective per use.
FSDP_MIN_ELEMENTS = 256


def fsdp_spec(shape: Sequence[int], mesh: Mesh, min_elements: int = FSDP_MIN_ELEMENTS) -> P:
    """PartitionSpec of one parameter or optimizer-state array under FSDP on `mesh`.

    Replicated (`P()`) when the mesh's `fsdp` axis has size 1, when the array has fewer than
    `min_elements` elements, or when no dimension is divisible by the fsdp size; otherwise
    split over `fsdp` along its largest divisible dimension (the later one among equals).
    The rule depends only on the array's own shape, so Adafactor's `v_row` / `v_col` (other
    shapes than their parameter) get specs of their own.
    """
    n = int(mesh.shape[FSDP])
    shape = tuple(int(d) for d in shape)
    if n <= 1 or int(np.prod(shape, dtype=np.int64)) < min_elements:
        return P()
    dims = [int(i) for i in np.argsort(shape)[::-1] if shape[i] % n == 0]
    if not dims:
        return P()
    spec = [None] * len(shape)
    spec[dims[0]] = FSDP
    return P(*spec)


def fsdp_shardings(tree: Any, mesh: Mesh, min_elements: int = FSDP_MIN_ELEMENTS) -> Any:
    """`NamedSharding` per leaf of `tree` (arrays or ShapeDtypeStructs) by `fsdp_spec`:
    all replicated on a mesh whose fsdp axis has size 1."""
    return jax.tree.map(
        lambda x: NamedSharding(mesh, fsdp_spec(x.shape if hasattr(x, "shape") else np.shape(x), mesh, min_elements)),
        tree,
    )


def data_parallel_size(mesh: Mesh) -> int:
    """Number of shards the batch axis is split into."""
    return int(mesh.shape[DATA] * mesh.shape[FSDP])


def batch_split_error(batch_size: int, mesh: Mesh, knob: str) -> str | None:
    """Why `batch_size` rows cannot be split over the mesh's data-parallel shards (None: they can).

    The message names `knob` (e.g. "config.vectors.batch_size") and the nearest size that splits.
    """
    dp = data_parallel_size(mesh)
    if batch_size % dp == 0:
        return None
    lower = batch_size // dp * dp
    nearest = lower + dp if lower == 0 or batch_size - lower >= lower + dp - batch_size else lower
    return (
        f"{knob}={batch_size} is not divisible by the {dp} data-parallel shards of mesh {dict(mesh.shape)}: "
        f"set it to a multiple of {dp} (the nearest is {nearest}), or shrink the data axes (config.mesh.shape)"
    )


def batch_shardings(mesh: Mesh) -> dict[str, NamedSharding]:
    """Shardings of a batch dict (rows over the data axes)."""
    return {
        "tokens": batch_sharding(mesh, 2),
        "loss_mask": batch_sharding(mesh, 2),
        "example_id": batch_sharding(mesh, 1),
    }


def device_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Places a global host batch on `mesh`.

    On a mesh that spans several processes (multi-host training) every process reads the
    same global batch (the loaders are deterministic) and places the rows its own devices
    hold, whatever the order of the mesh's devices. A process-local mesh (index building on
    a pod: one writer per host) takes the batch as it is.
    """
    sh = batch_shardings(mesh)
    if mesh.is_multi_process:
        return {k: jax.make_array_from_callback(v.shape, sh[k], lambda idx, v=v: v[idx]) for k, v in batch.items()}
    return {k: jax.device_put(v, sh[k]) for k, v in batch.items()}


def put_global(x: Any, sharding: NamedSharding) -> jax.Array:
    """A host array (the same full value on every process) placed in `sharding`.

    On a mesh that spans several processes each process places only the pieces its own devices
    hold (`make_array_from_callback`); on a process-local mesh this is `jax.device_put`.
    """
    x = np.asarray(x)
    if sharding.mesh.is_multi_process:
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])
    return jax.device_put(x, sharding)


def to_host(tree: Any) -> Any:
    """Every leaf as a full numpy array on every process (an all-gather across processes when
    a leaf is split over devices of other processes; plain `np.asarray` otherwise)."""

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils  # noqa: PLC0415  (only multi-process runs need it)

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(one, tree)
