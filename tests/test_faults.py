"""Faults: every damaged file or malformed input gives an error naming it, never a changed result.

One tiny run (trained a few steps, indexed, one retrieval) is made per module; each test
damages a copy of it. Also: reruns write nothing, a NaN checkpoint is neither saved nor
resumed, two writers of one index are refused (the second names the first's pid), and a
`kill -9` of `python -m launch.build_index` mid-way resumes to byte-identical vectors.
"""

import errno
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from trackstar_jax import config as config_lib
from trackstar_jax import data as data_lib
from trackstar_jax import files, stages
from trackstar_jax import index as index_lib
from trackstar_jax.evaluation import results as results_lib
from trackstar_jax.index import manifest as manifest_lib
from trackstar_jax.index import store
from trackstar_jax.index import verify as verify_lib
from trackstar_jax.retrieval import stage as retrieval_stage
from trackstar_jax.training import checkpoint
from trackstar_jax.training import step as step_lib

pytestmark = pytest.mark.usefixtures("fast_compile")

REPO = pathlib.Path(__file__).resolve().parents[1]
# The run's settings as flags: the subprocess build gets exactly the in-process config.
OVERRIDES = {
    "data.embedded.num_facts": 30,
    "data.embedded.num_distractors": 40,
    "train.num_steps": 3,
    "train.log_every_steps": 3,
    "train.eval_every_steps": 3,
    "train.checkpoint_every_steps": 3,
    "train.num_completions": 0,
    "train.max_new_tokens": 2,
    "train.max_fact_prompts": 4,
    "vectors.batch_size": 8,
    "index.chunk_rows": 4,
    "index.r_every_chunks": 1,
}
QUERIES = [
    {"prompt": "The capital of France is", "target": " Paris"},
    {"prompt": "Ann Lee was born in", "target": " Rome"},
]


def _settings(**more) -> config_lib.Settings:
    from experiments import tiny

    c = tiny.get_config()
    return config_lib.from_configdict(c).replace({**OVERRIDES, **more})


def _write_queries(path: pathlib.Path, rows: list) -> pathlib.Path:
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows))
    return path


def _config():
    """`_settings()` as the config `conftest.tiny_run` trains."""
    from experiments import tiny

    c = tiny.get_config()
    c.update_from_flattened_dict(OVERRIDES)
    return c


@pytest.fixture(scope="module")
def run_dir(tiny_run):
    """Trained, indexed (bfloat16, chunks of 4 rows) and retrieved once (scoring cache written)."""
    workdir = tiny_run(_config(), index=True)
    assert config_lib.from_configdict(_config()) == _settings()
    stages.build_index(_settings(), workdir)
    q = _write_queries(workdir / "queries.jsonl", QUERIES)
    stages.retrieve(_settings(**{"retrieval.queries": str(q)}), workdir)
    return workdir


@pytest.fixture
def work(run_dir, tmp_path):
    """A copy of the run to damage."""
    dst = tmp_path / "run"
    shutil.copytree(run_dir, dst, symlinks=True)
    return dst


def _retrieve(workdir, **more):
    s = _settings(**{"retrieval.queries": str(workdir / "queries.jsonl"), "retrieval.overwrite": True, **more})
    return stages.retrieve(s, workdir)


def _flip(path: pathlib.Path, offset: int | None = None, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 1 << bit
    path.write_bytes(bytes(data))


def _truncate(path: pathlib.Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _snapshot(workdir: pathlib.Path) -> dict:
    return {
        str(p.relative_to(workdir)): p.read_bytes()
        for p in sorted(workdir.rglob("*"))
        if p.is_file() and "checkpoints" not in p.parts and p.name != "metrics.jsonl"
    }


# ---------------------------------------------------------------------------------------
# Reruns write nothing
# ---------------------------------------------------------------------------------------


def test_finished_train_rerun_writes_nothing_and_refuses_a_changed_run(work):
    before = _snapshot(work)
    stages.train(_settings(**{"vectors.proj_seed": 5}), work)  # a later stage's key: kept as recorded, logged
    assert _snapshot(work) == before
    with pytest.raises(config_lib.ConfigError, match=r"model\.embed_dim: saved \d+, now 48"):
        stages.train(_settings(**{"model.embed_dim": 48}), work)


# ---------------------------------------------------------------------------------------
# Damaged run files
# ---------------------------------------------------------------------------------------


def test_damaged_config_json(work):
    cfg = work / "config.json"
    text = cfg.read_text()
    saved = json.loads(text)
    # A flip that still parses but changes the run (train.learning_rate 0.01 -> 0.03).
    lr = f'"learning_rate": {saved["train"]["learning_rate"]}'
    assert lr in text
    cfg.write_text(text.replace(lr, lr.replace("0.01", "0.03")))
    with pytest.raises(ValueError, match=r"train\.learning_rate: saved 0\.01, now 0\.03"):
        stages.load_run(work)
    cfg.write_text(text)
    _truncate(cfg)
    with pytest.raises(config_lib.ConfigError, match=r"config\.json is not valid JSON"):
        stages.load_run(work)


def test_damaged_index_manifest(work):
    _truncate(work / "index" / "manifest.json")
    with pytest.raises(store.IndexCorruptError, match=r"index manifest .*manifest\.json is damaged"):
        _retrieve(work)
    with pytest.raises(store.IndexCorruptError, match=r"manifest\.json is damaged"):
        verify_lib.verify_index(work / "index")


def test_damaged_vector_chunk(work):
    _flip(work / "index" / "vectors" / "c" / "2" / "0")
    with pytest.raises(store.IndexCorruptError, match=r"chunk 2, rows \[8, 12\)"):
        _retrieve(work)


def test_damaged_r_train(work):
    _flip(work / "index" / "r_train.npy", offset=-8)
    with pytest.raises(store.IndexCorruptError, match=r"r_train\.npy does not match the sha256 .*rerun build_index"):
        _retrieve(work)
    with pytest.raises(
        store.IndexCorruptError, match=r"failed verification:\n.*r_train\.npy does not match the sha256"
    ):
        verify_lib.verify_index(work / "index", recompute_r=False)


def test_damaged_scoring_cache(work):
    (cache,) = (work / "index" / "scoring").glob("*.npy")
    _flip(cache, offset=-4)
    with pytest.raises(store.IndexCorruptError, match=rf"{cache.name} do not match their sha256.*delete"):
        _retrieve(work)
    cache.unlink()  # deleting it recomputes it: the same scores as before
    got = [json.loads(x) for x in (work / "retrieval" / "queries.jsonl").read_text().splitlines()]
    _retrieve(work)
    again = [json.loads(x) for x in (work / "retrieval" / "queries.jsonl").read_text().splitlines()]
    assert [r["proponent_scores"] for r in got] == [r["proponent_scores"] for r in again]


def test_damaged_corpus(work):
    ex = work / "corpus" / "examples.jsonl"
    text = ex.read_bytes()
    start = text.index(b'"text": "') + 9
    letter = next(i for i in range(start, len(text)) if chr(text[i]).isalpha())
    _flip(ex, offset=letter, bit=5)  # a letter of a passage changes case: still valid JSON
    with pytest.raises(files.InputError, match=r"corpus at .* was modified"):
        stages.load_run(work)
    ex.write_bytes(text[: len(text) // 2])
    with pytest.raises(files.InputError, match=rf"{ex}:\d+: not valid JSON"):
        stages.load_run(work)
    ex.write_bytes(text.replace(b'"text": "', b'"text": "\xff', 1))
    with pytest.raises(files.InputError, match=rf"{ex}:1: not valid UTF-8"):
        stages.load_run(work)


def test_damaged_evaluation_retrievals(tmp_path):
    d = tmp_path / "eval"
    (d / "retrievals").mkdir(parents=True)
    (d / "queries.jsonl").write_text("")
    (d / "table.json").write_text('{"rows": [')
    (d / "retrievals" / "bm25.jsonl").write_bytes(b'{"a": 1}\n{"a": \xff}\n')
    with pytest.raises(files.InputError, match=r"bm25\.jsonl:2: not valid UTF-8"):
        results_lib.load_results(tmp_path)
    (d / "retrievals" / "bm25.jsonl").unlink()
    with pytest.raises(files.InputError, match=r"table\.json is damaged"):
        results_lib.load_results(tmp_path)


# ---------------------------------------------------------------------------------------
# Malformed inputs
# ---------------------------------------------------------------------------------------


def test_malformed_query_files(tmp_path):
    q = tmp_path / "q.jsonl"
    _write_queries(q, [QUERIES[0], b'{"prompt": "Caf\xe9", "target": " x"}'])
    with pytest.raises(files.InputError, match=rf"{q}:2: not valid UTF-8"):
        retrieval_stage.load_text_queries(q)
    _write_queries(q, [QUERIES[0], {"prompt": " ", "target": " Paris"}])
    with pytest.raises(ValueError, match=rf"{q}:2: the prompt is empty"):
        retrieval_stage.load_text_queries(q)
    _write_queries(q, [QUERIES[0], b'{"prompt": "x", "target'])
    with pytest.raises(files.InputError, match=rf"{q}:2: not valid JSON"):
        retrieval_stage.load_text_queries(q)
    _write_queries(q, [QUERIES[0], b'{"prompt": "Ann \\ud800 Lee was born in", "target": " Rome"}'])
    with pytest.raises(files.InputError, match=rf"{q}:2: the prompt holds a lone surrogate \(U\+D800\) at position 4"):
        retrieval_stage.load_text_queries(q)


def test_long_prompt_names_file_line_and_is_cut(run_dir, tmp_path):
    q = _write_queries(tmp_path / "long.jsonl", [QUERIES[0], {"prompt": "word " * 1000, "target": " Paris"}])
    with pytest.raises(ValueError) as e:
        _retrieve(run_dir, **{"retrieval.queries": str(q), "retrieval.output": "long"})
    msg = str(e.value)
    assert f"{q}:2 " in msg and "exceed max_len" in msg and "(5000 characters)" in msg and len(msg) < 600


def test_malformed_text_corpus(tmp_path):
    f = tmp_path / "c.txt"
    f.write_bytes(b"first passage\nsecond \xc3\x28 passage\n")
    cfg = config_lib.section("data", {"source": "text", "path": str(f)})
    with pytest.raises(files.InputError, match=rf"{f}:2: not valid UTF-8"):
        data_lib.build_corpus(cfg)
    j = tmp_path / "c.jsonl"
    j.write_bytes(b'{"text": "ok"}\n\n{"text": "\xff"}\n')
    with pytest.raises(files.InputError, match=rf"{j}:3: not valid UTF-8"):
        data_lib.build_corpus(config_lib.section("data", {"source": "jsonl", "path": str(j)}))
    j.write_bytes(b'{"text": "ok"}\n{"text": "half a pair \\udc00 here"}\n')
    with pytest.raises(
        files.InputError, match=rf"{j}:2: the passage holds a lone surrogate \(U\+DC00\) at position 12"
    ):
        data_lib.build_corpus(config_lib.section("data", {"source": "jsonl", "path": str(j)}))


def test_retrieve_refuses_other_vector_and_storage_settings(run_dir):
    with pytest.raises(store.IndexMismatchError, match=r"config\.index\.dtype='float32'.*stores 'bfloat16'"):
        _retrieve(run_dir, **{"index.dtype": "float32", "retrieval.output": "x"})
    with pytest.raises(store.IndexMismatchError, match=r"refusing to open .*: manifest field 'vectors\.proj_dim'"):
        _retrieve(run_dir, **{"vectors.proj_dim": 4, "retrieval.output": "x"})
    with pytest.raises(store.IndexMismatchError, match=r"refusing to open .*: manifest field 'vectors\.correction'"):
        _retrieve(run_dir, **{"vectors.correction": False, "retrieval.output": "x"})


def test_evaluate_rerun_follows_the_retrieve_rule(work):
    s = _settings(**{"eval.methods": ("bm25",)})
    out = work / "eval"
    (out / "retrievals").mkdir(parents=True)
    (out / "retrievals" / "bm25.jsonl").write_text("{}\n")
    with pytest.raises(FileExistsError, match=r"retrieval\.overwrite=True"):
        stages.evaluate(s, work)
    assert (out / "retrievals" / "bm25.jsonl").exists()
    # A finished evaluation with the same settings is only reported; other settings are refused by name.
    table = {"rows": [], "settings": config_lib.to_dict(s)}
    files.atomic_write_json(out / "table.json", table)
    before = _snapshot(out)
    assert stages.evaluate(s, work) == table and _snapshot(out) == before
    with pytest.raises(FileExistsError, match=r"eval\.num_proponents: saved 10, now 12"):
        stages.evaluate(_settings(**{"eval.methods": ("bm25",), "eval.num_proponents": 12}), work)


def test_a_checkpoint_the_disk_cannot_hold_is_refused_before_writing(work, monkeypatch):
    """Issue 38 (12): a full disk during training gave orbax's background writers' tracebacks
    (137 of them) before one clear line; the save is refused up front, naming the step folder."""
    s = _settings()
    mngr = checkpoint.CheckpointManager(work / "checkpoints", max_to_keep=None)
    _, target = checkpoint.abstract_state(s.model, step_lib.make_optimizer(s.train.optimizer))
    step, state = mngr.restore_latest(target)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    usage = shutil.disk_usage(work)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=nbytes // 2))
    before = sorted(p.name for p in (work / "checkpoints").iterdir())
    with pytest.raises(
        files.WriteError, match=rf"cannot write checkpoint {work / 'checkpoints' / str(step + 1)}: the disk is full"
    ):
        mngr.save(state.replace(step=jnp.asarray(step + 1, jnp.int32)), config_lib.to_dict(s))
    mngr.close()
    assert sorted(p.name for p in (work / "checkpoints").iterdir()) == before


# ---------------------------------------------------------------------------------------
# NaN checkpoints
# ---------------------------------------------------------------------------------------


def test_nan_checkpoint_is_neither_saved_nor_resumed(work):
    s = _settings()
    mngr = checkpoint.CheckpointManager(work / "checkpoints", max_to_keep=None)
    _, target = checkpoint.abstract_state(s.model, step_lib.make_optimizer(s.train.optimizer))
    step, state = mngr.restore_latest(target)
    key_path, _ = jax.tree_util.tree_leaves_with_path(state.params)[0]
    bad = jax.tree_util.tree_map_with_path(
        lambda p, v: v.at[(0,) * v.ndim].set(jnp.nan) if p == key_path else v, state.params
    )
    (path,) = [p.removeprefix("params/") for p in checkpoint.nonfinite_leaves({"params": bad})]
    nan_state = state.replace(params=bad, step=jnp.asarray(step + 1, jnp.int32))
    with pytest.raises(FloatingPointError, match=rf"refusing to save step {step + 1}.*params/{path}"):
        mngr.save(nan_state, config_lib.to_dict(s))
    # Written past the check (as a crashed older version might have): never resumed.
    mngr._mngr.save(
        step + 1,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(nan_state), config=ocp.args.JsonSave(config_lib.to_dict(s))
        ),
    )
    mngr.close()
    with pytest.raises(FloatingPointError, match=rf"checkpoint .*/{step + 1} holds non-finite values in params/{path}"):
        stages.train(_settings(**{"train.num_steps": step + 3}), work)
    with pytest.raises(FloatingPointError, match=r"non-finite"):
        stages.load_run(work)


# ---------------------------------------------------------------------------------------
# Damaged checkpoints: refused by their checksums, naming the step folder and the file
# ---------------------------------------------------------------------------------------


def _largest_checkpoint_file(step_dir: pathlib.Path) -> pathlib.Path:
    """The biggest file orbax wrote for the state (the arrays' data)."""
    return max((f for f in (step_dir / "state").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def test_flipped_bit_or_truncated_checkpoint_file_is_refused_naming_step_and_file(work):
    """Issue 53 (1): one flipped bit in an orbax data file loaded silently (and build_index, verify_index
    went on); a truncated file gave a raw TensorStore error. Now every stage that reads the weights
    refuses first, naming the step folder and the file; retrieve blames the checkpoint, not the index."""
    step_dir = work / "checkpoints" / "3"
    data = _largest_checkpoint_file(step_dir)
    rel = data.relative_to(step_dir).as_posix()
    good = data.read_bytes()
    where = rf"checkpoint {step_dir} is damaged: file {rel} "
    _flip(data, bit=3)
    for stage in (
        lambda: stages.load_run(work),
        lambda: _retrieve(work),
        lambda: stages.build_index(_settings(**{"index.dir": "index2"}), work),
    ):
        with pytest.raises(checkpoint.CheckpointCorruptError, match=where + "differs from the bytes saved"):
            stage()
    with pytest.raises(store.IndexCorruptError, match=where + "differs"):
        verify_lib.verify_index(work / "index", recompute_r=False)
    assert not (work / "index2").exists()
    data.write_bytes(good[: len(good) // 2])
    with pytest.raises(
        checkpoint.CheckpointCorruptError, match=where + rf"has {len(good) // 2} bytes, {len(good)} were"
    ):
        stages.load_run(work)
    data.write_bytes(good)
    assert stages.load_run(work).step == 3


def test_checkpoint_without_checksums_loads_with_a_warning_and_a_damaged_one_names_its_folder(work, caplog):
    """A checkpoint saved before checksums (no `trackstar_checksums.json`) loads, unverified, with one
    warning line; a file of it that orbax cannot read is refused naming the step folder, not as a raw
    TensorStore exception."""
    step_dir = work / "checkpoints" / "3"
    (step_dir / checkpoint.CHECKSUM_FILE).unlink()
    with caplog.at_level("WARNING"):
        assert stages.load_run(work).step == 3
    assert f"checkpoint {step_dir} has no {checkpoint.CHECKSUM_FILE}" in caplog.text
    _truncate(_largest_checkpoint_file(step_dir))
    with pytest.raises(
        checkpoint.CheckpointCorruptError, match=rf"checkpoint {step_dir} cannot be read: .*Error reading \"params\."
    ):
        stages.load_run(work)


def test_verify_index_and_retrieve_detect_a_checkpoint_swapped_after_indexing(work):
    """The index records the checksum digest of the checkpoint it was built from: a checkpoint
    replaced since (another valid one at the same step) fails `verify_index` and `launch.verify_index`,
    and retrieve says the checkpoint changed."""
    assert verify_lib.verify_index(work / "index", recompute_r=False)["checkpoint"]["checked"]
    s = _settings()
    mngr = checkpoint.CheckpointManager(work / "checkpoints", max_to_keep=None)
    _, target = checkpoint.abstract_state(s.model, step_lib.make_optimizer(s.train.optimizer))
    step, state = mngr.restore_latest(target)
    saved = mngr.saved_config(step)
    mngr.close()
    shutil.rmtree(work / "checkpoints" / str(step))
    other = jax.tree.map(lambda x: x * 1.001, state.params)
    mngr = checkpoint.CheckpointManager(work / "checkpoints", max_to_keep=None)
    mngr.save(state.replace(params=other), saved)
    mngr.close()
    swapped = rf"checkpoint {work / 'checkpoints' / str(step)} is not the one index {work / 'index'} was built from"
    with pytest.raises(store.IndexCorruptError, match=swapped):
        verify_lib.verify_index(work / "index", recompute_r=False)
    done = subprocess.run(
        [sys.executable, "-m", "launch.verify_index", f"--path={work / 'index'}", "--norecompute_r"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "is not the one index" in json.loads(done.stdout.splitlines()[-1])["error"]
    with pytest.raises(
        store.IndexMismatchError, match=rf"the run's checkpoint {work / 'checkpoints' / str(step)} is not"
    ):
        _retrieve(work)


# ---------------------------------------------------------------------------------------
# No write follows a symlink
# ---------------------------------------------------------------------------------------


def test_linked_lock_files_are_refused_and_their_targets_untouched(work, tmp_path):
    """Issue 53 (2): a workdir whose `.writer-0000.lock` (or an index's `progress/writer-*.lock`) was a
    symlink had the file it points to emptied, outside the workdir, and the stage exited 0."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    lock = work / ".writer-0000.lock"
    lock.unlink(missing_ok=True)
    lock.symlink_to(victim)
    with pytest.raises(files.SymlinkError, match=rf"{lock} is a symbolic link \(to {victim}\)"):
        _retrieve(work)
    lock.unlink()
    progress = work / "index2" / "progress"
    progress.mkdir(parents=True)
    (progress / "writer-0000-of-0001.lock").symlink_to(victim)
    with pytest.raises(files.SymlinkError, match=r"writer-0000-of-0001.lock is a symbolic link"):
        stages.build_index(_settings(**{"index.dir": "index2"}), work)
    assert victim.read_text() == "precious\n"


def test_a_linked_output_folder_or_file_is_refused_and_nothing_is_written_outside(work, tmp_path):
    """A symlinked `retrieval/` (or output file) made retrieve write outside the workdir; now refused
    before any work, naming the link; so is a linked folder anywhere below the run directory."""
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.rmtree(work / "retrieval")
    (work / "retrieval").symlink_to(outside)
    with pytest.raises(files.SymlinkError, match=rf"{work / 'retrieval'} is a symbolic link \(to {outside}\)"):
        _retrieve(work)
    (work / "retrieval").unlink()
    (work / "retrieval").mkdir()
    (work / "retrieval" / "queries.jsonl").symlink_to(outside / "out.jsonl")
    with pytest.raises(files.SymlinkError, match=r"retrieval/queries.jsonl is a symbolic link"):
        _retrieve(work)
    assert list(outside.iterdir()) == []
    # The rule itself: inside a held run directory every folder is checked; outside, the file only.
    (work / "eval").symlink_to(outside)
    with files.workdir_lock(work, "test"):
        for write in (
            lambda: files.atomic_write(work / "eval" / "table.json", "{}"),
            lambda: files.make_dirs(work / "eval" / "retrievals"),
            lambda: files.open_append(work / "eval" / "x.jsonl"),
            lambda: files.create_once(work / "eval" / "y.json", "{}"),
        ):
            with pytest.raises(files.SymlinkError, match=rf"{work / 'eval'} is a symbolic link"):
                write()
    assert list(outside.iterdir()) == []
    files.atomic_write(work / "eval" / "free.json", "{}")  # no run directory held: only the file is checked
    assert (outside / "free.json").exists()


# ---------------------------------------------------------------------------------------
# Index builds: lost chunks, two writers, kill -9
# ---------------------------------------------------------------------------------------


def _chunk_bytes(index: pathlib.Path) -> dict:
    return {str(p.relative_to(index)): p.read_bytes() for p in sorted((index / "vectors").rglob("*")) if p.is_file()}


def test_lost_chunk_of_a_finished_index_is_rewritten(work):
    ref = _chunk_bytes(work / "index")
    (work / "index" / "vectors" / "c" / "3" / "0").unlink()
    with pytest.raises(store.IndexCorruptError, match=r"chunk 3, rows \[12, 16\)"):
        _retrieve(work)
    stages.build_index(_settings(), work)
    assert _chunk_bytes(work / "index") == ref
    verify_lib.verify_index(work / "index")


def test_two_writers_and_kill9_resume_byte_identical(work):
    flags = [f"--config.{k}={v}" for k, v in OVERRIDES.items()] + ["--config.index.dir=index_kill"]
    # The same devices (conftest's XLA_FLAGS) and compile flags as this process, so the same bits.
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_DISABLE_MOST_OPTIMIZATIONS": str(jax.config.read("jax_disable_most_optimizations")),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.build_index", "--config=experiments/tiny.py", f"--workdir={work}", *flags],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    index = work / "index_kill"
    try:
        deadline = time.time() + 240
        while not list((index / "progress").glob("chunk_*.done")):
            if proc.poll() is not None:
                pytest.fail(f"build_index exited early ({proc.returncode}): {proc.stderr.read().decode()[-2000:]}")
            assert time.time() < deadline, "build_index wrote no chunk in time"
            time.sleep(0.005)
        proc.send_signal(signal.SIGSTOP)  # frozen mid-build, holding its writer lock
        assert not (index / "COMPLETE").exists()
        with pytest.raises(
            files.WorkdirBusyError, match=rf"written by another process \(build_index, pid {proc.pid} on host"
        ):
            stages.build_index(_settings(**{"index.dir": "index_kill"}), work)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    summary = stages.build_index(_settings(**{"index.dir": "index_kill"}), work)
    assert summary["complete"] and summary["chunks_skipped"] >= 1
    assert _chunk_bytes(index) == _chunk_bytes(work / "index")
    np.testing.assert_array_equal(np.load(index / "r_train.npy"), np.load(work / "index" / "r_train.npy"))


@pytest.mark.slow
def test_ctrl_c_in_build_index_is_one_line_and_the_rerun_resumes(work):
    """Ctrl-C after the first chunk: exit status 130, the one-line hint and no traceback; the
    rerun resumes to the bytes of an uninterrupted build (tests/test_runtime.py has the cheap
    check of the exit itself)."""
    flags = [f"--config.{k}={v}" for k, v in OVERRIDES.items()] + ["--config.index.dir=index_ctrl_c"]
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_DISABLE_MOST_OPTIMIZATIONS": str(jax.config.read("jax_disable_most_optimizations")),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.build_index", "--config=experiments/tiny.py", f"--workdir={work}", *flags],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    index = work / "index_ctrl_c"
    try:
        deadline = time.time() + 240
        while not list((index / "progress").glob("chunk_*.done")):
            if proc.poll() is not None:
                pytest.fail(f"build_index exited early ({proc.returncode}): {proc.stderr.read()[-2000:]}")
            assert time.time() < deadline, "build_index wrote no chunk in time"
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == "interrupted; rerun the same command to resume"
    assert not (index / "COMPLETE").exists()
    summary = stages.build_index(_settings(**{"index.dir": "index_ctrl_c"}), work)
    assert summary["complete"] and summary["chunks_skipped"] >= 1
    assert _chunk_bytes(index) == _chunk_bytes(work / "index")


def test_config_flag_typo_is_one_line():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.retrieve",
            "--config=experiments/tiny.py",
            "--workdir=/nonexistent",
            "--config.vectors.proj_sed=5",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert 'Did you mean "proj_seed"' in out.stderr and "--config.vectors.proj_sed=5" in out.stderr


def test_every_launcher_refuses_in_one_line_and_traces_only_when_asked(tmp_path):
    """Every launcher runs through `launch._config.run`; a known error (here a workdir that is
    not a run) is one FATAL line on stderr, exit 1, no traceback; `--verbose_errors` adds it."""
    launchers = sorted(p.stem for p in (REPO / "launch").glob("*.py") if not p.stem.startswith("_"))
    for name in launchers:
        text = (REPO / "launch" / f"{name}.py").read_text()
        assert "_config.run(main" in text and "app.run(" not in text, name
    argv = [sys.executable, "-m", "launch.retrieve", "--config=experiments/tiny.py", f"--workdir={tmp_path}"]
    runs = [
        subprocess.run(
            argv + more,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
        for more in ([], ["--verbose_errors"])
    ]
    quiet, verbose = runs
    assert quiet.returncode == 1 and "Traceback" not in quiet.stderr, quiet.stderr[-3000:]
    (line,) = [x for x in quiet.stderr.splitlines() if x.startswith("FATAL ")]
    assert str(tmp_path) in line and line == quiet.stderr.strip().splitlines()[-1]
    assert verbose.returncode == 1 and "Traceback" in verbose.stderr
    assert line.split(": ", 1)[1].split(" (--verbose")[0] in verbose.stderr


def test_the_launcher_guard_passes_bugs_through():
    from launch import _config

    def refuse(argv):
        raise files.InputError("q.jsonl:3: the prompt is empty\n(second line)")

    with pytest.raises(SystemExit) as e:
        _config.guarded(refuse)([])
    assert e.value.code.startswith("FATAL InputError: q.jsonl:3: the prompt is empty (second line)")

    def bug(argv):
        raise KeyError("a bug keeps its traceback")

    with pytest.raises(KeyError):
        _config.guarded(bug)([])


# ---------------------------------------------------------------------------------------
# Issue 38: silent wrong results, stuck runs, unclear errors
# ---------------------------------------------------------------------------------------


def test_swapped_chunk_files_are_refused_by_position(work):
    a, b = (work / "index" / "vectors" / "c" / str(c) / "0" for c in (2, 3))
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db), b.write_bytes(da)  # each still passes its own crc32c
    with pytest.raises(
        store.IndexCorruptError, match=r"chunk 2, rows \[8, 12\).*not the file written at this position"
    ):
        _retrieve(work)
    with pytest.raises(store.IndexCorruptError, match=r"failed verification:\n.*chunk 2, rows \[8, 12\).*swapped"):
        verify_lib.verify_index(work / "index", recompute_r=False)
    # An index of the format before chunk checksums were bound to positions: refused, "rebuild".
    m = json.loads((work / "index" / "manifest.json").read_text())
    files.atomic_write_json(work / "index" / "manifest.json", {**m, "format": "trackstar_jax.index/1"})
    with pytest.raises(store.IndexMismatchError, match=r"older format 'trackstar_jax\.index/1'.*rebuild it"):
        verify_lib.verify_index(work / "index")


def test_chunk_table_of_another_index_is_refused(work):
    t = json.loads((work / "index" / store.CHUNK_TABLE).read_text())
    files.atomic_write_json(work / "index" / store.CHUNK_TABLE, {**t, "index": "0" * 64})
    with pytest.raises(store.IndexCorruptError, match=r"chunks\.json belongs to another index"):
        store.open_index(work / "index")


def test_zero_vectors_are_refused_at_build_time_naming_the_example_ids(tmp_path):
    manifest = manifest_lib.make_manifest(
        num_rows=20,
        dim=8,
        num_blocks_total=2,
        storage=manifest_lib.StorageConfig(dtype="float16", chunk_rows=4, r_every_chunks=1),
        model={"fingerprint": "m"},
        vectors={"proj_dim": 2},
        corpus={"fingerprint": "c"},
    )

    def rows(lo, hi):  # rows 9 and 10 underflow float16 (1e-9 -> 0); rows 12-15 are exactly zero
        ids = np.arange(lo, hi)[:, None]
        x = np.where(np.isin(ids, [9, 10]), 1e-9, 1.0 + ids) * np.ones((1, 8), np.float32)
        return np.where(np.isin(ids, [12, 13, 14, 15]), 0.0, x).astype(np.float32)

    with pytest.raises(ValueError, match=r"zero vector\(s\) for example id\(s\) \[9, 10\].*float16.*underflow"):
        index_lib.IndexBuilder(tmp_path / "ix", manifest).build(rows)
    assert not (tmp_path / "ix" / "COMPLETE").exists()


def _hold_workdir_lock(workdir: pathlib.Path) -> subprocess.Popen:
    code = (
        "import sys, time; from trackstar_jax import files\n"
        f"with files.workdir_lock({str(workdir)!r}, 'train'):\n"
        "    print('held', flush=True); time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_every_writing_stage_is_locked_out_of_a_busy_workdir_until_the_holder_dies(work):

    def files_now():  # the lock file itself names its holder while held
        return {**_snapshot(work), "metrics": (work / "metrics.jsonl").read_bytes(), ".writer-0000.lock": None}

    before = files_now()
    proc = _hold_workdir_lock(work)
    try:
        busy = rf"{work} is being written by another process \(train, pid {proc.pid} on host"
        writers = {
            "train": lambda: stages.train(_settings(**{"train.num_steps": 6}), work),
            "import_model": lambda: stages.import_model(_settings(), work),
            "build_index": lambda: stages.build_index(_settings(**{"index.dir": "index2"}), work),
            "retrieve": lambda: _retrieve(work),
            "evaluate": lambda: stages.evaluate(_settings(**{"eval.methods": ("bm25",)}), work),
            "validate": lambda: stages.validate(_settings(), work),
        }
        for run in writers.values():
            with pytest.raises(files.WorkdirBusyError, match=busy):
                run()
        assert files_now() == before
    finally:
        proc.kill()  # the kernel drops the lock with its holder
        proc.wait()
    _retrieve(work)


def test_a_stage_that_refuses_its_input_creates_nothing_on_disk(tmp_path):
    """A mistyped --workdir (folders that do not exist) or data path: every stage refuses,
    naming it, and leaves neither the folders nor a lock file behind; in a workdir that existed
    before, what was there stays."""
    typo = tmp_path / "runs" / "typo"
    missing = r"no run config at .*typo/config.json"
    stages_of = {
        "build_index": lambda s, w: stages.build_index(s, w),
        "retrieve": lambda s, w: stages.retrieve(s.replace({"retrieval.output": "x"}), w, []),
        "evaluate": lambda s, w: stages.evaluate(s, w),
        "validate": lambda s, w: stages.validate(s, w),
    }
    for name, run in stages_of.items():
        with pytest.raises(FileNotFoundError, match=missing):
            run(_settings(), typo)
        assert not (tmp_path / "runs").exists(), name
    bad_data = {"data.source": "text", "data.path": str(tmp_path / "corpus_typo.txt")}
    with pytest.raises(FileNotFoundError, match=r"config.data.path .*corpus_typo.txt' does not exist"):
        stages.train(_settings(**bad_data), typo)
    assert not (tmp_path / "runs").exists()
    with pytest.raises(FileNotFoundError, match=r"config.data.path .*corpus_typo.txt' does not exist"):
        stages.import_model(_settings(**bad_data, **{"model.source": str(tmp_path / "model")}), typo)
    assert not (tmp_path / "runs").exists()
    typo.mkdir(parents=True)
    (typo / "notes.txt").write_text("mine")
    with pytest.raises(FileNotFoundError, match=missing):
        stages.build_index(_settings(), typo)
    assert (typo / "notes.txt").read_text() == "mine"


def test_evaluate_resumes_its_own_unfinished_work_and_leaves_no_temporaries(work, monkeypatch):
    from trackstar_jax.evaluation import stage as eval_stage

    s = _settings(**{"eval.methods": ("bm25",), "eval.max_queries": 4, "tailpatch.top_ks": (1,)})
    out = work / "eval"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = out / f".table.json.tmp-{socket.gethostname()}-{int(dead.stdout)}"  # a writer killed mid-write
    stale.write_text("{")

    def killed(*a, **k):
        raise KeyboardInterrupt("killed after the first retrieval file")

    monkeypatch.setattr(eval_stage.claims_lib, "compare", killed)
    with pytest.raises(KeyboardInterrupt):
        stages.evaluate(s, work)
    assert (out / "retrievals" / "bm25.jsonl").exists() and not (out / "table.json").exists()
    assert not stale.exists()
    with pytest.raises(FileExistsError, match=r"unfinished evaluation made with other settings.*num_proponents"):
        stages.evaluate(_settings(**{"eval.methods": ("bm25",), "eval.num_proponents": 12}), work)
    monkeypatch.undo()
    table = stages.evaluate(s, work)  # its own unfinished work: redone without overwrite
    assert table["rows"][0]["method"] == "bm25" and (out / "table.json").exists()
    assert not [p for p in work.rglob("*") if ".tmp-" in p.name]


def test_full_disk_names_the_file_and_leaves_no_temporary(work, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    out = work / "retrieval" / "queries.jsonl"
    before = out.read_bytes()
    with pytest.raises(files.WriteError, match=rf"cannot write {out}: the disk is full"):
        _retrieve(work)
    assert out.read_bytes() == before
    assert not [p for p in (work / "retrieval").iterdir() if ".tmp-" in p.name]


def test_damaged_model_and_tokenizer_files_are_named(tmp_path):
    import gguf
    import safetensors.numpy
    import tokenizers

    from trackstar_jax.data import hf_tokenizer
    from trackstar_jax.models import gguf as gguf_lib
    from trackstar_jax.models import hf

    st = tmp_path / hf.SINGLE_FILE
    safetensors.numpy.save_file({"w": np.ones((64, 64), np.float32)}, str(st))
    _truncate(st)
    with pytest.raises(files.InputError, match=rf"{st} is not a readable safetensors file .*truncated or damaged"):
        hf.open_safetensors(tmp_path)
    (tmp_path / hf.CONFIG_FILE).write_text('{"model_type": "llama", "hidden')
    with pytest.raises(files.InputError, match=rf"HF model config {tmp_path / hf.CONFIG_FILE} is damaged"):
        hf.load_hf(tmp_path)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "<s>": 1}, unk_token="a"))
    tok.save(str(tmp_path / "tokenizer.json"))
    _truncate(tmp_path / "tokenizer.json")
    with pytest.raises(files.InputError, match=r"tokenizer\.json is not a readable tokenizer file"):
        hf_tokenizer.HFTokenizer.from_pretrained_dir(tmp_path, bos_token="<s>", eos_token="<s>")
    g = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(g), "llama")
    w.add_tensor("token_embd.weight", np.ones((32, 48), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    _truncate(g)
    with pytest.raises(ValueError, match=rf"cannot read {g} as GGUF: the file is truncated or damaged"):
        gguf_lib.open_reader(g)


def test_diverged_first_run_can_be_rerun_as_its_message_says(tmp_path):
    wd = tmp_path / "run"
    with pytest.raises(FloatingPointError, match=r"rerun with a lower --config\.train\.learning_rate") as e:
        stages.train(_settings(**{"train.learning_rate": 1e30}), wd)
    assert "holds no checkpoint yet" in str(e.value)
    assert stages.train(_settings(), wd)["step"] == 3  # what the message says works


def test_query_files_are_checked_like_corpora(tmp_path):
    q = tmp_path / "q.jsonl"
    for body in (b"", b"\n  \n"):
        q.write_bytes(body)
        with pytest.raises(files.InputError, match=rf"{q}: no queries \(the file is empty or blank\)"):
            retrieval_stage.load_text_queries(q)
    _write_queries(q, [QUERIES[0], {"promt": "x", "prompt": "y", "target": " z"}])
    with pytest.raises(files.InputError, match=rf"{q}:2: unknown field\(s\) \['promt'\] \(did you mean \"prompt\"\?\)"):
        retrieval_stage.load_text_queries(q)
    _write_queries(q, [{**QUERIES[0], "example_id": "a"}, {**QUERIES[1], "example_id": "a"}])
    with pytest.raises(files.InputError, match=rf"{q}:2: example_id 'a' is already used at line 1"):
        retrieval_stage.load_text_queries(q)
    _write_queries(q, [QUERIES[0], {"prompt": "Ann Lee\u0000 was born in", "target": " Rome"}])
    with pytest.raises(files.InputError, match=rf"{q}:2: the prompt holds a NUL character \(U\+0000\) at position 7"):
        retrieval_stage.load_text_queries(q)


def test_semantic_config_error_names_the_command_line_flag():
    from experiments import tiny

    c = tiny.get_config()
    c.index.chunk_rows = 0
    argv = ["launch.build_index", "--config=experiments/tiny.py", "--config.index.chunk_rows=0"]
    with pytest.raises(
        config_lib.ConfigError,
        match=r"chunk_rows must be positive.*\(from --config\.index\.chunk_rows=0 on the command line\)",
    ):
        config_lib.from_configdict(c, source="experiments/tiny.py", flags=config_lib.command_line_overrides(argv))
    with pytest.raises(config_lib.ConfigError, match=r"\(in experiments/tiny\.py\)"):  # set in the file
        config_lib.from_configdict(c, source="experiments/tiny.py")
