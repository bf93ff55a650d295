"""An imported checkpoint's own optimizer second moments -> the run's optax Adafactor state.

A source that carries the optimizer state it was trained with (today a Hugging Face `Trainer`
checkpoint's `optimizer.pt`, `models.hf_trainer`) gives the run its real V instead of the
per-example estimate of `training.second_moment`. Readers are registered by name
(`register`, `READERS`); `read_imported` asks each whether a source path is its kind.

The run keeps V where every later stage reads it: the optax Adafactor state of the run's
optimizer (`training.step.make_optimizer`), so `features.preconditioner.from_opt_state`, the
index manifest and the tail-patch step need nothing new. What is stored is the V whose `1/sqrt`
is the source optimizer's exact per-element step size:

* Adam / AdamW: `preconditioner.adam_effective_v` = `(sqrt(exp_avg_sq / (1 - beta2^step)) +
  eps)^2`, each parameter at its own `step`. Such a V is not rank-one, so the run's Adafactor
  must keep a full `v` for every matrix: when `train.min_dim_size_to_factor` would factor one,
  the run's value is raised above every dimension (recorded in config.json and opt_state.json).
* transformers Adafactor: `row col^T / mean(row)`, rank-one, so optax's factored `v_row` /
  `v_col` (their means) hold it exactly; unfactored leaves hold it in full.

Either V goes through the weights' own HF -> ours mapping (`hf.params_from_state_dict`:
transposes, fused-QKV splits), so V and the weights stay aligned entry by entry.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Callable

import numpy as np
from absl import logging
from optax._src.factorized import _factored_dims  # optax's own factoring rule

from trackstar_jax.features import preconditioner as precond_lib
from trackstar_jax.models import hf as hf_lib
from trackstar_jax.models import hf_trainer
from trackstar_jax.models import lm as model_lib
from trackstar_jax.training import second_moment as sm_lib
from trackstar_jax.training import step as step_lib


@dataclasses.dataclass(frozen=True)
class ImportedState:
    """A run's optimizer state holding a source's real V.

    Attributes:
      opt_state: `step.make_optimizer(optimizer).init(params)` with its FactoredState's
        `v_row` / `v_col` / `v` (and count) from the source.
      optimizer: the run's optimizer settings (the user's, `min_dim_size_to_factor` raised
        where the source's V must be kept in full).
      record: `opt_state.json`: kind "checkpoint", the source, the file, the optimizer and its
        settings, the step, how V is stored.
    """

    opt_state: Any
    optimizer: step_lib.OptimizerConfig
    record: dict


@dataclasses.dataclass(frozen=True)
class Reader:
    """A source format whose checkpoint carries its optimizer state.

    Attributes:
      name: the record's `source` (e.g. "hf_trainer").
      detect: whether a `model.source` path is this kind (e.g. holds `optimizer.pt`).
      read: `(path, model config, params as host numpy, run optimizer) -> ImportedState`.
    """

    name: str
    detect: Callable[[pathlib.Path], bool]
    read: Callable[[pathlib.Path, model_lib.LMConfig, Any, step_lib.OptimizerConfig], ImportedState]


READERS: dict[str, Reader] = {}


def register(reader: Reader) -> Reader:
    """Adds `reader` to `READERS` (a name registers once)."""
    if reader.name in READERS:
        raise ValueError(f"optimizer-state reader {reader.name!r} is already registered")
    READERS[reader.name] = reader
    return reader


def read_imported(
    path: pathlib.Path, cfg: model_lib.LMConfig, params: Any, opt_cfg: step_lib.OptimizerConfig
) -> ImportedState | None:
    """The real V of the source at `path` (None: the source carries no optimizer state).

    Raises:
      ValueError: two readers claim the path; or what the reader refuses (named there).
    """
    found = [r for r in READERS.values() if r.detect(pathlib.Path(path))]
    if len(found) > 1:
        raise ValueError(f"{path} is claimed by several optimizer-state readers: {', '.join(r.name for r in found)}")
    return found[0].read(pathlib.Path(path), cfg, params, opt_cfg) if found else None


def run_state(
    v: Any, params: Any, opt_cfg: step_lib.OptimizerConfig, *, count: int, rank_one: bool
) -> tuple[Any, step_lib.OptimizerConfig]:
    """`(opt_state, optimizer)`: V in our layout (params' tree) as the run's Adafactor state.

    Args:
      v: the V whose `1/sqrt` is the source optimizer's step size, params' paths and shapes.
      params: the imported model's parameters (shapes and dtypes of the state).
      opt_cfg: the run's optimizer settings.
      count: the optimizer's step (the state's count, for the tail-patch step's decay).
      rank_one: every V is rank-one (factored storage is exact); else the returned settings
        raise `min_dim_size_to_factor` above every dimension, so every matrix keeps a full `v`.
    """
    shapes = [tuple(x.shape) for x in model_lib.flat_params(params).values()]
    factored = [s for s in shapes if _factored_dims(s, True, opt_cfg.min_dim_size_to_factor) is not None]
    if factored and not rank_one:
        opt_cfg = dataclasses.replace(opt_cfg, min_dim_size_to_factor=1 + max(max(s) for s in shapes))
    fs = sm_lib.factored_state(v, params, opt_cfg.min_dim_size_to_factor, count, epsilon=0.0)
    opt = step_lib.make_optimizer(opt_cfg)
    return sm_lib.with_second_moments(opt.init(params), fs), opt_cfg


def hf_trainer_v(folder: pathlib.Path, cfg: model_lib.LMConfig) -> tuple[dict, dict, bool]:
    """`(V in our layout, record, rank_one)` of a Trainer checkpoint (`models.hf_trainer`).

    V is the source optimizer's exact `1/sqrt`-V per HF parameter, mapped by the weights' own
    `hf.params_from_state_dict` (transposes, fused splits: V stays aligned with the weights).

    Raises:
      ValueError, UnsafePickleError: what `hf_trainer.read_second_moments` or the mapping refuses.
    """
    tm = hf_trainer.read_second_moments(folder, cfg)
    if tm.optimizer == "adamw":
        v_hf = {
            n: np.asarray(precond_lib.adam_effective_v(np.asarray(m.exp_avg_sq, np.float32), m.step, m.beta2, m.eps))
            for n, m in tm.moments.items()
        }
        steps = sorted({m.step for m in tm.moments.values()})
        method = (
            "torch AdamW exp_avg_sq stored as (sqrt(exp_avg_sq / (1 - beta2^step)) + eps)^2, each parameter "
            "at its own step, so 1/sqrt(V) is AdamW's exact step size (preconditioner.adam_effective_v)"
        )
    else:
        v_hf = {n: m.v() for n, m in tm.moments.items()}
        steps = []
        method = (
            "transformers Adafactor exp_avg_sq_row / exp_avg_sq_col as V = row col^T / mean(row) "
            "(its _approx_sq_grad), exp_avg_sq for vectors"
        )
    v = hf_lib.params_from_state_dict(dataclasses.replace(cfg, param_dtype="float32"), v_hf, source=tm.path)
    record = {
        "kind": "checkpoint",
        "source": "hf_trainer",
        "file": tm.path,
        "optimizer": tm.optimizer,
        "hyper": tm.hyper,
        "global_step": tm.global_step,
        "count": tm.global_step if tm.global_step is not None else int(max(steps or [0])),
        "num_parameters": len(tm.moments),
        "method": method,
    }
    if steps:
        record["steps"] = [float(s) for s in steps]
    return v, record, tm.optimizer == "adafactor"


def _read_hf_trainer(
    folder: pathlib.Path, cfg: model_lib.LMConfig, params: Any, opt_cfg: step_lib.OptimizerConfig
) -> ImportedState:
    """A Trainer checkpoint's Adam(W) or Adafactor V as the run's state (`hf_trainer_v`, `run_state`)."""
    v, record, rank_one = hf_trainer_v(folder, cfg)
    opt_state, run_opt = run_state(v, params, opt_cfg, count=record["count"], rank_one=rank_one)
    record["min_dim_size_to_factor"] = run_opt.min_dim_size_to_factor
    return ImportedState(opt_state=opt_state, optimizer=run_opt, record=record)


def _is_hf_trainer(path: pathlib.Path) -> bool:
    """A folder with `optimizer.pt`; a Trainer folder without one is said, not silently estimated."""
    if hf_trainer.is_trainer_checkpoint(path):
        return True
    if (path / hf_trainer.TRAINER_STATE_FILE).is_file():
        logging.warning(
            "%s holds %s but no %s (saved with save_only_model, or by DeepSpeed / FSDP): "
            "its optimizer state is not read, so V is estimated",
            path,
            hf_trainer.TRAINER_STATE_FILE,
            hf_trainer.OPTIMIZER_FILE,
        )
    return False


HF_TRAINER = register(Reader("hf_trainer", _is_hf_trainer, _read_hf_trainer))
