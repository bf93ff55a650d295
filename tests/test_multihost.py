"""Multi-host SPMD for real: 2 OS processes under jax.distributed on CPU (2 devices each, gloo).

They train the tiny config together (one program over the 4-device global mesh) and build
its index together (each process one writer over its 2 local devices, process 0 finalises).
The results must equal single-process runs of the same config; bad launcher input fails
with an error naming the flag. Every subprocess has a timeout, so a hang fails the test.
"""

import json
import subprocess
import sys

import _multihost_util as mh
import jax
import numpy as np
import pytest
from test_build_index import _config  # the small run of the index tests (30 facts, 3 steps)

from trackstar_jax import config as config_lib
from trackstar_jax import index, stages
from trackstar_jax.distributed import multihost

pytestmark = pytest.mark.usefixtures("fast_compile")


def _launch(
    stage: str, workdir, *extra: str, num_processes: int = 2, per_process=None, timeout_s: float = mh.TIMEOUT_S
) -> list[subprocess.CompletedProcess]:
    """Runs `python -m launch.<stage>` as `num_processes` processes of one jax.distributed job."""
    flags = [*mh.override_flags(_config()), *extra]
    procs = mh.start(stage, workdir, flags, num_processes=num_processes, per_process=per_process)
    return mh.wait(procs, stage, timeout_s)


@pytest.fixture(scope="module")
def two_host_run(tmp_path_factory):
    """A run trained by 2 processes, then indexed by 2 processes; `(workdir, index summaries)`."""
    workdir = tmp_path_factory.mktemp("multihost")
    mh.ok(_launch("train", workdir))
    outs = mh.ok(_launch("build_index", workdir))
    return workdir, [json.loads(o.strip().splitlines()[-1]) for o in outs]


def test_two_processes_train_like_one(two_host_run, tiny_run):
    workdir, _ = two_host_run
    ref_dir = tiny_run(_config())  # one process, 8 devices
    two, one = stages.load_run(workdir), stages.load_run(ref_dir)
    assert two.step == one.step == 3 and two.corpus.fingerprint == one.corpus.fingerprint
    # Same batches and updates; only the all-reduce differs (4 devices over gloo vs 8 in one process).
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
        (two.params, two.opt_state),
        (one.params, one.opt_state),
    )
    # Process 0 alone wrote the run directory's files: one record per logged step.
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [3, 3]
    assert json.loads((workdir / "train_summary.json").read_text())["step"] == 3


def test_two_processes_build_the_index_of_one(two_host_run):
    workdir, summaries = two_host_run
    assert [(s["process_index"], s["process_count"], s["complete"]) for s in summaries] == [(0, 2, True), (1, 2, True)]
    assert sum(s["rows_written"] for s in summaries) == summaries[0]["rows"]
    # Finalised exactly once, by process 0, after both writers were done.
    assert {s["finalized_by"] for s in summaries} == {"process 0 of 2"}
    path = workdir / "index"
    assert index.finalized_by(path) == "process 0 of 2"
    assert not [f for f in path.rglob(".*tmp*")]  # no leftover temporary files
    # The reference: one process over all its (8) devices, same run, another index directory.
    c = _config()
    c.index.dir = "index_one_process"
    one = stages.build_index(config_lib.from_configdict(c), workdir)
    assert one["process_count"] == 1 and one["complete"]
    two_r, one_r = index.open_index(path), index.open_index(workdir / "index_one_process")
    a, _ = two_r.read_block(0, two_r.num_rows)
    b, _ = one_r.read_block(0, one_r.num_rows)
    # The same rows in the same order, each value within one bfloat16 step: the processes' programs
    # see other per-device batch shapes, so XLA may tile them otherwise and the float32 vectors
    # differ by round-off, which flips a rounding to bfloat16 now and then (bits were equal on one
    # CPU, 2 of 33,280 one step apart on another). Adjacent bfloat16 values of one sign are
    # adjacent integers in their bits; a wrong or misplaced row is hundreds of steps off, and
    # another rounding (truncation) one step off in about half the values.
    bits_a, bits_b = a.view(np.uint16).astype(np.int32), b.view(np.uint16).astype(np.int32)
    assert np.array_equal(bits_a >> 15, bits_b >> 15), "signs differ"
    assert np.abs(bits_a - bits_b).max() <= 1, np.abs(bits_a - bits_b).max()
    assert np.mean(bits_a != bits_b) < 1e-2, np.mean(bits_a != bits_b)
    assert two_r.r_train().count == one_r.r_train().count == two_r.num_rows
    # R_train sums the float32 vectors' outer products: equal to their round-off, at the sum's scale
    total = one_r.r_train().total
    np.testing.assert_allclose(two_r.r_train().total, total, rtol=0, atol=1e-6 * np.abs(total).max())
    assert index.verify_index(path)["ok"]


def test_process_count_that_disagrees_with_jax_is_refused(two_host_run):
    workdir, _ = two_host_run
    results = _launch("build_index", workdir, "--process_count=3", "--config.index.dir=index_bad")
    for r in results:
        assert r.returncode != 0
        assert "--process_count=3 disagrees with this jax.distributed job (process_count is 2)" in r.stderr
    assert not (workdir / "index_bad").exists()


def test_a_failing_process_fails_the_others_at_once(two_host_run):
    """Process 1 asks for another storage dtype, so whichever process creates the index second
    is refused (manifest mismatch). The other must not wait for it: it fails with that
    message at the barrier, or, when the refused one is process 0 (the coordinator), JAX's
    coordination service ends it."""
    workdir, _ = two_host_run
    results = _launch(
        "build_index",
        workdir,
        "--config.index.dir=index_mixed",
        timeout_s=120,
        per_process={1: ["--config.index.dtype=float32"]},
    )
    assert all(r.returncode != 0 for r in results)
    # the refused process names the mismatch; the other may quote it ("process N failed at ...")
    refused = [
        i
        for i, r in enumerate(results)
        if "IndexMismatchError: refusing to resume" in r.stderr and f"process {1 - i} failed at" not in r.stderr
    ]
    assert len(refused) == 1, [r.stderr[-2000:] for r in results]
    other = results[1 - refused[0]].stderr
    assert (
        f"process {refused[0]} failed at 'build_index:written': error: IndexMismatchError" in other
        or "JAX distributed service detected fatal errors" in other
    ), other[-3000:]


def test_missing_coordinator_is_named(tmp_path):
    port = mh.free_port()  # nobody listens there
    args = [sys.executable, "-m", "launch.build_index", "--config=experiments/tiny.py", f"--workdir={tmp_path}"]
    r = subprocess.run(
        args
        + [
            "--distributed",
            f"--coordinator_address=localhost:{port}",
            "--num_processes=2",
            "--process_id=1",
            "--distributed_timeout_s=2",
        ],
        cwd=mh.REPO,
        env=mh.env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        r.returncode != 0
        and f"could not connect to the coordinator at localhost:{port} (--coordinator_address)" in r.stderr
    )
    # Incomplete settings are refused before jax.distributed is touched (so, in this process).
    with pytest.raises(ValueError, match="needs --coordinator_address as well"):
        multihost.initialize(None, 2, 1)
    with pytest.raises(ValueError, match=r"--process_id=2 is not in \[0, --num_processes=2\)"):
        multihost.initialize("localhost:1", 2, 2)


def test_writer_partition_in_one_process():
    assert multihost.writer_partition() == (0, 1)
    assert multihost.writer_partition(1, 2) == (1, 2)
    with pytest.raises(ValueError, match=r"--process_index=2 is not in \[0, --process_count=2\)"):
        multihost.writer_partition(2, 2)
    multihost.sync("single-process-noop")  # no jax.distributed: nothing to wait for
    multihost.require_single_process("launch.retrieve")  # one process: allowed


_SERIAL_SCRIPT = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from trackstar_jax.distributed import multihost
multihost.initialize(f"localhost:{sys.argv[1]}", 1, 0, timeout_s=60)
assert multihost.serial_collectives()  # CPU under jax.distributed: gloo
mesh = Mesh(np.array(jax.devices()), ("d",))
f = jax.jit(jax.shard_map(
    lambda x: 0.5 * jax.lax.all_gather(x, "d", axis=0, tiled=True).mean(0, keepdims=True) + 0.5 * x,
    mesh=mesh, in_specs=P("d"), out_specs=P("d")))
x = jnp.ones((8, 16), jnp.float32)
for _ in range(300):  # unsettled, such a loop hung within seconds
    x = multihost.settle(f(x))
print(float(jax.device_get(x).sum()))
"""


def test_collective_programs_are_serial_on_a_multi_device_cpu():
    """`serial_collectives`: on the CPU with several devices (this 8-device process), also
    without jax.distributed; with one CPU device, nothing has collectives: dispatch stays
    asynchronous."""
    assert jax.default_backend() == "cpu" and jax.local_device_count() == 8  # conftest's fake devices
    assert multihost.serial_collectives()
    script = "from trackstar_jax.distributed import multihost; print(multihost.serial_collectives())"
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=mh.REPO,
        env=mh.env(num_devices=1),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_settled_collective_programs_do_not_deadlock_under_gloo():
    """`multihost.settle` waits for each program where gloo runs the collectives (one process of
    a jax.distributed job with 8 CPU devices): 300 shard_map all-gathers finish."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERIAL_SCRIPT, str(mh.free_port())],
        cwd=mh.REPO,
        env=mh.env(num_devices=8),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    (result,) = mh.wait([proc], "the settled all-gather loop", timeout_s=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert float(result.stdout.strip().splitlines()[-1]) == 8 * 16  # ones stay ones
