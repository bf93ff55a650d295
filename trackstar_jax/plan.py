"""Cost planner (issue 14): what each stage needs per device, before anything runs.

Everything here works on abstract shapes (`jax.ShapeDtypeStruct`, `checkpoint.abstract_state`):
no parameter is allocated. Figures:
- parameter and optimizer-state bytes per device (the mesh's fsdp split, `sharding.fsdp_spec`);
- the compiled train step's memory per device, from `jit(...).lower(abstract).compile().memory_analysis()`;
- index bytes per storage dtype, R bytes, bytes read per retrieval query batch;
- time estimates from a short calibration on the present hardware (a float32 matmul for
  FLOP/s, a jitted sum for memory bandwidth) or from rates the caller states.

`device_memory_limit()` reads `TRACKSTAR_JAX_DEVICE_MEMORY_BYTES` (or the device's own limit
where JAX reports one); `check_fits` raises `DoesNotFitError` naming the knob to turn.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trackstar_jax import config as config_lib
from trackstar_jax.distributed import memory
from trackstar_jax.distributed import sharding as sharding_lib
from trackstar_jax.features import vectors as vectors_lib
from trackstar_jax.training import checkpoint as checkpoint_lib
from trackstar_jax.training import step as step_lib

MEMORY_ENV, KNOBS, DoesNotFitError = memory.MEMORY_ENV, memory.KNOBS, memory.DoesNotFitError
check_fits, device_memory_limit = memory.check_fits, memory.device_memory_limit
# Bytes per stored vector element; int8 rows also keep one float32 scale per row.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


def tree_bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs carrying shardings (the largest shard)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


def state_bytes(settings: config_lib.Settings, mesh: jax.sharding.Mesh) -> dict:
    """`{"params", "opt_state"}`: total bytes and bytes per device on `mesh`."""
    opt = step_lib.make_optimizer(settings.train.optimizer)
    _, state = checkpoint_lib.abstract_state(settings.model, opt, mesh)
    out = {}
    for name, tree in (("params", state.params), ("opt_state", state.opt_state)):
        total = sum(int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
        out[name] = {"total_bytes": total, "per_device_bytes": tree_bytes_per_device(tree)}
    out["num_params"] = sum(int(np.prod(x.shape, dtype=np.int64)) for x in jax.tree.leaves(state.params))
    return out


def _memory(compiled) -> dict:
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


def train_step_memory(settings: config_lib.Settings, mesh: jax.sharding.Mesh) -> dict:
    """The compiled train step's memory per device (abstract state and batch; nothing allocated)."""
    opt = step_lib.make_optimizer(settings.train.optimizer)
    graphdef, target = checkpoint_lib.abstract_state(settings.model, opt, mesh)
    n = settings.train.global_batch_size
    batch = {
        k: jax.ShapeDtypeStruct((n,) + ((settings.model.max_len,) if k != "example_id" else ()), np.int32, sharding=sh)
        for k, sh in sharding_lib.batch_shardings(mesh).items()
    }
    return _memory(step_lib.make_jit_train_step(graphdef, opt, mesh, target).lower(target, batch).compile())


def index_bytes(num_examples: int, dim: int) -> dict:
    """Bytes of the stored vectors per storage dtype (int8 adds a float32 scale per row)."""
    return {dt: num_examples * dim * b + (4 * num_examples if dt == "int8" else 0) for dt, b in DTYPE_BYTES.items()}


def r_bytes(settings: config_lib.Settings) -> int:
    """Block-diagonal R (float32): one `block_dim^2` matrix per block, R_train and its inverse root."""
    num_blocks_total, block_dim = vectors_lib.block_layout(settings.vectors)
    return num_blocks_total * block_dim * block_dim * 4


def calibrate(seconds: float = 0.5) -> dict:
    """Measured on the present default device: float32 matmul FLOP/s and jitted-sum bytes/s."""
    n = 1024
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    big = jnp.ones((32 << 20,), jnp.float32)  # 128 MiB: beyond the caches
    sm = jax.jit(jnp.sum)
    mm(a).block_until_ready(), sm(big).block_until_ready()
    rates = {}
    for name, fn, arg, work in (("flops_per_s", mm, a, 2 * n**3), ("bytes_per_s", sm, big, big.nbytes)):
        best, t_end = math.inf, time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            fn(arg).block_until_ready()
            best = min(best, time.perf_counter() - t0)
        rates[name] = work / best
    return rates


@dataclasses.dataclass(frozen=True)
class Rates:
    """Hardware rates for the time estimates (per device)."""

    flops_per_s: float
    bytes_per_s: float
    source: str  # "measured on <device>" or "stated"


def plan(
    settings: config_lib.Settings,
    mesh: jax.sharding.Mesh,
    *,
    num_examples: int,
    tokens_per_example: int,
    rates: Rates,
    num_queries: int = 1000,
    compile_train: bool = True,
) -> dict:
    """Every figure of the planner as one dict (see the module docstring).

    Time estimates: featurizing costs about one training step per example (forward + backward,
    ~6 x params FLOPs per token; the projection is small next to it) spread over every device
    of the mesh; retrieval reads every index row once per query batch (memory-bound: bytes /
    bandwidth), spread over every device.
    """
    devices = int(mesh.devices.size)
    st = state_bytes(settings, mesh)
    d = settings.vectors.dim if hasattr(settings.vectors, "dim") else None
    num_blocks_total, block_dim = vectors_lib.block_layout(settings.vectors)
    d = num_blocks_total * block_dim
    idx = index_bytes(num_examples, d)
    stored = idx[settings.index.dtype]
    qbs = settings.retrieval.query_batch_size
    featurize_flops = 6 * st["num_params"] * num_examples * tokens_per_example
    out = {
        "devices": devices,
        "mesh": dict(mesh.shape),
        "num_params": st["num_params"],
        "params": st["params"],
        "opt_state": st["opt_state"],
        "dim": d,
        "index_bytes": idx,
        "index_dtype": settings.index.dtype,
        "r_bytes": r_bytes(settings),
        "retrieval_bytes_per_query_batch": stored,
        "retrieval_bytes_per_query_batch_per_device": stored // devices,
        "rates": dataclasses.asdict(rates),
        "featurize_flops": featurize_flops,
        "featurize_seconds": featurize_flops / (rates.flops_per_s * devices),
        "retrieval_seconds_per_1k_queries": math.ceil(num_queries / qbs) * stored / (rates.bytes_per_s * devices),
    }
    if compile_train:
        out["train_step"] = train_step_memory(settings, mesh)
    return out


__all__ = ("plan", "calibrate", "check_fits", "state_bytes", "train_step_memory", "index_bytes", "r_bytes")
