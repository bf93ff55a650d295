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

from trackstar_jax import config as config_lib
from trackstar_jax import data as data_lib
from trackstar_jax import files
from trackstar_jax.distributed import sharding as sharding_lib
from trackstar_jax.models import lm as model_lib
from trackstar_jax.training import loop as loop_lib

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
    settings: config_lib.Settings,
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


def run_subset(
    settings: config_lib.Settings,
    workdir: str | pathlib.Path,
    i: int,
    mask: np.ndarray,
    corpus: data_lib.Corpus,
    tok: data_lib.Tokenizer,
    encoded: Sequence[tuple[np.ndarray, np.ndarray]],
    num_steps: int,
    mesh: jax.sharding.Mesh,
) -> bool:
    """Retrains subset `i` and records its query losses, unless it is already done.

    Returns:
      True if this call trained it (False: reused).
    """
    d = subset_dir(workdir, i)
    if (d / DONE_FILE).is_file():
        saved = np.load(d / "mask.npy", allow_pickle=False)
        if not np.array_equal(saved, mask):  # the manifest check makes this unreachable unless files were edited
            raise config_lib.ConfigError(f"{d}/mask.npy differs from subset {i} as drawn now; remove {d}")
        return False
    graphdef, params = retrain_subset(settings, corpus, tok, mask, num_steps, mesh)
    losses = query_losses(graphdef, params, encoded)
    if jax.process_index() == 0:
        files.atomic_write(d / "mask.npy", files.npy_bytes(mask))
        files.atomic_write(d / "losses.npy", files.npy_bytes(losses))
        files.create_once(
            d / DONE_FILE,
            json.dumps(
                {"subset": i, "num_examples": int(mask.sum()), "num_queries": len(losses), "num_steps": num_steps}
            ),
        )
    logging.info(
        "validate: subset %d (%d examples) retrained %d steps; mean query loss %.4f",
        i,
        int(mask.sum()),
        num_steps,
        float(losses.mean()),
    )
    return True
