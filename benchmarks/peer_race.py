"""trackstar_jax vs bergson on the same model, tokens, d and optimizer correction, in one run.

    python -m benchmarks.peer_race [--shapes 14m,70m] [--tokens 65536] [--out DIR]
    python -m benchmarks.peer_race --quick --no_bergson     # micro smoke run (CI schema test)

One JSON line per (shape, correction) on stdout (and in `OUT/race.jsonl`).

Setup, per shape (a GPT-NeoX at the pythia-14m / pythia-70m shapes: width 128 / 512, 6
layers, 4 / 8 heads, MLP 512 / 2048, vocab 50304, untied, rotary_pct 0.25, parallel residual):

* A side virtualenv (`--peer_venv`, default ~/.cache/trackstar_jax/peer_venv) holds torch and
  bergson; it is created on first use (`pip install torch==2.13.0`, bergson's build-path
  dependencies by name, `pip install --no-deps bergson`), never touching the project's
  dependencies.
* Tokens: `tokens // seq_len` index examples plus held-out queries, drawn from 64 "topics"
  (each a Zipf distribution over its own 2,000 token ids), so that gradient neighbours are
  not pure noise. Every token after the first is a target for both tools.
* Model and optimizer state (stage `prepare`, torch, in the side venv): random HF
  initialisation, then `--adam_steps` real `torch.optim.AdamW` steps (lr 1e-3, batch 16)
  on the index tokens; those steps also give the torch AdamW train-step tokens/s. The model
  after the steps is saved with `save_pretrained` and loaded by both tools (ours through
  `models.hf.load_hf`, the import path). Optimizer states, identical for both tools:
  - `adam`: AdamW's `exp_avg_sq` V (bergson: `optimizer.pt` as torch saved it; ours: the same
    tensors mapped to our layout by the HF loader, as an optax-style `nu` tree).
  - `adafactor`: the row / column means of that V, `r = mean_in V`, `c = mean_out V`
    (exactly what Adafactor with the same beta2 stores from the same gradients, since the
    EMA and the means commute); bergson reads them as `exp_avg_sq_row` / `exp_avg_sq_col`,
    and ours gets the rank-one `r c^T / mean(r)` mapped to our layout (so the fused
    query_key_value factors bergson uses are the ones we use after the split).
* d: bergson p=16 over its 24 Linear modules = 6,144; ours num_blocks=3, k=32 = 6,144.

Corrections raced: `adafactor` (ours: rank-one folded into the projections), `adam` (ours:
`vectors.exact_v=True`, the exact element-wise V like bergson), `adam_rank1` (ours: the
default rank-one factorisation of Adam's V; bergson's figures are its exact Adam run).

Training step (stages `ours_train`, then `torch_train`, never resumed): our jitted train step
and torch's AdamW step on the same saved model, batches and batch size, one after the other;
ours with optax AdamW and with the project's Adafactor. `--train_rounds` (2) alternations;
each tool's figure is its best round.

Compilation: our stages run with the persistent XLA compilation cache on, as every launcher
does (`distributed.runtime`), in a folder of the race's own per correction: the build runs twice,
first with that folder empty (`ours_tokens_per_s`: a first run on a machine) and then again
(`ours_tokens_per_s_warm_cache`: every later run with the same model and shapes).

Roofline (stage `gemm`, resumed with the builds): this machine's best GEMM rate (float32
operands, or bf16 under `--precision bf16`) at the shape's matrix shapes through XLA, measured
in the same run, and our featurize step's GEMM FLOPs per token (`plan.dot_flops` of the step
the build runs): `ours_steady_gflops`, `ours_roofline_tokens_per_s` (the most any featurizer
doing our FLOPs could reach here) and `roofline_over_bergson` (the most `ours_over_bergson`
could be).

Precision (`--precision`, default `fp32`): `bf16` races our `model.matmul_dtype="bfloat16"`
(the dense layers' and the head's GEMM operands in bf16, float32 accumulation and activations)
against bergson's `--precision bf16` (its model in bf16, queries too); rows say `precision`, the
roofline uses the bf16 GEMM rate, the exact top-10 stays float32, and the two precisions' files
and stages sit side by side (`*_bf16`).

`--resume` reuses every finished stage whose spec is unchanged; `--reuse_inputs` reuses only
the prepared model, optimizer states and exact top-10, and times everything else again.

Per tool, each stage in its own subprocess (`os.wait4` gives its peak RSS, `ru_maxrss`):
build tokens/s = index tokens / the build process's whole wall time (start-up, model load,
compile and writing included, both tools alike), over `--build_rounds` (3) alternations of
the two cold builds (ours, bergson; bergson, ours; ...): each tool's figure is its median
round, `ours_over_bergson` the median of the rounds' ratios (each pairing two builds run
next to each other), the peak RSS the largest round's, and `*_rounds` lists every round (this
VM's speed, and bergson's with it, moved by up to 25% between runs an hour apart); 100 queries
one at a time (gradient + cosine score against the whole index + top-10), after one warm-up
query; and on the first `--subset` index examples the top-10 overlap, over `--overlap_queries` held-out queries, with
the exact cosine of the unprojected corrected gradients (computed with materialised
per-example gradients by our reference path; `_full`: every parameter TrackStar attributes by
default (all but the token embedding and the untied `embed_out`: biases and LayerNorms
included), `_linear`: only the 24 Linear weights bergson attributes, `_unembed`: `_full` plus
`embed_out`, the set ours attributes with `--unembed` (`vectors.unembed`), as before session 5).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import time

SHAPES = {
    "14m": dict(hidden_size=128, num_hidden_layers=6, num_attention_heads=4, intermediate_size=512, vocab_size=50304),
    "70m": dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, intermediate_size=2048, vocab_size=50304),
    "micro": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=512),
}
CORRECTIONS = ("adafactor", "adam", "adam_rank1")
BERGSON_DEPS = (
    "accelerate datasets jinja2 jaxtyping ml_dtypes natsort numpy scipy peft petname pyarrow pyyaml "
    "simple-parsing torchopt transformers huggingface-hub safetensors tokenizers"
).split()
DEFAULT_VENV = pathlib.Path.home() / ".cache" / "trackstar_jax" / "peer_venv"
REPO = pathlib.Path(__file__).resolve().parents[1]
ROW_FIELDS = (
    "shape",
    "correction",
    "d",
    "ours_tokens_per_s",
    "bergson_tokens_per_s",
    "ours_over_bergson",
    "ours_peak_rss_bytes",
    "bergson_peak_rss_bytes",
    "ours_query_seconds",
    "bergson_query_seconds",
    "ours_top10_overlap",
    "bergson_top10_overlap",
)
# distributed.runtime.ENV, named here so that this (parent) process never imports jax: a
# child's ru_maxrss starts at the parent's RSS at fork.
CACHE_ENV = "TRACKSTAR_COMPILATION_CACHE"
EXACT_SETS = ("full", "linear", "unembed")  # parameter sets of the exact reference (module docstring)


# ------------------------------------------------------------------------------------------
# side virtualenv and subprocesses
# ------------------------------------------------------------------------------------------


def peer_python(venv: pathlib.Path) -> pathlib.Path:
    return venv / "bin" / "python"


def venv_ready(venv: pathlib.Path, need_bergson: bool) -> bool:
    py = peer_python(venv)
    mods = "torch, transformers, datasets, tokenizers" + (", bergson" if need_bergson else "")
    return py.exists() and subprocess.run([str(py), "-c", f"import {mods}"], capture_output=True).returncode == 0


def ensure_venv(venv: pathlib.Path, need_bergson: bool) -> pathlib.Path:
    """Creates the side virtualenv (torch + bergson's build-path deps + bergson --no-deps) if needed."""
    if venv_ready(venv, need_bergson):
        return peer_python(venv)
    print(f"creating the peer virtualenv {venv} (torch, bergson; a few minutes)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(peer_python(venv)), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["torch==2.13.0"], check=True)
    subprocess.run(pip + list(BERGSON_DEPS), check=True)
    subprocess.run(pip + ["--no-deps", "bergson"], check=True)
    if not venv_ready(venv, need_bergson):
        raise RuntimeError(f"the peer virtualenv {venv} still cannot import torch/transformers/bergson")
    return peer_python(venv)


def run_measured(cmd: list[str], log: pathlib.Path, env: dict | None = None) -> dict:
    """Runs `cmd` as a subprocess: `{wall_seconds, peak_rss_bytes}` (its own `ru_maxrss`)."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    full_env.update(env or {})
    with open(log, "w") as f:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=full_env, cwd=str(REPO))
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed with exit code {code}; log {log}:\n{tail}")
    return {"wall_seconds": wall, "peak_rss_bytes": int(usage.ru_maxrss) * 1024}


def stage_cmd(python: str | pathlib.Path, stage: str, spec: pathlib.Path) -> list[str]:
    return [str(python), "-m", "benchmarks.peer_race", "--stage", stage, "--spec", str(spec)]


# ------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------


def make_tokens(n: int, seq_len: int, vocab: int, seed: int, topics: int = 64, topic_vocab: int = 2000):
    """`[n, seq_len]` int32 token ids from topic-specific Zipf distributions (ids >= 4)."""
    import numpy as np

    rng = np.random.default_rng(1234)  # the topics are fixed; `seed` picks the examples
    topic_vocab = min(topic_vocab, vocab - 4)
    ids = np.stack([rng.choice(np.arange(4, vocab), topic_vocab, replace=False) for _ in range(topics)])
    w = 1.0 / np.arange(1, topic_vocab + 1)
    w /= w.sum()
    ex = np.random.default_rng(seed)
    which = ex.integers(0, topics, n)
    pos = ex.choice(topic_vocab, size=(n, seq_len), p=w)
    return ids[which[:, None], pos].astype(np.int32)


# ------------------------------------------------------------------------------------------
# stages in the side venv (torch, bergson)
# ------------------------------------------------------------------------------------------


def _torch_adamw_steps(model, opt, tokens, b: int, steps: int) -> list[float]:
    """`steps` timed torch training steps (forward, backward, AdamW) on consecutive batches of
    `b` examples of `tokens`: seconds per step."""
    import numpy as np
    import torch

    model.train()
    times = []
    for s in range(steps):
        x = torch.from_numpy(tokens[(s * b) % len(tokens) :][:b].astype(np.int64))
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def stage_prepare(spec: dict) -> dict:
    """Random GPT-NeoX + tokenizer + datasets + AdamW steps (timed) + optimizer states."""
    import numpy as np
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, PreTrainedTokenizerFast

    d = pathlib.Path(spec["dir"])
    torch.manual_seed(spec["seed"])
    cfg = GPTNeoXConfig(
        **SHAPES[spec["shape"]],
        rotary_pct=0.25,
        use_parallel_residual=True,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
        hidden_act="gelu",
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPTNeoXForCausalLM(cfg).float()
    tokens = np.load(d / "index_tokens.npy")
    queries = np.load(d / "query_tokens.npy")
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")))
    tok.pad_token, tok.eos_token, tok.bos_token, tok.unk_token = "t0", "t0", "t0", "t1"

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    b = spec["batch"]
    times = _torch_adamw_steps(model, opt, tokens, b, spec["adam_steps"])
    model.eval()
    model.save_pretrained(d / "model", safe_serialization=True)
    tok.save_pretrained(d / "model")
    Dataset.from_dict({"input_ids": tokens.tolist()}).save_to_disk(str(d / "data"))
    Dataset.from_dict({"input_ids": queries[: spec["overlap_queries"]].tolist()}).save_to_disk(str(d / "qdata"))

    names = [n for n, _ in model.named_parameters()]
    state = opt.state_dict()
    v = {names[i]: state["state"][i]["exp_avg_sq"].float().contiguous() for i in range(len(names))}
    (d / "opt_adam").mkdir(exist_ok=True)
    torch.save(state, d / "opt_adam" / "optimizer.pt")
    ada_state, v_ada = {}, {}
    for i, n in enumerate(names):
        x = v[n]
        if x.ndim == 2:  # [out, in]: row = mean over in, col = mean over out (bergson's convention)
            row, col = x.mean(1), x.mean(0)
            ada_state[i] = {"step": state["state"][i]["step"], "exp_avg_sq_row": row, "exp_avg_sq_col": col}
            v_ada[n] = (torch.outer(row, col) / row.mean()).contiguous()
        else:
            ada_state[i] = {"step": state["state"][i]["step"], "exp_avg_sq": x}
            v_ada[n] = x
    (d / "opt_adafactor").mkdir(exist_ok=True)
    torch.save(
        {"state": ada_state, "param_groups": [{"params": list(range(len(names)))}]},
        d / "opt_adafactor" / "optimizer.pt",
    )
    save_file(v, str(d / "v_adam.safetensors"))
    save_file(v_ada, str(d / "v_adafactor.safetensors"))
    steady = times[1:] or times
    tps = b * tokens.shape[1] / (sum(steady) / len(steady))
    return {"torch_adamw_tokens_per_s": tps, "adam_steps": len(times), "torch_threads": torch.get_num_threads()}


def stage_torch_train(spec: dict) -> dict:
    """torch AdamW steps on the saved model (what `stage_prepare` times while making V), run
    again beside `stage_ours_train` so that the two training-step figures always come from the
    same run, also when `--resume` reuses the prepared model."""
    import numpy as np
    import torch
    from transformers import GPTNeoXForCausalLM

    d = pathlib.Path(spec["dir"])
    model = GPTNeoXForCausalLM.from_pretrained(d / "model").float()
    tokens = np.load(d / "index_tokens.npy")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    b = spec["batch"]
    times = _torch_adamw_steps(model, opt, tokens, b, max(spec["adam_steps"], 3))
    return {"torch_adamw_tokens_per_s": b * tokens.shape[1] / (sum(times[1:]) / len(times[1:]))}


def stage_bergson_query(spec: dict) -> dict:
    """100 one-at-a-time queries with bergson's Attributor (unit norm), + overlap vectors."""
    import numpy as np
    import torch
    from bergson.data import load_gradients
    from bergson.query.attributor import Attributor
    from transformers import AutoModelForCausalLM

    d = pathlib.Path(spec["dir"])
    bf16 = spec.get("precision") == "bf16"
    run = d / f"bergson_{spec['correction']}{'_bf16' if bf16 else ''}"
    t0 = time.perf_counter()
    # the build's precision (bergson's `--precision`: the model's dtype)
    model = AutoModelForCausalLM.from_pretrained(
        str(d / "model"), torch_dtype=torch.bfloat16 if bf16 else torch.float32
    )
    model.requires_grad_(False)
    model.get_input_embeddings().requires_grad_(True)
    attr = Attributor(str(run), device="cpu", unit_norm=True)
    setup_s = time.perf_counter() - t0
    captured = []
    search = attr.search

    def recording_search(queries, k, modules=None, reverse=False):
        captured.append({n: queries[n].detach().clone() for n in attr.ordered_modules})
        return search(queries, k, modules, reverse)

    attr.search = recording_search
    queries = np.load(d / "query_tokens.npy")

    def one(i):
        x = torch.from_numpy(queries[i : i + 1].astype(np.int64))
        with attr.trace(model.base_model, k=10) as result:
            out = model(input_ids=x)
            loss = torch.nn.functional.cross_entropy(
                out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
            )
            loss.backward()
        model.zero_grad(set_to_none=True)
        return result.indices

    one(0)  # warm-up
    captured.clear()
    t0 = time.perf_counter()
    for i in range(spec["num_queries"]):
        one(i % len(queries))
    query_s = time.perf_counter() - t0
    nq = spec["overlap_queries"]
    q = np.stack(
        [np.concatenate([c[n].reshape(-1).float().numpy() for n in attr.ordered_modules]) for c in captured[:nq]]
    )
    idx = np.asarray(load_gradients(run), dtype=np.float32)[: spec["subset"]]
    np.save(run.with_name(run.name + "_top10.npy"), top10_cosine(q, idx))
    return {"query_seconds": query_s, "setup_seconds": setup_s, "d": int(idx.shape[1])}


def top10_cosine(q, rows):
    """`[Q, 10]` indices of the rows of highest cosine with each query (numpy, float64)."""
    import numpy as np

    q = q.astype(np.float64)
    rows = rows.astype(np.float64)
    s = (q / np.linalg.norm(q, axis=1, keepdims=True)) @ (rows / np.linalg.norm(rows, axis=1, keepdims=True)).T
    return np.argsort(-s, axis=1, kind="stable")[:, :10]


# ------------------------------------------------------------------------------------------
# stages in the project's venv (JAX)
# ------------------------------------------------------------------------------------------


def _ours_setup(spec: dict, correction: str):
    """`(cfg, graphdef, params, opt_state, vec_cfg)` for our side of the race."""
    import numpy as np
    from safetensors.numpy import load_file

    from trackstar_jax.features import vectors
    from trackstar_jax.models import hf
    from trackstar_jax.models import lm as model_lib

    d = pathlib.Path(spec["dir"])
    cfg, params = hf.load_hf(d / "model")
    if spec.get("matmul_dtype"):  # `--precision bf16`: bf16 GEMM operands, float32 accumulation
        cfg = dataclasses.replace(cfg, matmul_dtype=spec["matmul_dtype"])
    graphdef, _ = model_lib.abstract_params(cfg)
    opt_state = None
    if correction != "none":
        hf_config = json.loads((d / "model" / hf.CONFIG_FILE).read_text())
        src = d / ("v_adafactor.safetensors" if correction == "adafactor" else "v_adam.safetensors")
        tensors = {k: np.asarray(v, np.float32) for k, v in load_file(str(src)).items()}
        _, v = hf.from_hf_state_dict(hf_config, tensors, source=str(src))
        opt_state = {"nu": v}
    vc = vectors.VectorConfig(
        num_blocks=spec["num_blocks"],
        proj_dim=spec["proj_dim"],
        correction=correction != "none",
        exact_v=correction == "adam",
        unembed=spec.get("unembed", False),
        batch_size=spec["batch"],
    )
    return cfg, graphdef, params, opt_state, vc


def _ours_name(spec: dict) -> str:
    """The stem of our index / top-10 files for a spec: `ours_<correction>[_bf16]`."""
    return f"ours_{spec['correction']}{'_bf16' if spec.get('matmul_dtype') else ''}"


def _placed(fn, params):
    """The loader's host parameters on the devices, the host copy let go (as a user's script
    would: `load_hf` returns numpy arrays, and the featurizer places them once)."""
    import jax

    placed = fn.place_params(params)
    jax.block_until_ready(placed)
    return placed


def _batches(tokens, b: int):
    import numpy as np

    for s in range(0, len(tokens), b):
        t = tokens[s : s + b]
        n = len(t)
        if n < b:
            t = np.concatenate([t, np.repeat(t[-1:], b - n, 0)])
        yield n, {"tokens": t, "loss_mask": np.ones_like(t), "example_id": np.arange(s, s + b, dtype=np.int32)}


def stage_ours_build(spec: dict) -> dict:
    """Featurize every index example (fast path) and write the `[N, d]` float32 rows.

    The persistent compilation cache is on, as in every launcher (`distributed.runtime`); the
    race points it at a folder of its own (`TRACKSTAR_COMPILATION_CACHE`), empty for the cold
    build and filled by it for the warm one. Phases are timed from this function's start:
    imports, model + optimizer-state load, the first batch (compile or cache load), the rest.
    """
    t_start = time.perf_counter()
    import jax
    import numpy as np

    from trackstar_jax.distributed import runtime
    from trackstar_jax.features import vectors

    cache = runtime.enable_compilation_cache()
    t_import = time.perf_counter()
    d = pathlib.Path(spec["dir"])
    cfg, graphdef, params, opt_state, vc = _ours_setup(spec, spec["correction"])
    tokens = np.load(d / "index_tokens.npy")
    fn = vectors.make_vector_fn(graphdef, cfg, vc, params, opt_state)
    params = _placed(fn, params)
    del opt_state  # its correction is in `fn.precond`
    out = np.lib.format.open_memmap(d / f"{_ours_name(spec)}.npy", "w+", np.float32, (len(tokens), fn.dim))
    t_first = None
    t0 = time.perf_counter()
    for i, (n, b) in enumerate(_batches(tokens, spec["batch"])):
        out[i * spec["batch"] : i * spec["batch"] + n] = fn(params, fn.precond, b)[:n]
        if i == 0:
            t_first = time.perf_counter()
    out.flush()
    t1 = time.perf_counter()
    steady = (len(tokens) - spec["batch"]) * tokens.shape[1] / max(t1 - t_first, 1e-9)
    del jax
    return {
        "d": fn.dim,
        "steady_tokens_per_s": steady,
        "import_seconds": t_import - t_start,
        "load_seconds": t0 - t_import,
        "first_batch_seconds": t_first - t0,
        "rest_seconds": t1 - t_first,
        "compilation_cache": str(cache) if cache else None,
    }


def stage_ours_train(spec: dict) -> dict:
    """Our jitted training step on the same model, batches and batch size as torch's timed AdamW
    steps (`stage_prepare`): with optax AdamW (lr 1e-3, torch's defaults) and with the project's
    Adafactor (`training.step.make_optimizer`). Tokens/s counts `batch * seq_len` per step, as
    torch's figure does; the mean over the steps after the first (the compile), as torch's."""
    import functools
    import statistics

    import jax
    import numpy as np
    import optax

    from trackstar_jax.distributed import runtime
    from trackstar_jax.models import hf
    from trackstar_jax.models import lm as model_lib
    from trackstar_jax.training import step as step_lib

    runtime.enable_compilation_cache()
    d = pathlib.Path(spec["dir"])
    cfg, params = hf.load_hf(d / "model")
    graphdef, _ = model_lib.abstract_params(cfg)
    tokens = np.load(d / "index_tokens.npy")
    b = spec["batch"]
    out = {}
    optimizers = {
        "adamw": optax.adamw(1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01),
        "adafactor": step_lib.make_optimizer(step_lib.OptimizerConfig()),
    }
    for name, opt in optimizers.items():
        state = step_lib.TrainState(
            step=jax.numpy.zeros((), jax.numpy.int32), params=jax.tree.map(jax.numpy.copy, params), opt_state=None
        )
        state = state.replace(opt_state=opt.init(state.params))
        step = jax.jit(functools.partial(step_lib.train_step, graphdef=graphdef, opt=opt), donate_argnums=0)
        times = []
        for s in range(max(spec["adam_steps"], 3)):
            x = tokens[(s * b) % len(tokens) :][:b]
            batch = {"tokens": x, "loss_mask": np.ones_like(x)}
            t0 = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics["loss"])
            times.append(time.perf_counter() - t0)
        out[f"ours_train_{name}_tokens_per_s"] = b * tokens.shape[1] / statistics.mean(times[1:])
    return out


def stage_ours_query(spec: dict) -> dict:
    """100 one-at-a-time queries: featurize (role=query) + cosine against the index + top-10."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from trackstar_jax.distributed import runtime
    from trackstar_jax.features import vectors

    runtime.enable_compilation_cache()
    d = pathlib.Path(spec["dir"])
    t0 = time.perf_counter()
    cfg, graphdef, params, opt_state, vc = _ours_setup(spec, spec["correction"])
    fn = vectors.make_vector_fn(graphdef, cfg, vc, params, opt_state, role="query")
    params = _placed(fn, params)
    del opt_state
    index = np.load(d / f"{_ours_name(spec)}.npy")
    head = index[: spec["subset"]].copy()  # the overlap's rows, as the build wrote them
    # normalised in place and handed over: one copy of the index in memory, not three
    index /= np.linalg.norm(index, axis=1, keepdims=True)
    rows = jax.device_put(index)
    del index

    @functools.partial(jax.jit)
    def score(rows, q):
        q = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
        return jax.lax.top_k(q @ rows.T, 10)

    queries = np.load(d / "query_tokens.npy")
    setup_s = time.perf_counter() - t0

    def one(i):
        _, b = next(_batches(queries[i : i + 1], 1))
        v = fn(params, fn.precond, b)
        s, idx = score(rows, jnp.asarray(v))
        return np.asarray(idx), v

    one(0)  # warm-up (compile)
    vecs = []
    t0 = time.perf_counter()
    for i in range(spec["num_queries"]):
        vecs.append(one(i % len(queries))[1])
    query_s = time.perf_counter() - t0
    q = np.concatenate(vecs[: spec["overlap_queries"]])
    np.save(d / f"{_ours_name(spec)}_top10.npy", top10_cosine(q, head))
    return {"query_seconds": query_s, "setup_seconds": setup_s}


def stage_gemm(spec: dict) -> dict:
    """The roofline's two factors, measured in the race's run: this machine's float32 GEMM rate
    at the race shape's matrix shapes, through XLA as our steps run them (`jnp.matmul` of 2-D
    operands; the planner's calibration `plan.calibrate`, each shape's best call within 2 s)
    over the layers' shapes (`batch * (seq_len - 1)` rows), the training head's chunk
    (`head.head_chunk_tokens(d)` rows by the vocabulary) and, where the platform blocks it,
    the featurize head's vocabulary block and its `dx` (`head.head_vocab_blocks`); and, per correction raced, our
    featurize step's GEMM FLOPs per index token (`plan.dot_flops` on the very step the build
    runs, projections and the exact path's per-example gradients included, over
    `batch * seq_len` tokens as the race's tokens/s counts them)."""
    import numpy as np

    from trackstar_jax import plan
    from trackstar_jax.features import vectors
    from trackstar_jax.models import head as head_lib

    c = SHAPES[spec["shape"]]
    d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    r = spec["batch"] * (spec["seq_len"] - 1)
    shapes = [(r, d, 3 * d), (r, d, d), (r, d, f), (r, f, d), (head_lib.head_chunk_tokens(d), d, v)]
    block = head_lib.head_vocab_block()
    if block:  # the featurize step's head runs in vocabulary blocks on this platform
        _, vb = head_lib.head_vocab_blocks(v, block)
        rows = head_lib.head_chunk_tokens(d, blocked=True)
        shapes += [(rows, d, vb), (rows, vb, d)]
    dtype = spec.get("matmul_dtype") or "float32"
    rates = plan.calibrate(seconds=2.0, matmuls=tuple(shapes), dtype=dtype)["flops_per_s_by_shape"]
    rates = {k: x / 1e9 for k, x in rates.items()}
    tokens = np.zeros((spec["batch"], spec["seq_len"]), np.int32)
    batch = {"tokens": tokens, "loss_mask": np.ones_like(tokens)}
    flops = {}
    for correction in spec["corrections"]:
        cfg, graphdef, params, opt_state, vc = _ours_setup(spec, correction)
        fn = vectors.make_vector_fn(graphdef, cfg, vc, params, opt_state)
        step_args = (fn.place_params(params), fn.precond, batch, fn.projections)
        flops[correction] = plan.dot_flops(fn.step, *step_args) / tokens.size
    return {
        "gemm_dtype": dtype,
        "gemm_gflops_by_shape": rates,
        "gemm_peak_gflops": max(rates.values()),
        "featurize_gemm_flops_per_token": flops,
    }


def stage_exact(spec: dict) -> dict:
    """Exact top-10 (cosine of unprojected corrected per-example gradients) per correction and
    parameter set, on the first `subset` index examples for the first `overlap_queries` queries."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from trackstar_jax.features import grads, vectors
    from trackstar_jax.features import preconditioner as pc

    d = pathlib.Path(spec["dir"])
    corrections = spec["corrections"]
    cfg, graphdef, params, _, vc = _ours_setup(spec, "none")
    plan = vectors.make_block_plan(params, cfg, dataclasses.replace(vc, unembed=True))  # every set's params
    factors = []  # per correction: {path: f^2}, f = exact element-wise 1/sqrt(V)
    for c in corrections:
        if c == "none":
            factors.append({p: jnp.ones(()) for p in plan.paths})
            continue
        _, _, _, opt_state, _ = _ours_setup(spec, c)
        corr = pc.from_opt_state(params, opt_state, plan.paths, exact=True)
        shapes = {e.path: (e.shape if e.ndim == 2 else (e.shape[1],)) for e in plan.entries}
        factors.append({p: jnp.square(corr.elementwise(p, shapes[p])) for p in plan.paths})
    # bergson's set: the Linear weights of the decoder layers (not unembed, biases or norms)
    linear = {p for p in plan.paths if p.endswith("/kernel") and p.startswith("layer_")}
    default = set(vectors.make_block_plan(params, cfg, dataclasses.replace(vc, unembed=False)).paths)
    sets = {"full": default, "linear": linear, "unembed": set(plan.paths)}

    def per_example(batch):
        return grads.per_example_grads(params, batch, plan, graphdef=graphdef)

    @jax.jit
    def dots(batch, qg, f2s):
        g = per_example(batch)
        out = []  # [C, S (EXACT_SETS), B, Q] dots and [C, S, B] squared norms
        for f2 in f2s:
            d = {s: 0.0 for s in EXACT_SETS}
            n = {s: 0.0 for s in EXACT_SETS}
            for p in plan.paths:
                gb = g[p].reshape(g[p].shape[0], -1)
                gf = (g[p] * f2[p]).reshape(gb.shape[0], -1)
                dp = gf @ qg[p].reshape(qg[p].shape[0], -1).T
                np_ = jnp.sum(gf * gb, axis=1)
                for s in EXACT_SETS:
                    if p in sets[s]:
                        d[s], n[s] = d[s] + dp, n[s] + np_
            out.append((jnp.stack([d[s] for s in EXACT_SETS]), jnp.stack([n[s] for s in EXACT_SETS])))
        return out

    b = spec["exact_batch"]
    queries = np.load(d / "query_tokens.npy")[: spec["overlap_queries"]]
    qparts = [per_example(bt) for n, bt in _batches(queries, b)]
    qg = {p: jnp.concatenate([x[p] for x in qparts])[: len(queries)] for p in plan.paths}
    del qparts
    qnorm = []
    for f2 in factors:
        qnorm.append(
            np.stack(
                [
                    np.asarray(sum(jnp.sum((qg[p] ** 2 * f2[p]).reshape(len(queries), -1), 1) for p in sets[s]))
                    for s in EXACT_SETS
                ]
            )
        )
    tokens = np.load(d / "index_tokens.npy")[: spec["subset"]]
    dot_parts = [[] for _ in corrections]
    norm_parts = [[] for _ in corrections]
    for n, bt in _batches(tokens, b):
        for ci, (dp, nq) in enumerate(dots(bt, qg, factors)):
            dot_parts[ci].append(np.asarray(dp)[:, :n])
            norm_parts[ci].append(np.asarray(nq)[:, :n])
    result = {}
    for ci, c in enumerate(corrections):
        dmat = np.concatenate(dot_parts[ci], axis=1)  # [S, N, Q]
        nrm = np.concatenate(norm_parts[ci], axis=1)  # [S, N]
        for si, s in enumerate(EXACT_SETS):
            cos = dmat[si].T / np.sqrt(np.outer(qnorm[ci][si], nrm[si]))  # [Q, N]
            top = np.argsort(-cos, axis=1, kind="stable")[:, :10]
            np.save(d / f"exact_{c}_{s}_top10.npy", top)
            result[f"{c}_{s}"] = True
    return result


STAGES = {
    "prepare": stage_prepare,
    "bergson_query": stage_bergson_query,
    "ours_build": stage_ours_build,
    "ours_query": stage_ours_query,
    "ours_train": stage_ours_train,
    "torch_train": stage_torch_train,
    "exact": stage_exact,
    "gemm": stage_gemm,
}


# ------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------


def overlap(a, b) -> float:
    import numpy as np

    return float(np.mean([len(set(x) & set(y)) / 10 for x, y in zip(np.asarray(a), np.asarray(b))]))


def _reusable(name: str, spec: dict, d: pathlib.Path, tag: str = "") -> dict | None:
    """The result of a finished stage run with this very spec (`measured_<stage>.json`), else None."""
    done = d / f"measured_{name}{tag}.json"
    if done.exists():
        saved = json.loads(done.read_text())
        if saved.get("spec") == spec:
            return saved["result"]
    return None


def _stage(
    python, name: str, spec: dict, d: pathlib.Path, tag: str = "", resume: bool = False, env: dict | None = None
) -> dict:
    """Runs one stage in its own measured subprocess (with `env` added to its environment);
    with `resume`, a finished stage (same spec) is read back from `measured_<stage>.json`
    instead of being run again."""
    saved = _reusable(name, spec, d, tag) if resume else None
    if saved is not None:
        return saved
    spec_path = d / f"spec_{name}{tag}.json"
    spec_path.write_text(json.dumps(spec))
    meas = run_measured(stage_cmd(python, name, spec_path), d / f"log_{name}{tag}.txt", env=env)
    result = {**json.loads((d / f"result_{name}{tag}.json").read_text()), **meas}
    (d / f"measured_{name}{tag}.json").write_text(json.dumps({"spec": spec, "result": result}))
    return result


def _rounded(v):
    """5 significant digits for the row's floats (and lists of them)."""
    if isinstance(v, float):
        return float(f"{v:.5g}")
    return [_rounded(x) for x in v] if isinstance(v, list) else v


def _bergson_build(args, peer_py, d: pathlib.Path, bc: str, sfx: str, resume: bool) -> dict:
    """One measured `bergson build` (correction `bc`, `--precision` as raced) into
    `d/bergson_<bc>[_bf16]`, which it overwrites; with `resume`, a finished build with the same
    command is read back."""
    psfx = "_bf16" if args.precision == "bf16" else ""
    cmd = [
        str(peer_py.parent / "bergson"),
        "build",
        str(d / f"bergson_{bc}{psfx}"),
        "--model",
        str(d / "model"),
        "--dataset",
        str(d / "data"),
        "--projection_dim",
        str(args.bergson_p),
        "--token_batch_size",
        str(args.batch * args.seq_len),
        "--overwrite",
        "true",
    ]
    if bc != "none":
        cmd += ["--optimizer_state", str(d / f"opt_{bc}")]
    if psfx:
        cmd += ["--precision", "bf16"]
    done = d / f"measured_bergson_build_{bc}{psfx}{sfx}.json"
    if resume and done.exists() and json.loads(done.read_text())["cmd"] == cmd:
        return json.loads(done.read_text())["result"]
    bb = run_measured(cmd, d / f"log_bergson_build_{bc}{psfx}{sfx}.txt")
    done.write_text(json.dumps({"cmd": cmd, "result": bb}))
    return bb


def race_shape(shape: str, args, peer_py) -> list[dict]:
    import numpy as np

    d = pathlib.Path(args.out) / shape
    d.mkdir(parents=True, exist_ok=True)
    vocab = SHAPES[shape]["vocab_size"]
    n = args.tokens // args.seq_len
    np.save(d / "index_tokens.npy", make_tokens(n, args.seq_len, vocab, seed=1))  # deterministic: resume-safe
    np.save(
        d / "query_tokens.npy", make_tokens(max(args.num_queries, args.overlap_queries), args.seq_len, vocab, seed=2)
    )
    r = args.resume
    subset = min(args.subset, n)
    base = dict(
        dir=str(d),
        shape=shape,
        seed=0,
        batch=args.batch,
        adam_steps=args.adam_steps,
        overlap_queries=args.overlap_queries,
        num_queries=args.num_queries,
        subset=subset,
        num_blocks=args.num_blocks,
        proj_dim=args.proj_dim,
        exact_batch=args.exact_batch,
    )
    # The inputs (model, tokens, optimizer states, the exact top-10) depend on the corrections
    # raced; the timed stages' specs do not, so a resumed run with another list reuses them.
    inputs = {**base, "corrections": sorted({"adam" if c == "adam_rank1" else c for c in args.corrections})}
    ri = r or args.reuse_inputs
    prep = _stage(peer_py, "prepare", inputs, d, resume=ri)
    # The two training steps, never resumed (one run's figures): `--train_rounds` alternations
    # (ours, torch, ours, ...), each figure its best round, so that a drift of this VM's speed
    # during one stage does not decide the ratio.
    rounds = [
        (_stage(sys.executable, "ours_train", base, d, tag), _stage(peer_py, "torch_train", base, d, tag))
        for tag in [""] + [f"_{i}" for i in range(1, args.train_rounds)]
    ]
    ours_train = {
        k: max(o[k] for o, _ in rounds) for k in ("ours_train_adamw_tokens_per_s", "ours_train_adafactor_tokens_per_s")
    }
    torch_train = {"torch_adamw_tokens_per_s": max(t["torch_adamw_tokens_per_s"] for _, t in rounds)}
    # the GEMM rate: resumed with the builds it bounds, so that both come from one run
    # `--precision bf16`: our specs carry the GEMM operand dtype (fp32 specs are as before, so
    # earlier runs' stages still match), bergson builds with `--precision bf16`
    psfx = "_bf16" if args.precision == "bf16" else ""
    lowp = {"matmul_dtype": "bfloat16"} if psfx else {}
    gemm_spec = {**base, "seq_len": args.seq_len, "corrections": args.corrections, "unembed": args.unembed, **lowp}
    gemm = _stage(sys.executable, "gemm", gemm_spec, d, resume=r)
    exact = _stage(sys.executable, "exact", {**inputs, "exact_sets": list(EXACT_SETS)}, d, resume=ri)
    rows = []
    bergson: dict[str, dict] = {}
    for c in args.corrections:
        spec = {**base, "correction": c, "unembed": args.unembed, **lowp}
        ct = f"{c}{psfx}"  # this correction's files and stage tags
        # Cold: an empty compilation cache (a first run); warm: the same build again, its
        # featurize step loaded from the cache the cold build filled (every later run).
        cache = d / f"xla_cache_{ct}"
        env = {CACHE_ENV: str(cache)}
        bc = "adam" if c == "adam_rank1" else c
        run_bergson = not args.no_bergson and bc not in bergson
        ours_rounds, bergson_rounds = [], []
        # `--build_rounds` alternations of the two cold builds, in the order ours, bergson,
        # bergson, ours, ...: a drift of this VM's speed (or a first-build effect) falls on both.
        for i in range(args.build_rounds):
            sfx = "" if i == 0 else f"_r{i}"
            order = ("ours", "bergson") if i % 2 == 0 else ("bergson", "ours")
            for tool in order:
                if tool == "ours":
                    ob = _reusable("ours_build", spec, d, f"_{ct}{sfx}") if r else None
                    if ob is None:  # a cold build runs: its cache folder starts empty
                        shutil.rmtree(cache, ignore_errors=True)
                        ob = _stage(sys.executable, "ours_build", spec, d, f"_{ct}{sfx}", env=env)
                    ours_rounds.append(ob)
                elif run_bergson:
                    bergson_rounds.append(_bergson_build(args, peer_py, d, bc, sfx, r))
        # the warm build after the last cold one, whose compilation cache it reads
        obw = _stage(sys.executable, "ours_build", {**spec, "warm": True}, d, f"_{ct}_warm", resume=r, env=env)
        oq = _stage(sys.executable, "ours_query", spec, d, f"_{ct}", resume=r, env=env)
        if run_bergson:
            bspec = {**base, "correction": bc, **({"precision": "bf16"} if psfx else {})}
            bq = _stage(peer_py, "bergson_query", bspec, d, f"_{bc}{psfx}", resume=r)
            bergson[bc] = {"builds": bergson_rounds, "query": bq}
        # the round with the median wall time stands for the build (phases, steady rate); the
        # peak RSS is the largest of any round
        ob = sorted(ours_rounds, key=lambda o: o["wall_seconds"])[len(ours_rounds) // 2]
        ours_tps = [n * args.seq_len / o["wall_seconds"] for o in ours_rounds]
        flops = gemm["featurize_gemm_flops_per_token"][c]
        row = {
            "bench": "peer_race",
            "shape": shape,
            "correction": c,
            "precision": args.precision,
            "d": ob["d"],
            "tokens": n * args.seq_len,
            "ours_tokens_per_s": statistics.median(ours_tps),
            "ours_tokens_per_s_rounds": ours_tps,
            "build_rounds": len(ours_rounds),
            "ours_steady_tokens_per_s": ob["steady_tokens_per_s"],
            "ours_tokens_per_s_warm_cache": n * args.seq_len / obw["wall_seconds"],
            "ours_build_phases_s": {k: ob[f"{k}_seconds"] for k in ("import", "load", "first_batch", "rest")},
            "ours_build_phases_warm_cache_s": {
                k: obw[f"{k}_seconds"] for k in ("import", "load", "first_batch", "rest")
            },
            "ours_peak_rss_bytes": max(o["peak_rss_bytes"] for o in ours_rounds),
            "ours_query_seconds": oq["query_seconds"],
            "ours_query_peak_rss_bytes": oq["peak_rss_bytes"],
            "ours_exact_v": c == "adam",
            "ours_unembed": args.unembed,
            "subset": subset,
            "overlap_queries": args.overlap_queries,
            "torch_adamw_tokens_per_s": torch_train["torch_adamw_tokens_per_s"],
            "torch_adamw_tokens_per_s_prepare": prep["torch_adamw_tokens_per_s"],
            "ours_train_adamw_tokens_per_s": ours_train["ours_train_adamw_tokens_per_s"],
            "ours_train_adafactor_tokens_per_s": ours_train["ours_train_adafactor_tokens_per_s"],
            "train_rounds": len(rounds),
            "ours_train_adamw_over_torch": (
                ours_train["ours_train_adamw_tokens_per_s"] / torch_train["torch_adamw_tokens_per_s"]
            ),
            "ours_featurize_over_train": ob["steady_tokens_per_s"] / ours_train["ours_train_adafactor_tokens_per_s"],
            # the roofline: this run's best GEMM rate over our featurize step's GEMM FLOPs per token
            # (`plan.dot_flops` of the build's step)
            "gemm_peak_gflops": gemm["gemm_peak_gflops"],
            "gemm_dtype": gemm["gemm_dtype"],
            "ours_flops_per_token": flops,
            "ours_steady_gflops": ob["steady_tokens_per_s"] * flops / 1e9,
            "ours_roofline_tokens_per_s": gemm["gemm_peak_gflops"] * 1e9 / flops,
        }
        ours_top = np.load(d / f"{_ours_name(spec)}_top10.npy")
        ex_c = bc
        for s in EXACT_SETS:
            ex = np.load(d / f"exact_{ex_c}_{s}_top10.npy")
            row[f"ours_top10_overlap{'' if s == 'full' else '_' + s}"] = overlap(ours_top, ex)
        if bc in bergson:
            bbs, bq = bergson[bc]["builds"], bergson[bc]["query"]
            btop = np.load(d / f"bergson_{bc}{psfx}_top10.npy")
            bergson_tps = [n * args.seq_len / b["wall_seconds"] for b in bbs]
            row.update(
                {
                    "bergson_d": bq["d"],
                    "bergson_tokens_per_s": statistics.median(bergson_tps),
                    "bergson_tokens_per_s_rounds": bergson_tps,
                    "bergson_peak_rss_bytes": max(b["peak_rss_bytes"] for b in bbs),
                    "bergson_query_seconds": bq["query_seconds"],
                    "bergson_query_peak_rss_bytes": bq["peak_rss_bytes"],
                    "bergson_top10_overlap": overlap(btop, np.load(d / f"exact_{bc}_full_top10.npy")),
                    "bergson_top10_overlap_linear": overlap(btop, np.load(d / f"exact_{bc}_linear_top10.npy")),
                    "bergson_top10_overlap_unembed": overlap(btop, np.load(d / f"exact_{bc}_unembed_top10.npy")),
                }
            )
            # each round's ratio pairs the two builds run next to each other (for adam_rank1,
            # the exact-Adam run's bergson builds); the row's ratio is their median
            ratios = [o / b for o, b in zip(ours_tps, bergson_tps)]
            row["ours_over_bergson_rounds"] = ratios
            row["ours_over_bergson"] = statistics.median(ratios)
            row["ours_over_bergson_warm_cache"] = row["ours_tokens_per_s_warm_cache"] / row["bergson_tokens_per_s"]
            # the most ours_over_bergson could be with our FLOPs at this run's best GEMM rate
            row["roofline_over_bergson"] = row["ours_roofline_tokens_per_s"] / row["bergson_tokens_per_s"]
        else:
            for f in ROW_FIELDS:
                row.setdefault(f, None)
        row["loadavg_1m"] = round(os.getloadavg()[0], 2)
        row = {k: _rounded(v) for k, v in row.items()}
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(pathlib.Path(args.out) / "race.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    del exact
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="14m,70m")
    parser.add_argument("--corrections", default=",".join(CORRECTIONS))
    parser.add_argument("--tokens", type=int, default=65536, help="index tokens (>= 64k for the race)")
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="examples per featurize / train step (both tools)")
    parser.add_argument("--adam_steps", type=int, default=6, help="real AdamW steps giving V (and torch's timing)")
    parser.add_argument("--num_queries", type=int, default=100)
    parser.add_argument("--overlap_queries", type=int, default=16)
    parser.add_argument("--subset", type=int, default=512)
    parser.add_argument("--num_blocks", type=int, default=3)
    parser.add_argument("--proj_dim", type=int, default=32, help="ours: k, d = 2 num_blocks k^2 (6,144 by default)")
    parser.add_argument("--bergson_p", type=int, default=16, help="bergson: d = 24 p^2")
    parser.add_argument("--exact_batch", type=int, default=4)
    parser.add_argument(
        "--train_rounds", type=int, default=2, help="alternations of our and torch's train-step stages (best of each)"
    )
    parser.add_argument(
        "--build_rounds",
        type=int,
        default=3,
        help="alternations of our cold build and bergson's (median of each; the ratio: median of the rounds' ratios)",
    )
    parser.add_argument("--unembed", action="store_true", help="ours: also attribute embed_out (vectors.unembed)")
    parser.add_argument(
        "--precision",
        default="fp32",
        choices=("fp32", "bf16"),
        help="bf16: our GEMM operands in bf16 with float32 accumulation (model.matmul_dtype) and "
        "bergson's --precision bf16 (its model in bf16); the exact top-10 stays float32",
    )
    parser.add_argument("--out", default=str(pathlib.Path.home() / ".cache" / "trackstar_jax" / "peer_race"))
    parser.add_argument("--peer_venv", default=str(DEFAULT_VENV))
    parser.add_argument("--resume", action="store_true", help="reuse finished stages of an earlier run in --out")
    parser.add_argument(
        "--reuse_inputs",
        action="store_true",
        help="reuse only the prepared model / optimizer states and the exact top-10 of an earlier run in --out; "
        "time every build, query and train step again",
    )
    parser.add_argument("--no_bergson", action="store_true", help="ours only (bergson fields null)")
    parser.add_argument("--quick", action="store_true", help="micro smoke run: tiny shape, few tokens and queries")
    parser.add_argument("--stage", default="", help=argparse.SUPPRESS)
    parser.add_argument("--spec", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.stage:
        spec = json.loads(pathlib.Path(args.spec).read_text())
        result = STAGES[args.stage](spec)
        out = pathlib.Path(args.spec).with_name(pathlib.Path(args.spec).name.replace("spec_", "result_"))
        out.write_text(json.dumps(result))
        return
    if args.quick:
        args.shapes, args.tokens, args.num_queries, args.overlap_queries = "micro", 2048, 4, 4
        args.subset, args.adam_steps, args.batch, args.proj_dim, args.bergson_p = 16, 2, 4, 4, 2
        args.num_blocks, args.build_rounds = 2, 2
    if args.build_rounds < 1:
        raise SystemExit(f"--build_rounds must be at least 1, got {args.build_rounds}")
    args.corrections = [c for c in args.corrections.split(",") if c]
    bad = [c for c in args.corrections if c not in CORRECTIONS + ("none",)]
    if bad:
        raise SystemExit(f"--corrections: unknown {bad}; choose from {CORRECTIONS + ('none',)}")
    pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    peer_py = ensure_venv(pathlib.Path(args.peer_venv), need_bergson=not args.no_bergson)
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            raise SystemExit(f"--shapes: unknown {shape!r}; choose from {sorted(SHAPES)}")
        race_shape(shape, args, peer_py)


if __name__ == "__main__":
    main()
