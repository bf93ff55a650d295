"""Multi-process runs (a TPU pod or a GPU cluster: one JAX process per host, `jax.distributed`).

Which stage does what on a pod (BUILD_NOTES.md, "Multi-host (pods)"):
- `train` is one SPMD program over the global mesh; process 0 writes the run directory's
  plain files (config.json, corpus, tokenizer, metrics, summary) and every process takes
  part in orbax's checkpoint save / restore.
- `build_index`: each host is an independent index writer over its *local* devices
  (per-example gradients need no communication); process 0 finalises R_train once after
  all writers have finished.
- `retrieve` / `evaluate`: each process streams its own row range of the index on its local
  devices and keeps a local top-k / bottom-k with global ids; the candidates are gathered
  (`gather_from_processes`) and merged; query featurization and tail-patch are one SPMD
  program over the global mesh (pairs split over every process's devices); process 0 writes
  the outputs.

Every synchronisation point goes through `step`: a process that fails inside a step tells
the others through the coordination service's key-value store, so they fail at once with
its message instead of waiting for a process that will not come. A process that dies
outright is detected by JAX's heartbeat (`heartbeat_timeout_s`), which ends the others.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import sys
import time
from typing import Any, Callable, Iterator

import jax

from trackstar_jax import files

_KV_PREFIX = "trackstar_jax/sync"
# Fault injection for the tests of "a process that dies": `TRACKSTAR_JAX_HOLD_AT=<sync name>@<process>`
# makes that process stop (SIGSTOP) on reaching the named barrier, so a test can kill it there.
HOLD_ENV = "TRACKSTAR_JAX_HOLD_AT"
_POLL_S = 0.1
# name -> how many times this process has synced on it. Process-global on purpose: the
# coordination service's key-value store is process-global too, and every process of a job
# syncs the same sequence of names, so the n-th sync on a name has the same key everywhere
# (a key is never reused, which the store requires). Only `sync` touches it.
_calls: dict[str, int] = {}


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout_s: int = 300,
    heartbeat_timeout_s: int = 100,
) -> None:
    """Starts `jax.distributed` (call before any other JAX use).

    With no arguments the cluster is detected (Cloud TPU pod, SLURM, Open MPI). Otherwise all
    three of `coordinator_address`, `num_processes`, `process_id` are needed (local tests,
    other clusters). Errors name the launcher flag (`--coordinator_address`, ...).

    Args:
      coordinator_address: `host:port` of process 0, which starts the coordinator there.
      num_processes: number of processes in the job.
      process_id: this process's id in `[0, num_processes)`.
      timeout_s: how long to wait for the coordinator and the other processes.
      heartbeat_timeout_s: a process silent for this long counts as dead and ends the job.

    Raises:
      ValueError: an incomplete or inconsistent set of arguments (names the flag).
      RuntimeError: the coordinator could not be reached or no cluster was detected.
    """
    given = {"--coordinator_address": coordinator_address, "--num_processes": num_processes, "--process_id": process_id}
    if any(v is not None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise ValueError(
                f"--distributed with explicit settings needs {', '.join(missing)} as well "
                f"(got {', '.join(f'{k}={v}' for k, v in given.items() if v is not None)}); "
                "give all three, or none to detect a TPU pod / SLURM / Open MPI cluster"
            )
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise ValueError(f"--process_id={process_id} is not in [0, --num_processes={num_processes})")
        if process_id != 0:  # jax aborts the process (no Python error) when it cannot connect
            _wait_for_coordinator(coordinator_address, timeout_s)
    try:
        jax.distributed.initialize(
            coordinator_address,
            num_processes,
            process_id,
            initialization_timeout=int(timeout_s),
            heartbeat_timeout_seconds=int(heartbeat_timeout_s),
        )
    except ValueError as e:  # jax: no coordinator address given and none detected
        raise RuntimeError(
            f"--distributed: no cluster environment was detected ({e}); pass --coordinator_address, "
            "--num_processes and --process_id"
        ) from e
    except RuntimeError as e:
        if "must be called before" not in str(e):
            raise _unreachable(coordinator_address, timeout_s, e) from e
        raise RuntimeError(
            "--distributed: JAX was already started in this process before jax.distributed.initialize() "
            "(an import or call before it ran a JAX computation); initialise first"
        ) from e
    except Exception as e:  # noqa: BLE001 - jax raises XlaRuntimeError (DEADLINE_EXCEEDED, UNAVAILABLE)
        raise _unreachable(coordinator_address, timeout_s, e) from e


def _wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Waits until `host:port` accepts TCP connections; raises naming the flag if it never does."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--coordinator_address={address!r} is not host:port")
    deadline, err = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, timeout_s)):
                return
        except OSError as e:
            err = e
            time.sleep(0.5)
    raise _unreachable(address, timeout_s, err or TimeoutError("no connection"))


def _unreachable(coordinator_address: str | None, timeout_s: float, e: BaseException) -> RuntimeError:
    where = coordinator_address or "the detected coordinator"
    return RuntimeError(
        f"--distributed: could not connect to the coordinator at {where} (--coordinator_address) "
        f"within {timeout_s}s: is process 0 running, and is the address reachable from this "
        f"host? ({type(e).__name__}: {str(e).splitlines()[0][:300]})"
    )


def is_multiprocess() -> bool:
    """True when this is one of several processes of a `jax.distributed` job."""
    return jax.process_count() > 1


def serial_collectives() -> bool:
    """Whether each multi-device program must finish before the next is dispatched: on the CPU
    with several devices. Two programs with collectives in flight at once (async dispatch) can
    deadlock there:
    - under `jax.distributed` (gloo): a loop of shard_map all-gathers over 8 CPU devices in one
      such process hung within seconds in every run (BUILD_NOTES, issue 13, session 14);
    - in one process (XLA's in-process communicator): the 8-device streamed top-k aborted on
      the rendezvous's 40 s termination timeout ("only 5 of 8 arrived") in 1 of 18 runs with
      three test processes sharing the 2 cores (session 17), and in sessions 9-10's suites."""
    from jax._src import distributed  # noqa: PLC0415  (the client `_client` reads too)

    if jax.default_backend() != "cpu":
        return False
    return distributed.global_state.client is not None or jax.local_device_count() > 1


def settle(x: Any) -> Any:
    """`x`, waited for where `serial_collectives()` (else returned at once, still in flight)."""
    return jax.block_until_ready(x) if serial_collectives() else x


def is_primary() -> bool:
    """True on process 0: the process that writes a stage's shared, single files."""
    return jax.process_index() == 0


def require_single_process(stage: str) -> None:
    """Refuses to run `stage` (retrieve, evaluate) as one of several JAX processes.

    These stages read the whole index and write single output files, so they run on one host;
    several processes would write the same files.

    Raises:
      RuntimeError: `jax.process_count() > 1`.
    """
    if is_multiprocess():
        raise RuntimeError(
            f"{stage} runs on one host, but this is process {jax.process_index()} of "
            f"{jax.process_count()}: start it on a single host as a single-process JAX program "
            "(no --distributed; on a TPU pod, a host whose runtime sees only its own chips)"
        )


def writer_partition(process_index: int | None = None, process_count: int | None = None) -> tuple[int, int]:
    """This index writer's `(process_index, process_count)`.

    Single-process JAX: the given values (default 0 of 1), for independent writer processes.
    Under `jax.distributed` with N processes every process is a writer: the values default to
    `jax.process_index()` / `jax.process_count()`, and explicit values must agree with them.

    Raises:
      ValueError: an index outside `[0, count)`, or values that disagree with jax (names the flag).
    """
    if is_multiprocess():
        for flag, given, actual in (
            ("--process_count", process_count, jax.process_count()),
            ("--process_index", process_index, jax.process_index()),
        ):
            if given is not None and given != actual:
                raise ValueError(
                    f"{flag}={given} disagrees with this jax.distributed job ({flag[2:]} is {actual}); "
                    f"under --distributed every process is one writer: leave {flag} out"
                )
        return jax.process_index(), jax.process_count()
    count = 1 if process_count is None else int(process_count)
    index = 0 if process_index is None else int(process_index)
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"--process_index={index} is not in [0, --process_count={count})")
    return index, count


def writes_workdir(stage: str) -> Callable:
    """Decorator of a stage `fn(settings, workdir, ...)` that writes the run directory: it runs
    holding `files.workdir_lock(workdir, stage, i)`, `i` being its `process_index` keyword (an
    independent writer) or else `jax.process_index()`, so a second writer of the same workdir
    is refused at once, naming the first (`files.WorkdirBusyError`)."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(settings: Any, workdir: Any, *args: Any, **kwargs: Any) -> Any:
            i = kwargs.get("process_index")
            with files.workdir_lock(workdir, stage, jax.process_index() if i is None else int(i)):
                return fn(settings, workdir, *args, **kwargs)

        return run

    return decorate


def _client():
    from jax._src import distributed  # the client orbax's barriers also use

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized, but jax.process_count() > 1")
    return client


def sync(name: str, timeout_s: float = 3600.0, error: BaseException | None = None) -> None:
    """Barrier `name` across all processes that fails fast.

    Each process posts "ok" (or, with `error`, its failure) under `name`; the others wait
    until every process has posted, and raise as soon as one has posted a failure. No-op in
    a single process. A name may recur (its n-th use is its own barrier).

    Raises:
      RuntimeError: another process failed at `name`, or not all arrived within `timeout_s`.
    """
    if not is_multiprocess():
        return
    _hold_if_asked(name)
    client, me, n = _client(), jax.process_index(), jax.process_count()
    _calls[name] = _calls.get(name, 0) + 1
    prefix = f"{_KV_PREFIX}/{name}/{_calls[name]}/"
    status = "ok" if error is None else f"error: {type(error).__name__}: {error}"[:2000]
    client.key_value_set(f"{prefix}{me}", status)
    if error is not None:
        return
    deadline = time.monotonic() + timeout_s
    while True:
        posted = dict(client.key_value_dir_get(prefix))
        failed = sorted((k, v) for k, v in posted.items() if v != "ok")
        if failed:
            key, why = failed[0]
            raise RuntimeError(f"process {key.rsplit('/', 1)[-1]} failed at '{name}': {why}")
        if len(posted) >= n:
            return
        if time.monotonic() > deadline:
            arrived = sorted(int(k.rsplit("/", 1)[-1]) for k in posted)
            raise RuntimeError(f"'{name}': only processes {arrived} of {n} arrived within {timeout_s:.0f}s")
        time.sleep(_POLL_S)


def _hold_if_asked(name: str) -> None:
    """Stops this process at barrier `name` when `TRACKSTAR_JAX_HOLD_AT` asks for it (tests)."""
    if os.environ.get(HOLD_ENV) == f"{name}@{jax.process_index()}":
        print(
            f"{HOLD_ENV}: process {jax.process_index()} holds at '{name}' (pid {os.getpid()})",
            file=sys.stderr,
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGSTOP)


def gather_from_processes(x: Any) -> Any:
    """`[process_count, *x.shape]`: every process's host array `x` (same shape and dtype on all),
    stacked in process order on every process; `x[None]` in a single process.

    Runs as one all-gather over the processes (their devices' collectives). A process that
    has died is detected by JAX's heartbeat, which ends the others.
    """
    import numpy as np  # noqa: PLC0415

    if not is_multiprocess():
        return np.asarray(x)[None]
    from jax.experimental import multihost_utils  # noqa: PLC0415

    return np.asarray(multihost_utils.process_allgather(np.asarray(x), tiled=False))


@contextlib.contextmanager
def step(name: str, timeout_s: float = 3600.0) -> Iterator[None]:
    """`with step(name):` body, then `sync(name)`; if the body raises, the others are told.

    Use it around work whose results other processes need next (files process 0 writes).
    """
    try:
        yield
    except BaseException as e:
        if is_multiprocess():
            try:
                sync(name, timeout_s, error=e)
            except Exception:  # noqa: BLE001 - the original error matters more
                pass
        raise
    sync(name, timeout_s)
