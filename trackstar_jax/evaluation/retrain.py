"""Retraining the run's model on a subset of its corpus, for the linear datamodeling score.

Each subset is trained from the run's own initialisation (same `seed` -> same init) with the
run's optimizer and schedule, through the training loop's own pieces (`compile_train_fns`,
`run_loop`, `data.train_batches` over the subset's example ids): there is no second loop.
The retrained model is kept only long enough to record its loss on the query set.

A subset is one cached unit of work in `workdir/validate/subset_XXXX/`: `mask.npy` (bool
`[N]`), `losses.npy` (float32 `[Q]`), and `done.json`, written last (create_once), which marks
it finished. A rerun skips subsets with a done marker.
"""

from __future__ import annotations

import functools
import json
import pathlib
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from trackstar_jax import data as data_lib
from trackstar_jax import files
from trackstar_jax.distributed import sharding as sharding_lib
from trackstar_jax.evaluation import settings as settings_lib
from trackstar_jax.models import lm as model_lib
from trackstar_jax.training import loop as loop_lib
from trackstar_jax.training import step as step_lib

VALIDATE_DIR = "validate"
MANIFEST_FILE = "manifest.json"
DONE_FILE = "done.json"


def subset_dir(workdir: str | pathlib.Path, i: int) -> pathlib.Path:
    """`workdir/validate/subset_XXXX`."""
    return pathlib.Path(workdir) / VALIDATE_DIR / f"subset_{i:04d}"


def is_done(workdir: str | pathlib.Path, i: int) -> bool:
    return (subset_dir(workdir, i) / DONE_FILE).is_file()


def read_subset(workdir: str | pathlib.Path, i: int) -> tuple[np.ndarray, np.ndarray]:
    """`(mask bool [N], losses float32 [Q])` of a finished subset.

    Raises:
      FileNotFoundError: subset `i` has no done marker (names its folder).
    """
    d = subset_dir(workdir, i)
    if not (d / DONE_FILE).is_file():
        raise FileNotFoundError(f"subset {i} is not finished ({d / DONE_FILE} missing)")
    return np.load(d / "mask.npy", allow_pickle=False), np.load(d / "losses.npy", allow_pickle=False)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _query_losses(params: Any, batch: dict, *, graphdef: Any) -> jax.Array:
    losses = model_lib.example_losses(lambda x: model_lib.apply(graphdef, params, x), batch)
    return losses / jnp.maximum(jnp.sum(batch["loss_mask"][:, 1:], axis=-1), 1)


def query_losses(
    graphdef: Any, params: Any, encoded: Sequence[tuple[np.ndarray, np.ndarray]], batch_size: int = 64
) -> np.ndarray:
    """Mean next-token NLL over each query's target tokens, float32 `[Q]`.

    Args:
      encoded: `(tokens, loss_mask)` per query (`data.encode_query`: mask 1 on the target).
    """
    seq_len = max(len(t) for t, _ in encoded)
    out = []
    for lo in range(0, len(encoded), batch_size):
        items = list(encoded[lo : lo + batch_size])
        batch = data_lib.pad_batch(items, list(range(len(items))), batch_size, seq_len)
        out.append(np.asarray(_query_losses(params, batch, graphdef=graphdef))[: len(items)])
    return np.concatenate(out).astype(np.float32)


def retrain_subset(
    settings: settings_lib.TableSettings,
    corpus: data_lib.Corpus,
    tok: data_lib.Tokenizer,
    mask: np.ndarray,
    num_steps: int,
    mesh: jax.sharding.Mesh,
) -> tuple[Any, Any]:
    """Trains the run's model from its initialisation on the examples where `mask` is True.

    Same init (`settings.seed`), optimizer, schedule and batch size as the run; the batches
    are the seeded shuffle of the subset (`data.train_batches(example_ids=...)`).

    Returns:
      `(graphdef, params)` after `num_steps` steps.

    Raises:
      FloatingPointError: the retrained loss is not finite (names the step count).
    """
    t, model_cfg = settings.train, settings.model
    fns = loop_lib.compile_train_fns(model_cfg, t.optimizer, settings.seed, mesh, t.global_batch_size)
    ids = np.flatnonzero(mask)
    batches = (
        sharding_lib.device_batch(b, mesh)
        for b in data_lib.train_batches(
            corpus, tok, t.global_batch_size, model_cfg.max_len, settings.seed, example_ids=ids
        )
    )
    last: list[Any] = [None]
    hooks = [loop_lib.Hook(num_steps, lambda step, state, metrics: last.__setitem__(0, metrics))]
    state = loop_lib.run_loop(fns.init(), 0, num_steps, fns.step, batches, hooks)
    loss = float(jax.device_get(last[0]["loss"]))
    if not np.isfinite(loss):
        raise FloatingPointError(f"retraining on a subset of {len(ids)} examples: loss {loss} after {num_steps} steps")
    return fns.graphdef, state.params


# Steps fused into one compiled call by `retrain_subsets` (lax.scan): one dispatch and one
# host->device batch copy per chunk instead of per step.
SCAN_STEPS = 50


@functools.lru_cache(maxsize=4)
def _parallel_fns(
    model_cfg: model_lib.LMConfig, opt_cfg: step_lib.OptimizerConfig, seed: int, mesh: jax.sharding.Mesh
) -> tuple[Any, step_lib.TrainState, Any]:
    """`(graphdef, init state, chunk)`: `chunk(states [K], batches [T, K, B, L]) -> (states, losses [T, K])`.

    `chunk` is the training step (`step.train_step`, the run's optimizer) vmapped over K
    independent models and scanned over T steps; jitted once per (K, T), states donated.
    """
    opt = step_lib.make_optimizer(opt_cfg)
    graphdef, state = loop_lib.init_train_state(model_cfg, opt, seed, mesh)
    vstep = jax.vmap(functools.partial(step_lib.train_step, graphdef=graphdef, opt=opt))

    def chunk(states, batches):
        def body(s, b):
            s, metrics = vstep(s, b)
            return s, metrics["loss"]

        return jax.lax.scan(body, states, batches)

    return graphdef, state, jax.jit(chunk, donate_argnums=0)


def retrain_subsets(
    settings: settings_lib.TableSettings,
    corpus: data_lib.Corpus,
    tok: data_lib.Tokenizer,
    masks: np.ndarray,
    num_steps: int,
    mesh: jax.sharding.Mesh,
) -> tuple[Any, Any]:
    """`retrain_subset` for K subsets at once: K models trained side by side in one program.

    Each model starts from the run's initialisation and sees exactly the batches
    `retrain_subset` would give it (its own seeded shuffle of its subset); the step is the
    run's `train_step` under `jax.vmap`, so the result equals K sequential retrainings up to
    float rounding (tests/test_lds.py). Each model's state keeps the run's shardings on `mesh`
    (the K axis is replicated); the batches are placed by jit.

    Args:
      masks: bool `[K, N]`.

    Returns:
      `(graphdef, params)` with every params leaf stacked `[K, ...]`.

    Raises:
      FloatingPointError: a retrained loss is not finite (names the subset and step count).
    """
    t, model_cfg = settings.train, settings.model
    masks = np.asarray(masks, bool)
    graphdef, state0, chunk = _parallel_fns(model_cfg, t.optimizer, settings.seed, mesh)
    k = len(masks)
    states = jax.tree.map(lambda x: jnp.repeat(x[None], k, axis=0), state0)
    streams = [
        data_lib.train_batches(corpus, tok, t.global_batch_size, model_cfg.max_len, settings.seed, example_ids=ids)
        for ids in (np.flatnonzero(m) for m in masks)
    ]
    done, last = 0, None
    while done < num_steps:
        n = min(SCAN_STEPS, num_steps - done)
        rows = [[next(s) for s in streams] for _ in range(n)]  # [T][K] batches
        batches = {key: np.stack([np.stack([b[key] for b in row]) for row in rows]) for key in rows[0][0]}
        states, losses = chunk(states, batches)
        done, last = done + n, losses[-1]
    last = np.asarray(jax.device_get(last))
    if not np.isfinite(last).all():
        j = int(np.flatnonzero(~np.isfinite(last))[0])
        raise FloatingPointError(
            f"retraining on a subset of {int(masks[j].sum())} examples (model {j} of {k}): "
            f"loss {last[j]} after {num_steps} steps"
        )
    return graphdef, states.params


def _write_subset(workdir: str | pathlib.Path, i: int, mask: np.ndarray, losses: np.ndarray, num_steps: int) -> None:
    """Subset i's unit of work: mask, losses, then the done marker (last)."""
    if jax.process_index() != 0:
        return
    d = subset_dir(workdir, i)
    files.atomic_write(d / "mask.npy", files.npy_bytes(mask))
    files.atomic_write(d / "losses.npy", files.npy_bytes(losses))
    files.create_once(
        d / DONE_FILE,
        json.dumps({"subset": i, "num_examples": int(mask.sum()), "num_queries": len(losses), "num_steps": num_steps}),
    )
    logging.info(
        "validate: subset %d (%d examples) retrained %d steps; mean query loss %.4f",
        i,
        int(mask.sum()),
        num_steps,
        float(losses.mean()),
    )


def _check_done(workdir: str | pathlib.Path, i: int, mask: np.ndarray) -> bool:
    """True if subset i is finished (its saved mask must be the one drawn now)."""
    d = subset_dir(workdir, i)
    if not (d / DONE_FILE).is_file():
        return False
    saved = np.load(d / "mask.npy", allow_pickle=False)
    if not np.array_equal(saved, mask):  # the manifest check makes this unreachable unless files were edited
        raise files.ConfigError(f"{d}/mask.npy differs from subset {i} as drawn now; remove {d}")
    return True


def run_subsets(
    settings: settings_lib.TableSettings,
    workdir: str | pathlib.Path,
    ids: Sequence[int],
    masks: Sequence[np.ndarray],
    corpus: data_lib.Corpus,
    tok: data_lib.Tokenizer,
    encoded: Sequence[tuple[np.ndarray, np.ndarray]],
    num_steps: int,
    mesh: jax.sharding.Mesh,
) -> list[int]:
    """Retrains the unfinished subsets among `ids` and records each one's query losses.

    With `validate.parallel_subsets` = K > 1 they are trained K at a time (`retrain_subsets`);
    each subset is still written (and marked done) on its own, so an interruption loses at
    most the K in flight.

    Args:
      masks: bool `[N]` per id: subset ids[j]'s membership.

    Returns:
      The ids this call trained (the others were reused).
    """
    todo = [(i, m) for i, m in zip(ids, masks) if not _check_done(workdir, i, m)]
    k = settings.validate.parallel_subsets
    for lo in range(0, len(todo), k):
        group = todo[lo : lo + k]
        if k == 1:
            graphdef, params = retrain_subset(settings, corpus, tok, group[0][1], num_steps, mesh)
            per_model = [params]
        else:
            graphdef, stacked = retrain_subsets(settings, corpus, tok, np.stack([m for _, m in group]), num_steps, mesh)
            per_model = [jax.tree.map(lambda x, j=j: x[j], stacked) for j in range(len(group))]
        for (i, m), params in zip(group, per_model):
            _write_subset(workdir, i, m, query_losses(graphdef, params, encoded), num_steps)
    return [i for i, _ in todo]
