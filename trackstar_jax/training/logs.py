"""Readable absl logs for the stages: library chatter (orbax's per-save INFO lines, JAX's probe
of an absent TPU) is dropped (`distributed.runtime.quiet_library_logs`)."""

from __future__ import annotations

from typing import Any, Iterable

import jax
import tqdm

from trackstar_jax.distributed import runtime

# Called at the start of every stage (a library user may call a stage without a launcher).
quiet_library_logs = runtime.quiet_library_logs


def progress(iterable: Iterable[Any], *, total: int, desc: str, unit: str) -> Iterable[Any]:
    """`iterable` with a progress bar on process 0 (stderr, at most one update per 2 s), for a
    loop that would otherwise be silent for minutes; no bar for a single step."""
    return tqdm.tqdm(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        disable=jax.process_index() > 0 or total <= 1,
        mininterval=2.0,
        dynamic_ncols=True,
    )
