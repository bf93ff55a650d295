"""Pretraining: optax Adafactor with the paper's schedule, a pure jit-able train step.

§A.3 / Table A.3: Adafactor, learning rate 0.01, inverse-square-root decay after warmup.
The optimizer state (Adafactor's factored second moments `v_row` / `v_col`, or full `v` for
small matrices) is what TrackStar later reads, so it is kept in full in `TrainState`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jaxtyping import Array, Float

from trackstar_jax.distributed import sharding as sharding_lib
from trackstar_jax.models import lm as model_lib


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Adafactor + schedule hyperparameters (hashable; the optimizer keys of `config.train`)."""

    learning_rate: float = 0.01
    warmup_steps: int = 10_000
    decay_rate: float = 0.8  # Adafactor second-moment decay exponent (optax default)
    min_dim_size_to_factor: int = 128  # optax default; smaller dims keep a full v
    clipping_threshold: float | None = 1.0
    multiply_by_parameter_scale: bool = True
    weight_decay_rate: float | None = None


# `config.train` keys that may change on resume (longer training, other cadences); all other train
# keys (optimizer, batch size) must match.
RESUMABLE_TRAIN_KEYS = (
    "num_steps",
    "log_every_steps",
    "eval_every_steps",
    "num_eval_batches",
    "checkpoint_every_steps",
    "max_checkpoints_to_keep",
    "num_completions",
    "max_new_tokens",
)


@dataclasses.dataclass(frozen=True)
class TrainSettings(OptimizerConfig):
    """`config.train`: the optimizer's keys (`OptimizerConfig`, §A.3) and the training loop's cadences."""

    num_steps: int = 187_000
    global_batch_size: int = 1024
    log_every_steps: int = 50
    eval_every_steps: int = 500
    num_eval_batches: int = 4
    checkpoint_every_steps: int = 1000
    max_checkpoints_to_keep: int = 3
    num_completions: int = 8
    max_new_tokens: int = 8
    max_fact_prompts: int = 256  # fact prompts completed for the train summary's fact_accuracy

    def __post_init__(self):
        for key in ("num_steps", "global_batch_size", "log_every_steps", "eval_every_steps", "checkpoint_every_steps"):
            if getattr(self, key) < 1:
                raise ValueError(f"train.{key} must be >= 1, got {getattr(self, key)}")

    @property
    def optimizer(self) -> OptimizerConfig:
        """The optimizer's keys alone (a jit static argument that ignores the cadences)."""
        return OptimizerConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(OptimizerConfig)})


def make_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """Linear warmup to `learning_rate`, then inverse-square-root decay.

    lr(s) = lr * min(1, s / warmup) * sqrt(warmup / max(s, warmup)).
    """
    warmup = max(int(cfg.warmup_steps), 1)

    def schedule(step):
        s = jnp.asarray(step, jnp.float32) + 1.0  # the first update uses step 1
        return cfg.learning_rate * jnp.minimum(1.0, s / warmup) * jnp.sqrt(warmup / jnp.maximum(s, warmup))

    return schedule


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """optax Adafactor with the paper's schedule."""
    return optax.adafactor(
        learning_rate=make_schedule(cfg),
        min_dim_size_to_factor=cfg.min_dim_size_to_factor,
        decay_rate=cfg.decay_rate,
        clipping_threshold=cfg.clipping_threshold,
        multiply_by_parameter_scale=cfg.multiply_by_parameter_scale,
        weight_decay_rate=cfg.weight_decay_rate,
    )


class TrainState(flax.struct.PyTreeNode):
    """Everything a checkpoint holds. `params` is a pure nested dict (string keys)."""

    step: Array
    params: Any
    opt_state: Any


def init_state(
    model_cfg: model_lib.LMConfig, opt: optax.GradientTransformation, seed: int
) -> tuple[nnx.GraphDef, TrainState]:
    """Initialises parameters and optimizer state; returns `(graphdef, state)`."""
    graphdef, params = model_lib.split_model(model_lib.make_model(model_cfg, seed))
    params = nnx.to_pure_dict(params)
    return graphdef, TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt.init(params))


def loss_fn(params: Any, graphdef: nnx.GraphDef, batch: Mapping[str, Array]) -> tuple[Float[Array, ""], dict]:
    """Mean next-token loss over target tokens of the batch (training objective)."""
    inputs, targets, weights = model_lib.lm_targets(batch)
    loss_sum = model_lib.nll_sum(graphdef, params, inputs, targets, weights)
    num_tokens = jnp.sum(weights)
    loss = loss_sum / jnp.maximum(num_tokens, 1.0)
    return loss, {"loss_sum": loss_sum, "num_tokens": num_tokens}


def train_step(
    state: TrainState, batch: Mapping[str, Array], *, graphdef: nnx.GraphDef, opt: optax.GradientTransformation
) -> tuple[TrainState, dict]:
    """One optimizer step on `batch`. Pure; bind `graphdef`/`opt` with functools.partial and jit."""
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, graphdef, batch)
    updates, opt_state = opt.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "num_tokens": aux["num_tokens"], "grad_norm": optax.tree.norm(grads)}
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(params: Any, batch: Mapping[str, Array], *, graphdef: nnx.GraphDef) -> dict:
    """Summed loss and token count on `batch` (summed over eval batches by the caller)."""
    _, aux = loss_fn(params, graphdef, batch)
    return aux


# ---------------------------------------------------------------------------------------
# jit at the step boundary (explicit shardings, state donated)
# ---------------------------------------------------------------------------------------


def make_jit_train_step(
    graphdef: nnx.GraphDef, opt: optax.GradientTransformation, mesh: jax.sharding.Mesh, state: Any
) -> Any:
    """`jit(train_step)` with explicit state / batch shardings over `mesh`, state donated.

    Args:
      state: a TrainState (or its abstract form) whose leaves carry their shardings.
    """
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    return jax.jit(
        functools.partial(train_step, graphdef=graphdef, opt=opt),
        in_shardings=(state_sh, sharding_lib.batch_shardings(mesh)),
        out_shardings=(state_sh, sharding_lib.replicated(mesh)),
        donate_argnums=0,
    )


def make_jit_eval_step(graphdef: nnx.GraphDef, mesh: jax.sharding.Mesh, params: Any) -> Any:
    """`jit(eval_step)`: summed loss and token count of a batch."""
    params_sh = jax.tree.map(lambda x: x.sharding, params)
    return jax.jit(
        functools.partial(eval_step, graphdef=graphdef),
        in_shardings=(params_sh, sharding_lib.batch_shardings(mesh)),
        out_shardings=sharding_lib.replicated(mesh),
    )
