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

from typing import Any

import ml_collections

from trackstar_jax import model as model_lib
from trackstar_jax import train as train_lib


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


# ---------------------------------------------------------------------------------------
# Stage 2: build_index (issue #4)
# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# Stage 3: retrieve (issue #5)
# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# Stage 4: evaluate (issue #6)
# ---------------------------------------------------------------------------------------
