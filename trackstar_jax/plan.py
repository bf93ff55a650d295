"""Cost planner (issue 14): what each stage needs per device, before anything runs.

Everything here works on abstract shapes (`jax.ShapeDtypeStruct`, `checkpoint.abstract_state`):
no parameter is allocated. Figures:
- parameter and optimizer-state bytes per device (the mesh's fsdp split, `sharding.fsdp_spec`);
- the compiled memory per device of the train, featurize (both paths; the configured one is
  what `build_index` runs), tail-patch and retrieval-scoring steps, from
  `jit(...).lower(abstract).compile().memory_analysis()` (`memory.compiled_memory`);
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
from jax.extend import core as jex_core

from trackstar_jax import config as config_lib
from trackstar_jax.distributed import memory
from trackstar_jax.distributed import sharding as sharding_lib
from trackstar_jax.evaluation import tailpatch as tailpatch_lib
from trackstar_jax.features import vectors as vectors_lib
from trackstar_jax.index import store as store_lib
from trackstar_jax.retrieval import topk as topk_lib
from trackstar_jax.training import checkpoint as checkpoint_lib
from trackstar_jax.training import importer as importer_lib
from trackstar_jax.training import step as step_lib

MEMORY_ENV, KNOBS, DoesNotFitError = memory.MEMORY_ENV, memory.KNOBS, memory.DoesNotFitError
check_fits, device_memory_limit = memory.check_fits, memory.device_memory_limit
# Bytes per stored vector element; int8 rows also keep one float32 scale per row.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


def with_imported_model(settings: config_lib.Settings) -> config_lib.Settings:
    """`settings` with the model an import config (`model.source`) brings: its arch and shapes
    from the source's header (config.json, GGUF or MaxText orbax metadata; no weights read), the user's dtypes
    and `max_len` (`config.resolve_imported_model`). Unchanged without `model.source`."""
    if not settings.model.source:
        return settings
    m = settings.model
    imported = importer_lib.read_source_config(
        m.source, dtype=m.dtype, param_dtype=m.param_dtype, maxtext=settings.maxtext
    )
    return dataclasses.replace(settings, model=config_lib.resolve_imported_model(m, imported, settings.source))


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


def train_step_memory(settings: config_lib.Settings, mesh: jax.sharding.Mesh) -> dict:
    """The compiled train step's memory per device (abstract state and batch; nothing allocated)."""
    opt = step_lib.make_optimizer(settings.train.optimizer)
    graphdef, target = checkpoint_lib.abstract_state(settings.model, opt, mesh)
    n = settings.train.global_batch_size
    batch = {
        k: jax.ShapeDtypeStruct((n,) + ((settings.model.max_len,) if k != "example_id" else ()), np.int32, sharding=sh)
        for k, sh in sharding_lib.batch_shardings(mesh).items()
    }
    compiled = step_lib.make_jit_train_step(graphdef, opt, mesh, target).lower(target, batch).compile()
    return memory.compiled_memory(compiled)


def featurize_step_memory(
    settings: config_lib.Settings, mesh: jax.sharding.Mesh, *, seq_len: int | None = None, path: str | None = None
) -> dict:
    """The compiled featurize step's memory per device (`vectors.featurize_step_memory`) for
    `vectors.batch_size` rows of `seq_len` tokens (default `model.max_len`) on `path` (default the
    configured one), from the abstract trained state: what `build_index` and query featurization run."""
    opt = step_lib.make_optimizer(settings.train.optimizer)
    graphdef, target = checkpoint_lib.abstract_state(settings.model, opt, mesh)
    vec_cfg = settings.vectors if path is None else dataclasses.replace(settings.vectors, path=path)
    return vectors_lib.featurize_step_memory(
        graphdef, settings.model, vec_cfg, target.params, target.opt_state, mesh, seq_len=seq_len
    )


def tailpatch_step_memory(settings: config_lib.Settings, mesh: jax.sharding.Mesh) -> dict:
    """The compiled tail-patch step's memory per device: `tailpatch.batch_size` proponents (rounded
    up to the data-parallel size, as `evaluate` does), each with `tailpatch.queries_per_step`
    queries, all of `model.max_len` tokens."""
    opt = step_lib.make_optimizer(settings.train.optimizer)
    graphdef, target = checkpoint_lib.abstract_state(settings.model, opt, mesh)
    bs = tailpatch_lib.pair_batch_size(settings.tailpatch.batch_size, mesh)
    lowrank = settings.train.optimizer if settings.tailpatch.step == "lowrank" else None
    fn = tailpatch_lib.make_jit_tailpatch(mesh, graphdef=graphdef, opt=opt, opt_cfg=lowrank)
    n = settings.model.max_len
    g = settings.tailpatch.queries_per_step
    out = memory.compiled_memory(tailpatch_lib.compile_tailpatch(fn, target.params, target.opt_state, bs, g, n, n))
    return {**out, "proponents": bs, "queries_per_step": g} if out else out


def retrieval_step_memory(
    settings: config_lib.Settings, mesh: jax.sharding.Mesh, *, num_examples: int, num_queries: int
) -> dict:
    """`topk.stream_memory` of `retrieve` over `num_examples` stored rows: one read chunk of
    `retrieval.read_chunk_rows` rows, the next (prefetched) one, a query batch and the candidates."""
    st = settings.retrieval
    return topk_lib.stream_memory(
        num_queries,
        settings.vectors.dim,
        store_lib.NP_DTYPES[settings.index.dtype],
        min(st.top_k, num_examples),
        st.read_chunk_rows,
        mesh,
        num_rows=num_examples,
        query_batch_size=st.query_batch_size,
    )


def index_bytes(num_examples: int, dim: int) -> dict:
    """Bytes of the stored vectors per storage dtype (int8 adds a float32 scale per row)."""
    return {dt: num_examples * dim * b + (4 * num_examples if dt == "int8" else 0) for dt, b in DTYPE_BYTES.items()}


def r_bytes(settings: config_lib.Settings) -> int:
    """Block-diagonal R (float32): one `block_dim^2` matrix per block, R_train and its inverse root."""
    num_blocks_total, block_dim = vectors_lib.block_layout(settings.vectors)
    return num_blocks_total * block_dim * block_dim * 4


def _jaxpr_dot_flops(jaxpr: Any) -> int:
    """`dot_flops` of one (open) jaxpr."""
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            k = math.prod(int(lhs[i]) for i in lhs_contract)
            total += 2 * math.prod(int(s) for s in eqn.outvars[0].aval.shape) * k
            continue
        subs = []
        for v in eqn.params.values():
            for item in v if isinstance(v, (tuple, list)) else (v,):
                if isinstance(item, jex_core.ClosedJaxpr):
                    subs.append(item.jaxpr)
                elif isinstance(item, jex_core.Jaxpr):
                    subs.append(item)
        if name == "cond":  # one branch runs: the costliest
            total += max((_jaxpr_dot_flops(j) for j in subs), default=0)
        elif name == "scan":
            total += int(eqn.params["length"]) * sum(_jaxpr_dot_flops(j) for j in subs)
        elif name == "while":
            raise ValueError("dot_flops: a while loop's trip count is not known from its jaxpr")
        else:  # pjit, custom_jvp / custom_vjp calls, remat, shard_map: their body once
            total += sum(_jaxpr_dot_flops(j) for j in subs)
    return total


def dot_flops(fn: Any, *args: Any) -> int:
    """FLOPs of the matrix products `fn(*args)` runs (2 per multiply-add of every
    `dot_general`, batch dimensions included), counted on its jaxpr: a scan counts its body
    `length` times, a cond its costliest branch. Element-wise work is not counted. XLA's
    `cost_analysis()` counts a loop's body once, which undercounts the chunked head (a scan).

    Dead code is removed first, as XLA removes it: a custom VJP's backward computes every
    input's gradient (`layers.lowp_matmul`'s weight gradient under a featurizer's input-only
    gradient), and what nothing reads never runs.

    Raises:
      ValueError: if `fn` runs a while loop (its trip count is not in the jaxpr).
    """
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    # private: jax has no public DCE of a jaxpr (nested scans / pjits pruned by its rules)
    from jax._src.interpreters import partial_eval as pe

    jaxpr, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    return _jaxpr_dot_flops(jaxpr)


def calibrate(
    seconds: float = 0.5, matmuls: tuple[tuple[int, int, int], ...] = ((1024, 1024, 1024),), dtype: str = "float32"
) -> dict:
    """Measured on the present default device, each rate the best call within `seconds`:
    `flops_per_s` (the best `[m, k] @ [k, n]` over `matmuls`, operands in `dtype`, accumulated
    and returned in float32; each shape's in `flops_per_s_by_shape`, keyed `"MxKxN"`) and
    `bytes_per_s` (a jitted sum of 128 MiB)."""
    mm = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    big = jnp.ones((32 << 20,), jnp.float32)  # 128 MiB: beyond the caches
    sm = jax.jit(jnp.sum)

    def best_rate(fn, args, work):
        jax.block_until_ready(fn(*args))
        best, t_end = math.inf, time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            best = min(best, time.perf_counter() - t0)
        return work / best

    by_shape = {}
    for m, k, n in matmuls:
        a, b = jnp.ones((m, k), dtype), jnp.ones((k, n), dtype)
        by_shape[f"{m}x{k}x{n}"] = best_rate(mm, (a, b), 2 * m * k * n)
    return {
        "flops_per_s": max(by_shape.values()),
        "flops_per_s_by_shape": by_shape,
        "bytes_per_s": best_rate(sm, (big,), big.nbytes),
    }


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
    compile_steps: bool = True,
) -> dict:
    """Every figure of the planner as one dict (see the module docstring).

    Time estimates: featurizing costs about one training step per example (forward + backward,
    ~6 x params FLOPs per token; the projection is small next to it) spread over every device
    of the mesh; retrieval reads every index row once per query batch (memory-bound: bytes /
    bandwidth), spread over every device.
    """
    settings = with_imported_model(settings)
    devices = int(mesh.devices.size)
    st = state_bytes(settings, mesh)
    d = settings.vectors.dim
    idx = index_bytes(num_examples, d)
    stored = idx[settings.index.dtype]
    qbs = settings.retrieval.query_batch_size
    featurize_flops = 6 * st["num_params"] * num_examples * tokens_per_example
    out = {
        "devices": devices,
        "mesh": dict(mesh.shape),
        "model": {
            "arch": settings.model.arch,
            "source": settings.model.source,
            "num_layers": settings.model.num_layers,
        },
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
    if compile_steps:
        # A batch the mesh cannot split is reported (naming the knob and the nearest size that
        # splits) in place of that step's memory, as the stage would refuse it.
        bad_train = sharding_lib.batch_split_error(
            settings.train.global_batch_size, mesh, "config.train.global_batch_size"
        )
        out["train_step"] = {"error": bad_train} if bad_train else train_step_memory(settings, mesh)
        # Featurize: the configured path is the one `build_index` runs (and checks); the other for comparison.
        paths = (settings.vectors.path,) + tuple(p for p in vectors_lib.PATHS if p != settings.vectors.path)
        bad_vec = sharding_lib.batch_split_error(settings.vectors.batch_size, mesh, "config.vectors.batch_size")
        out["featurize_step"] = {
            p: {"error": bad_vec} if bad_vec else featurize_step_memory(settings, mesh, path=p) for p in paths
        }
        out["featurize_step"]["configured"] = settings.vectors.path
        out["tailpatch_step"] = tailpatch_step_memory(settings, mesh)
        out["retrieval_step"] = retrieval_step_memory(
            settings, mesh, num_examples=num_examples, num_queries=num_queries
        )
    return out


def _duration(seconds: float) -> str:
    """`seconds` in the unit that reads best (s, min, hours, days)."""
    for unit, size in (("days", 86_400), ("hours", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.3g} s"


def summary(out: dict) -> list[str]:
    """The figures of a `plan(...)` result in human units (bytes as GiB / MiB, times as s / min /
    hours / days), one line each: what `launch.plan` prints beside the JSON."""
    fb, m = memory.format_bytes, out["model"]
    source = f" imported from {m['source']}" if m["source"] else ""
    lines = [
        f"model: {m['arch']}{source}, {out['num_params'] / 1e6:.1f}M parameters, {m['num_layers']} layers",
        f"mesh: {out['mesh']} ({out['devices']} devices)",
        f"parameters: {fb(out['params']['total_bytes'])}, {fb(out['params']['per_device_bytes'])} per device; "
        f"optimizer state: {fb(out['opt_state']['total_bytes'])}, {fb(out['opt_state']['per_device_bytes'])} per device",
        f"index (d = {out['dim']}): "
        + ", ".join(f"{dt} {fb(b)}" for dt, b in out["index_bytes"].items())
        + f"; configured {out['index_dtype']}; R {fb(out['r_bytes'])}",
        f"featurize (build_index): about {_duration(out['featurize_seconds'])} on the mesh ({out['rates']['source']})",
        f"retrieval: about {_duration(out['retrieval_seconds_per_1k_queries'])} per 1000 queries",
    ]
    pk = peaks(out)
    if pk:
        lines.append("peak memory per device: " + ", ".join(f"{step} {fb(b)}" for step, b in pk.items()))
    lines += [f"cannot run as configured: {e}" for e in errors(out)]
    return lines


def errors(out: dict) -> list[str]:
    """The steps of a `plan(...)` result that cannot run as configured (each names its knob)."""
    steps = [out.get("train_step", {}), *out.get("featurize_step", {}).values()]
    return sorted({st["error"] for st in steps if isinstance(st, dict) and st.get("error")})


def peaks(out: dict) -> dict[str, int]:
    """`{step: peak bytes per device}` of a `plan(...)` result, for `memory.KNOBS` steps (the
    featurize step on the configured path): what `launch.plan` warns about and the stages refuse."""
    found = {
        "train": out.get("train_step", {}).get("peak_bytes"),
        "featurize": out.get("featurize_step", {})
        .get(out.get("featurize_step", {}).get("configured"), {})
        .get("peak_bytes"),
        "tailpatch": out.get("tailpatch_step", {}).get("peak_bytes"),
        "retrieve": out.get("retrieval_step", {}).get("peak_bytes"),
    }
    return {k: v for k, v in found.items() if v is not None}


__all__ = (
    "plan",
    "peaks",
    "errors",
    "summary",
    "with_imported_model",
    "calibrate",
    "check_fits",
    "state_bytes",
    "train_step_memory",
    "featurize_step_memory",
    "tailpatch_step_memory",
    "retrieval_step_memory",
    "index_bytes",
    "r_bytes",
)
