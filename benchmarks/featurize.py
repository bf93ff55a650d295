"""Featurization throughput and memory: training step vs fast factored path vs reference path vs a
TRAK-style baseline, side by side in one process. One JSON object per line: one per path, printed
the moment it is measured (`"path"`: train | fast | reference | trak; `compile_s` apart from
`step_s`; GEMM FLOP/s and `peak_fraction` of the chip's peak at the precision the GEMMs ran,
`benchmarks/device_peaks.py`), then a `"path": "summary"` row per (config, dtype, d) with the ratios.
The train step is measured once per (config, dtype), for the first d.

    python -m benchmarks.featurize [--configs tiny,small] [--dims 4096,65536] [--steps 5]
        [--paths train,fast,reference,trak] [--dtypes float32,bfloat16] [--precision float32]
    python -m benchmarks.featurize --rank1_workdir=RUN [--rank1_rows 256]

The second form measures what the fast path's rank-one V costs where optax kept a full
second moment: on the first rows of a trained run's corpus, fast vectors (rank-one V) vs the
exact reference (element-wise V): relative error, per-row cosine and top-10 neighbour
overlap after unit normalisation (see `rank_one_gap`).

* train: the project's jitted train step (`training.step.make_jit_train_step`, state donated).
* fast: `vectors.jit_vector_step` with path="fast" (what the index builder runs).
* reference: the same step with path="reference" (vmap(grad), materialised gradients).
* trak: TRAK without its CUDA kernel: per-example gradients (vmap(grad)), flattened, times a
  dense Gaussian `[|theta|, d]` projection generated chunk by chunk on the fly (as
  MadryLab/trak's BasicProjector does). Its cost is |theta| * d per batch for generating P
  plus |theta| * d per example; it runs on `--trak_batch` examples, and, when the whole
  projection would take too long, on the first `--trak_max_chunks` chunks of P and is
  extrapolated linearly in the number of chunks (every chunk does identical work): the row
  then says `trak_chunks_timed` < `trak_chunks_total`.

Every path sees the same `[batch, seq_len]` batch of random tokens with every position after
BOS a target (a training example), after a compile and a warm-up call. tokens/s counts all
`batch * seq_len` positions. Peak bytes = the compiled executable's
`memory_analysis()`: arguments + outputs + temporaries - aliased (donated) bytes, i.e. what
XLA must hold at once for one call. `*_peak_bytes_2x_batch` compiles (does not run) each step
at twice the batch, to show how memory scales with batch.

GEMM FLOPs per token (`*_gemm_flops_per_token`, `plan.dot_flops` on each step's jaxpr: every
matrix product, the chunked head's scan counted per chunk): `fast_over_train_gemm_flops` =
train / fast is the fast / train ratio equal GEMM efficiency would give. The fast step skips the
training step's weight gradients (4 FLOPs per weight per token, not 6, so at most 1.5x) and
adds the projections, which at large d on a small model cost more than the skipped gradients.

d = 2 * num_blocks * k^2: the config's num_blocks when d allows an integer k, otherwise the
largest num_blocks <= num_layers that does (recorded in the row).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import device_peaks
from trackstar_jax import config as config_lib
from trackstar_jax import plan as plan_lib
from trackstar_jax import stages
from trackstar_jax.distributed import sharding
from trackstar_jax.distributed import sharding as sharding_lib
from trackstar_jax.features import grads, vectors

# "medium": the largest config that fits this benchmark's time budget on a 2-core CPU.
from trackstar_jax.models import lm as model_lib
from trackstar_jax.training import loop
from trackstar_jax.training import step as step_lib
from trackstar_jax.training import step as train

EXTRA_CONFIGS = {
    "medium": dict(base="small", model=dict(num_layers=8, embed_dim=512, num_heads=8, head_dim=64, mlp_dim=2048)),
    # 70M class (pythia-70m's widths and vocabulary, this project's architecture: 8 layers so
    # that d = 2^16 is the paper's 8 blocks x 64^2 x 2; ~60M parameters)
    "m70": dict(
        base="small",
        model=dict(num_layers=8, embed_dim=512, num_heads=8, head_dim=64, mlp_dim=2048, vocab_size=50_304, max_len=512),
    ),
    # toy size for the accelerator script's --smoke (CPU, seconds)
    "toy": dict(base="tiny", model=dict(num_layers=2, embed_dim=32, num_heads=2, head_dim=16, mlp_dim=64, max_len=16)),
}


def _config(name: str):
    if name in EXTRA_CONFIGS:
        spec = EXTRA_CONFIGS[name]
        config = importlib.import_module(f"experiments.{spec['base']}").get_config()
        for k, v in spec["model"].items():
            setattr(config.model, k, v)
        return config
    return importlib.import_module(f"experiments.{name}").get_config()


def _num_blocks(d: int, preferred: int, num_layers: int) -> int:
    for nb in [preferred] + list(range(num_layers, 0, -1)):
        if 1 <= nb <= num_layers:
            try:
                vectors.projection_dim_for(d, nb)
                return nb
            except ValueError:
                pass
    raise ValueError(f"no num_blocks <= {num_layers} gives an integer k for d={d}")


def _peak(compiled) -> int:
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def _time(fn, args, steps: int, donate_first: bool = False) -> float:
    """Median seconds per call after one warm-up call (blocks on every call)."""
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(steps):
        if donate_first:
            args = (out[0],) + tuple(args[1:])
        t0 = time.perf_counter()
        out = fn(*args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _batch(b: int, t: int, vocab: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(4, vocab, (b, t)).astype(np.int32)
    tokens[:, 0] = 2  # BOS
    mask = np.ones((b, t), np.int32)
    mask[:, 0] = 0
    return {"tokens": tokens, "loss_mask": mask, "example_id": np.arange(b, dtype=np.int32)}


def trak_style_vectors(params, batch, key, *, graphdef, plan, d: int, chunk: int, num_chunks: int):
    """TRAK-style features: flattened per-example gradient x dense N(0, 1/d) projection made on the fly.

    Processes the first `num_chunks` chunks of `chunk` gradient coordinates (all of them when
    `num_chunks` covers |theta|); each chunk's `[chunk, d]` block of P is generated from
    `fold_in(key, chunk_index)`, used, and dropped.

    `key` is an argument, not a constant of the program: XLA could otherwise fold a chunk's
    threefry stream into the executable at compile time.

    Returns:
      `[B, d]` float32.
    """
    g = grads.per_example_grads(params, batch, plan, graphdef=graphdef)
    flat = jnp.concatenate([g[p].reshape(g[p].shape[0], -1) for p in plan.paths], axis=1)
    b, n = flat.shape
    flat = jnp.pad(flat, ((0, 0), (0, num_chunks * chunk - n))) if num_chunks * chunk > n else flat

    def body(i, acc):
        block = jax.random.normal(jax.random.fold_in(key, i), (chunk, d), jnp.float32) / math.sqrt(d)
        return acc + jax.lax.dynamic_slice_in_dim(flat, i * chunk, chunk, axis=1) @ block

    return jax.lax.fori_loop(0, num_chunks, body, jnp.zeros((b, d), jnp.float32))


_START = time.perf_counter()


def _progress(msg: str) -> None:
    """A timestamped stage line on stderr: a part killed at its limit (accelerator.sh) still shows
    in its log where the time went (compile, FLOP count, timing)."""
    print(f"[featurize +{time.perf_counter() - _START:.1f}s] {msg}", file=sys.stderr, flush=True)


def _emit(row: dict) -> dict:
    row = {k_: (float(f"{v:.5g}") if isinstance(v, float) else v) for k_, v in row.items()}
    print(json.dumps(row), flush=True)
    return row


def _compiled(fn_lowered):
    """`(compiled, compile seconds)`."""
    t0 = time.perf_counter()
    c = fn_lowered.compile()
    return c, time.perf_counter() - t0


def _rates(path, compile_s, secs, flops, peak_bytes, tokens, gemm_prec) -> dict:
    """A path's timing fields: compile apart from the step, tokens/s, GEMM FLOP/s and its fraction
    of the chip's peak at the precision the GEMMs ran (`device_peaks`)."""
    row = dict(path=path, compile_s=compile_s, step_s=secs, tokens_per_s=tokens / secs)
    if flops is not None:
        row.update(gemm_flops_per_token=flops / tokens, gemm_flops_per_s=flops / secs, gemm_precision=gemm_prec)
        row.update(device_peaks.fraction(flops / secs, gemm_prec))
    if peak_bytes is not None:
        row["peak_bytes"] = peak_bytes
    return row


_TRAINED: dict = {}


def _trained(config, name: str, b: int, t: int, timed: bool, steps: int, memory_2x: int, gemm_prec: str) -> dict:
    """The model after one train step (a realistic, non-zero V for the correction), made once per
    (config, dtype, batch shape) and shared by every d; with `timed` the train step is measured
    and its line printed (once)."""
    key = (name, config.model.dtype, b, t)
    if key in _TRAINED:
        return _TRAINED[key]
    model_cfg = config_lib.from_configdict(config).model
    opt = train.make_optimizer(config_lib.from_configdict(config).train.optimizer)
    mesh = sharding.make_mesh()
    graphdef, state = loop.init_train_state(model_cfg, opt, 0, mesh)
    host = _batch(b, t, model_cfg.vocab_size)
    batch = sharding_lib.device_batch(host, mesh)
    dev = jax.devices()[0]
    base = {
        "bench": "featurize",
        "config": name,
        "batch": b,
        "seq_len": t,
        "operand_dtype": model_cfg.matmul_dtype or model_cfg.dtype,
        "params": model_lib.param_count(state.params),
        "attributed_params": model_lib.param_count(
            {
                p: x
                for p, x in model_lib.flat_params(state.params).items()
                if p in model_lib.attributed_paths(state.params)
            }
        ),
        "device": f"{dev.platform}:{dev.device_kind} x{jax.device_count()}",
    }
    step = step_lib.make_jit_train_step(graphdef, opt, mesh, state)
    _progress(f"{name} {model_cfg.dtype}: train step compiling")
    train_c, compile_s = _compiled(step.lower(state, batch))
    _progress(f"train step compiled in {compile_s:.1f} s")
    summary = {}
    row = {"train_peak_bytes": _peak(train_c)}
    if timed and memory_2x:
        big = sharding_lib.device_batch(_batch(2 * b, t, model_cfg.vocab_size), mesh)
        row["train_peak_bytes_2x_batch"] = _peak(step.lower(state, big).compile())
    state, _ = train_c(state, batch)
    params = jax.tree.map(jnp.copy, state.params)  # the timed train steps donate `state`
    opt_state = jax.tree.map(jnp.copy, state.opt_state)
    if timed:
        train_flops = plan_lib.dot_flops(step, state, batch)
        train_s = _time(train_c, (state, batch), steps, donate_first=True)
        out = _emit(
            {
                **base,
                **_rates("train", compile_s, train_s, train_flops, row["train_peak_bytes"], b * t, gemm_prec),
                **row,
            }
        )
        summary.update({f"train_{k_}": out[k_] for k_ in ("tokens_per_s", "gemm_flops_per_token", "compile_s")})
        summary.update(row)
    _TRAINED.clear()  # one model held at a time
    _TRAINED[key] = dict(
        graphdef=graphdef,
        mesh=mesh,
        params=params,
        opt_state=opt_state,
        batch=batch,
        host=host,
        base=base,
        summary=summary,
    )
    return _TRAINED[key]


def bench_one(name: str, d: int, args) -> dict:
    """Measures the paths of `args.paths` for one (config, d) and prints one JSON line per path
    the moment it is measured (`"path"`: train | fast | reference | trak; `compile_s` apart from
    `step_s`), then the combined row (`"path": "summary"`, the ratios) which it returns."""
    config = _config(name)
    # Every kernel factored (as at paper scale, where all dims are >= 128): V is then exactly
    # rank-one, so fast == reference is checked at scale too. The rank-one gap where optax
    # keeps a full v is measured on a trained run by `--rank1_workdir`.
    config.train.min_dim_size_to_factor = min(int(config.train.min_dim_size_to_factor), 32, int(config.model.head_dim))
    if args.dtype:
        config.model.dtype = args.dtype
    if args.matmul_dtype:
        config.model.matmul_dtype = args.matmul_dtype
    paths = [p for p in args.paths.split(",") if p]
    unknown = sorted(set(paths) - {"train", "fast", "reference", "trak"})
    if unknown:
        raise ValueError(f"--paths: unknown {unknown} (train, fast, reference, trak)")
    model_cfg = config_lib.from_configdict(config).model
    b = args.batch or int(config.vectors.batch_size)
    t = args.seq_len or model_cfg.max_len
    dev = jax.devices()[0]
    op_dtype = model_cfg.matmul_dtype or model_cfg.dtype
    nb = _num_blocks(d, int(config.vectors.num_blocks), model_cfg.num_layers)
    k = vectors.projection_dim_for(d, nb)
    gemm_prec = device_peaks.gemm_precision(op_dtype, args.precision, dev.platform)
    # the train step runs at JAX's default precision, not at vectors.matmul_precision
    train_prec = device_peaks.gemm_precision(op_dtype, "default", dev.platform)
    trained = _trained(config, name, b, t, "train" in paths, args.steps, args.memory_2x, train_prec)
    graphdef, mesh, params, opt_state, batch, host = (
        trained[k_] for k_ in ("graphdef", "mesh", "params", "opt_state", "batch", "host")
    )
    base = dict(trained["base"], d=d, num_blocks=nb, k=k, matmul_precision=args.precision)
    summary = dict(base, path="summary", **trained["summary"])

    def rate_fields(path: str, compile_s: float, secs: float, flops: float | None, peak_bytes: int | None) -> dict:
        return dict(base, **_rates(path, compile_s, secs, flops, peak_bytes, b * t, gemm_prec))

    features = {}
    for path in [p for p in ("fast", "reference") if p in paths]:
        vc = vectors.VectorConfig(num_blocks=nb, proj_dim=k, correction=True, path=path)
        vc = dataclasses.replace(vc, matmul_precision=args.precision)
        plan = vectors.make_block_plan(params, model_cfg, vc)
        _progress(f"{path} d={d} k={k} blocks={nb}: correction and projections")
        precond = vectors.make_precond(params, opt_state, vc, plan)
        jitted = vectors.jit_vector_step(graphdef, vc, plan, mesh)
        projs = vectors.step_projections(vc, plan, precond)
        jax.block_until_ready(projs)
        vb = {"tokens": batch["tokens"], "loss_mask": batch["loss_mask"]}
        _progress(f"{path} d={d}: compiling")
        compiled, compile_s = _compiled(jitted.lower(params, precond, vb, projs))
        _progress(f"{path} d={d}: compiled in {compile_s:.1f} s; counting FLOPs")
        flops = plan_lib.dot_flops(jitted, params, precond, vb, projs)
        _progress(f"{path} d={d}: timing")
        row = {}
        if args.memory_2x:
            host2 = _batch(2 * b, t, model_cfg.vocab_size)
            vb2 = {k_: jnp.asarray(host2[k_]) for k_ in ("tokens", "loss_mask")}
            row[f"{path}_peak_bytes_2x_batch"] = _peak(jitted.lower(params, precond, vb2, projs).compile())
        secs = _time(compiled, (params, precond, vb, projs), args.steps if path == "fast" else max(1, args.steps // 2))
        features[path] = np.asarray(compiled(params, precond, vb, projs)[0])
        if path == "reference" and "fast" in features:
            # Every kernel is factored here, so the two paths must agree (to the GEMMs' precision).
            f, r = features["fast"], features["reference"]
            row["fast_vs_reference_rel_err"] = float(np.linalg.norm(f - r) / np.linalg.norm(r))
        out = _emit({**rate_fields(path, compile_s, secs, flops, _peak(compiled)), **row})
        summary.update({f"{path}_{k_}": out[k_] for k_ in ("tokens_per_s", "gemm_flops_per_token", "compile_s")})
        summary.update({f"{path}_{k_}": out[k_] for k_ in ("gemm_flops_per_s", "peak_fraction", "peak_bytes")})
        summary.update(row)

    # --- TRAK-style baseline ---
    if "trak" in paths:
        tb = min(args.trak_batch, b)
        plan = vectors.make_block_plan(params, model_cfg, vectors.VectorConfig(num_blocks=nb, proj_dim=k))
        n_attr = base["attributed_params"]
        total_chunks = -(-n_attr // args.trak_chunk)
        timed_chunks = min(total_chunks, args.trak_max_chunks)
        trak_batch = {"tokens": jnp.asarray(host["tokens"][:tb]), "loss_mask": jnp.asarray(host["loss_mask"][:tb])}
        key = jax.random.key(0)
        per_chunk_s, compile_s = [], 0.0
        for n_chunks in sorted({max(1, timed_chunks // 2), timed_chunks}):
            fn = jax.jit(
                functools.partial(
                    trak_style_vectors, graphdef=graphdef, plan=plan, d=d, chunk=args.trak_chunk, num_chunks=n_chunks
                )
            )
            c, cs = _compiled(fn.lower(params, trak_batch, key))
            compile_s += cs
            per_chunk_s.append((n_chunks, _time(c, (params, trak_batch, key), 1)))
        if len(per_chunk_s) == 2 and timed_chunks < total_chunks:  # linear fit: fixed grad cost + per-chunk cost
            (n1, s1), (n2, s2) = per_chunk_s
            slope = max((s2 - s1) / (n2 - n1), 0.0)
            trak_s = s2 + slope * (total_chunks - n2)
        else:
            trak_s = per_chunk_s[-1][1]
        row = {
            "trak_batch": tb,
            "trak_chunks_timed": timed_chunks,
            "trak_chunks_total": total_chunks,
        }
        out = _emit(dict(base, path="trak", compile_s=compile_s, step_s=trak_s, tokens_per_s=tb * t / trak_s, **row))
        summary.update(row, trak_tokens_per_s=out["tokens_per_s"])

    # Memory per extra example (slope between batch b and 2b) next to the size of one
    # example's full gradient: the fast path's slope is activations (T x widths, T x vocab)
    # and does not grow with |theta|; materialising per-example gradients would add |theta|.
    for path in ("train", "fast", "reference"):
        if f"{path}_peak_bytes_2x_batch" in summary and f"{path}_peak_bytes" in summary:
            summary[f"{path}_bytes_per_example"] = (
                summary[f"{path}_peak_bytes_2x_batch"] - summary[f"{path}_peak_bytes"]
            ) / b
    summary["grad_bytes_per_example"] = 4 * base["attributed_params"]
    ratios = {
        "fast_over_train": ("fast_tokens_per_s", "train_tokens_per_s"),
        # what fast / train would be were both steps' GEMMs equally efficient (element-wise work
        # aside): the featurize step skips the weight gradients but adds the projections
        "fast_over_train_gemm_flops": ("train_gemm_flops_per_token", "fast_gemm_flops_per_token"),
        "fast_over_reference": ("fast_tokens_per_s", "reference_tokens_per_s"),
        "fast_over_trak": ("fast_tokens_per_s", "trak_tokens_per_s"),
    }
    for name_, (num, den) in ratios.items():
        if num in summary and den in summary:
            summary[name_] = summary[num] / summary[den]
    summary["loadavg_1m"] = round(os.getloadavg()[0], 2)
    return _emit(summary)


def rank_one_gap(workdir: str, rows: int, batch: int, d: int) -> dict:
    """Fast path (rank-one V) vs exact reference (element-wise V) on a trained run's corpus rows."""
    from trackstar_jax import data as data
    from trackstar_jax.features import factored, preconditioner

    run = stages.load_run(workdir)
    cfg = run.model_cfg
    nb = _num_blocks(d, int(run.config.vectors.num_blocks), cfg.num_layers)
    vc = vectors.VectorConfig(num_blocks=nb, proj_dim=vectors.projection_dim_for(d, nb))
    plan = vectors.make_block_plan(run.params, cfg, vc)
    exact = preconditioner.from_opt_state(run.params, run.opt_state, plan.paths, exact=True)
    rank1 = preconditioner.from_opt_state(run.params, run.opt_state, plan.paths, exact=False)
    kw = dict(graphdef=run.graphdef, plan=plan, seed=vc.proj_seed)
    fast_fn = jax.jit(functools.partial(factored.factored_vectors, **kw))
    ref_fn = jax.jit(functools.partial(grads.reference_vectors, **kw))
    out = {"fast": [], "exact": [], "ref_rank1": []}
    for b in data.index_batches(run.corpus, run.tokenizer, batch, cfg.max_len, stop=rows):
        keep = b["example_id"] >= 0
        vb = {"tokens": b["tokens"], "loss_mask": b["loss_mask"]}
        out["fast"].append(np.asarray(fast_fn(run.params, exact, vb))[keep])
        out["exact"].append(np.asarray(ref_fn(run.params, exact, vb))[keep])
        out["ref_rank1"].append(np.asarray(ref_fn(run.params, rank1, vb))[keep])
    f, e, r1 = (np.concatenate(out[k]).astype(np.float64) for k in ("fast", "exact", "ref_rank1"))
    cos = np.sum(f * e, 1) / np.linalg.norm(f, axis=1) / np.linalg.norm(e, axis=1)
    fu, eu = f / np.linalg.norm(f, axis=1, keepdims=True), e / np.linalg.norm(e, axis=1, keepdims=True)

    def top10(u):
        s = u @ u.T
        np.fill_diagonal(s, -np.inf)
        return np.argsort(-s, axis=1)[:, :10]

    tf, te = top10(fu), top10(eu)
    overlap = np.mean([len(set(a) & set(b_)) / 10 for a, b_ in zip(tf, te)])
    factor_err = preconditioner.rank_one_error(exact)
    return {
        "bench": "rank_one_v",
        "workdir": str(workdir),
        "step": run.step,
        "rows": int(f.shape[0]),
        "d": d,
        "min_dim_size_to_factor": int(run.config.train.min_dim_size_to_factor),
        "non_rank_one_params": sorted(factor_err),
        "factor_rel_err_mean": float(np.mean(list(factor_err.values()) or [0])),
        "fast_vs_exact_rel_err": float(np.linalg.norm(f - e) / np.linalg.norm(e)),
        "fast_vs_exact_cos_mean": float(cos.mean()),
        "fast_vs_exact_cos_min": float(cos.min()),
        "top10_overlap_fast_vs_exact": float(overlap),
        "fast_vs_reference_same_rank1_rel_err": float(np.linalg.norm(f - r1) / np.linalg.norm(r1)),
        "device": f"{jax.devices()[0].platform}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="tiny,small")
    parser.add_argument("--dims", default="4096,65536")
    parser.add_argument("--batch", type=int, default=0, help="examples per step (0: config.vectors.batch_size)")
    parser.add_argument("--seq_len", type=int, default=0, help="0: model.max_len")
    parser.add_argument("--steps", type=int, default=5, help="timed calls (median) per path")
    parser.add_argument("--trak_batch", type=int, default=4)
    parser.add_argument("--trak_chunk", type=int, default=8192, help="gradient coordinates per P block")
    parser.add_argument("--trak_max_chunks", type=int, default=16)
    parser.add_argument("--paths", default="train,fast,reference,trak", help="comma list of train,fast,reference,trak")
    parser.add_argument(
        "--dtypes",
        default="",
        help="comma list of model.dtype overrides: float32,bfloat16 (GEMM operands; '': the config's)",
    )
    parser.add_argument(
        "--matmul_dtype", default="", help="model.matmul_dtype override (GEMM operands only; '': model.dtype)"
    )
    parser.add_argument("--precision", default="float32", choices=("float32", "tf32", "bf16"))
    parser.add_argument(
        "--memory_2x", type=int, default=1, help="also compile each step at 2x batch for memory (0: skip)"
    )
    parser.add_argument("--rank1_workdir", default="", help="trained run: measure rank-one V vs exact V instead")
    parser.add_argument("--rank1_rows", type=int, default=256)
    args = parser.parse_args()
    if args.rank1_workdir:
        for d in (int(x) for x in args.dims.split(",")):
            print(json.dumps(rank_one_gap(args.rank1_workdir, args.rank1_rows, args.batch or 32, d)), flush=True)
        return
    for name in args.configs.split(","):
        for dtype in args.dtypes.split(","):
            args.dtype = dtype
            for d in (int(x) for x in args.dims.split(",")):
                bench_one(name, d, args)


if __name__ == "__main__":
    main()
