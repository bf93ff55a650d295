"""Results cached beside the run so a stage resumes: tail-patch deltas per (query, proponent)
pair, and the queries' greedy completions (`ResultCache`, one append-only file per identity).

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

The greedy completions of the evaluation's prompts (`queries.predict`: every candidate fact's,
~6 min for SmolLM2 on 2 CPU cores) are cached the same way in `workdir/completions/`, one
entry per call keyed by its prompts in order and their token ids, under an identity of the
weights, the model config, the checkpoint step and the generation settings
(`completions_identity`): a resumed or reopened evaluation makes the same calls and reads them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from typing import Any, Callable

from absl import logging

from trackstar_jax import files
from trackstar_jax.index import manifest as manifest_lib

CACHE_DIR = "tailpatch_pairs"
COMPLETIONS_DIR = "completions"


def pair_key(prompt: str, target: str, passage: str) -> str:
    return hashlib.sha256("\0".join((prompt, target, passage)).encode("utf-8")).hexdigest()[:24]


class ResultCache:
    """Append-only `{key: value}` for one identity (`workdir/<folder>/<identity hash>.jsonl`, the
    identity beside it); `parse` checks a value read back (a damaged line is skipped, warned).
    The defaults are the tail-patch pairs': `CACHE_DIR`, float deltas."""

    def __init__(
        self,
        workdir: str | pathlib.Path,
        identity: dict,
        write: bool = True,
        *,
        folder: str = CACHE_DIR,
        parse: Callable[[Any], Any] = float,
    ):
        key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
        self.path = pathlib.Path(workdir) / folder / f"{key}.jsonl"
        self.write, self.values = write, {}
        if self.path.exists():
            for n, line in enumerate(self.path.read_text(encoding="utf-8").splitlines()):
                try:
                    rec = json.loads(line)
                    self.values[rec["k"]] = parse(rec["d"])
                except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                    logging.warning("cache %s: skipping damaged line %d (a killed write)", self.path, n + 1)
        self._identity = (self.path.parent / f"{key}.identity.json", json.dumps(identity, indent=1, sort_keys=True))

    def add(self, items: dict[str, Any]) -> None:
        self.values.update(items)
        if self.write and items:
            if not self._identity[0].exists():  # beside the first entry: what the file's values depend on
                files.atomic_write(*self._identity)
            with files.open_append(self.path) as f:
                f.write("".join(json.dumps({"k": k, "d": d}) + "\n" for k, d in items.items()))
                f.flush()


def strings(value: Any) -> list[str]:
    """A cached list of completions, checked (`ResultCache`'s `parse`)."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("not a list of strings")
    return value


def completions_identity(run, *, max_new_tokens: int, max_len: int, batch_size: int) -> dict:
    """What the greedy completions of a list of prompts depend on besides the prompts and their
    token ids (the entries' keys): the weights, the model config, the checkpoint step and the
    generation settings (`queries.predict`)."""
    return {
        "model_fingerprint": manifest_lib.tree_fingerprint(run.params),
        "model": {k: repr(v) for k, v in sorted(dataclasses.asdict(run.model_cfg).items())},
        "checkpoint_step": int(run.step),
        "max_new_tokens": int(max_new_tokens),
        "max_len": int(max_len),
        "batch_size": int(batch_size),
    }


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
