"""build_index on a tiny trained run: rows equal the featurizer's vectors, the manifest
identifies the run, R_train matches numpy, an interrupted (disk-full) build resumes to the same
bytes, and a changed corpus / projection seed / model is refused."""

import errno
import json
import logging
import pathlib
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from conftest import tiny_run_config

from trackstar_jax import config as config_lib
from trackstar_jax import data as data
from trackstar_jax import index, stages
from trackstar_jax.features import vectors
from trackstar_jax.index import build
from trackstar_jax.training import checkpoint

pytestmark = pytest.mark.usefixtures("compile_cache")


def _config():
    return tiny_run_config(num_facts=30, num_distractors=40, num_steps=3, chunk_rows=64, **{"index.r_every_chunks": 1})


@pytest.fixture(scope="module")
def run_dir(tiny_run):
    return tiny_run(_config())


@pytest.fixture(scope="module")
def f32_index(run_dir):
    c = _config()
    c.index.dtype, c.index.dir = "float32", "index_f32"
    summary = stages.build_index(config_lib.from_configdict(c), run_dir)
    return c, summary


def test_rows_are_the_featurizer_vectors_of_each_example(run_dir, f32_index):
    c, summary = f32_index
    run = stages.load_run(run_dir)
    n = len(run.corpus.examples)
    assert summary["rows"] == summary["rows_written"] == n and summary["complete"]
    assert summary["tokens"] > n and 0 <= summary["write_fraction"] < 1
    reader = index.open_index(build.index_dir(config_lib.from_configdict(c).index, run_dir))
    got = reader.read_dequantized(0, n)
    # Reference: the featurizer over data.index_batches (padded to max_len, not length-bucketed).
    vec_cfg = config_lib.from_configdict(c).vectors
    fn = vectors.make_vector_fn(run.graphdef, run.model_cfg, vec_cfg, run.params, run.opt_state)
    ref = []
    for b in data.index_batches(run.corpus, run.tokenizer, vec_cfg.batch_size, run.model_cfg.max_len):
        v = fn(run.params, fn.precond, b)
        ref.append(v[b["example_id"] >= 0])
    ref = np.concatenate(ref)
    assert ref.shape == got.shape == (n, vec_cfg.dim)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())
    # R_train is the block autocorrelation of exactly these rows.
    r = reader.r_train()
    k2 = vec_cfg.proj_dim**2
    blocks = np.stack(
        [
            got[:, b * k2 : (b + 1) * k2].astype(np.float64).T @ got[:, b * k2 : (b + 1) * k2]
            for b in range(2 * vec_cfg.num_blocks)
        ]
    )
    assert r.count == n
    np.testing.assert_allclose(r.total, blocks, rtol=1e-5, atol=1e-6 * np.abs(blocks).max())


def test_manifest_identifies_the_run(run_dir, f32_index):
    c, _ = f32_index
    run = stages.load_run(run_dir)
    m = index.open_index(build.index_dir(config_lib.from_configdict(c).index, run_dir)).manifest
    assert m["model"]["checkpoint_step"] == 3
    assert m["model"]["fingerprint"] == index.tree_fingerprint({"params": run.params, "opt_state": run.opt_state})
    assert m["vectors"] | {} == {
        "output_fn": "loss",
        "num_blocks": 2,
        "proj_dim": 8,
        "proj_seed": 0,
        "correction": True,
        "path": "fast",
        "exact_v": False,
        "dim": 256,
        "num_blocks_total": 4,
        "block_dim": 64,
    }
    assert m["corpus"] == {
        "name": run.corpus.name,
        "fingerprint": run.corpus.fingerprint,
        "num_examples": len(run.corpus.examples),
    }
    assert m["storage"]["dtype"] == "float32" and m["code_version"]
    expect = {"model": {"fingerprint": m["model"]["fingerprint"]}, "vectors": {"proj_seed": 0, "dim": 256}}
    index.open_index(build.index_dir(config_lib.from_configdict(c).index, run_dir), expect=expect)


def test_disk_full_then_resume_gives_the_same_bytes(run_dir, f32_index, monkeypatch, caplog):
    """A bf16 build that hits ENOSPC at chunk 1 keeps chunk 0, resumes, and ends equal to
    rounding the float32 index to bfloat16 (same featurizer bits, deterministic rounding)."""
    c = _config()
    c.index.dir = "index_bf16"
    real = index.IndexBuilder._write_rows

    def full_disk(self, lo, hi, stored, scale):
        if lo >= 64:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, lo, hi, stored, scale)

    monkeypatch.setattr(index.IndexBuilder, "_write_rows", full_disk)
    with pytest.raises(index.IndexWriteError, match=r"chunk 1, rows \[64, 128\) failed \(the disk is full"):
        stages.build_index(config_lib.from_configdict(c), run_dir)
    path = build.index_dir(config_lib.from_configdict(c).index, run_dir)
    assert index.open_index(path).complete_chunks == frozenset({0})
    monkeypatch.setattr(index.IndexBuilder, "_write_rows", real)
    with caplog.at_level(logging.INFO):
        summary = stages.build_index(config_lib.from_configdict(c), run_dir)
    assert summary["chunks_skipped"] == 1 and summary["complete"]
    assert f"index: wrote {summary['rows'] - 64} rows in " in caplog.text
    assert "; resumed: 64 rows were already built; complete" in caplog.text
    assert json.loads((path / "build_summary-p0000.json").read_text())["chunks_written"] == summary["chunks_written"]
    reader = index.open_index(path)
    rows, scale = reader.read_block(0, reader.num_rows)
    f32 = index.open_index(build.index_dir(config_lib.from_configdict(f32_index[0]).index, run_dir)).read_dequantized(
        0, reader.num_rows
    )
    assert scale is None and rows.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(rows.view(np.uint16), f32.astype(ml_dtypes.bfloat16).view(np.uint16))
    report = index.verify_index(build.index_dir(config_lib.from_configdict(c).index, run_dir))
    assert report["ok"] and report["bytes_on_disk"] >= reader.num_rows * 256 * 2


def test_verify_index_launcher_finds_the_index_of_a_config(run_dir, f32_index):
    """`launch.verify_index --config --workdir` reads the index folder from the config's `index` section."""
    root = pathlib.Path(__file__).resolve().parents[1]
    args = [sys.executable, "-m", "launch.verify_index", "--config=experiments/tiny.py", f"--workdir={run_dir}"]
    done = subprocess.run(
        [*args, "--config.index.dir=index_f32", "--norecompute_r"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["ok"] and pathlib.Path(report["path"]).name == "index_f32"


def test_changed_seed_or_corpus_is_refused(run_dir, f32_index, tmp_path):
    c, _ = f32_index
    other = _config()
    other.index.dtype, other.index.dir = "float32", "index_f32"
    other.vectors.proj_seed = 1
    with pytest.raises(
        index.IndexMismatchError, match=r"refusing to resume .*'vectors.proj_seed' is 0 in the index but 1"
    ):
        stages.build_index(config_lib.from_configdict(other), run_dir)
    other.vectors.proj_seed, other.vectors.correction = 0, False
    with pytest.raises(index.IndexMismatchError, match=r"'model.fingerprint'|'vectors.correction'"):
        stages.build_index(config_lib.from_configdict(other), run_dir)
    # A regenerated corpus (one passage edited, fingerprint updated consistently).
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("index_bf16"))
    corpus = data.load_corpus(copy / "corpus")
    texts = corpus.texts
    texts[5] = texts[5] + " Edited."
    lines = [json.dumps({"example_id": i, "text": t}) for i, t in enumerate(texts)]
    (copy / "corpus" / "examples.jsonl").write_text("\n".join(lines) + "\n")
    meta = json.loads((copy / "corpus" / "meta.json").read_text())
    meta["fingerprint"] = data.fingerprint(texts)
    (copy / "corpus" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(index.IndexMismatchError, match=r"refusing to resume .*'corpus.fingerprint'"):
        stages.build_index(config_lib.from_configdict(c), copy)


def test_a_finished_index_is_reused_from_the_loaded_run(run_dir, f32_index, monkeypatch, caplog):
    """`index.build_from_run` (what the evaluation's gradient rows and LDS call with the run the
    stage opened) reuses a finished index without checking or loading the run again and without
    making (compiling) the featurize step, and says so (not "wrote 0 rows ... 0.0 examples/s");
    it still refuses an index of other settings."""
    c, first = f32_index
    settings = config_lib.from_configdict(c)
    loaded = stages.open_run(settings, run_dir)

    def fail(*args, **kwargs):
        raise AssertionError("called on a finished index")

    for mod, name in ((checkpoint, "restore_state"), (config_lib, "check_matches_run"), (vectors, "make_vector_fn")):
        monkeypatch.setattr(mod, name, fail)
    with caplog.at_level(logging.INFO):
        summary = build.build_from_run(
            loaded.run, settings.vectors, settings.index, run_dir, mesh_shape=settings.mesh.shape, mesh=loaded.mesh
        )
    assert summary["complete"] and summary["rows_written"] == 0 and summary["rows"] == first["rows"]
    path = build.index_dir(settings.index, run_dir)
    assert f"index {path} reused: {first['rows']} rows already built; complete" in caplog.text
    assert "wrote 0 rows" not in caplog.text and "examples/s" not in caplog.text
    with pytest.raises(index.IndexMismatchError, match="vectors.proj_seed"):
        other = settings.replace({"vectors.proj_seed": 1})
        build.build_from_run(
            loaded.run, other.vectors, other.index, run_dir, mesh_shape=other.mesh.shape, mesh=loaded.mesh
        )


def test_companion_indices_are_written_in_one_pass_and_equal_their_own_builds(run_dir, f32_index, monkeypatch):
    """`build_from_run(..., companions=...)`: Exp. 4's index (correction on) and Exp. 1's
    (off) from one featurizer (one forward and backward per batch), each equal to its own
    build, with its own manifest, R_train and resume. A disk that fills while the companion
    writes stops both with every written chunk kept; the next call resumes each where it
    stopped (the companion's lost chunk featurized on its own, the rest in one pass). A
    companion that cannot share the pass is refused."""
    c, _ = f32_index
    settings = config_lib.from_configdict(c)
    loaded = stages.open_run(settings, run_dir)
    off = settings.replace({"vectors.correction": False, "index.dir": "index_f32_off"})
    kw = dict(mesh_shape=settings.mesh.shape, mesh=loaded.mesh)
    build.build_from_run(loaded.run, off.vectors, off.index, run_dir, **kw)  # Exp. 1's index on its own

    on2 = settings.replace({"index.dir": "pass_on"})
    off2 = off.replace({"index.dir": "pass_off"})
    made, real_make, real_write = [], vectors.make_vector_fn, index.IndexBuilder._write_rows
    monkeypatch.setattr(vectors, "make_vector_fn", lambda *a, **k: made.append(k["companions"]) or real_make(*a, **k))

    def full_disk(self, lo, hi, stored, scale):
        if self.path.name == "pass_off" and lo >= 64:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, lo, hi, stored, scale)

    monkeypatch.setattr(index.IndexBuilder, "_write_rows", full_disk)
    args = (loaded.run, on2.vectors, on2.index, run_dir)
    with pytest.raises(index.IndexWriteError, match=r"pass_off: writing chunk 1, rows \[64, 128\)"):
        build.build_from_run(*args, companions=[(off2.vectors, off2.index)], **kw)
    assert made == [[off2.vectors]]
    assert index.open_index(run_dir / "pass_off").complete_chunks == frozenset({0})
    assert {0, 1} <= index.open_index(run_dir / "pass_on").complete_chunks
    monkeypatch.setattr(index.IndexBuilder, "_write_rows", real_write)
    summary = build.build_from_run(*args, companions=[(off2.vectors, off2.index)], **kw)
    # the resume: one pass for both, the lost chunk alone (made as their chunks come)
    assert sorted(made[1:], key=len) == [[], [off2.vectors]]
    assert summary["complete"] and summary["shared_pass"] == [str(run_dir / "pass_off")]
    for mine, own in (("pass_on", settings.index.dir), ("pass_off", "index_f32_off")):
        got, want = index.open_index(run_dir / mine), index.open_index(run_dir / own)
        assert got.is_complete and got.manifest["vectors"] == want.manifest["vectors"]
        n = want.num_rows
        np.testing.assert_allclose(got.read_dequantized(0, n), want.read_dequantized(0, n), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(got.r_train().total, want.r_train().total, rtol=1e-5)
        assert index.verify_index(run_dir / mine)["ok"]
    with pytest.raises(ValueError, match="vectors.proj_seed"):
        other = off.replace({"vectors.proj_seed": 1, "index.dir": "never"})
        build.build_from_run(*args, companions=[(other.vectors, other.index)], **kw)


def test_the_memory_check_runs_only_against_a_known_limit(run_dir, monkeypatch):
    """build_index checks its featurize step where a device memory limit is known (a GPU / TPU,
    or `TRACKSTAR_JAX_DEVICE_MEMORY_BYTES`; test_plan has the refusal) and not on a CPU without
    one, where it could refuse nothing and its `model.max_len` compile may never be used."""
    from trackstar_jax.distributed import memory

    checked = []
    monkeypatch.setattr(vectors.VectorFn, "check_fits", lambda self, params, seq_len=None: checked.append(1) or {})
    monkeypatch.delenv(memory.MEMORY_ENV, raising=False)
    for folder, limit in (("index_gate_none", None), ("index_gate_limit", str(1 << 40))):
        if limit:
            monkeypatch.setenv(memory.MEMORY_ENV, limit)
        c = _config()
        c.index.dir = folder
        assert stages.build_index(config_lib.from_configdict(c), run_dir)["complete"]
        assert len(checked) == (1 if limit else 0), folder


def test_config_sections_are_checked(tiny_config):
    tiny_config.index.chunk_size = 3
    with pytest.raises(ValueError, match="unknown config key.*config.index: chunk_size"):
        config_lib.from_configdict(tiny_config).index.storage
    tiny_config.hessian.lam = 0.5
    with pytest.raises(ValueError, match="config.hessian: lam"):
        config_lib.from_configdict(tiny_config).hessian


def test_config_of_another_run_is_refused(run_dir):
    c = _config()
    c.model.embed_dim = 32
    with pytest.raises(ValueError, match=r"config disagrees with the run .*model.embed_dim: saved 64, now 32"):
        stages.build_index(config_lib.from_configdict(c), run_dir)


def test_a_stage_may_set_remat_on_a_run_made_without_it(run_dir):
    """`model.remat` (a `config.RUNTIME_KEYS` key) set by a stage reaches the loaded model, gives
    the same vectors and leaves the index identity as it was."""
    settings = config_lib.from_configdict(_config())
    remat = settings.replace({"model.remat": True})
    plain, rem = stages.load_run(run_dir), stages.load_run(run_dir, runtime=remat)
    assert not plain.model_cfg.remat and rem.model_cfg.remat
    assert build.expected_identity(rem, remat.vectors, remat.index.storage, 256) == build.expected_identity(
        plain, settings.vectors, settings.index.storage, 256
    )
    tokens = np.random.default_rng(0).integers(4, 100, (8, 16)).astype(np.int32)  # one row per fake device
    batch = {"tokens": tokens, "loss_mask": np.ones_like(tokens), "example_id": np.arange(8, dtype=np.int32)}
    out = []
    for run in (plain, rem):
        fn = vectors.make_vector_fn(run.graphdef, run.model_cfg, settings.vectors, run.params, run.opt_state)
        out.append(np.asarray(fn(run.params, fn.precond, batch)))
    np.testing.assert_allclose(out[1], out[0], rtol=1e-5, atol=1e-5 * np.max(np.abs(out[0])))


def test_a_stage_may_set_matmul_dtype_and_an_index_is_not_resumed_across_it(run_dir, f32_index):
    """`model.matmul_dtype` (a `config.RUNTIME_KEYS` key) set by a stage reaches the loaded
    model and is recorded with the index's featurizer settings: a float32 index is not resumed
    by a bf16 build (the rows' bits differ), and the refusal names the key."""
    c, _ = f32_index
    settings = config_lib.from_configdict(c).replace({"model.matmul_dtype": "bfloat16"})
    run = stages.load_run(run_dir, runtime=settings)
    assert run.model_cfg.matmul_dtype == "bfloat16"
    assert (
        "matmul_dtype"
        not in build.expected_identity(run, settings.vectors, settings.index.storage, 256)["model"]["config"]
    )
    with pytest.raises(index.IndexMismatchError, match=r"refusing to resume .*'featurizer.matmul_dtype'"):
        stages.build_index(settings, run_dir)


def test_shared_pass_benchmark_runs_on_a_run(run_dir, monkeypatch, capsys):
    """`benchmarks.shared_pass` (the figures in BUILD_NOTES §5) runs on a run's candidates and
    finds the shared passes' rows equal to each setting's own."""
    from benchmarks import shared_pass  # noqa: PLC0415

    monkeypatch.setattr(sys, "argv", ["shared_pass", f"--workdir={run_dir}", "--rows=24"])
    shared_pass.main()
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["rows"] == 24 and out["shared3_seconds"] > 0 and min(out[k] for k in ("speedup", "speedup_trak")) > 0
    diffs = {k: v for k, v in out.items() if k.startswith("max_rel_diff_")}
    assert len(diffs) == 5 and max(diffs.values()) < 1e-5, diffs
