"""distributed.runtime: the persistent compilation cache every launcher turns on, and the
one-line, prompt exit of a Ctrl-C'd launcher."""

import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import jax
import pytest
from absl import logging as absl_logging

from trackstar_jax.distributed import runtime

_KEYS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")


@pytest.fixture
def fresh_config(monkeypatch):
    """No cache configured (as in a new launcher process); the config is restored after."""
    old = {k: jax.config.values[k] for k in _KEYS}
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.delenv(runtime.ENV, raising=False)
    yield
    for k, v in old.items():
        jax.config.update(k, v)


def test_cache_goes_to_the_env_folder_and_is_used(fresh_config, tmp_path, monkeypatch):
    monkeypatch.setenv(runtime.ENV, str(tmp_path / "xla"))
    assert runtime.enable_compilation_cache() == tmp_path / "xla"
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.1
    # an explicit path is ignored once a folder is configured (the user's or the launcher's own)
    assert runtime.enable_compilation_cache(tmp_path / "other") == tmp_path / "xla"


@pytest.mark.parametrize("value", ["", "off", "OFF", "0", "false"])
def test_cache_can_be_turned_off(fresh_config, monkeypatch, value):
    monkeypatch.setenv(runtime.ENV, value)
    assert runtime.enable_compilation_cache() is None
    assert not jax.config.jax_compilation_cache_dir


def test_a_folder_that_cannot_be_made_runs_uncached(fresh_config, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv(runtime.ENV, str(blocker / "xla"))
    assert runtime.enable_compilation_cache() is None
    assert not jax.config.jax_compilation_cache_dir


def test_target_platform_is_the_backend_unless_the_env_names_one(monkeypatch):
    monkeypatch.delenv(runtime.TARGET_ENV, raising=False)
    assert runtime.target_platform() == jax.default_backend()
    monkeypatch.setenv(runtime.TARGET_ENV, "")
    assert runtime.target_platform() == jax.default_backend()
    monkeypatch.setenv(runtime.TARGET_ENV, " GPU ")
    assert runtime.target_platform() == "gpu"
    monkeypatch.setenv(runtime.TARGET_ENV, "cuda")
    with pytest.raises(ValueError, match=r"TRACKSTAR_TARGET_PLATFORM='cuda' is not a platform"):
        runtime.target_platform()


def test_a_target_platform_takes_its_own_step_structure_on_the_cpu(monkeypatch):
    """What the planner's `--target_platform=gpu` changes while tracing on CPU devices: the fused
    head's chunk, rows and vocabulary blocks, the exact-V loop, and the retrieval kernel's choice."""
    from trackstar_jax.models import head as head_lib
    from trackstar_jax.retrieval import topk

    assert jax.default_backend() == "cpu"
    monkeypatch.delenv(runtime.TARGET_ENV, raising=False)
    assert head_lib.head_chunk_tokens(512) == 512 and head_lib.head_chunk_rows() == head_lib.HEAD_CHUNK_ROWS["cpu"]
    assert topk.make_score_plan(1024, 4096, "bfloat16").upcast == "bf16_pairs"  # widened once per block
    monkeypatch.setenv(runtime.TARGET_ENV, "gpu")
    assert head_lib.head_chunk_tokens(512) == head_lib.HEAD_CHUNK_TOKENS_ACCELERATOR
    assert head_lib.head_chunk_rows() == 1
    assert topk.make_score_plan(1024, 4096, "bfloat16").upcast == "bf16_split3"  # the native bf16 dot
    monkeypatch.setenv(runtime.TARGET_ENV, "cpu")
    assert _exact_v_backward_loops()
    assert _head_scan_lengths(vocab=5000) == [1, 3]  # one chunk, 3 vocabulary blocks of 1,667
    monkeypatch.setenv(runtime.TARGET_ENV, "gpu")
    assert not _exact_v_backward_loops()
    assert _head_scan_lengths(vocab=5000) == [1]


def _head_scan_lengths(vocab: int) -> list[int]:
    """The scans' lengths in the input-only gradient of the fused head (16 x 8 tokens, width 4),
    outermost first."""
    import jax.numpy as jnp

    from trackstar_jax.models import head as head_lib

    def f(x):
        return head_lib.head_nll_sum(
            x, jnp.ones((4, vocab)), jnp.zeros((16, 8), jnp.int32), jnp.ones((16, 8)), weight_grad=False
        )

    lengths = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "scan":
                lengths.append(eqn.params["length"])
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(jax.grad(f))(jnp.ones((16, 8, 4))).jaxpr)
    return lengths


def _exact_v_backward_loops() -> bool:
    """Whether the exact-V capture's backward pass loops over the examples (`lax.map`: a scan)."""
    import jax.numpy as jnp

    from trackstar_jax.features import factored

    b, t, m, n, k = 2, 3, 4, 5, 2
    x, y = jnp.ones((b, t, m)), jnp.ones((b, t, n))
    p0, p1, f = jnp.ones((k, m)), jnp.ones((k, n)), jnp.ones((m, n))

    def dz(z):
        return jax.vjp(lambda z: factored._capture_dense_exact(y, x, p0, p1, f, z), z)[1](y)[0]

    return "scan" in str(jax.make_jaxpr(dz)(jnp.zeros((b, k, k))))


def test_library_chatter_is_filtered_and_warnings_pass():
    """orbax's INFO lines and JAX's "Unable to initialize backend 'tpu'" (libtpu absent) are
    dropped from absl's handler; their warnings and every other INFO line pass."""
    runtime.quiet_library_logs()
    runtime.quiet_library_logs()  # idempotent
    handler = absl_logging.get_absl_handler()
    assert sum(f is runtime._CHATTER for f in handler.filters) == 1

    def rec(level, path, msg):
        return logging.LogRecord("x", level, path, 1, msg, None, None)

    orbax = "/venv/site-packages/orbax/checkpoint/checkpoint_manager.py"
    tpu = "Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so: no such file"
    assert not handler.filter(rec(logging.INFO, orbax, "Saving checkpoint at step 10"))
    assert handler.filter(rec(logging.WARNING, orbax, "a real orbax warning"))
    assert not handler.filter(rec(logging.INFO, "/jax/_src/xla_bridge.py", tpu))
    assert handler.filter(rec(logging.INFO, "/jax/_src/xla_bridge.py", "Unable to initialize backend 'cuda': x"))
    assert handler.filter(rec(logging.INFO, "/trackstar_jax/training/loop.py", "step 10: loss 3.2"))


def test_the_suite_compiles_through_one_per_user_cache():
    """conftest's persistent compilation cache (BUILD_NOTES §14): this process and every process
    it launches (they inherit the environment) use one folder per user, kept across runs, keep
    every compile however short, and leave JAX's own size bound off (it lists the whole folder
    on every write); conftest bounds the folder at the session's start instead."""
    import os
    import subprocess
    import sys

    import conftest

    if conftest.TEST_CACHE is None:
        pytest.skip(f"{conftest.TEST_CACHE_ENV} turns the tests' compilation cache off")
    if os.environ.get(conftest.TEST_CACHE_ENV) is None:
        assert conftest.TEST_CACHE == conftest.TEST_CACHE_DEFAULT  # stable across runs, not a temp folder
    want = [str(conftest.TEST_CACHE), "-1", "0.0"]
    got = jax.config
    assert [got.jax_compilation_cache_dir, str(got.jax_compilation_cache_max_size)] == want[:2]
    assert got.jax_persistent_cache_min_compile_time_secs == 0.0
    code = (
        "import jax; c = jax.config; print(c.jax_compilation_cache_dir, c.jax_compilation_cache_max_size,"
        " float(c.jax_persistent_cache_min_compile_time_secs))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == want


def test_modules_go_out_heaviest_first_and_the_measured_seconds_name_real_modules(tmp_path):
    """conftest orders modules by their measured seconds (tools/module_seconds.py), unknown ones
    first, each module's tests kept in order; the seconds name only modules that exist."""
    import conftest

    from tools import module_seconds

    ids = [
        "tests/test_a.py::t1",
        "tests/test_a.py::t2[x]",
        "tests/test_b.py::t",
        "tests/test_new.py::t",
        "tests/test_c.py::t",
    ]
    got = conftest.heaviest_first(ids, {"test_a.py": 5.0, "test_b.py": 50.0, "test_c.py": 5.0})
    assert got == [
        "tests/test_new.py::t",
        "tests/test_b.py::t",
        "tests/test_a.py::t1",
        "tests/test_a.py::t2[x]",
        "tests/test_c.py::t",
    ]
    log = "12.50s setup    tests/test_b.py::t\n0.50s call     tests/test_b.py::t\n3.00s call     tests/test_a.py::t1[2-x]\n"
    assert module_seconds.module_seconds(log) == {"test_b.py": 13.0, "test_a.py": 3.0}
    listed = json.loads(conftest.MODULE_SECONDS.read_text())
    assert listed and all((conftest.REPO / "tests" / name).is_file() for name in listed), sorted(listed)


def test_the_jax_seconds_plugin_reports_each_tests_tracing_lowering_and_compiling(tmp_path):
    """tools/jax_seconds.py (the profile behind BUILD_NOTES §14's warm-run split): a pytest run
    with the plugin writes, for a test that jits, its trace, lower and compile seconds; without
    the file named it refuses in one line."""
    from conftest import REPO

    from tools import jax_seconds

    (tmp_path / "test_jits.py").write_text(
        "import jax, jax.numpy as jnp\n"
        "def test_jits():\n"
        "    assert float(jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.float32(0.5))) > 1\n"
        "def test_nothing():\n"
        "    pass\n"
    )
    out = tmp_path / "seconds.tsv"
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", jax_seconds.ENV: str(out)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # a fresh compile, not a load
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tools.jax_seconds", str(tmp_path)]
    run = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line.split("\t") for line in out.read_text().splitlines()]
    mine = {r[1]: (float(r[2]), int(r[3])) for r in rows if r[4].endswith("test_jits.py::test_jits")}
    assert set(mine) == {"trace", "lower", "compile"} and all(s > 0 and n >= 1 for s, n in mine.values()), rows
    assert not [r for r in rows if r[4].endswith("::test_nothing")]
    kinds, heaviest = jax_seconds.summary(out.read_text())
    assert set(kinds) == {"trace", "lower", "compile"} and heaviest[0][1].endswith("::test_jits")
    env.pop(jax_seconds.ENV)
    run = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and f"set {jax_seconds.ENV}" in run.stdout + run.stderr


_COMPILES = """
import jax, jax.numpy as jnp
print(float(jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.float32(0.5))))
"""


def test_a_torn_cache_entry_is_compiled_again_with_a_warning(tmp_path):
    """What conftest relies on with JAX's size bound off (entries written in place): a worker that
    reads another's half-written entry compiles the program itself and warns; it does not fail."""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    env.pop("JAX_RAISE_PERSISTENT_CACHE_ERRORS", None)

    def run():
        return subprocess.run([sys.executable, "-c", _COMPILES], env=env, capture_output=True, text=True, timeout=120)

    first = run()
    assert first.returncode == 0, first.stderr[-2000:]
    entries = [f for f in tmp_path.iterdir() if f.name.endswith("-cache")]
    assert entries, sorted(f.name for f in tmp_path.iterdir())
    for f in entries:  # every entry torn half-way
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    second = run()
    assert second.returncode == 0, second.stderr[-2000:]
    assert second.stdout == first.stdout
    assert "Error reading persistent compilation cache entry" in second.stderr


def test_the_cache_folder_is_pruned_oldest_first_to_half_its_bound(tmp_path):
    import conftest

    for i, size in enumerate((300, 300, 200, 100)):  # written in this order, oldest first
        f = tmp_path / f"entry{i}-cache"
        f.write_bytes(b"x" * size)
        os.utime(f, ns=(i * 10**9, i * 10**9))
    assert conftest._prune_cache(tmp_path, max_bytes=900) == 0  # 900 bytes: within the bound
    (tmp_path / "entry4-cache").write_bytes(b"x" * 100)  # 1,000 bytes: over it
    assert conftest._prune_cache(tmp_path, max_bytes=900) == 2  # the two oldest, down to <= 450
    assert sorted(f.name for f in tmp_path.iterdir()) == ["entry2-cache", "entry3-cache", "entry4-cache"]


def test_test_run_cache_keeps_the_recent_fingerprints_and_keys_on_the_sources(tmp_path, monkeypatch):
    """conftest's trained-run cache: all but the most recently used fingerprint folders go, and
    the fingerprint moves with a source byte of the package or an XLA / JAX setting."""
    import conftest

    for i in range(5):
        d = tmp_path / f"fp{i}"
        (d / "run").mkdir(parents=True)
        os.utime(d, ns=(i * 10**9, i * 10**9))
    (tmp_path / "fp0.lock").write_text("")  # files are not fingerprints
    (tmp_path / conftest.REFERENCES).mkdir()  # nor the kept transformers references, however old
    os.utime(tmp_path / conftest.REFERENCES, ns=(0, 0))
    assert [d.name for d in conftest.prune_runs(tmp_path, keep=3)] == ["fp0", "fp1"]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["fp0.lock", "fp2", "fp3", "fp4", conftest.REFERENCES]
    assert conftest.prune_runs(tmp_path / "absent") == []

    repo = tmp_path / "repo"
    for folder in ("trackstar_jax", "experiments"):
        (repo / folder).mkdir(parents=True)
        (repo / folder / "m.py").write_text("x = 1\n")
    monkeypatch.setattr(conftest, "REPO", repo)
    first = conftest.inputs_fingerprint()
    assert conftest.inputs_fingerprint() == first  # a function of its inputs
    (repo / "trackstar_jax" / "m.py").write_text("x = 2\n")
    second = conftest.inputs_fingerprint()
    assert second != first
    monkeypatch.setenv("JAX_DEFAULT_MATMUL_PRECISION", "highest")
    assert conftest.inputs_fingerprint() != second


# A stage stand-in under `exit_on_interrupt`: prints "ready", then works until interrupted,
# printing "unwound" if the KeyboardInterrupt unwinds it.
_INTERRUPTED = """
import signal, sys, time
import numpy as np
# SIGINT as a shell gives it to a launcher. Once in the suite the child never saw the signal (no
# "unwound", no watcher exit: the test timed out); a SIGINT ignored or blocked in the worker that
# starts it, both of which survive exec, is the cause that fits, and is not what is tested here
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
signal.signal(signal.SIGINT, signal.default_int_handler)
from trackstar_jax.distributed import runtime
a, b = np.ones((4000, 4000)), np.empty((4000, 4000))  # one product: ~1 s inside BLAS
with runtime.exit_on_interrupt(grace_s=float(sys.argv[2])):
    try:
        print("ready", flush=True)
        while True:
            if sys.argv[1] == "python":
                time.sleep(0.01)  # the interrupt reaches Python at once
            else:
                np.dot(a, a, out=b)  # BLAS holds it: it reaches Python only when the product returns
                # (one call per iteration: a chain of products would let it in between them)
    finally:
        print("unwound", flush=True)
"""


@pytest.mark.parametrize(
    "work, grace_s, unwound",
    [
        ("python", 60.0, True),
        # the watcher must win a race with the product's return: under the suite's second worker
        # it lost once in three runs, so it runs with `-m slow` (the one-line exit stays pinned above)
        pytest.param("native", 0.05, False, marks=pytest.mark.slow),
    ],
)
def test_a_ctrl_c_ends_the_process_in_one_line(tmp_path, work, grace_s, unwound):
    """Ctrl-C: exit status 130 and one line saying a rerun resumes, not a traceback; when native
    code holds the interrupt past the grace period, the watcher thread ends the process."""
    script = tmp_path / "stage.py"
    script.write_text(textwrap.dedent(_INTERRUPTED))
    repo = pathlib.Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, str(script), work, str(grace_s)],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo), "JAX_PLATFORMS": "cpu"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == runtime.INTERRUPTED_EXIT
    assert err == runtime.RESUME_HINT + "\n"
    assert ("unwound" in out) == unwound
