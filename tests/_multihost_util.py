"""Launching `python -m launch.<stage>` as the processes of one jax.distributed job on CPU (gloo),
for test_multihost.py and test_multihost_stages.py. Every wait has a timeout, so a hang fails."""

import os
import signal
import socket
import subprocess
import sys
import tempfile

import jax
import pytest
from conftest import REPO, TEST_XLA_CODEGEN_FLAGS

from trackstar_jax.index import manifest as manifest_lib

TIMEOUT_S = 240  # per launch of all processes; a hang fails instead of blocking CI
_CACHE_DIR = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def override_flags(config) -> list[str]:
    """`--config.a.b=v` for every key where `config` differs from experiments/tiny.py."""
    from experiments import tiny

    base, new = (manifest_lib.flatten(c.to_dict()) for c in (tiny.get_config(), config))
    return [f"--config.{k}={_flag_value(v)}" for k, v in sorted(new.items()) if base.get(k) != v]


def _flag_value(v) -> str:
    """A config value as a flag parses it: a tuple of strings as `("a","b",)`."""
    return "(" + ",".join(f'"{x}"' for x in v) + ",)" if isinstance(v, tuple) else str(v)


def env(num_devices: int = 2) -> dict:
    """This process's environment for a launched process with `num_devices` CPU devices."""
    global _CACHE_DIR
    if _CACHE_DIR is None:  # the session's cache (conftest.TEST_CACHE), else one for every launch
        _CACHE_DIR = os.environ.get("JAX_COMPILATION_CACHE_DIR") or tempfile.mkdtemp(prefix="multihost_jax_cache")
    out = dict(os.environ)
    out.update(
        # the tests' XLA codegen flags (conftest), as for the compiler setting below
        XLA_FLAGS=f"--xla_force_host_platform_device_count={num_devices} {TEST_XLA_CODEGEN_FLAGS}",
        JAX_PLATFORMS="cpu",
        # the same compiler setting as this process (fast_compile), so the bits compare
        JAX_DISABLE_MOST_OPTIMIZATIONS=str(jax.config.read("jax_disable_most_optimizations")).lower(),
        JAX_COMPILATION_CACHE_DIR=_CACHE_DIR,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.2",
        # on SIGABRT (sent to a process that hangs, see `wait`) print every thread's traceback
        PYTHONFAULTHANDLER="1",
    )
    return out


def start(
    stage: str,
    workdir,
    flags: list[str],
    *,
    num_processes: int = 2,
    num_devices: int = 2,
    per_process: dict | None = None,
    extra_env: dict | None = None,
    logs=None,
) -> list[subprocess.Popen]:
    """Starts `python -m launch.<stage> --config=experiments/tiny.py <flags>` as `num_processes`
    processes of one job (`num_devices` devices each); `per_process[i]` adds flags to process i,
    `logs` (a folder) takes each process's stderr as `p<i>.err` instead of a pipe."""
    port = free_port()
    args = [sys.executable, "-m", f"launch.{stage}", "--config=experiments/tiny.py", *flags]
    args += [f"--workdir={workdir}", "--distributed", f"--coordinator_address=localhost:{port}"]
    args += [f"--num_processes={num_processes}", "--heartbeat_timeout_s=10"]
    procs = []
    for i in range(num_processes):
        err = open(logs / f"p{i}.err", "w") if logs else subprocess.PIPE  # noqa: SIM115
        procs.append(
            subprocess.Popen(
                args + [f"--process_id={i}"] + list((per_process or {}).get(i, ())),
                cwd=REPO,
                env={**env(num_devices), **(extra_env or {})},
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        )
    return procs


def wait(procs: list[subprocess.Popen], stage: str, timeout_s: float = TIMEOUT_S) -> list[subprocess.CompletedProcess]:
    """Each process's result; fails the test (killing them all) when one runs past `timeout_s`."""
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout_s)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"launch.{stage} with {len(procs)} processes did not finish within {timeout_s}s (a hang); "
            f"where each process was:\n{_where_hung(procs)}"
        )
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def _where_hung(procs: list[subprocess.Popen]) -> str:
    """Each running process's Python tracebacks (faulthandler, on SIGABRT) and stderr tail."""
    parts = []
    for i, p in enumerate(procs):
        if p.poll() is not None:
            parts.append(f"process {i}: exited {p.returncode}")
            continue
        p.send_signal(signal.SIGABRT)
        try:
            _, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            err = "(no output within 30 s of SIGABRT)"
        parts.append(f"process {i}:\n{(err or '(stderr went to a log file)')[-6000:]}")
    return "\n".join(parts)


def ok(results: list[subprocess.CompletedProcess]) -> list[str]:
    """Every process's stdout, after asserting each exited 0 (else its stderr's tail)."""
    for i, r in enumerate(results):
        assert r.returncode == 0, f"process {i} failed:\n{(r.stderr or '')[-4000:]}"
    return [r.stdout for r in results]
