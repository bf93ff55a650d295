"""Stage 1, `train`: corpus -> tokenizer -> pretraining (paper §A.3) -> loss and completions.

The stage composes the run directory (`config.json`, `run.save_run_config`), the data
(`training.loop.prepare_data`), the compiled step and the hook loop (`training.loop`) and the
checkpoints (`training.checkpoint`). Run directory written here: `config.json`, `corpus/`,
`tokenizer.model`, `checkpoints/`, `metrics.jsonl`, `train_summary.json`.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
from typing import Any

import jax
from absl import logging

from trackstar_jax import config as config_lib
from trackstar_jax import data as data_lib
from trackstar_jax import files
from trackstar_jax.distributed import multihost, runtime
from trackstar_jax.distributed import sharding as sharding_lib
from trackstar_jax.models import lm as model_lib
from trackstar_jax.stages import run as run_lib
from trackstar_jax.training import checkpoint as checkpoint_lib
from trackstar_jax.training import logs
from trackstar_jax.training import loop as loop_lib
from trackstar_jax.training import step as step_lib


def _open_run_dir(settings: config_lib.Settings, workdir: pathlib.Path) -> tuple[data_lib.Corpus, data_lib.Tokenizer]:
    """config.json + corpus + tokenizer. Multi-host: process 0 writes, the others wait, then check and reload."""
    primary = multihost.is_primary()
    with multihost.step("train:run_dir"):
        if primary:
            loop_lib.check_corpus_source(settings.data, workdir)  # a mistyped data path writes nothing
            run_lib.save_run_config(workdir, settings)
            corpus, tok = loop_lib.prepare_data(settings.model, settings.data, settings.seed, workdir)
    if not primary:
        run_lib.save_run_config(workdir, settings, write=False)
        corpus, tok = loop_lib.prepare_data(settings.model, settings.data, settings.seed, workdir)
    return corpus, tok


def imported_settings(settings: config_lib.Settings, workdir: pathlib.Path) -> config_lib.Settings:
    """The settings of an imported run (`model.source` set): the model section resolved as
    `launch.import_model` wrote it into the run's config.json.

    Raises:
      ConfigError: the workdir holds no import (run `launch.import_model` first), or the
        config's model section disagrees with the import (named by `resolve_imported_model`).
    """
    if not (workdir / checkpoint_lib.OPT_STATE_INFO_FILE).exists():
        raise config_lib.ConfigError(
            f"config.model.source={settings.model.source!r}: {workdir} holds no imported model; run "
            "`python -m launch.import_model` with this config and workdir first, then `launch.train` "
            "continues pretraining it" + (f" (in {settings.source})" if settings.source else "")
        )
    saved = config_lib.load_run_settings(workdir)
    model = config_lib.resolve_imported_model(settings.model, saved.model, settings.source)
    return dataclasses.replace(settings, model=model)


@multihost.writes_workdir("train")
def train(settings: config_lib.Settings, workdir: str | os.PathLike) -> dict:
    """Stage 1: pretrain the run's model (resuming from its latest checkpoint).

    An imported run (`model.source` set, written by `launch.import_model`) is continued
    instead: from the imported parameters (checkpoint step 0), the project's Adafactor starts
    from zero and trains on the run's corpus to `train.num_steps`; `opt_state.json` then says
    "measured", and later stages use this state instead of the estimated V.

    A workdir of a different run is refused (naming the differing fields); a checkpoint at
    or beyond `train.num_steps` only reports. Multi-host: one SPMD program over the global
    mesh; process 0 writes the plain files, every process saves/restores checkpoints.

    Returns:
      The summary: final step, train / eval loss, fact accuracy, completions, throughput.
    """
    workdir = pathlib.Path(workdir)
    logs.quiet_library_logs()
    imported = bool(settings.model.source)
    if imported:
        settings = imported_settings(settings, workdir)
    t, model_cfg = settings.train, settings.model
    corpus, tok = _open_run_dir(settings, workdir)

    mesh = sharding_lib.make_mesh(settings.mesh.shape)
    bad_split = sharding_lib.batch_split_error(t.global_batch_size, mesh, "config.train.global_batch_size")
    if bad_split:
        raise ValueError(bad_split)
    mngr = checkpoint_lib.CheckpointManager(workdir / checkpoint_lib.CHECKPOINT_DIR, t.max_checkpoints_to_keep)
    must_match = dict(
        sections=config_lib.RUN_SECTIONS + ("train",),
        ignore=tuple(f"train.{k}" for k in config_lib.RESUMABLE_TRAIN_KEYS),
    )
    if mngr.latest_step() is not None:  # refuse a foreign checkpoint before compiling anything
        bad = config_lib.mismatches(mngr.saved_config(), settings, **must_match)
        if bad:
            raise config_lib.ConfigError(
                f"checkpoint {mngr.directory}/{mngr.latest_step()} does not match the config: " + "; ".join(bad)
            )
    fns = loop_lib.compile_train_fns(model_cfg, t.optimizer, settings.seed, mesh, t.global_batch_size)
    fns.check_fits()  # also when the compiled step came from the cache
    if mngr.latest_step() is not None:
        start, state = mngr.restore_latest(
            fns.target, lambda saved: config_lib.mismatches(saved, settings, **must_match)
        )
        logging.info("resumed from %s at step %d", mngr.directory, start)
        if imported and start == 0 and start < t.num_steps:
            # Continued pretraining starts Adafactor from zero, as pretraining does: the V
            # estimated at import (single-example gradients) is not mixed into batch moments.
            opt_state = jax.jit(fns.opt.init, out_shardings=jax.tree.map(lambda x: x.sharding, fns.target.opt_state))
            state = state.replace(opt_state=opt_state(state.params))
            logging.info("continued pretraining of the imported model: a fresh Adafactor state")
    else:
        state, start = fns.init(), 0
    logging.info(
        "model: %d parameters; mesh %s; %d examples; batch %d x %d tokens",
        model_lib.param_count(state.params),
        dict(mesh.shape),
        len(corpus.examples),
        t.global_batch_size,
        model_cfg.max_len,
    )

    eval_batches = [
        sharding_lib.device_batch(b, mesh)
        for b in data_lib.eval_batches(corpus, tok, t.global_batch_size, model_cfg.max_len, t.num_eval_batches)
    ]
    bar = logs.progress(total=t.num_steps, initial=start, desc="train", unit="step")
    log = loop_lib.MetricsLog(
        workdir / loop_lib.METRICS_FILE if multihost.is_primary() else None,
        t.global_batch_size * model_cfg.max_len,
        bar,
        workdir=workdir,
        start_step=start,
    )
    eval_loss: list[float | None] = [None]

    def eval_hook(step: int, state: step_lib.TrainState, metrics: Any) -> None:
        del metrics
        eval_loss[0] = loop_lib.held_out_loss(fns.eval, state.params, eval_batches)
        if eval_loss[0] is not None:
            logging.info("step %d: eval/loss=%.4f", step, eval_loss[0])
            log.write({"step": step, "eval/loss": eval_loss[0]})

    hooks = [
        loop_lib.Hook(1, log.collect),
        loop_lib.Hook(t.log_every_steps, log.flush),
        loop_lib.Hook(t.eval_every_steps, eval_hook),
        loop_lib.Hook(t.checkpoint_every_steps, log.save_window),
        loop_lib.Hook(t.checkpoint_every_steps, lambda step, state, m: mngr.save(state, config_lib.to_dict(settings))),
    ]
    summary_path = workdir / loop_lib.SUMMARY_FILE
    if start >= t.num_steps and summary_path.exists():  # a finished run only reports
        mngr.close()
        logging.info(
            "checkpoint step %d >= train.num_steps=%d: already trained; %s unchanged", start, t.num_steps, summary_path
        )
        return files.read_json(summary_path, "train summary")
    try:
        if start >= t.num_steps:
            logging.info("checkpoint step %d >= train.num_steps=%d: nothing to train", start, t.num_steps)
        else:
            batches = (
                sharding_lib.device_batch(b, mesh)
                for b in data_lib.train_batches(
                    corpus, tok, t.global_batch_size, model_cfg.max_len, settings.seed, start_step=start
                )
            )
            with loop_lib.StopRequest() as stop:
                state = loop_lib.run_loop(
                    state, start, t.num_steps, fns.step, batches, hooks, progress=lambda: bar.update(1), stop=stop
                )
            if (at := int(jax.device_get(state.step))) < t.num_steps:
                _save_interrupted(state, at, mngr, log, settings, stop)
    finally:
        bar.close()
        log.close()
        mngr.wait_until_finished()
        mngr.close()
    if imported and start < t.num_steps and multihost.is_primary():
        loop_lib.record_measured_opt_state(workdir, t.num_steps)
    return _report(
        settings, workdir, state, fns, tok, corpus, eval_batches, log.train_loss, eval_loss[0], log.tokens_per_sec
    )


def _save_interrupted(
    state: step_lib.TrainState,
    step: int,
    mngr: checkpoint_lib.CheckpointManager,
    log: loop_lib.MetricsLog,
    settings: config_lib.Settings,
    stop: loop_lib.StopRequest,
) -> None:
    """Training stopped early at `step` (`loop.StopRequest`): its metrics and a checkpoint at
    that step (unless the checkpoint hook just saved it), so that a rerun resumes there.

    Raises:
      runtime.Interrupted: always, saying where the checkpoint is.
    """
    if log.pending:  # the steps since the last logging hook
        log.flush(step, state, None)
    if mngr.latest_step() != step:
        mngr.save(state, config_lib.to_dict(settings))
    mngr.wait_until_finished()
    why = signal.Signals(stop.signal).name if stop.signal is not None else "a preemption notice"
    raise runtime.Interrupted(
        f"training stopped by {why} at step {step} of {settings.train.num_steps}; checkpoint saved in "
        f"{mngr.directory}/{step}; rerun the same command to resume"
    )


def _report(
    settings: config_lib.Settings,
    workdir: pathlib.Path,
    state: step_lib.TrainState,
    fns: loop_lib.TrainFns,
    tok: data_lib.Tokenizer,
    corpus: data_lib.Corpus,
    eval_batches: list,
    train_loss: float | None,
    eval_loss: float | None,
    tokens_per_sec: float | None,
) -> dict:
    """Held-out loss and fact completions of the final state -> `train_summary.json`."""
    t = settings.train
    final_step = int(jax.device_get(state.step))
    if eval_loss is None:
        eval_loss = loop_lib.held_out_loss(fns.eval, state.params, eval_batches)
    rows = loop_lib.evaluate_completions(
        fns.graphdef, state.params, tok, corpus, settings.model.max_len, t.max_new_tokens, t.max_fact_prompts
    )
    accuracy = sum(r["correct"] for r in rows) / len(rows) if rows else None
    for r in rows[: t.num_completions]:
        logging.info(
            "%s %r -> %r (target %r)", "OK " if r["correct"] else "   ", r["prompt"], r["completion"], r["target"]
        )
    summary = {
        "step": final_step,
        "train_loss": train_loss,
        "eval_loss": eval_loss,
        "fact_accuracy": accuracy,
        "num_fact_prompts": len(rows),
        "tokens_per_sec": tokens_per_sec,
        "num_params": model_lib.param_count(state.params),
        "completions": rows[: t.num_completions],
    }
    if multihost.is_primary():
        files.atomic_write_json(workdir / loop_lib.SUMMARY_FILE, summary)
    logging.info(
        "trained to step %d: train loss %s, eval loss %s, fact accuracy %s (%d prompts)",
        final_step,
        None if train_loss is None else f"{train_loss:.4f}",
        None if eval_loss is None else f"{eval_loss:.4f}",
        None if accuracy is None else f"{accuracy:.3f}",
        len(rows),
    )
    return summary
