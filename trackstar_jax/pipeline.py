"""The pipeline stages as functions of (config, workdir): the only module that reads the
experiment ConfigDict. It turns config sections into the typed, hashable objects the inner
modules take, owns the loops, logging and progress bars, and lays out the run directory:

    workdir/
      config.json         resolved config of the run (refused if a later stage disagrees)
      corpus/             examples (id -> text) and facts with gold evidence ids
      tokenizer.model     SentencePiece model trained on the corpus
      checkpoints/        orbax: params + full optimizer state + step + config
      index/              tensorstore zarr3 vectors, manifest, Hessian factors
      retrieval/          proponents / opponents per query (jsonl)
      eval/               table.json, table.md

Stages: `train` -> `build_index` -> `retrieve` -> `evaluate`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging as std_logging
import os
import pathlib
import time
import warnings
from typing import Any

import jax
import ml_collections
import numpy as np
import tqdm
from absl import logging

from trackstar_jax.evaluation import baselines as baselines_lib
from trackstar_jax.training import checkpoint as checkpoint_lib
from trackstar_jax.data import corpus as data_lib
from trackstar_jax.evaluation import embedding as embedding_lib
from trackstar_jax.models import generate as generate_lib
from trackstar_jax.index import hessian as hessian_lib
from trackstar_jax.index import store as index_lib
from trackstar_jax.evaluation import metrics as metrics_lib
from trackstar_jax.models import palm as model_lib
from trackstar_jax.distributed import multihost
from trackstar_jax.evaluation import queries as queries_lib
from trackstar_jax.retrieval import topk as retrieval_lib
from trackstar_jax.distributed import sharding as sharding_lib
from trackstar_jax.evaluation import tailpatch as tailpatch_lib
from trackstar_jax.training import step as train_lib
from trackstar_jax.features import vectors as vectors_lib
def model_config(config: ml_collections.ConfigDict) -> model_lib.LMConfig:
    """`config.model` -> `LMConfig` (unknown keys raise, naming the key)."""
    return _typed(model_lib.LMConfig, config.model, "model")


def optimizer_config(config: ml_collections.ConfigDict) -> train_lib.OptimizerConfig:
    """`config.train` -> `OptimizerConfig` (only the optimizer's keys are read)."""
    t = config.train
    return train_lib.OptimizerConfig(
        learning_rate=float(t.learning_rate),
        warmup_steps=int(t.warmup_steps),
        decay_rate=float(t.decay_rate),
        min_dim_size_to_factor=int(t.min_dim_size_to_factor),
        clipping_threshold=None if t.clipping_threshold is None else float(t.clipping_threshold),
        multiply_by_parameter_scale=bool(t.multiply_by_parameter_scale),
    )


def _typed(cls: Any, section: ml_collections.ConfigDict, name: str) -> Any:
    """Builds frozen dataclass `cls` from a config section; unknown keys are an error."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(cls)}
    values = section.to_dict()
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"unknown config key(s) in config.{name}: {', '.join(unknown)} (known: {', '.join(sorted(fields))})")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


# ---------------------------------------------------------------------------------------
# Stage 1: train (issue #2)
# ---------------------------------------------------------------------------------------

# Keys of config.train read by the training loop (the optimizer's keys are in OptimizerConfig).
TRAIN_LOOP_KEYS = ("num_steps", "global_batch_size", "log_every_steps", "eval_every_steps", "num_eval_batches",
                   "checkpoint_every_steps", "max_checkpoints_to_keep", "num_completions", "max_new_tokens")


def _check_train_keys(config: ml_collections.ConfigDict) -> None:
    known = set(TRAIN_LOOP_KEYS) | {f.name for f in dataclasses.fields(train_lib.OptimizerConfig)}
    unknown = sorted(set(config.train.keys()) - known)
    if unknown:
        raise ValueError(f"unknown config key(s) in config.train: {', '.join(unknown)} (known: {', '.join(sorted(known))})")


def prepare_data(config: ml_collections.ConfigDict, workdir: str | os.PathLike) -> tuple[data_lib.Corpus, data_lib.Tokenizer]:
    """Builds the corpus and trains the tokenizer, or reloads both from `workdir`.

    `workdir/corpus/` and `workdir/tokenizer.model` are written once; a rerun reuses them
    (its config.json has already been checked to describe the same data).

    Raises:
      ValueError: the trained vocabulary does not fit `config.model.vocab_size`.
    """
    workdir = pathlib.Path(workdir)
    model_cfg = model_config(config)
    corpus_dir = workdir / checkpoint_lib.CORPUS_DIR
    if (corpus_dir / "meta.json").exists():
        corpus = data_lib.load_corpus(corpus_dir)
        logging.info("reusing corpus %s (%d examples) from %s", corpus.name, len(corpus.examples), corpus_dir)
    else:
        corpus = data_lib.build_corpus(config.data, int(config.seed))
        data_lib.save_corpus(corpus, corpus_dir)
        logging.info("built corpus %s: %d examples, %d facts, %d held-out passages, fingerprint %s",
                     corpus.name, len(corpus.examples), len(corpus.facts), len(corpus.eval_texts), corpus.fingerprint[:12])
    tok_path = workdir / checkpoint_lib.TOKENIZER_FILE
    if tok_path.exists():
        tok = data_lib.load_tokenizer(tok_path)
    else:
        tok = data_lib.train_tokenizer(corpus.texts, model_cfg.vocab_size, tok_path, config.data.tokenizer_model_type)
        logging.info("trained %s tokenizer: %d pieces -> %s", config.data.tokenizer_model_type, tok.vocab_size, tok_path)
    if tok.vocab_size > model_cfg.vocab_size:
        raise ValueError(f"tokenizer at {tok_path} has {tok.vocab_size} pieces > config.model.vocab_size={model_cfg.vocab_size}")
    long = data_lib.truncation_report(corpus.texts, tok, model_cfg.max_len)
    if long:
        logging.warning("%d of %d passages exceed model.max_len=%d tokens and are truncated (example ids %s%s)",
                        len(long), len(corpus.examples), model_cfg.max_len, long[:10], " ..." if len(long) > 10 else "")
    return corpus, tok


def batch_shardings(mesh: jax.sharding.Mesh) -> dict[str, jax.sharding.NamedSharding]:
    """Shardings of a batch dict (rows over the data axes)."""
    return {"tokens": sharding_lib.batch_sharding(mesh, 2), "loss_mask": sharding_lib.batch_sharding(mesh, 2),
            "example_id": sharding_lib.batch_sharding(mesh, 1)}


def device_batch(batch: dict[str, np.ndarray], mesh: jax.sharding.Mesh) -> dict[str, jax.Array]:
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


def init_train_state(model_cfg: model_lib.LMConfig, opt: Any, seed: int,
                     mesh: jax.sharding.Mesh) -> tuple[Any, train_lib.TrainState]:
    """`(graphdef, state)` initialised directly into its shardings on `mesh` (jit out_shardings)."""
    graphdef, target = checkpoint_lib.abstract_state(model_cfg, opt, mesh)
    shardings = jax.tree.map(lambda x: x.sharding, target)
    state = jax.jit(lambda: train_lib.init_state(model_cfg, opt, seed)[1], out_shardings=shardings)()
    return graphdef, state


def make_jit_train_step(graphdef: Any, opt: Any, mesh: jax.sharding.Mesh, state: Any) -> Any:
    """`jit(train_step)` with explicit state / batch shardings over `mesh`, state donated."""
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    return jax.jit(functools.partial(train_lib.train_step, graphdef=graphdef, opt=opt),
                   in_shardings=(state_sh, batch_shardings(mesh)),
                   out_shardings=(state_sh, sharding_lib.replicated(mesh)), donate_argnums=0)


def make_jit_eval_step(graphdef: Any, mesh: jax.sharding.Mesh, params: Any) -> Any:
    """`jit(eval_step)`: summed loss and token count of a batch."""
    params_sh = jax.tree.map(lambda x: x.sharding, params)
    return jax.jit(functools.partial(train_lib.eval_step, graphdef=graphdef),
                   in_shardings=(params_sh, batch_shardings(mesh)), out_shardings=sharding_lib.replicated(mesh))


@dataclasses.dataclass(frozen=True)
class _TrainFns:
    graphdef: Any
    opt: Any
    target: Any  # abstract TrainState with shardings (restore target)
    init: Any  # () -> TrainState, placed in its shardings
    step: Any  # compiled train step (state donated)
    eval: Any  # jit(eval_step)


@functools.lru_cache(maxsize=4)
def _train_fns(model_cfg: model_lib.LMConfig, opt_cfg: train_lib.OptimizerConfig, seed: int,
               mesh: jax.sharding.Mesh, batch_size: int) -> _TrainFns:
    """The jitted pieces of `train`, built and compiled once per process and configuration
    (a rerun or a second stage in the same process reuses the compiled step)."""
    opt = train_lib.make_optimizer(opt_cfg)
    graphdef, target = checkpoint_lib.abstract_state(model_cfg, opt, mesh)
    shardings = jax.tree.map(lambda x: x.sharding, target)
    init = jax.jit(lambda: train_lib.init_state(model_cfg, opt, seed)[1], out_shardings=shardings)
    abstract_batch = {k: jax.ShapeDtypeStruct((batch_size,) + ((model_cfg.max_len,) if k != "example_id" else ()),
                                              np.int32, sharding=sh) for k, sh in batch_shardings(mesh).items()}
    compiled = make_jit_train_step(graphdef, opt, mesh, target).lower(target, abstract_batch).compile()
    mem = compiled.memory_analysis()
    if mem is not None:
        logging.info("train step memory: arguments %.1f MiB, outputs %.1f MiB, temporaries %.1f MiB",
                     mem.argument_size_in_bytes / 2**20, mem.output_size_in_bytes / 2**20,
                     mem.temp_size_in_bytes / 2**20)
    return _TrainFns(graphdef, opt, target, init, compiled, make_jit_eval_step(graphdef, mesh, target.params))


def fact_prompts(corpus: data_lib.Corpus, max_facts: int = 0) -> list[tuple[str, data_lib.Fact]]:
    """(prompt, fact) pairs for completions, round-robin over relations.

    The prompt is the relation's template 0 (embedded corpus) or, without templates (LAMA),
    the first evidence passage cut right before the object.
    """
    by_rel: dict[str, list[data_lib.Fact]] = {}
    for f in corpus.facts:
        by_rel.setdefault(f.relation, []).append(f)
    out = []
    for row in range(max((len(v) for v in by_rel.values()), default=0)):
        for rel in sorted(by_rel):
            if row >= len(by_rel[rel]):
                continue
            f = by_rel[rel][row]
            if corpus.templates.get(rel):
                out.append((data_lib.fill_template(corpus.templates[rel][0], f.subject), f))
            elif f.evidence_ids:
                # The longest passage prefix that ends right before an alias of the object.
                best = ""
                for e in f.evidence_ids[:8]:
                    text = corpus.examples[e].text
                    cuts = [text.find(a) for a in f.object_aliases if a and text.find(a) > 0]
                    if cuts and min(cuts) > len(best):
                        best = text[: min(cuts)].rstrip()
                if best:
                    out.append((best, f))
            if max_facts and len(out) >= max_facts:
                return out
    return out


def _is_correct(completion: str, fact: data_lib.Fact) -> bool:
    c = completion.strip().lower()
    return any(c.startswith(a.lower()) for a in fact.object_aliases if a)


def evaluate_completions(graphdef: Any, params: Any, tok: data_lib.Tokenizer, corpus: data_lib.Corpus, max_len: int,
                         max_new_tokens: int, max_facts: int = 256, batch_size: int = 64) -> list[dict]:
    """Greedy completions of fact prompts, marked correct when they start with an alias."""
    rows = []
    pairs = [(p, f) for p, f in fact_prompts(corpus, max_facts) if len(tok.encode(p)) + 1 < max_len]
    for i in range(0, len(pairs), batch_size):
        chunk = pairs[i:i + batch_size]
        prompts = [p for p, _ in chunk]
        prompts += [""] * (batch_size - len(prompts))  # one batch shape: one compilation
        outs = generate_lib.complete(graphdef, params, tok, prompts, max_new_tokens, max_len)
        rows += [{"fact_id": f.fact_id, "prompt": p, "completion": o, "target": f.object, "correct": _is_correct(o, f)}
                 for (p, f), o in zip(chunk, outs)]
    return rows


def _mean_loss(metrics: list[dict]) -> float:
    tot = sum(float(m["loss_sum"]) for m in metrics)
    n = sum(float(m["num_tokens"]) for m in metrics)
    return tot / max(n, 1.0)


def _evaluate(jit_eval_step: Any, params: Any, batches: list[dict]) -> float | None:
    if not batches:
        return None
    return _mean_loss(jax.device_get([jit_eval_step(params, b) for b in batches]))


class _DropLibraryInfo(std_logging.Filter):
    """Drops INFO/DEBUG records of orbax (dozens of lines per checkpoint); warnings pass."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        return record.levelno >= std_logging.WARNING or "/orbax/" not in record.pathname


def quiet_library_logs() -> None:
    """Keeps absl INFO logs readable: orbax's per-save INFO chatter is dropped."""
    for target in (logging.get_absl_handler(), logging.get_absl_logger()):
        if not any(isinstance(f, _DropLibraryInfo) for f in target.filters):
            target.addFilter(_DropLibraryInfo())


def train(config: ml_collections.ConfigDict, workdir: str | os.PathLike) -> dict:
    """Stage 1: corpus -> tokenizer -> pretraining (paper §A.3) -> loss and completions.

    Resumes from the latest checkpoint in `workdir` when one exists (the batches continue
    exactly where they stopped); a workdir of a different run is refused. Writes
    `config.json`, `corpus/`, `tokenizer.model`, `checkpoints/`, `metrics.jsonl` and
    `train_summary.json`.

    Returns:
      The summary: final step, train / eval loss, fact accuracy, completions, throughput.
    """
    workdir = pathlib.Path(workdir)
    quiet_library_logs()
    _check_train_keys(config)
    data_lib.data_config(config.data)  # unknown data keys fail before anything is written
    model_cfg, opt_cfg = model_config(config), optimizer_config(config)
    t = config.train
    # Multi-host: one SPMD program over the global mesh. Process 0 writes the run directory's
    # plain files; the others wait for them (failing at once if process 0 fails), then check
    # and reload them. Checkpoints are saved and restored by every process (orbax).
    primary = multihost.is_primary()
    with multihost.step("train:run_dir"):
        if primary:
            checkpoint_lib.save_run_config(workdir, config)
            corpus, tok = prepare_data(config, workdir)
    if not primary:
        checkpoint_lib.save_run_config(workdir, config, write=False)
        corpus, tok = prepare_data(config, workdir)

    mesh = sharding_lib.make_mesh(tuple(config.mesh.shape))
    dp = sharding_lib.data_parallel_size(mesh)
    if t.global_batch_size % dp:
        raise ValueError(f"config.train.global_batch_size={t.global_batch_size} is not divisible by the "
                         f"{dp} data-parallel shards of mesh {dict(mesh.shape)}")
    mngr = checkpoint_lib.CheckpointManager(workdir / checkpoint_lib.CHECKPOINT_DIR, t.max_checkpoints_to_keep)
    must_match = dict(sections=checkpoint_lib.RUN_SECTIONS + ("train",),
                      ignore=tuple(f"train.{k}" for k in checkpoint_lib.RESUMABLE_TRAIN_KEYS))
    if mngr.latest_step() is not None:  # refuse a foreign checkpoint before compiling anything
        bad = checkpoint_lib.config_mismatches(mngr.saved_config(), config, **must_match)
        if bad:
            raise ValueError(f"checkpoint {mngr.directory}/{mngr.latest_step()} does not match the config: "
                             + "; ".join(bad))
    fns = _train_fns(model_cfg, opt_cfg, int(config.seed), mesh, int(t.global_batch_size))
    graphdef = fns.graphdef
    if mngr.latest_step() is not None:
        start, state = mngr.restore_latest(fns.target, expect_config=config, **must_match)
        logging.info("resumed from %s at step %d", mngr.directory, start)
    else:
        state, start = fns.init(), 0
    logging.info("model: %d parameters; mesh %s; %d examples; batch %d x %d tokens", model_lib.param_count(state.params),
                 dict(mesh.shape), len(corpus.examples), t.global_batch_size, model_cfg.max_len)

    seq_len = model_cfg.max_len
    batches = data_lib.train_batches(corpus, tok, t.global_batch_size, seq_len, int(config.seed), start_step=start)
    eval_batches = [device_batch(b, mesh) for b in
                    data_lib.eval_batches(corpus, tok, t.global_batch_size, seq_len, t.num_eval_batches)]
    jit_eval_step = fns.eval
    metrics_file = open(workdir / "metrics.jsonl", "a") if primary else None

    def log(record: dict) -> None:
        if metrics_file is not None:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()

    train_loss, eval_loss, tokens_per_sec = None, None, None
    num_steps = int(t.num_steps)
    if start >= num_steps:
        logging.info("checkpoint step %d >= train.num_steps=%d: nothing to train", start, num_steps)
    else:
        batch = device_batch(next(batches), mesh)
        compiled = fns.step
        pending: list[dict] = []
        bar = tqdm.tqdm(total=num_steps, initial=start, desc="train", disable=jax.process_index() > 0,
                        mininterval=2.0, dynamic_ncols=True)
        t0, tok0 = time.perf_counter(), 0
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
            for step in range(start + 1, num_steps + 1):
                state, m = compiled(state, batch)
                pending.append(m)  # stays on device; fetched every log_every_steps
                if step < num_steps:
                    batch = device_batch(next(batches), mesh)
                bar.update(1)
                if step % t.log_every_steps == 0 or step == num_steps:
                    fetched = jax.device_get(pending)
                    pending = []
                    n_tok = sum(float(x["num_tokens"]) for x in fetched)
                    train_loss = sum(float(x["loss"]) * float(x["num_tokens"]) for x in fetched) / max(n_tok, 1.0)
                    tok0 += len(fetched) * t.global_batch_size * seq_len
                    tokens_per_sec = tok0 / (time.perf_counter() - t0)
                    rec = {"step": step, "train/loss": train_loss, "train/grad_norm": float(fetched[-1]["grad_norm"]),
                           "train/tokens_per_sec": tokens_per_sec}
                    bar.set_postfix(loss=f"{train_loss:.3f}")
                    logging.info("step %d: %s", step, " ".join(f"{k}={v:.4g}" for k, v in rec.items() if k != "step"))
                    log(rec)
                if step % t.eval_every_steps == 0 or step == num_steps:
                    eval_loss = _evaluate(jit_eval_step, state.params, eval_batches)
                    if eval_loss is not None:
                        logging.info("step %d: eval/loss=%.4f", step, eval_loss)
                        log({"step": step, "eval/loss": eval_loss})
                if step % t.checkpoint_every_steps == 0 or step == num_steps:
                    mngr.save(state, config)
        bar.close()
    mngr.wait_until_finished()
    mngr.close()
    if metrics_file is not None:
        metrics_file.close()

    final_step = int(jax.device_get(state.step))
    if eval_loss is None:
        eval_loss = _evaluate(jit_eval_step, state.params, eval_batches)
    rows = evaluate_completions(graphdef, state.params, tok, corpus, model_cfg.max_len, int(t.max_new_tokens))
    accuracy = sum(r["correct"] for r in rows) / len(rows) if rows else None
    for r in rows[: t.num_completions]:
        logging.info("%s %r -> %r (target %r)", "OK " if r["correct"] else "   ", r["prompt"], r["completion"], r["target"])
    summary = {"step": final_step, "train_loss": train_loss, "eval_loss": eval_loss, "fact_accuracy": accuracy,
               "num_fact_prompts": len(rows), "tokens_per_sec": tokens_per_sec,
               "num_params": model_lib.param_count(state.params), "completions": rows[: t.num_completions]}
    if primary:
        (workdir / "train_summary.json").write_text(json.dumps(summary, indent=1))
    logging.info("trained to step %d: train loss %s, eval loss %s, fact accuracy %s (%d prompts)", final_step,
                 None if train_loss is None else f"{train_loss:.4f}", None if eval_loss is None else f"{eval_loss:.4f}",
                 None if accuracy is None else f"{accuracy:.3f}", len(rows))
    return summary


# ---------------------------------------------------------------------------------------
# Stage 2: build_index (issue #4)
# ---------------------------------------------------------------------------------------

# Smallest padded length of a featurize batch; lengths are rounded up to powers of two from
# here to model.max_len, so short passages (T-REx sentences) do not pay for max_len padding
# and the step compiles at most log2(max_len / 16) + 1 times.
MIN_BUCKET_LEN = 16


def hessian_config(config: ml_collections.ConfigDict) -> hessian_lib.HessianConfig:
    """`config.hessian` -> `HessianConfig` (unknown keys raise, naming the key)."""
    return _typed(hessian_lib.HessianConfig, config.hessian, "hessian")


def storage_config(config: ml_collections.ConfigDict) -> index_lib.StorageConfig:
    """`config.index` -> `StorageConfig` (dtype, chunk_rows, r_every_chunks)."""
    section = config.index
    known = {f.name for f in dataclasses.fields(index_lib.StorageConfig)} | {"dir"}
    unknown = sorted(set(section.keys()) - known)
    if unknown:
        raise ValueError(f"unknown config key(s) in config.index: {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return index_lib.StorageConfig(dtype=str(section.dtype), chunk_rows=int(section.chunk_rows),
                                   r_every_chunks=int(section.get("r_every_chunks", 0)))


def index_dir(config: ml_collections.ConfigDict, workdir: str | os.PathLike) -> pathlib.Path:
    """Where the index of this config lives: `workdir/<config.index.dir>` (default `index`).

    Use a separate `index.dir` per vector setting (e.g. `index_nocorr` for correction off);
    R and unit-norm ablations reuse one index (they apply at scoring time).
    """
    return pathlib.Path(workdir) / str(config.index.get("dir", "index") or "index")


def bucket_len(longest: int, max_len: int) -> int:
    """Padded length of a batch whose longest example has `longest` tokens (power of two)."""
    n = MIN_BUCKET_LEN
    while n < longest:
        n *= 2
    return min(n, max_len)


def index_manifest(run: checkpoint_lib.Run, vec_cfg: vectors_lib.VectorConfig, storage: index_lib.StorageConfig,
                   dim: int) -> dict:
    """The manifest of the index of `run` under `vec_cfg` (what a resume or a reader must match)."""
    fp_tree = {"params": run.params, "opt_state": run.opt_state} if vec_cfg.correction else {"params": run.params}
    num_blocks_total, _ = vectors_lib.block_layout(vec_cfg)
    vec = dataclasses.asdict(vec_cfg)
    del vec["batch_size"]  # recorded under featurizer
    return index_lib.make_manifest(
        num_rows=len(run.corpus.examples), dim=dim, num_blocks_total=num_blocks_total, storage=storage,
        model={"checkpoint_step": int(run.step), "fingerprint": index_lib.tree_fingerprint(fp_tree),
               "config": dataclasses.asdict(run.model_cfg)},
        vectors=vec,
        corpus={"name": run.corpus.name, "fingerprint": run.corpus.fingerprint, "num_examples": len(run.corpus.examples)},
        featurizer={"batch_size": int(vec_cfg.batch_size), "max_len": int(run.model_cfg.max_len),
                    "length_buckets": f"pow2>={MIN_BUCKET_LEN}"},
        info={"workdir": str(run.workdir), "devices": [str(d) for d in jax.local_devices()],
              "jax_version": jax.__version__},
    )


def make_rows_fn(run: checkpoint_lib.Run, vec_fn: vectors_lib.VectorFn, mesh: jax.sharding.Mesh,
                 counters: dict) -> Any:
    """`rows_fn(start, stop)` for `IndexBuilder`: featurizes examples `[start, stop)`.

    Batches never straddle the call's row range (so a resumed or split build forms the same
    batches), are padded to `vectors.batch_size` rows and to a power-of-two length, and are
    dispatched without blocking: the device works on them while the builder writes the
    previous chunk. `counters["tokens"]` accumulates the non-padding tokens.
    """
    tok, max_len, bs = run.tokenizer, run.model_cfg.max_len, vec_fn.vec_cfg.batch_size
    examples = run.corpus.examples

    def rows_fn(start: int, stop: int) -> jax.Array:
        outs = []
        for lo in range(start, stop, bs):
            hi = min(lo + bs, stop)
            items = []
            for e in examples[lo:hi]:
                t, truncated = data_lib.encode_example(tok, e.text, max_len)
                counters["truncated"] += int(truncated)
                m = np.ones(len(t), np.int32)
                m[0] = 0  # BOS is never a target; every other token is (paper §3: all tokens of a training example)
                items.append((t, m))
            counters["tokens"] += sum(len(t) for t, _ in items)
            seq_len = bucket_len(max(len(t) for t, _ in items), max_len)
            batch = data_lib.pad_batch(items, list(range(lo, hi)), bs, seq_len)
            vecs, _ = vec_fn.jitted(run.params, vec_fn.precond, device_batch(
                {"tokens": batch["tokens"], "loss_mask": batch["loss_mask"]}, mesh))
            outs.append(vecs[: hi - lo])
        return outs[0] if len(outs) == 1 else jax.numpy.concatenate(outs)

    return rows_fn


def build_index(config: ml_collections.ConfigDict, workdir: str | os.PathLike, *, process_index: int | None = None,
                process_count: int | None = None, sync_timeout_s: float = 4 * 3600) -> dict:
    """Stage 2: one pass over the corpus with the fast featurizer -> zarr3 index + R_train (§3, §A.1.3).

    Resumes an interrupted build (refusing one whose model, vectors, storage or corpus
    differ); with `process_count > 1`, this call writes only its share of whole R_train
    segments. Each writer featurizes over its own (process-local) devices.

    - Independent processes (single-process JAX each, e.g. one per GPU): pass
      `process_index` / `process_count`; the last one to finish finalises R_train.
    - A `jax.distributed` job (a pod): every process is one writer (`process_index` /
      `process_count` default to jax's, see `multihost.writer_partition`); after all have
      written, process 0 finalises R_train once, waiting at most `sync_timeout_s` for the
      others (a failing process makes the others fail at once).

    Returns:
      Summary (also written to `index/build_summary-pXXXX.json`): rows, examples/s, tokens/s,
      write_fraction, bytes per example.
    """
    quiet_library_logs()
    path = index_dir(config, workdir)
    vec_cfg = vectors_lib.vector_config(config.vectors)
    storage = storage_config(config)
    process_index, process_count = multihost.writer_partition(process_index, process_count)
    spmd = multihost.is_multiprocess()
    # Local devices only: per-example vectors need no communication, so on a pod each host
    # is an independent writer (in a single process these are all devices).
    mesh = sharding_lib.make_mesh(tuple(config.mesh.shape), devices=jax.local_devices())
    dp = sharding_lib.data_parallel_size(mesh)
    if vec_cfg.batch_size % dp:
        raise ValueError(f"config.vectors.batch_size={vec_cfg.batch_size} is not divisible by the {dp} data shards of mesh {dict(mesh.shape)}")
    run = checkpoint_lib.load_run(workdir, mesh=mesh)
    bad = checkpoint_lib.config_mismatches(run.config, config, sections=checkpoint_lib.RUN_SECTIONS, ignore=())
    if bad:
        raise ValueError(f"config disagrees with the run in {workdir} (its config.json): " + "; ".join(bad))
    vec_fn = vectors_lib.make_vector_fn(run.graphdef, run.model_cfg, vec_cfg, run.params, run.opt_state, mesh=mesh, role="index")
    num_blocks_total, block_dim = vectors_lib.block_layout(vec_cfg)
    if vec_fn.dim != num_blocks_total * block_dim:
        raise ValueError(f"featurizer dim {vec_fn.dim} != {num_blocks_total} blocks x {block_dim}")
    manifest = index_manifest(run, vec_cfg, storage, vec_fn.dim)
    # Under jax.distributed a writer that fails here (a refused manifest, a full disk) tells
    # the others, which then fail at once instead of waiting for it at the barrier.
    with multihost.step("build_index:written", sync_timeout_s):
        builder = index_lib.IndexBuilder(path, manifest, process_index=process_index, process_count=process_count)
        counters = {"tokens": 0, "truncated": 0}
        rows_fn = make_rows_fn(run, vec_fn, mesh, counters)
        logging.info("index %s: %d rows x d=%d (%s), chunks of %d rows, this process writes chunks [%d, %d)", path,
                     builder.num_rows, vec_fn.dim, storage.dtype, builder.chunk_rows, builder.chunks.start,
                     builder.chunks.stop)
        bar = tqdm.tqdm(total=len(builder.chunks), desc="index", unit="chunk", disable=jax.process_index() > 0,
                        mininterval=2.0, dynamic_ncols=True)
        stats = builder.build(rows_fn, progress=lambda done, total: bar.update(done - bar.n), finalize_when_done=not spmd)
        bar.close()
    if spmd:  # every writer is done: finalise exactly once, on process 0
        with multihost.step("build_index:finalized", sync_timeout_s):
            if multihost.is_primary():
                index_lib.finalize(path, finalized_by=f"process {process_index} of {process_count}")
        stats.finalized = (path / "COMPLETE").exists()
    if counters["truncated"]:
        logging.warning("%d passages were truncated to model.max_len=%d tokens", counters["truncated"], run.model_cfg.max_len)
    itemsize = index_lib._NP_DTYPES[storage.dtype].itemsize
    summary = {
        "index": str(path), "process_index": process_index, "process_count": process_count,
        "rows": builder.num_rows, "dim": vec_fn.dim, "dtype": storage.dtype,
        "rows_written": stats.rows_written, "chunks_written": stats.chunks_written,
        "chunks_skipped": stats.chunks_skipped, "chunks_read_back": stats.chunks_read_back,
        "tokens": counters["tokens"], "seconds": stats.seconds,
        "examples_per_s": stats.rows_written / stats.seconds if stats.seconds else None,
        "tokens_per_s": counters["tokens"] / stats.seconds if stats.seconds else None,
        "write_seconds": stats.write_seconds, "write_fraction": stats.write_fraction,
        "bytes_per_example": vec_fn.dim * itemsize + (4 if storage.dtype == "int8" else 0),
        "complete": stats.finalized,
        "finalized_by": index_lib.finalized_by(path) if stats.finalized else None,
    }
    (path / f"build_summary-p{process_index:04d}.json").write_text(json.dumps(summary, indent=1))
    logging.info("index: wrote %d rows in %.1fs (%.1f examples/s, %.0f tokens/s, writing %.1f%% of the time)%s",
                 stats.rows_written, stats.seconds, summary["examples_per_s"] or 0, summary["tokens_per_s"] or 0,
                 100 * stats.write_fraction, "; complete" if stats.finalized else "")
    return summary


def verify_index(config: ml_collections.ConfigDict, workdir: str | os.PathLike, *, recompute_r: bool = True) -> dict:
    """Checks the whole index of this config (see `index.verify_index`); raises naming bad row ranges."""
    return index_lib.verify_index(index_dir(config, workdir), recompute_r=recompute_r)


# ---------------------------------------------------------------------------------------
# Stage 3: retrieve (issue #5)
# ---------------------------------------------------------------------------------------


RETRIEVAL_KEYS = ("top_k", "query_batch_size", "read_chunk_rows", "queries", "output", "overwrite")
RETRIEVAL_DIR = "retrieval"
RETRIEVAL_FORMAT = "trackstar_jax.retrieval/1"


@dataclasses.dataclass(frozen=True)
class RetrievalSettings:
    """`config.retrieval`, checked (see experiments/base.py for the meaning of each key)."""

    top_k: int
    query_batch_size: int
    read_chunk_rows: int
    queries: str
    output: str
    overwrite: bool


def retrieval_settings(config: ml_collections.ConfigDict) -> RetrievalSettings:
    """`config.retrieval` -> `RetrievalSettings` (unknown keys and bad values raise, naming the key)."""
    section = config.retrieval
    unknown = sorted(set(section.keys()) - set(RETRIEVAL_KEYS))
    if unknown:
        raise ValueError(f"unknown config key(s) in config.retrieval: {', '.join(unknown)} (known: {', '.join(RETRIEVAL_KEYS)})")
    s = RetrievalSettings(top_k=int(section.top_k), query_batch_size=int(section.query_batch_size),
                          read_chunk_rows=int(section.read_chunk_rows), queries=str(section.get("queries", "") or ""),
                          output=str(section.get("output", "") or ""), overwrite=bool(section.get("overwrite", False)))
    for key in ("top_k", "query_batch_size", "read_chunk_rows"):
        if getattr(s, key) < 1:
            raise ValueError(f"config.retrieval.{key} must be >= 1, got {getattr(s, key)}")
    if s.output and (pathlib.Path(s.output).name != s.output or s.output.startswith(".")):
        raise ValueError(f"config.retrieval.output must be a plain file name stem, got {s.output!r}")
    return s


@dataclasses.dataclass(frozen=True)
class TextQuery:
    """A query given as text: `prompt` + `target` (the target starts with a space, " Paris").

    `extra` fields are copied into the query's output record (e.g. fact_id, model_correct).
    """

    example_id: Any
    prompt: str
    target: str
    extra: tuple[tuple[str, Any], ...] = ()


def load_text_queries(path: str | os.PathLike) -> list[TextQuery]:
    """Reads a jsonl of `{"prompt", "target"[, "example_id"]}` (example_id defaults to the line number).

    Raises:
      ValueError: a malformed line (names the file and line).
    """
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from e
            if not isinstance(rec, dict) or not all(isinstance(rec.get(k), str) for k in ("prompt", "target")):
                raise ValueError(f"{path}:{n}: expected an object with string fields 'prompt' and 'target'")
            out.append(TextQuery(rec.get("example_id", len(out)), rec["prompt"], rec["target"]))
    return out


def expected_index_identity(run: checkpoint_lib.Run, config: ml_collections.ConfigDict, dim: int) -> dict:
    """Manifest sections an index must match for queries featurized by `run` under `config`
    (model weights + optimizer state fingerprint, vector settings, corpus)."""
    m = index_manifest(run, vectors_lib.vector_config(config.vectors), storage_config(config), dim)
    return {section: m[section] for section in ("model", "vectors", "corpus")}


def retrieve_queries(run: checkpoint_lib.Run, config: ml_collections.ConfigDict, workdir: str | os.PathLike,
                     queries: list[TextQuery], *, mesh: jax.sharding.Mesh | None = None,
                     k: int | None = None) -> tuple[list[dict], dict]:
    """Featurizes text queries like the index and retrieves their proponents / opponents.

    The queries' vectors come from the same model, optimizer state (correction), projection and
    R as the index (`config.vectors`, `config.hessian`); the index manifest is checked against
    them first. Notebook use: `records, info = pipeline.retrieve_queries(run, config, workdir,
    [pipeline.TextQuery(0, "Paris is the capital of", " France")])`.

    Returns:
      `(records, info)`: one PAIR-code-schema dict per query (example_id, inputs_plaintext,
      targets_plaintext, proponents, proponent_ids, proponent_scores, opponents, opponent_ids,
      opponent_scores), and what was used (index, whitening, timings).

    Raises:
      index.IndexMismatchError: the index was built from another model / projection / corpus
        (names the manifest field).
      ValueError: a query that cannot be encoded (names it), bad k.
    """
    st = retrieval_settings(config)
    k = st.top_k if k is None else int(k)
    mesh = mesh if mesh is not None else sharding_lib.make_mesh(tuple(config.mesh.shape))
    path = index_dir(config, workdir)
    vec_cfg = vectors_lib.vector_config(config.vectors)
    if not (path / "manifest.json").exists():
        raise FileNotFoundError(f"no index at {path} (run `python -m launch.build_index` with this config first)")
    num_blocks_total, block_dim = vectors_lib.block_layout(vec_cfg)
    reader = index_lib.open_index(path, expect=expected_index_identity(run, config, num_blocks_total * block_dim))
    if k < 1 or k > reader.num_rows:
        raise ValueError(f"config.retrieval.top_k={k} must be in [1, {reader.num_rows}] (the index has {reader.num_rows} rows)")
    info = {"index": str(path), "index_rows": reader.num_rows, "index_dtype": reader.dtype_name, "k": k}
    if not queries:
        return [], info
    t0 = time.perf_counter()
    encoded = [data_lib.encode_query(run.tokenizer, q.prompt, q.target, run.model_cfg.max_len, query_id=q.example_id)
               for q in queries]
    vec_fn = vectors_lib.make_vector_fn(run.graphdef, run.model_cfg, vec_cfg, run.params, run.opt_state, mesh=mesh,
                                        role="query")
    q_raw = query_vectors(run, vec_fn, [(e["tokens"], e["loss_mask"]) for e in encoded], mesh)
    t1 = time.perf_counter()
    info["featurize_seconds"] = t1 - t0
    scoring = index_lib.prepare_scoring(reader, hessian_config(config), q_raw)
    q_prime = scoring.finalize_queries(q_raw)
    t2 = time.perf_counter()
    res = retrieval_lib.stream_topk(q_prime, reader, k, st.read_chunk_rows, mesh=mesh, row_scale=scoring.row_scale,
                                    query_batch_size=st.query_batch_size)
    t3 = time.perf_counter()
    info.update(whitening=scoring.whitening.describe(), scoring_prep_seconds=t2 - t1, retrieval_seconds=t3 - t2,
                dots_per_s=len(queries) * reader.num_rows / max(t3 - t2, 1e-9))
    texts = run.corpus.texts
    records = []
    for qi, q in enumerate(queries):
        top, bot = res.top_ids[qi].tolist(), res.bottom_ids[qi].tolist()
        records.append({
            **dict(q.extra),
            "example_id": q.example_id, "inputs_plaintext": q.prompt, "targets_plaintext": q.target,
            "proponents": [texts[i] for i in top], "proponent_ids": top,
            "proponent_scores": [float(s) for s in res.top_scores[qi]],
            "opponents": [texts[i] for i in bot], "opponent_ids": bot,
            "opponent_scores": [float(s) for s in res.bottom_scores[qi]]})
        if "entailing_ids" in records[-1]:  # fact queries: which proponents state the fact (Table 1 files)
            gold = set(records[-1]["entailing_ids"])
            records[-1]["proponent_correct"] = [i in gold for i in top]
    return records, info


def _atomic_write_text(path: pathlib.Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def retrieve(config: ml_collections.ConfigDict, workdir: str | os.PathLike) -> dict:
    """Stage 3: proponents and opponents of every query over the whole index (exact, §4).

    Queries come from `config.retrieval.queries` (a jsonl of `{"prompt", "target"}`), or, when
    that is empty, from the evaluation's query set (`config.eval`, facts of the run's corpus).
    Each query (prompt + target, loss on the target tokens only) is featurized with the same
    model / projection / correction as the index (checked against its manifest), finalised
    with the same R (`config.hessian`), and scored against every row (`retrieval.stream_topk`).

    Writes `workdir/retrieval/<name>.jsonl` (PAIR-code/pretraining-tda schema, one query per
    line) and `<name>.manifest.json` (what produced it). Refuses to replace existing output
    unless `config.retrieval.overwrite` is set.

    Returns:
      The manifest (also written), with counts and timings.
    """
    quiet_library_logs()
    st = retrieval_settings(config)
    # Cheap refusals first (bad query file, existing output), before loading the run.
    ev = None if st.queries else eval_settings(config)
    queries = load_text_queries(st.queries) if st.queries else None
    name = st.output or (pathlib.Path(st.queries).stem if st.queries else f"eval_{ev.query_mode}_t{ev.template_variant}")
    out_dir = pathlib.Path(workdir) / RETRIEVAL_DIR
    out, man_path = out_dir / f"{name}.jsonl", out_dir / f"{name}.manifest.json"
    if not st.overwrite and (out.exists() or man_path.exists()):
        raise FileExistsError(f"{out} already exists: set --config.retrieval.overwrite=True to replace it, "
                              "or --config.retrieval.output=<another name>")
    mesh = sharding_lib.make_mesh(tuple(config.mesh.shape))
    run = checkpoint_lib.load_run(workdir, mesh=mesh)
    bad = checkpoint_lib.config_mismatches(run.config, config, sections=checkpoint_lib.RUN_SECTIONS, ignore=())
    if bad:
        raise ValueError(f"config disagrees with the run in {workdir} (its config.json): " + "; ".join(bad))
    if st.queries:
        source = {"kind": "jsonl", "path": str(st.queries)}
    else:
        eq = make_eval_queries(run, ev, str(run.config.data.get("path", "")))
        queries = [TextQuery(q.query_id, q.prompt, q.target, (
            ("fact_id", q.fact_id), ("relation", q.relation), ("model_completion", c), ("model_correct", ok),
            ("entailing_ids", list(q.entailing_ids)))) for q, c, ok in zip(eq.queries, eq.completions, eq.correct)]
        source = {"kind": "eval", "query_mode": ev.query_mode, "template_variant": ev.template_variant}
    records, info = retrieve_queries(run, config, workdir, queries, mesh=mesh)
    out_dir.mkdir(parents=True, exist_ok=True)
    _atomic_write_text(out, "".join(json.dumps({**r, "query_set": name}, ensure_ascii=False) + "\n" for r in records))
    reader = index_lib.open_index(info["index"])
    manifest = {
        "format": RETRIEVAL_FORMAT, "name": name, "queries": source, "num_queries": len(records), "output": str(out),
        "index_fingerprint": index_lib.manifest_fingerprint(reader.manifest), "checkpoint_step": int(run.step),
        "vectors": checkpoint_lib.config_to_dict(config.vectors), "hessian": checkpoint_lib.config_to_dict(config.hessian),
        "retrieval": dataclasses.asdict(st), "mesh": dict(mesh.shape), "devices": [str(d) for d in jax.devices()],
        "jax_version": jax.__version__, **info}
    _atomic_write_text(man_path, json.dumps(manifest, indent=1, default=str))
    logging.info("retrieve: %d queries x %d rows in %.2fs -> %s", len(records), info["index_rows"],
                 info.get("retrieval_seconds", 0.0), out)
    return manifest


# ---------------------------------------------------------------------------------------
# Stage 4: evaluate (issue #6)
# ---------------------------------------------------------------------------------------


# Keys of config.eval / config.tailpatch read by `evaluate` (a misspelt key is an error).
EVAL_KEYS = ("query_mode", "template_variant", "max_queries", "methods", "relations", "lama_dir", "pararel_dir",
             "num_proponents", "max_per_bucket", "max_per_relation_target_per_bucket", "max_per_relation_target",
             "max_incorrect_per_bucket", "bucket_edges", "include_unmentioned", "max_new_tokens", "bm25_k1", "bm25_b",
             "bootstrap_seed", "num_examples_shown", "output_dir")
TAILPATCH_KEYS = ("top_ks", "learning_rate", "batch_size")
QUERY_MODES = ("gold", "prediction")
EVAL_DIR = "eval"


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """Typed view of `config.eval` + `config.tailpatch` (see experiments/base.py)."""

    query_mode: str
    template_variant: int
    max_queries: int
    methods: tuple[str, ...]
    relations: tuple[str, ...]
    lama_dir: str
    pararel_dir: str
    num_proponents: int
    selection: queries_lib.SelectionConfig
    max_new_tokens: int
    bm25_k1: float
    bm25_b: float
    bootstrap_seed: int
    num_examples_shown: int
    top_ks: tuple[int, ...]
    tailpatch_lr: float
    tailpatch_batch_size: int


def eval_settings(config: ml_collections.ConfigDict) -> EvalSettings:
    """`config.eval` / `config.tailpatch` -> `EvalSettings` (unknown keys and bad values raise, naming the key)."""
    for name, known in (("eval", EVAL_KEYS), ("tailpatch", TAILPATCH_KEYS)):
        unknown = sorted(set(config[name].keys()) - set(known))
        if unknown:
            raise ValueError(f"unknown config key(s) in config.{name}: {', '.join(unknown)} (known: {', '.join(known)})")
    e, t = config.eval, config.tailpatch
    if e.query_mode not in QUERY_MODES:
        raise ValueError(f"config.eval.query_mode must be one of {QUERY_MODES}, got {e.query_mode!r}")
    methods = tuple(e.methods)
    for m in methods:
        baselines_lib.method(m)  # raises naming an unknown row
    if not methods:
        raise ValueError("config.eval.methods is empty: name at least one row (e.g. 'bm25', 'trackstar')")
    top_ks = tuple(int(k) for k in t.top_ks)
    if int(e.num_proponents) < max(top_ks, default=1) or int(e.num_proponents) < 1:
        raise ValueError(f"config.eval.num_proponents={e.num_proponents} must be >= max(config.tailpatch.top_ks)={max(top_ks)}")
    edges = tuple(int(x) for x in e.bucket_edges)
    if not edges or list(edges) != sorted(set(edges)) or edges[0] < 1:
        raise ValueError(f"config.eval.bucket_edges must be increasing positive integers, got {edges}")
    sel = queries_lib.SelectionConfig(
        max_per_bucket=int(e.max_per_bucket), max_per_relation_target_per_bucket=int(e.max_per_relation_target_per_bucket),
        max_per_relation_target=int(e.max_per_relation_target), max_incorrect_per_bucket=int(e.max_incorrect_per_bucket),
        bucket_edges=edges, include_unmentioned=bool(e.include_unmentioned), seed=int(config.seed))
    return EvalSettings(
        query_mode=str(e.query_mode), template_variant=int(e.template_variant), max_queries=int(e.max_queries),
        methods=methods, relations=tuple(r.strip() for r in str(e.relations).split(",") if r.strip()),
        lama_dir=str(e.lama_dir), pararel_dir=str(e.pararel_dir), num_proponents=int(e.num_proponents), selection=sel,
        max_new_tokens=int(e.max_new_tokens), bm25_k1=float(e.bm25_k1), bm25_b=float(e.bm25_b),
        bootstrap_seed=int(e.bootstrap_seed), num_examples_shown=int(e.num_examples_shown), top_ks=top_ks,
        tailpatch_lr=float(t.learning_rate), tailpatch_batch_size=int(t.batch_size))


@dataclasses.dataclass
class EvalQueries:
    """The query set of an evaluation run.

    Attributes:
      queries: encoded queries (query_id = row).
      encoded: `(tokens, loss_mask)` per query.
      completions, correct: the model's greedy completion of each prompt and its §4.2 correctness.
      report: what happened to every fact (drops, no evidence, empty targets).
      templates: the templates used.
    """

    queries: list[queries_lib.Query]
    encoded: list[tuple[np.ndarray, np.ndarray]]
    completions: list[str]
    correct: list[bool]
    report: queries_lib.QueryReport
    templates: dict[str, list[str]]


def eval_templates(run: checkpoint_lib.Run, ev: EvalSettings, relations: list[str], data_path: str) -> dict[str, list[str]]:
    """The corpus's own templates (embedded source) or LAMA relations.jsonl + ParaRel (LAMA source)."""
    if run.corpus.templates:
        return {k: list(v) for k, v in run.corpus.templates.items()}
    lama = ev.lama_dir or data_path
    if not lama:
        raise ValueError("the corpus has no prompt templates: set config.eval.lama_dir to a folder with LAMA relations.jsonl")
    root = pathlib.Path(lama)
    root = root if (root / "relations.jsonl").is_file() else root.parent  # data.path may point at TREx/
    return queries_lib.load_templates(root, ev.pararel_dir or None, relations)


def make_eval_queries(run: checkpoint_lib.Run, ev: EvalSettings, data_path: str = "") -> EvalQueries:
    """Facts -> sampled, labelled, encoded queries with the model's greedy completions (§4.2, §A.4).

    Raises:
      ValueError: the corpus has no facts; a queried relation has no template (names it);
        no query survives.
    """
    corpus = run.corpus
    if not corpus.facts:
        raise ValueError(f"corpus {corpus.name} has no facts to query (fact tracing needs source 'embedded' or 'lama')")
    have = sorted({f.relation for f in corpus.facts})
    missing = [r for r in ev.relations if r not in have]
    if missing:
        raise ValueError(f"config.eval.relations {missing} have no facts in corpus {corpus.name} (it has {have})")
    relations = list(ev.relations) or have
    templates = eval_templates(run, ev, relations, data_path)
    for r in relations:
        queries_lib.template_for(templates, r, ev.template_variant)  # a relation with no template: error naming it
    mention_index = queries_lib.MentionIndex(corpus.texts)
    facts = [f for f in corpus.facts if f.relation in set(relations)]
    mentions = queries_lib.mention_ids(facts, mention_index)
    entailing = queries_lib.entailing_ids(corpus.facts)
    freq = {k: len(v) for k, v in mentions.items()}
    max_len, bs = run.model_cfg.max_len, 64
    correct_all = None
    if ev.selection.max_incorrect_per_bucket > 0:  # §A.4 caps wrong predictions: needs them for every candidate
        cand = queries_lib.build_queries(facts, templates, variant=ev.template_variant, entailing=entailing,
                                         mentions=mentions, bucket_edges=ev.selection.bucket_edges)
        _, flags = queries_lib.predict(run.graphdef, run.params, run.tokenizer, cand, max_new_tokens=ev.max_new_tokens,
                                       max_len=max_len, batch_size=bs)
        correct_all = {q.fact_id: c for q, c in zip(cand, flags)}
    report = queries_lib.QueryReport()
    report.dropped_relation_filter = len(corpus.facts) - len(facts)
    report.num_facts = len(corpus.facts) - len(facts)
    selected = queries_lib.select_facts(facts, freq, ev.selection, report, correct=correct_all)
    selected = queries_lib.take_balanced(selected, freq, ev.max_queries, ev.selection.bucket_edges, report)
    qs = queries_lib.build_queries(selected, templates, variant=ev.template_variant, entailing=entailing,
                                   mentions=mentions, bucket_edges=ev.selection.bucket_edges, report=report)
    completions, correct = queries_lib.predict(run.graphdef, run.params, run.tokenizer, qs,
                                               max_new_tokens=ev.max_new_tokens, max_len=max_len, batch_size=bs)
    by_fact = {q.fact_id: (c, ok) for q, c, ok in zip(qs, completions, correct)}
    if ev.query_mode == "prediction":
        qs = queries_lib.with_targets(qs, completions, report)
    encode = functools.partial(data_lib.encode_query, run.tokenizer, max_len=max_len)
    qs, enc = queries_lib.encode_queries(qs, encode, report)
    if not qs:
        raise ValueError(f"no query left after selection and encoding: {json.dumps(report.to_dict())}")
    return EvalQueries(qs, enc, [by_fact[q.fact_id][0] for q in qs], [by_fact[q.fact_id][1] for q in qs], report, templates)


@dataclasses.dataclass
class Retrieved:
    """One method's ranked proponents (and opponents, for gradient methods) per query."""

    proponent_ids: list[list[int]]
    proponent_scores: list[list[float]]
    opponent_ids: list[list[int]] | None = None
    opponent_scores: list[list[float]] | None = None
    info: dict = dataclasses.field(default_factory=dict)


def method_config(config: ml_collections.ConfigDict, m: baselines_lib.Method) -> ml_collections.ConfigDict:
    """`config` with the row's vectors / hessian settings and its own index directory.

    Rows that share (output_fn, correction) share an index: the Hessian and the unit norm
    apply at scoring time. TrackStar's setting (loss, corrected) uses `config.index.dir`
    (the index `launch.build_index` builds by default); every other setting gets
    `<index.dir>_<output_fn>_<corr|nocorr>`, whichever row config asks for it.
    """
    c = ml_collections.ConfigDict(config.to_dict())
    for key, value in m.overrides().items():
        section, field = key.split(".")
        c[section][field] = value
    if m.kind == "gradient" and (m.output_fn, m.correction) != ("loss", True):
        c.index.dir = f"{config.index.dir}_{m.output_fn}_{'corr' if m.correction else 'nocorr'}"
    return c


def query_vectors(run: checkpoint_lib.Run, vec_fn: vectors_lib.VectorFn, encoded: list[tuple[np.ndarray, np.ndarray]],
                  mesh: jax.sharding.Mesh) -> np.ndarray:
    """Raw query vectors `[Q, d]` (loss on the target tokens only), in batches of `vectors.batch_size`."""
    bs = vec_fn.vec_cfg.batch_size
    seq_len = max(len(t) for t, _ in encoded)
    out = []
    for lo in range(0, len(encoded), bs):
        items = encoded[lo:lo + bs]
        batch = data_lib.pad_batch(items, list(range(lo, lo + len(items))), bs, seq_len)
        out.append(vec_fn(run.params, vec_fn.precond, batch)[: len(items)])
    return np.concatenate(out)


def gradient_retrieval(config: ml_collections.ConfigDict, workdir: pathlib.Path, run: checkpoint_lib.Run,
                       m: baselines_lib.Method, eq: EvalQueries, k: int, mesh: jax.sharding.Mesh) -> Retrieved:
    """Builds (or reuses) the row's index, then Stage 3's `retrieve_queries` (top / bottom k)."""
    mc = method_config(config, m)
    summary = build_index(mc, workdir)
    records, info = retrieve_queries(run, mc, workdir, [TextQuery(q.query_id, q.prompt, q.target) for q in eq.queries],
                                     mesh=mesh, k=k)
    return Retrieved([r["proponent_ids"] for r in records], [r["proponent_scores"] for r in records],
                     [r["opponent_ids"] for r in records], [r["opponent_scores"] for r in records],
                     info={"index": info["index"], "index_seconds": summary.get("seconds"),
                           "whitening": info["whitening"], "retrieval_seconds": info.get("retrieval_seconds")})


DENSE_DIR = "dense_embeddings"  # workdir folder caching the dense row's passage embeddings


def dense_retriever(run: checkpoint_lib.Run, workdir: pathlib.Path, mesh: jax.sharding.Mesh) -> baselines_lib.DenseEmbedding:
    """The dense row's retriever, with passage embeddings cached in `workdir/dense_embeddings/`.

    The cache is reused when its manifest matches the corpus fingerprint and the model's
    weights / tokenizer (sha256); otherwise it is recomputed and replaced (logged).

    Raises:
      embedding.MissingModelError: the model package is not installed (names the pip command).
    """
    enc = embedding_lib.make_encoder(mesh=mesh)
    want = {"model": embedding_lib.MODEL_NAME, "model_sha256": embedding_lib.model_fingerprint(enc.directory),
            "max_seq_length": enc.cfg.max_seq_length, "corpus_fingerprint": run.corpus.fingerprint,
            "num_rows": len(run.corpus.examples), "dim": enc.dim}
    d = workdir / DENSE_DIR
    if (d / "manifest.json").is_file() and (d / "embeddings.npy").is_file():
        if json.loads((d / "manifest.json").read_text()) == want:
            logging.info("eval: dense row reuses the passage embeddings in %s", d)
            return baselines_lib.DenseEmbedding(run.corpus.texts, enc, embeddings=np.load(d / "embeddings.npy"))
        logging.info("eval: %s was made for another corpus or model; recomputing it", d)
    t0 = time.perf_counter()
    dense = baselines_lib.DenseEmbedding(run.corpus.texts, enc)
    logging.info("eval: embedded %d passages with %s in %.1fs", len(run.corpus.examples), embedding_lib.MODEL_NAME,
                 time.perf_counter() - t0)
    if jax.process_index() == 0:
        d.mkdir(parents=True, exist_ok=True)
        np.save(d / "embeddings.npy", dense.embeddings)
        (d / "manifest.json").write_text(json.dumps(want, indent=1))  # written last: marks the cache complete
    return dense


def retrieve_for_method(config: ml_collections.ConfigDict, workdir: pathlib.Path, run: checkpoint_lib.Run,
                        m: baselines_lib.Method, eq: EvalQueries, ev: EvalSettings, mesh: jax.sharding.Mesh,
                        bm25: baselines_lib.BM25 | None, dense: baselines_lib.DenseEmbedding | None = None) -> Retrieved:
    """Proponents of every query for one table row."""
    k = ev.num_proponents
    if m.kind == "gold":  # the fact's own entailing passages, in id order (T-REx gold row)
        ids = [list(q.entailing_ids[:k]) for q in eq.queries]
        return Retrieved(ids, [[1.0] * len(i) for i in ids])
    if m.kind == "bm25":
        scores, ids = bm25.topk([q.prompt + q.target for q in eq.queries], k)
        return Retrieved(ids.tolist(), scores.tolist())
    if m.kind == "dense":  # query text as for BM25 (the released retrievals' inputs + targets)
        scores, ids = dense.topk([q.prompt + q.target for q in eq.queries], k, mesh=mesh)
        return Retrieved(ids.tolist(), scores.tolist())
    return gradient_retrieval(config, workdir, run, m, eq, k, mesh)


def tailpatch_all(run: checkpoint_lib.Run, eq: EvalQueries, retrieved: dict[str, Retrieved], ev: EvalSettings,
                  mesh: jax.sharding.Mesh) -> dict[tuple[int, int], float]:
    """Tail-patch delta p for every distinct (query, proponent) pair among the rows' top-k (§4.3).

    Pairs shared by several rows (BM25 and TrackStar often agree) are computed once.
    """
    kmax = max(ev.top_ks)
    pairs = sorted({(qi, int(p)) for r in retrieved.values() for qi, ids in enumerate(r.proponent_ids) for p in ids[:kmax]})
    if not pairs:
        return {}
    props = sorted({p for _, p in pairs})
    row_of = {p: i for i, p in enumerate(props)}
    enc_props = []
    for p in props:
        t, _ = data_lib.encode_example(run.tokenizer, run.corpus.examples[p].text, run.model_cfg.max_len)
        m = np.ones(len(t), np.int32)
        m[0] = 0  # pretraining loss: every token after BOS
        enc_props.append((t, m))
    prop_rows = data_lib.pad_batch(enc_props, props, len(props), max(len(t) for t, _ in enc_props))
    query_rows = data_lib.pad_batch(eq.encoded, list(range(len(eq.encoded))), len(eq.encoded),
                                    max(len(t) for t, _ in eq.encoded))
    opt_cfg = checkpoint_lib.optimizer_config_from(run.config)
    opt = train_lib.make_optimizer(opt_cfg)
    lr_scale = tailpatch_lib.learning_rate_scale(opt_cfg, run.step, ev.tailpatch_lr)
    dp = sharding_lib.data_parallel_size(mesh)
    bs = -(-ev.tailpatch_batch_size // dp) * dp
    fn = tailpatch_lib.make_jit_tailpatch(mesh, graphdef=run.graphdef, opt=opt)
    idx = np.asarray([(q, row_of[p]) for q, p in pairs], np.int64)
    bar = tqdm.tqdm(total=len(pairs), desc="tail-patch", disable=jax.process_index() > 0, mininterval=2.0, dynamic_ncols=True)
    res = tailpatch_lib.run_pairs(fn, run.params, run.opt_state, prop_rows, query_rows, idx, batch_size=bs,
                                  lr_scale=lr_scale, progress=lambda n: bar.update(n - bar.n))
    bar.close()
    return {pair: float(d) for pair, d in zip(pairs, res["delta_prob"])}


def query_records(eq: EvalQueries, r: Retrieved, deltas: dict[tuple[int, int], float], ev: EvalSettings,
                  m: baselines_lib.Method) -> list[dict]:
    """Per-query metric values of one row (inputs of `metrics.method_row`)."""
    out = []
    for qi, q in enumerate(eq.queries):
        ids = r.proponent_ids[qi]
        rec = {"query_id": q.query_id, "has_evidence": q.has_evidence, "correct": eq.correct[qi], "bucket": q.bucket}
        if m.kind != "gold":
            rec.update(metrics_lib.query_metrics(ids, q.entailing_ids))
            rec.update(metrics_lib.query_metrics(ids, q.mention_ids, prefix="mention_"))
        rec.update(metrics_lib.tailpatch_at_k([deltas[(qi, int(p))] for p in ids[:max(ev.top_ks)]], ev.top_ks))
        out.append(rec)
    return out


def write_retrievals(path: pathlib.Path, run: checkpoint_lib.Run, eq: EvalQueries, r: Retrieved, m: baselines_lib.Method,
                     deltas: dict[tuple[int, int], float]) -> None:
    """Per-query proponents in the PAIR-code/pretraining-tda schema (+ fact fields, tail-patch deltas)."""
    texts = run.corpus.texts
    with open(path, "w") as f:
        for qi, q in enumerate(eq.queries):
            ids = [int(i) for i in r.proponent_ids[qi]]
            gold = set(q.entailing_ids)
            row = {"example_id": q.query_id, "query_set": m.name, "inputs_plaintext": q.prompt,
                   "targets_plaintext": q.target, "fact_id": q.fact_id, "relation": q.relation,
                   "frequency": q.frequency, "frequency_bucket": q.bucket, "has_trex_sentence": q.has_evidence,
                   "model_completion": eq.completions[qi], "model_correct": eq.correct[qi],
                   "proponents": [texts[i] for i in ids], "proponent_ids": ids,
                   "proponent_scores": [float(s) for s in r.proponent_scores[qi]],
                   "proponent_correct": [i in gold for i in ids],
                   "proponent_tailpatch": [deltas.get((qi, i)) for i in ids]}
            if r.opponent_ids is not None:
                oids = [int(i) for i in r.opponent_ids[qi]]
                row.update({"opponents": [texts[i] for i in oids], "opponent_ids": oids,
                            "opponent_scores": [float(s) for s in r.opponent_scores[qi]]})
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def eval_dir(config: ml_collections.ConfigDict, workdir: str | os.PathLike) -> pathlib.Path:
    """`workdir/<eval.output_dir>` if set; else `workdir/eval` for gold targets with template 0
    and `eval_<mode>[_t<variant>]` otherwise.

    Query modes and template variants get their own folders, so one run can hold the main
    table, the prediction-mode table and the Table A.1 template variations side by side.
    """
    name = str(config.eval.get("output_dir", "") or "")
    if name:
        if pathlib.Path(name).name != name or name.startswith("."):
            raise ValueError(f"config.eval.output_dir must be a plain folder name inside the workdir, got {name!r}")
        return pathlib.Path(workdir) / name
    mode, variant = str(config.eval.query_mode), int(config.eval.template_variant)
    suffix = "" if (mode, variant) == ("gold", 0) else f"_{mode}" + (f"_t{variant}" if variant else "")
    return pathlib.Path(workdir) / (EVAL_DIR + suffix)


def evaluate(config: ml_collections.ConfigDict, workdir: str | os.PathLike) -> dict:
    """Stage 4: the fact-tracing table (§4-5, Table 1 / A.1 / A.2) for every row in `config.eval.methods`.

    Builds the query set from the run's facts (`make_eval_queries`), retrieves proponents per
    row (T-REx gold, BM25, the dense-embedding row with passage embeddings cached in
    `workdir/dense_embeddings/`, and gradient rows whose indices are built or reused under
    `workdir/<index.dir>[_<output_fn>_<corr|nocorr>]`), tail-patches every distinct (query,
    top-k proponent) pair from the final checkpoint, and writes to `eval_dir(config, workdir)`
    (`workdir/eval/` for gold targets and template 0):
    `queries.jsonl`, `query_report.json`, `retrievals/<method>.jsonl` (PAIR-code schema),
    `table.json` (one row per method with 95% intervals and correctness / frequency splits)
    and `table.md`.

    Returns:
      The table.json content.
    """
    t0 = time.perf_counter()
    workdir = pathlib.Path(workdir)
    quiet_library_logs()
    ev = eval_settings(config)
    methods = [baselines_lib.method(n) for n in ev.methods]
    if any(m.kind == "dense" for m in methods) and not embedding_lib.is_available():
        embedding_lib.make_encoder()  # refuses before any work, naming the missing package and the pip command
    mesh = sharding_lib.make_mesh(tuple(config.mesh.shape))
    run = checkpoint_lib.load_run(workdir, mesh=mesh)
    out_dir = eval_dir(config, workdir)
    (out_dir / "retrievals").mkdir(parents=True, exist_ok=True)
    stale = sorted((out_dir / "retrievals").glob("*.jsonl"))
    if stale:  # a previous evaluation's rows would not match this query set
        logging.info("eval: replacing the previous evaluation in %s (%d retrieval files)", out_dir, len(stale))
        for f in stale:
            f.unlink()

    eq = make_eval_queries(run, ev, str(run.config.data.get("path", "")))
    queries_lib.save_queries(eq.queries, out_dir / "queries.jsonl")
    report = eq.report.to_dict()
    (out_dir / "query_report.json").write_text(json.dumps(report, indent=1))
    accuracy = sum(eq.correct) / len(eq.correct)
    logging.info("eval: %d queries (%s mode, template %d), model accuracy %.3f, %d without evidence, %d empty targets; "
                 "buckets %s", len(eq.queries), ev.query_mode, ev.template_variant, accuracy, report["num_no_evidence"],
                 report["num_empty_target"], report["per_bucket"])
    if report["num_no_evidence"]:
        logging.warning("eval: %d queried facts have no entailing passage in the corpus; they are excluded from MRR / "
                        "recall / precision (fact ids %s)", report["num_no_evidence"], report["no_evidence_fact_ids"][:10])

    bm25 = None
    if any(m.kind == "bm25" for m in methods):
        bm25 = baselines_lib.BM25(run.corpus.texts, k1=ev.bm25_k1, b=ev.bm25_b)
    dense = dense_retriever(run, workdir, mesh) if any(m.kind == "dense" for m in methods) else None
    retrieved, seconds = {}, {}
    for m in methods:
        t1 = time.perf_counter()
        retrieved[m.name] = retrieve_for_method(config, workdir, run, m, eq, ev, mesh, bm25, dense)
        seconds[m.name] = time.perf_counter() - t1
        logging.info("eval: retrieved for %s in %.1fs", m.label, seconds[m.name])
    t1 = time.perf_counter()
    deltas = tailpatch_all(run, eq, retrieved, ev, mesh)
    tailpatch_seconds = time.perf_counter() - t1
    logging.info("eval: tail-patched %d distinct (query, proponent) pairs in %.1fs", len(deltas), tailpatch_seconds)

    names = list(metrics_lib.ATTRIBUTION_METRICS) + [f"mention_{x}" for x in metrics_lib.ATTRIBUTION_METRICS] + \
        [f"tailpatch_at_{k}" for k in ev.top_ks]
    rows = []
    for m in methods:
        r = retrieved[m.name]
        write_retrievals(out_dir / "retrievals" / f"{m.name}.jsonl", run, eq, r, m, deltas)
        extra = {"label": m.label, "kind": m.kind, "settings": dataclasses.asdict(m), "gold_attribution": m.kind == "gold",
                 "retrieval_seconds": seconds[m.name], **({"scoring": r.info} if r.info else {})}
        rows.append(metrics_lib.method_row(m.name, query_records(eq, r, deltas, ev, m), names,
                                           bucket_order=queries_lib.bucket_order(ev.selection.bucket_edges),
                                           seed=ev.bootstrap_seed, extra=extra))
    table = {
        "rows": rows, "query_mode": ev.query_mode, "template_variant": ev.template_variant,
        "num_queries": len(eq.queries), "model_accuracy": accuracy, "query_report": report,
        "corpus": {"name": run.corpus.name, "num_examples": len(run.corpus.examples), "num_facts": len(run.corpus.facts)},
        "model": {"num_params": model_lib.param_count(run.params), "checkpoint_step": run.step,
                  "config": dataclasses.asdict(run.model_cfg)},
        "tailpatch": {"learning_rate": ev.tailpatch_lr, "top_ks": list(ev.top_ks), "num_pairs": len(deltas),
                      "seconds": tailpatch_seconds},
        "ci": f"{int(metrics_lib.CONFIDENCE * 100)}% percentile bootstrap over queries, {metrics_lib.NUM_RESAMPLES} resamples",
        "seconds": time.perf_counter() - t0,
    }
    (out_dir / "table.json").write_text(json.dumps(table, indent=1))
    (out_dir / "table.md").write_text(table_markdown(table, eq, retrieved, run, ev))
    logging.info("eval: wrote %s and table.md in %.1fs", out_dir / "table.json", table["seconds"])
    return table


def table_markdown(table: dict, eq: EvalQueries, retrieved: dict[str, Retrieved], run: checkpoint_lib.Run,
                   ev: EvalSettings) -> str:
    """table.md: the main table, the correct / incorrect split, and a few queries' top proponents."""
    rows = table["rows"]
    cols = list(metrics_lib.ATTRIBUTION_METRICS) + [f"tailpatch_at_{k}" for k in ev.top_ks]
    shown = [{**r, "method": r["label"]} for r in rows]
    head = (f"Fact tracing on {table['corpus']['name']} ({table['corpus']['num_examples']} passages), "
            f"{table['num_queries']} queries ({table['query_mode']} targets, template {table['template_variant']}), "
            f"model {table['model']['num_params']:,} params at step {table['model']['checkpoint_step']}, "
            f"accuracy {table['model_accuracy']:.3f}. Mean [{table['ci']}]; tail-patch in percentage points.\n\n")
    md = "# Fact tracing table\n\n" + head + metrics_lib.markdown_table(shown, cols)
    for label in ("correct", "incorrect"):
        sub = [{**r["by_correctness"][label], "method": r["label"], "gold_attribution": r["gold_attribution"]}
               for r in rows if label in r["by_correctness"]]
        if sub:
            md += "\n" + metrics_lib.markdown_table(sub, cols, title=f"Facts the model predicts {label}ly (Table A.2)")
    md += "\n" + metrics_lib.markdown_table(
        [{"method": r["label"], "num_queries": r["num_queries"], **{k: r.get(k) for k in r if k.startswith("mention_")}}
         for r in rows if r["kind"] != "gold"],
        [f"mention_{x}" for x in metrics_lib.ATTRIBUTION_METRICS],
        title="Looser label: proponent mentions both entities")
    md += "\n## Example queries\n"
    for qi, q in enumerate(eq.queries[: ev.num_examples_shown]):
        md += f"\n**{q.prompt}** →{q.target}  (model: {eq.completions[qi]!r}, {'correct' if eq.correct[qi] else 'incorrect'}; " \
              f"{len(q.entailing_ids)} gold passages)\n\n"
        for name, r in retrieved.items():
            if name == "trex_gold":
                continue
            md += f"- {baselines_lib.METHODS[name].label}:\n"
            for rank, (p, s) in enumerate(zip(r.proponent_ids[qi][:3], r.proponent_scores[qi][:3]), 1):
                mark = "✓" if p in set(q.entailing_ids) else " "
                md += f"  {rank}. {mark} [{p}] ({s:.3g}) {run.corpus.texts[p][:160]}\n"
    return md
