"""Tail-patch results per (query, proponent) pair, cached beside the run so a stage resumes.

One tail-patch step on a 135M-parameter model is ~37 GFLOP, so the pairs, not the indexing,
set an evaluation's wall time. Every distinct pair is computed once per evaluation (rows that
retrieve the same proponent share it) and its delta p is appended to
`workdir/tailpatch_pairs/<key>.jsonl` as soon as its batch is done: a killed evaluation
resumes with the pairs it finished, and a later evaluation with other rows or queries (the λ
sweep, more tail-patched queries) reuses every pair it shares.

The file's `key` hashes what a delta depends on besides the pair: the model weights and
optimizer state (V, its step count), the checkpoint step, every optimizer setting the step
runs with (`OptimizerConfig`: learning rate and schedule, decay, update clipping, parameter
scaling, weight decay, factoring), the learning-rate override, `model.max_len`, and any
variant of the step a caller runs (`variant`, e.g. a frozen embedding update): changing any of
them starts another file instead of reusing pairs measured under other settings.
A pair is keyed by its content (query prompt + target, proponent text), not by ids, so a
changed query set or candidate set never reuses a wrong value.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib

from absl import logging

from trackstar_jax import files
from trackstar_jax.index import manifest as manifest_lib

CACHE_DIR = "tailpatch_pairs"


def pair_key(prompt: str, target: str, passage: str) -> str:
    return hashlib.sha256("\0".join((prompt, target, passage)).encode("utf-8")).hexdigest()[:24]


class PairCache:
    """Append-only `{pair key: delta p}` for one model state and tail-patch learning rate."""

    def __init__(self, workdir: str | pathlib.Path, identity: dict, write: bool = True):
        key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
        self.path = pathlib.Path(workdir) / CACHE_DIR / f"{key}.jsonl"
        self.write, self.values = write, {}
        if self.path.exists():
            for n, line in enumerate(self.path.read_text(encoding="utf-8").splitlines()):
                try:
                    rec = json.loads(line)
                    self.values[rec["k"]] = float(rec["d"])
                except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                    logging.warning("tail-patch cache %s: skipping damaged line %d (a killed write)", self.path, n + 1)
        if write:
            files.atomic_write(
                self.path.parent / f"{key}.identity.json", json.dumps(identity, indent=1, sort_keys=True)
            )

    def add(self, items: dict[str, float]) -> None:
        self.values.update(items)
        if self.write and items:
            with files.open_append(self.path) as f:
                f.write("".join(json.dumps({"k": k, "d": d}) + "\n" for k, d in items.items()))
                f.flush()


def identity(run, lr_scale: float, variant: dict | None = None) -> dict:
    """What a tail-patch delta depends on besides the pair (the cache file's key).

    Args:
      run: the loaded run (`checkpoint.Run`): weights, optimizer state, step, optimizer settings.
      lr_scale: the learning-rate override's factor (`tailpatch.learning_rate_scale`).
      variant: settings of a modified step (e.g. `{"frozen": ["embed/embedding"]}`); None: the plain step.
    """
    tree = {"params": run.params, "opt_state": run.opt_state}
    out = {
        "model_fingerprint": manifest_lib.tree_fingerprint(tree),
        "checkpoint_step": int(run.step),
        "optimizer": dataclasses.asdict(run.optimizer),
        "lr_scale": float(lr_scale),
        "max_len": int(run.model_cfg.max_len),
    }
    if variant:
        out["variant"] = variant
    return out
