"""The `--distributed` flags of the launchers that run on a pod (train, build_index).

`--distributed` starts `jax.distributed` (one JAX process per host) before JAX is used.
On a Cloud TPU pod, SLURM or Open MPI nothing else is needed; elsewhere (and for local
tests) give `--coordinator_address=host:port --num_processes=N --process_id=i`.
"""

import os
import sys
import time
import traceback

from absl import flags, logging

from launch import _config
from trackstar_jax.distributed import multihost, runtime

_DISTRIBUTED = flags.DEFINE_bool("distributed", False, "Multi-host: one JAX process per host (jax.distributed).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address",
    None,
    "With --distributed: host:port of process 0 (not needed on a TPU pod, SLURM or Open MPI).",
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "With --distributed: number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "With --distributed: this process's id in [0, num_processes).")
_TIMEOUT = flags.DEFINE_integer(
    "distributed_timeout_s", 300, "With --distributed: seconds to wait for the coordinator."
)
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout_s", 100, "With --distributed: a process silent this long counts as dead and ends the job."
)


# Seconds process 0 (the coordinator) waits before exiting on an error; see `run`.
_EXIT_GRACE_S = 3.0


def initialize() -> bool:
    """Starts jax.distributed when `--distributed` is given; returns whether it did.

    Raises:
      app.UsageError-like ValueError: --coordinator_address etc. without --distributed.
    """
    explicit = {
        "--coordinator_address": _COORDINATOR.value,
        "--num_processes": _NUM_PROCESSES.value,
        "--process_id": _PROCESS_ID.value,
    }
    if not _DISTRIBUTED.value:
        given = [k for k, v in explicit.items() if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} given without --distributed")
        return False
    multihost.initialize(
        _COORDINATOR.value,
        _NUM_PROCESSES.value,
        _PROCESS_ID.value,
        timeout_s=_TIMEOUT.value,
        heartbeat_timeout_s=_HEARTBEAT.value,
    )
    return True


def run(fn):
    """Calls `fn()`; a Ctrl-C ends it in one line saying a rerun resumes (`runtime.exit_on_interrupt`);
    under --distributed an uncaught error ends this process at once.

    A Python error would otherwise leave this process in jax.distributed's shutdown barrier
    while the others wait in a collective for it: exiting hard lets the coordination service
    end the job (peers waiting at a `multihost.step` have already been told the error).

    The error's one-line message is printed first. Process 0 hosts the coordination service,
    whose end aborts every other process at once, so it waits `_EXIT_GRACE_S` before exiting:
    a peer that failed at the same check (a bad flag refused on every host) prints its own
    message instead of being aborted mid-way.
    """
    with runtime.exit_on_interrupt():
        return _run(fn)


def _run(fn):
    if not _DISTRIBUTED.value:
        return fn()
    try:
        return fn()
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, KeyboardInterrupt) or (isinstance(e, SystemExit) and not e.code):
            raise  # a Ctrl-C: `exit_on_interrupt`
        print(_config.error_line(e), file=sys.stderr, flush=True)
        if _config.verbose_errors() or not _config.is_known(e):
            logging.error("process failed: %s", "".join(traceback.format_exception(e)))
        logging.flush()
        if multihost.is_primary() and multihost.is_multiprocess():
            time.sleep(_EXIT_GRACE_S)
        os._exit(1)
