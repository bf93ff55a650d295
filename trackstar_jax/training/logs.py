"""Readable absl logs for the stages: library chatter (orbax's per-save INFO lines, JAX's probe
of an absent TPU) is dropped (`distributed.runtime.quiet_library_logs`)."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterable, Iterator

import jax
import tqdm

from trackstar_jax.distributed import runtime

# Called at the start of every stage (a library user may call a stage without a launcher).
quiet_library_logs = runtime.quiet_library_logs

# Seconds between a bar's redraws (tqdm's `mininterval`): a log file stays readable.
MIN_INTERVAL_S = 2.0
# True inside `inner_loops()`: bars of loops nested in an outer one are not drawn.
_INNER = contextvars.ContextVar("trackstar_inner_loops", default=False)


@contextlib.contextmanager
def inner_loops() -> Iterator[None]:
    """Within it, `progress` draws no bar: for the inner loops of an outer loop that has its own
    (one bar per long loop, not one per item: token scores featurize a few batches per query)."""
    token = _INNER.set(True)
    try:
        yield
    finally:
        _INNER.reset(token)


def progress(
    iterable: Iterable[Any] | None = None, *, total: int, desc: str, unit: str = "it", initial: int = 0
) -> tqdm.tqdm:
    """`iterable` with a progress bar on process 0 (stderr, at most one update per 2 s), for a
    loop that would otherwise be silent for minutes; no bar for a single step, nor inside
    `inner_loops()`. Without
    `iterable`, a bar the caller advances (`bar.update(n)`, `bar.set_postfix(...)`; use it as a
    context manager or `close()` it), starting at `initial` (a resumed loop)."""
    return tqdm.tqdm(
        iterable,
        total=total,
        initial=initial,
        desc=desc,
        unit=unit,
        disable=jax.process_index() > 0 or total <= 1 or _INNER.get(),
        mininterval=MIN_INTERVAL_S,
        dynamic_ncols=True,
    )
