"""Readable absl logs for the stages: library chatter (orbax's per-save INFO lines, JAX's probe
of an absent TPU) is dropped (`distributed.runtime.quiet_library_logs`)."""

from __future__ import annotations

from typing import Any, Iterable

import jax
import tqdm

from trackstar_jax.distributed import runtime

# Called at the start of every stage (a library user may call a stage without a launcher).
quiet_library_logs = runtime.quiet_library_logs


def progress(
    iterable: Iterable[Any] | None = None, *, total: int, desc: str, unit: str = "it", initial: int = 0
) -> tqdm.tqdm:
    """`iterable` with a progress bar on process 0 (stderr, at most one update per 2 s), for a
    loop that would otherwise be silent for minutes; no bar for a single step. Without
    `iterable`, a bar the caller advances (`bar.update(n)`, `bar.set_postfix(...)`; use it as a
    context manager or `close()` it), starting at `initial` (a resumed loop)."""
    return tqdm.tqdm(
        iterable,
        total=total,
        initial=initial,
        desc=desc,
        unit=unit,
        disable=jax.process_index() > 0 or total <= 1,
        mininterval=2.0,
        dynamic_ncols=True,
    )
