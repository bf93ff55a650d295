"""Stage 1's work (the stage is `stages.train`): corpus -> tokenizer -> pretraining (paper §A.3)
-> loss and completions.

The loop is a plain `for` over the jitted step with hooks (levanter's pattern): logging,
held-out evaluation and checkpointing each run every N steps and see `(step, state,
metrics)`; metrics stay on device until the logging hook fetches them.

Run directory written here: `config.json`, `corpus/`, `tokenizer.model`, `checkpoints/`,
`metrics.jsonl` (with `metrics_window.json`, what a resumed log needs), `train_summary.json`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import signal
import threading
import time
import warnings
from typing import Any, Callable, Iterator

import jax
import numpy as np
from absl import logging

from trackstar_jax import data as data_lib
from trackstar_jax import files
from trackstar_jax.distributed import memory as memory_lib
from trackstar_jax.distributed import multihost
from trackstar_jax.distributed import sharding as sharding_lib
from trackstar_jax.models import generate as generate_lib
from trackstar_jax.models import lm as model_lib
from trackstar_jax.training import checkpoint as checkpoint_lib
from trackstar_jax.training import step as step_lib

SUMMARY_FILE = "train_summary.json"
METRICS_FILE = "metrics.jsonl"
# Evidence passages searched for the longest prefix that ends right before the object, when
# a LAMA corpus has no templates (the train summary's fact prompts).
MAX_EVIDENCE_FOR_PROMPT = 8


def check_corpus_source(data_cfg: data_lib.DataConfig, workdir: str | os.PathLike) -> None:
    """Refuses, before a stage writes anything, a data path `prepare_corpus` would not find
    (`data.check_source`); a workdir whose corpus is built already needs none."""
    if not (pathlib.Path(workdir) / checkpoint_lib.CORPUS_DIR / "meta.json").exists():
        data_lib.check_source(data_cfg)


def prepare_corpus(data_cfg: data_lib.DataConfig, seed: int, workdir: str | os.PathLike) -> data_lib.Corpus:
    """Builds the corpus of `data_cfg` (`config.data`; `seed`: `config.seed`) into `workdir/corpus/`,
    or reloads it (written once)."""
    corpus_dir = pathlib.Path(workdir) / checkpoint_lib.CORPUS_DIR
    if (corpus_dir / "meta.json").exists():
        corpus = data_lib.load_corpus(corpus_dir)
        logging.info("reusing corpus %s (%d examples) from %s", corpus.name, len(corpus.examples), corpus_dir)
    else:
        corpus = data_lib.build_corpus(data_cfg, seed)
        data_lib.save_corpus(corpus, corpus_dir)
        logging.info(
            "built corpus %s: %d examples, %d facts, %d held-out passages, fingerprint %s",
            corpus.name,
            len(corpus.examples),
            len(corpus.facts),
            len(corpus.eval_texts),
            corpus.fingerprint[:12],
        )
        lama = corpus.info.get("lama")
        if lama:  # the LAMA reader's per-fact evidence cap and max_examples skips (also in corpus/meta.json)
            logging.info(
                "LAMA evidence: %s per fact (cap data.max_evidence_per_fact=%d left out %d sentences), "
                "%d facts skipped over data.max_examples",
                lama["evidence_per_fact"],
                lama["max_evidence_per_fact"],
                lama["evidence_dropped"],
                lama["facts_skipped"],
            )
    return corpus


def report_truncation(corpus: data_lib.Corpus, tok: data_lib.Tokenizer, max_len: int) -> dict:
    """Logs how many passages exceed `max_len` tokens (they are truncated when encoded) and
    returns `{"max_len", "num_passages", "num_truncated"}`."""
    long = data_lib.truncation_report(corpus.texts, tok, max_len)
    out = {"max_len": int(max_len), "num_passages": len(corpus.examples), "num_truncated": len(long)}
    if not long:
        logging.info("all %d passages fit model.max_len=%d tokens", len(corpus.examples), max_len)
        return out
    logging.warning(
        "%d of %d passages exceed model.max_len=%d tokens and are truncated (example ids %s%s)",
        len(long),
        len(corpus.examples),
        max_len,
        long[:10],
        " ..." if len(long) > 10 else "",
    )
    return out


def prepare_data(
    model_cfg: model_lib.LMConfig, data_cfg: data_lib.DataConfig, seed: int, workdir: str | os.PathLike
) -> tuple[data_lib.Corpus, data_lib.Tokenizer]:
    """Builds the corpus and trains the tokenizer, or reloads both from `workdir`
    (`config.model`, `config.data`, `config.seed`).

    `workdir/corpus/` and `workdir/tokenizer.model` are written once; a rerun reuses them
    (its config.json has already been checked to describe the same data).

    Raises:
      ValueError: the trained vocabulary does not fit `config.model.vocab_size`.
    """
    workdir = pathlib.Path(workdir)
    corpus = prepare_corpus(data_cfg, seed, workdir)
    tok_path = workdir / checkpoint_lib.TOKENIZER_FILE
    if model_cfg.source:  # an imported run brings its tokenizer (launch.import_model)
        tok = checkpoint_lib.load_run_tokenizer(workdir)
    elif tok_path.exists():
        tok = data_lib.load_tokenizer(tok_path)
    else:
        tok = data_lib.train_tokenizer(corpus.texts, model_cfg.vocab_size, tok_path, data_cfg.tokenizer_model_type)
        logging.info("trained %s tokenizer: %d pieces -> %s", data_cfg.tokenizer_model_type, tok.vocab_size, tok_path)
    if tok.vocab_size > model_cfg.vocab_size:
        raise ValueError(
            f"tokenizer at {tok_path} has {tok.vocab_size} pieces > config.model.vocab_size={model_cfg.vocab_size}"
        )
    report_truncation(corpus, tok, model_cfg.max_len)
    return corpus, tok


# ---------------------------------------------------------------------------------------
# Compiled pieces
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrainFns:
    """The jitted pieces of training for one (model, optimizer, seed, mesh, batch size)."""

    graphdef: Any
    opt: Any
    target: Any  # abstract TrainState with shardings (restore target)
    init: Callable[[], step_lib.TrainState]  # placed in its shardings
    step: Any  # compiled train step (state donated)
    eval: Any  # jit(eval_step)
    peak_bytes: int | None = None  # compiled step's peak device memory (None: no memory analysis)

    def check_fits(self) -> None:
        """Refuses (memory.DoesNotFitError, naming the knobs) a step that cannot fit in device memory."""
        if self.peak_bytes is not None:
            memory_lib.check_fits("train", self.peak_bytes)


def init_train_state(
    model_cfg: model_lib.LMConfig, opt: Any, seed: int, mesh: jax.sharding.Mesh
) -> tuple[Any, step_lib.TrainState]:
    """`(graphdef, state)` initialised directly into its shardings on `mesh` (jit out_shardings)."""
    graphdef, target = checkpoint_lib.abstract_state(model_cfg, opt, mesh)
    shardings = jax.tree.map(lambda x: x.sharding, target)
    state = jax.jit(lambda: step_lib.init_state(model_cfg, opt, seed)[1], out_shardings=shardings)()
    return graphdef, state


# Compiled once per process and configuration: a rerun, or a later stage in the same process
# (tests, notebooks, the LDS retraining loop), reuses the compiled step instead of spending
# seconds to minutes recompiling it. Keys are hashable typed configs and the mesh.
@functools.lru_cache(maxsize=4)
def compile_train_fns(
    model_cfg: model_lib.LMConfig,
    opt_cfg: step_lib.OptimizerConfig,
    seed: int,
    mesh: jax.sharding.Mesh,
    batch_size: int,
) -> TrainFns:
    """Builds and AOT-compiles the train step; logs its memory analysis once."""
    opt = step_lib.make_optimizer(opt_cfg)
    graphdef, target = checkpoint_lib.abstract_state(model_cfg, opt, mesh)
    shardings = jax.tree.map(lambda x: x.sharding, target)
    init = jax.jit(lambda: step_lib.init_state(model_cfg, opt, seed)[1], out_shardings=shardings)
    abstract_batch = {
        k: jax.ShapeDtypeStruct(
            (batch_size,) + ((model_cfg.max_len,) if k != "example_id" else ()), np.int32, sharding=sh
        )
        for k, sh in sharding_lib.batch_shardings(mesh).items()
    }
    compiled = step_lib.make_jit_train_step(graphdef, opt, mesh, target).lower(target, abstract_batch).compile()
    mem = memory_lib.compiled_memory(compiled)
    if mem:
        logging.info(
            "train step memory: arguments %.1f MiB, outputs %.1f MiB, temporaries %.1f MiB",
            mem["argument_bytes"] / 2**20,
            mem["output_bytes"] / 2**20,
            mem["temp_bytes"] / 2**20,
        )
    peak = mem.get("peak_bytes")
    fns = TrainFns(
        graphdef, opt, target, init, compiled, step_lib.make_jit_eval_step(graphdef, mesh, target.params), peak
    )
    # Refuse before the first step (and before init allocates the state) when it cannot fit. Not
    # inside the cache alone: the limit may change between calls that share a compiled step.
    fns.check_fits()
    return fns


# ---------------------------------------------------------------------------------------
# The loop and its hooks
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Hook:
    """Runs `fn(step, state, metrics)` every `every` steps and at the last step."""

    every: int
    fn: Callable[[int, step_lib.TrainState, Any], None]


class StopRequest:
    """Asks the training loop to stop after the step under way, so that it can save a checkpoint
    there (`stages.train`): SIGINT (Ctrl-C) or SIGTERM (a TPU VM's preemption notice, a
    scheduler's stop) in one process; on a pod, JAX's preemption sync point, which every process
    reaches at the same step (the coordination service turns one host's SIGTERM into a step
    all agree on). A second SIGINT interrupts at once (KeyboardInterrupt).

    Use as a context manager around the loop (it installs the handlers in the main thread and
    restores the old ones); call it with a step to ask whether to stop after it.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signal: int | None = None  # the signal that asked to stop
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread() and not multihost.is_multiprocess():
            self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}

    def _handle(self, signum: int, frame: Any) -> None:
        del frame
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: no checkpoint
        self.signal = signum
        logging.warning("%s: stopping after this step to save a checkpoint", signal.Signals(signum).name)

    def __call__(self, step: int) -> bool:
        if multihost.is_multiprocess():
            from jax.experimental import multihost_utils  # noqa: PLC0415  (a pod only)

            try:
                return multihost_utils.reached_preemption_sync_point(step)
            except RuntimeError:  # `jax_enable_preemption_service` turned off: no step to agree on
                return False
        return self.signal is not None


def run_loop(
    state: step_lib.TrainState,
    start: int,
    num_steps: int,
    step_fn: Any,
    batches: Iterator[dict[str, jax.Array]],
    hooks: list[Hook],
    progress: Callable[[], None] = lambda: None,
    stop: Callable[[int], bool] = lambda step: False,
) -> step_lib.TrainState:
    """Steps `start+1 .. num_steps`; the next batch is placed while the device runs the step.

    Each hook sees the step's on-device metrics (it decides whether to fetch them). Returns
    early, after a step's hooks, when `stop(step)` is true (a `StopRequest`): the state's
    step says where it stopped.
    """
    batch = next(batches)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
        for step in range(start + 1, num_steps + 1):
            state, metrics = multihost.settle(step_fn(state, batch))  # gloo: one step in flight
            if step < num_steps:
                batch = next(batches)
            progress()
            for h in hooks:
                if step % h.every == 0 or step == num_steps:
                    h.fn(step, state, metrics)
            if step < num_steps and stop(step):
                break
    return state


class MetricsLog:
    """The logging hook: keeps step metrics on device, fetches them every `log_every_steps`.

    Refuses to go on from a non-finite loss: training stops naming the step before the
    checkpoint hook can save a NaN state. Made with the step the loop resumes from
    (`start_step`), it first leaves `path` as an uninterrupted run had it then
    (`resume_metrics`), so the log a resumed run ends with is the uninterrupted run's.
    """

    def __init__(
        self, path: pathlib.Path | None, tokens_per_step: int, bar: Any, workdir: Any = None, start_step: int = 0
    ):
        self.workdir = workdir
        # The window of steps since the last log, as saved with the checkpoint the loop resumes from.
        self.pending: list[Any] = resume_metrics(path, start_step) if path is not None else []
        self.window_path = path.with_name(WINDOW_FILE) if path is not None else None
        self.file = files.open_append(path) if path is not None else None  # closed by close()
        self.tokens_per_step, self.bar = tokens_per_step, bar
        self.train_loss: float | None = None
        self.tokens_per_sec: float | None = None
        self._t0, self._tokens = time.perf_counter(), 0

    def collect(self, step: int, state: Any, metrics: Any) -> None:
        del step, state
        self.pending.append(metrics)

    def flush(self, step: int, state: Any, metrics: Any) -> None:
        del state, metrics
        fetched, self.pending = jax.device_get(self.pending), []
        n_tok = sum(float(x["num_tokens"]) for x in fetched)
        loss = sum(float(x["loss"]) * float(x["num_tokens"]) for x in fetched) / max(n_tok, 1.0)
        if not np.isfinite(loss):
            bad = next(step - len(fetched) + 1 + i for i, x in enumerate(fetched) if not np.isfinite(float(x["loss"])))
            raise FloatingPointError(
                f"training loss is {loss} at step {bad} (nothing after step "
                f"{step - len(fetched)} was saved): training diverged; {checkpoint_lib.diverged_advice(self.workdir)}"
            )
        self.train_loss = loss
        self._tokens += len(fetched) * self.tokens_per_step
        self.tokens_per_sec = self._tokens / (time.perf_counter() - self._t0)
        rec = {
            "step": step,
            "train/loss": loss,
            "train/grad_norm": float(fetched[-1]["grad_norm"]),
            "train/tokens_per_sec": self.tokens_per_sec,
        }
        self.bar.set_postfix(loss=f"{loss:.3f}")
        logging.info("step %d: %s", step, " ".join(f"{k}={v:.4g}" for k, v in rec.items() if k != "step"))
        self.write(rec)

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def save_window(self, step: int, state: Any, metrics: Any) -> None:
        """The checkpoint hook's companion (run just before each save): the steps logged at the
        next log step but not yet written, fetched and recorded under `step` in `WINDOW_FILE`,
        so a run resumed from this checkpoint logs the same means as an uninterrupted one."""
        del state, metrics
        self.pending = [
            {k: float(x[k]) for k in WINDOW_KEYS} for x in jax.device_get(self.pending)
        ]  # host floats: the mean is summed from the same values either way
        if self.window_path is None:
            return
        saved = _read_windows(self.window_path)
        saved[str(step)] = self.pending
        keep = sorted(saved, key=int)[-MAX_WINDOWS:]
        files.atomic_write_json(self.window_path, {k: saved[k] for k in keep})

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


# Beside metrics.jsonl: per checkpoint step, the per-step metrics of the log window open at that
# step (a checkpoint that is not also a log step); the last MAX_WINDOWS checkpoints' windows.
WINDOW_FILE = "metrics_window.json"
WINDOW_KEYS = ("loss", "num_tokens", "grad_norm")
MAX_WINDOWS = 16


def _read_windows(path: pathlib.Path) -> dict:
    try:
        saved = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return saved if isinstance(saved, dict) else {}


def resume_metrics(path: pathlib.Path, step: int) -> list[dict]:
    """Makes `path` (metrics.jsonl) what an uninterrupted run would have written by checkpoint
    `step`: records of later steps (written after that checkpoint by a run killed or failed
    before its next one) are dropped, atomically. A fresh run (`step` 0) starts an empty log.

    Returns:
      The per-step metrics of the log window open at `step` (`MetricsLog.save_window`), [] when
      `step` is a log step (or unknown).
    """
    if path.exists():
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        kept = []
        for line in lines:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a kill: written after the checkpoint
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
        if kept != lines:
            logging.info("%s: dropping %d record(s) after the resumed step %d", path, len(lines) - len(kept), step)
            files.atomic_write(path, "".join(kept))
    window = _read_windows(path.with_name(WINDOW_FILE)).get(str(step), []) if step else []
    ok = isinstance(window, list) and all(isinstance(x, dict) and set(x) == set(WINDOW_KEYS) for x in window)
    return window if ok else []


def held_out_loss(jit_eval_step: Any, params: Any, batches: list[dict]) -> float | None:
    """Mean loss per target token over the held-out batches (None without held-out text)."""
    if not batches:
        return None
    metrics = jax.device_get([multihost.settle(jit_eval_step(params, b)) for b in batches])
    return sum(float(m["loss_sum"]) for m in metrics) / max(sum(float(m["num_tokens"]) for m in metrics), 1.0)


# ---------------------------------------------------------------------------------------
# Fact completions (the summary's fact accuracy)
# ---------------------------------------------------------------------------------------


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
                for e in f.evidence_ids[:MAX_EVIDENCE_FOR_PROMPT]:
                    text = corpus.examples[e].text
                    cuts = [text.find(a) for a in f.object_aliases if a and text.find(a) > 0]
                    if cuts and min(cuts) > len(best):
                        best = text[: min(cuts)].rstrip()
                if best:
                    out.append((best, f))
            if max_facts and len(out) >= max_facts:
                return out
    return out


def evaluate_completions(
    graphdef: Any,
    params: Any,
    tok: data_lib.Tokenizer,
    corpus: data_lib.Corpus,
    max_len: int,
    max_new_tokens: int,
    max_facts: int,
    batch_size: int = 64,
) -> list[dict]:
    """Greedy completions of fact prompts, scored by the one correctness rule (`data.is_correct`, §4.2)."""
    pairs = [(p, f) for p, f in fact_prompts(corpus, max_facts) if len(tok.encode(p)) + 1 < max_len]
    outs = generate_lib.complete_batched(
        graphdef, params, tok, [p for p, _ in pairs], max_new_tokens, max_len, batch_size
    )
    return [
        {
            "fact_id": f.fact_id,
            "prompt": p,
            "completion": o,
            "target": f.object,
            "correct": data_lib.is_correct(o, f.object_aliases),
        }
        for (p, f), o in zip(pairs, outs)
    ]


def record_measured_opt_state(workdir: pathlib.Path, step: int) -> None:
    """Marks an imported run's optimizer state as the one training accumulated (`opt_state.json`
    kind "measured"; the import's estimate is kept under "imported"), so the correction and the
    index manifest stop calling it estimated."""
    path = workdir / checkpoint_lib.OPT_STATE_INFO_FILE
    before = checkpoint_lib.read_opt_state_info(workdir) or {}
    before = before.get("imported", before) if before.get("kind") == "measured" else before
    record = {
        "kind": "measured",
        "method": "optax.adafactor state of continued pretraining on the run's corpus (stages.train)",
        "steps": int(step),
        "imported": before,
    }
    files.atomic_write_json(path, record)
