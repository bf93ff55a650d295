"""Stage 1 (stages.train): sharded train step, loss decrease, resume, refusals, load_run."""

import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest
from conftest import skip_if_not_enough_devices

from trackstar_jax import config as config_lib
from trackstar_jax import data as data
from trackstar_jax import stages
from trackstar_jax.distributed import runtime, sharding
from trackstar_jax.distributed import sharding as sharding_lib
from trackstar_jax.models import generate
from trackstar_jax.training import checkpoint, loop
from trackstar_jax.training import step as step_lib
from trackstar_jax.training import step as train

pytestmark = pytest.mark.usefixtures("fast_compile")  # conftest.py: cheaper compiles, restored on exit

REPO = pathlib.Path(__file__).resolve().parents[1]


def _config(tiny_config, steps):
    c = tiny_config
    c.model.num_layers = 1  # compiles faster; every parameter kind is still there
    c.train.num_steps = steps
    c.train.log_every_steps = 10
    c.train.eval_every_steps = steps
    c.train.checkpoint_every_steps = 50
    c.train.num_completions = 4
    return c


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 100-step tiny run made in two calls (60 steps, then resumed to 100)."""
    from experiments import tiny

    workdir = tmp_path_factory.mktemp("run")
    first = stages.train(config_lib.from_configdict(_config(tiny.get_config(), 60)), workdir)
    summary = stages.train(config_lib.from_configdict(_config(tiny.get_config(), 100)), workdir)
    return workdir, first, summary


def _train_losses(workdir):
    recs = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in recs if "train/loss" in r}, [r for r in recs if "eval/loss" in r]


def test_loss_decreases_on_the_embedded_corpus(run):
    workdir, first, summary = run
    losses, evals = _train_losses(workdir)
    assert sorted(losses) == list(range(10, 101, 10))  # logged every 10 steps, across the resume
    assert losses[10] > np.log(512) - 1.0  # starts near chance
    assert losses[100] < losses[10] - 2.0
    assert [r["step"] for r in evals] == [60, 100] and evals[-1]["eval/loss"] < losses[10] - 1.0
    assert summary["step"] == 100 and first["step"] == 60
    assert summary["num_fact_prompts"] == 120 and len(summary["completions"]) == 4
    assert json.loads((workdir / "train_summary.json").read_text())["step"] == 100


def test_an_interrupted_train_leaves_the_log_of_an_uninterrupted_one(tmp_path, monkeypatch):
    """Killed right after logging step 6 (its last checkpoint is step 4, where a 3-step log
    window is open), then rerun: metrics.jsonl holds the records of an uninterrupted run, each
    step once and with the same values (throughput aside)."""
    from experiments import tiny

    def settings():
        c = _config(tiny.get_config(), 8)
        c.train.log_every_steps, c.train.eval_every_steps, c.train.checkpoint_every_steps = 3, 2, 4
        c.train.num_completions, c.train.max_fact_prompts = 0, 1
        return config_lib.from_configdict(c)

    def records(workdir):
        lines = (workdir / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if k != "train/tokens_per_sec"} for x in lines]

    stages.train(settings(), tmp_path / "whole")
    flush = loop.MetricsLog.flush

    def killed_after_step_6(self, step, state, metrics):
        flush(self, step, state, metrics)
        if step == 6:
            raise KeyboardInterrupt("killed after the step-6 log")

    monkeypatch.setattr(loop.MetricsLog, "flush", killed_after_step_6)
    with pytest.raises(KeyboardInterrupt):
        stages.train(settings(), tmp_path / "cut")
    monkeypatch.undo()
    assert [r["step"] for r in records(tmp_path / "cut")] == [2, 3, 4, 6]  # step 6 is past the checkpoint
    stages.train(settings(), tmp_path / "cut")
    whole = records(tmp_path / "whole")
    assert [r["step"] for r in whole] == [2, 3, 4, 6, 6, 8, 8]  # train and eval records
    assert records(tmp_path / "cut") == whole


def test_resumed_run_continues_the_same_batches(run, tiny_config, tmp_path):
    """The resumed run sees the batches of an uninterrupted run: the loss at step 70 (10 steps
    after the resume at 60) equals that of a reference loop written out here."""
    workdir, _, _ = run
    tiny_config = _config(tiny_config, 100)
    corpus, tok = data.load_corpus(workdir / "corpus"), data.load_tokenizer(workdir / "tokenizer.model")
    mesh = sharding.make_mesh()
    model_cfg, opt = (
        config_lib.from_configdict(tiny_config).model,
        train.make_optimizer(config_lib.from_configdict(tiny_config).train.optimizer),
    )
    graphdef, target = checkpoint.abstract_state(model_cfg, opt, mesh)
    mngr = checkpoint.CheckpointManager(workdir / "checkpoints")
    assert mngr.all_steps() == [50, 60, 100]
    _, state = mngr.restore(60, target)
    mngr.close()
    step = step_lib.make_jit_train_step(graphdef, opt, mesh, state)
    batches = data.train_batches(corpus, tok, 32, model_cfg.max_len, seed=0, start_step=60)
    ms = []
    for _ in range(10):
        state, m = step(state, sharding_lib.device_batch(next(batches), mesh))
        ms.append(jax.device_get(m))
    ref = sum(float(m["loss"]) * float(m["num_tokens"]) for m in ms) / sum(float(m["num_tokens"]) for m in ms)
    np.testing.assert_allclose(_train_losses(workdir)[0][70], ref, rtol=1e-5)


@pytest.mark.parametrize("steps", [3])
def test_one_and_eight_devices_give_the_same_loss(tiny_config, steps):
    skip_if_not_enough_devices(8)
    tiny_config.model.num_layers = 1
    corpus = data.build_corpus(config_lib.section("data", tiny_config.data), 0)
    tok = data.train_tokenizer(corpus.texts, 512)
    model_cfg, opt = (
        config_lib.from_configdict(tiny_config).model,
        train.make_optimizer(config_lib.from_configdict(tiny_config).train.optimizer),
    )
    batches = data.train_batches(corpus, tok, 16, model_cfg.max_len, seed=0)
    host = [next(batches) for _ in range(steps)]
    results = []
    for devices in (jax.devices()[:1], jax.devices()[:8]):
        mesh = sharding.make_mesh(devices=devices)
        graphdef, state = loop.init_train_state(model_cfg, opt, 0, mesh)
        jit_step = step_lib.make_jit_train_step(graphdef, opt, mesh, state)
        losses = []
        for b in host:
            batch = sharding_lib.device_batch(b, mesh)
            assert len(batch["tokens"].sharding.device_set) == len(devices)
            state, m = jit_step(state, batch)
            losses.append(float(m["loss"]))
        results.append((losses, jax.device_get(state.params)))
    (l1, p1), (l8, p8) = results
    np.testing.assert_allclose(l1, l8, rtol=1e-5, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), p1, p8)
    assert l1[-1] < l1[0]


def test_rerun_of_a_finished_run_does_not_retrain_or_overwrite(run, tiny_config):
    workdir, _, summary = run
    ckpts = sorted(p.name for p in (workdir / "checkpoints").iterdir())
    mtimes = {p.name: p.stat().st_mtime for p in (workdir / "checkpoints").iterdir()}
    again = stages.train(config_lib.from_configdict(_config(tiny_config, 100)), workdir)
    assert again == summary  # a finished run only reports: train_summary.json is not rewritten
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ckpts
    assert {p.name: p.stat().st_mtime for p in (workdir / "checkpoints").iterdir()} == mtimes


def test_load_run_gives_the_trained_model(run):
    workdir, _, summary = run
    r = stages.load_run(workdir)
    saved = config_lib.load_run_settings(workdir)
    assert r.step == 100 and (r.model_cfg, r.optimizer, r.data) == (saved.model, saved.train.optimizer, saved.data)
    assert r.corpus.fingerprint == data.load_corpus(workdir / "corpus").fingerprint
    assert r.tokenizer.vocab_size <= r.model_cfg.vocab_size
    import optax

    assert jax.tree.leaves(optax.tree_utils.tree_get(r.opt_state, "v_row"))
    # The loaded params reproduce the run's completions.
    rows = summary["completions"]
    outs = generate.complete(r.graphdef, r.params, r.tokenizer, [x["prompt"] for x in rows], 8, r.model_cfg.max_len)
    assert outs == [x["completion"] for x in rows]


def test_refuses_a_workdir_of_another_run(run, tiny_config):
    workdir, _, _ = run
    tiny_config.model.embed_dim = 32
    with pytest.raises(ValueError, match=r"different run.*model\.embed_dim: saved 64, now 32"):
        stages.train(config_lib.from_configdict(_config(tiny_config, 100)), workdir)


def test_checkpoint_of_another_model_is_refused(run, tiny_config, tmp_path):
    """config.json lost, checkpoint kept: the checkpoint's own config still guards it."""
    workdir, _, _ = run
    import shutil

    other = tmp_path / "w"
    shutil.copytree(workdir / "checkpoints", other / "checkpoints")
    tiny_config.model.mlp_dim = 128
    with pytest.raises(ValueError, match=r"does not match the config: model\.mlp_dim: saved 256, now 128"):
        stages.train(config_lib.from_configdict(_config(tiny_config, 100)), other)


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("train.num_step", 3, r"unknown config key\(s\) in config\.train: num_step"),
        ("data.tokenizer", "bpe", r"unknown config key\(s\) in config\.data: tokenizer"),
        ("train.global_batch_size", 12, r"global_batch_size=12 is not divisible by the 8"),
    ],
)
def test_bad_config_is_named(tiny_config, tmp_path, key, value, match):
    skip_if_not_enough_devices(8)
    section, name = key.split(".")
    with tiny_config.unlocked():
        setattr(getattr(tiny_config, section), name, value)
    with pytest.raises(ValueError, match=match):
        stages.train(config_lib.from_configdict(tiny_config), tmp_path)


def _prepare_data(config, workdir):
    s = config_lib.from_configdict(config)
    return loop.prepare_data(s.model, s.data, s.seed, workdir)


def test_overlong_passages_are_truncated_and_counted(tiny_config, tmp_path, caplog):
    tiny_config.model.max_len = 12
    with caplog.at_level(logging.WARNING):
        corpus, tok = _prepare_data(tiny_config, tmp_path)
    n = len(data.truncation_report(corpus.texts, tok, 12))
    assert n > 0 and f"{n} of {len(corpus.examples)} passages exceed model.max_len=12" in caplog.text


def test_tokenizer_larger_than_the_model_vocab_is_refused(tiny_config, tmp_path):
    tiny_config.model.vocab_size = 600
    _prepare_data(tiny_config, tmp_path)  # trains a tokenizer of <= 600 pieces
    tiny_config.model.vocab_size = 100
    with pytest.raises(ValueError, match=r"pieces > config\.model\.vocab_size=100"):
        _prepare_data(tiny_config, tmp_path)


def test_greedy_generate_matches_a_step_by_step_argmax(tiny_config):
    """Reference: recompute the full forward for each new token and take the argmax."""
    from trackstar_jax.models import lm as model_lib

    tiny_config.model.num_layers = 1
    cfg = config_lib.from_configdict(tiny_config).model
    graphdef, params = model_lib.split_model(model_lib.make_model(cfg, 1))
    prompts = [[2, 10, 11, 12], [2, 40], [2, 7, 7, 7, 7, 7, 7]]
    forward = jax.jit(lambda p, t: model_lib.apply(graphdef, p, t))
    # vocab_limit: ids the tokenizer does not have (a small corpus trains fewer pieces than
    # the embedding has rows) are never generated.
    for limit in (None, 37):
        got = generate.greedy_generate(graphdef, params, prompts, 5, cfg.max_len, eos_id=3, vocab_limit=limit)
        for p, g in zip(prompts, got):
            seq = list(p)
            for _ in range(5):
                buf = np.zeros((1, cfg.max_len), np.int32)  # one shape: one compile; causal, so
                buf[0, : len(seq)] = seq  # the padding after the sequence cannot matter
                nxt = int(np.argmax(np.asarray(forward(params, buf))[0, len(seq) - 1][:limit]))
                seq.append(nxt)
                if nxt == 3:
                    break
            assert g == seq[len(p) :]
            assert limit is None or max(g) < limit


def _fsdp_run(tiny_config, mesh_shape, steps=3):
    """`steps` train steps of the 1-layer tiny model on a (data, fsdp, tensor) mesh of 8 devices,
    through the compiled step (whose memory_analysis comes with it)."""
    tiny_config.model.num_layers = 1
    corpus = data.build_corpus(config_lib.section("data", tiny_config.data), 0)
    tok = data.train_tokenizer(corpus.texts, 512)
    model_cfg, opt = (
        config_lib.from_configdict(tiny_config).model,
        train.make_optimizer(config_lib.from_configdict(tiny_config).train.optimizer),
    )
    batches = data.train_batches(corpus, tok, 16, model_cfg.max_len, seed=0)
    mesh = sharding.make_mesh(mesh_shape, devices=jax.devices()[:8])
    graphdef, state = loop.init_train_state(model_cfg, opt, 0, mesh)
    init_sh = jax.tree.map(lambda x: x.sharding, state)
    first = sharding_lib.device_batch(next(batches), mesh)
    compiled = step_lib.make_jit_train_step(graphdef, opt, mesh, state).lower(state, first).compile()
    batch = first
    for _ in range(steps):
        state, _ = compiled(state, batch)
        batch = sharding_lib.device_batch(next(batches), mesh)
    return state, init_sh, compiled.memory_analysis()


def test_fsdp_sharded_training_equals_replicated(tiny_config):
    """(2, 4, 1) mesh: params and Adafactor state split over fsdp (by each leaf's own shape,
    v_row / v_col included), initialised split, and 3 steps equal the replicated (8, 1, 1) run."""
    skip_if_not_enough_devices(8)
    import copy

    rep, rep_sh, rep_mem = _fsdp_run(copy.deepcopy(tiny_config), (8, 1, 1))
    got, got_sh, got_mem = _fsdp_run(tiny_config, (2, 4, 1))
    P = jax.sharding.PartitionSpec
    assert all(x.sharding.spec == P() for x in jax.tree.leaves(rep))
    # the state is created split (init's out_shardings) and stays split after the donated steps
    assert jax.tree.map(lambda x: x.sharding, got) == got_sh
    flat = {jax.tree_util.keystr(k): x for k, x in jax.tree_util.tree_leaves_with_path(got)}
    split = {k: x for k, x in flat.items() if x.sharding.spec != P()}
    for k, x in split.items():  # one quarter of the array per device, along one dimension
        shard = x.addressable_shards[0].data.shape
        assert np.prod(shard) * 4 == x.size and x.sharding.spec.count("fsdp") == 1, k
    kernel = got.params["layer_0"]["mlp"]["up"]["kernel"]  # [64, 256]: split on the 256
    assert kernel.sharding.spec == P(None, "fsdp") and kernel.addressable_shards[0].data.shape == (64, 64)
    v_row, v_col = (
        optax.tree_utils.tree_get(got.opt_state, n)["layer_0"]["mlp"]["up"]["kernel"] for n in ("v_row", "v_col")
    )
    assert v_row.shape == (64,) and v_row.sharding.spec == P()  # tiny: kept whole
    assert v_col.shape == (256,) and v_col.sharding.spec == P("fsdp")
    params_bytes = sum(x.nbytes for x in jax.tree.leaves(got.params))
    split_bytes = sum(x.nbytes for x in split.values())
    assert split_bytes > 0.9 * (params_bytes + sum(x.nbytes for x in jax.tree.leaves(got.opt_state)))
    for (k, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(rep)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(k))
    # per-device argument bytes (state + batch) of the compiled step drop ~fsdp x
    ratio = rep_mem.argument_size_in_bytes / got_mem.argument_size_in_bytes
    assert ratio > 3.0, (rep_mem.argument_size_in_bytes, got_mem.argument_size_in_bytes)


def test_load_run_into_an_fsdp_mesh(run):
    """A run trained replicated loads split over fsdp (bit-exact), and featurizing it there (the
    correction read from the split optimizer state) gives the replicated run's vectors."""
    skip_if_not_enough_devices(8)
    from trackstar_jax.features import vectors

    workdir, _, _ = run
    rep = stages.load_run(workdir)
    got = stages.load_run(workdir, mesh=sharding.make_mesh((2, 4, 1)))
    specs = [x.sharding.spec for x in jax.tree.leaves((got.params, got.opt_state))]
    assert sum(s != jax.sharding.PartitionSpec() for s in specs) >= len(jax.tree.leaves(got.params)) // 2
    for a, b in zip(jax.tree.leaves((rep.params, rep.opt_state)), jax.tree.leaves((got.params, got.opt_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    vc = vectors.VectorConfig(num_blocks=1, proj_dim=4, correction=True, proj_seed=0)
    batch = next(data.train_batches(rep.corpus, rep.tokenizer, 8, rep.model_cfg.max_len, seed=0))
    out = []
    for r in (rep, got):
        fn = vectors.make_vector_fn(
            r.graphdef, r.model_cfg, vc, r.params, r.opt_state, mesh=sharding.make_mesh((2, 4, 1))
        )
        out.append(fn(r.params, fn.precond, batch))
    np.testing.assert_allclose(out[1], out[0], rtol=1e-5, atol=1e-5 * np.abs(out[0]).max())


def _final_params(workdir, settings, step):
    mesh = sharding.make_mesh()
    _, target = checkpoint.abstract_state(settings.model, train.make_optimizer(settings.train.optimizer), mesh)
    mngr = checkpoint.CheckpointManager(workdir / "checkpoints")
    try:
        return jax.device_get(mngr.restore(step, target)[1].params)
    finally:
        mngr.close()


def _interrupt_config(tiny_config, steps, log_every):
    overrides = {
        "model.num_layers": 1,
        "data.embedded.num_facts": 30,
        "data.embedded.num_distractors": 40,
        "train.num_steps": steps,
        "train.log_every_steps": log_every,
        "train.eval_every_steps": steps,
        "train.checkpoint_every_steps": steps,  # no checkpoint is due before the last step
        "train.num_completions": 0,
        "train.max_fact_prompts": 4,
    }
    for k, v in overrides.items():
        *path, key = k.split(".")
        section = tiny_config
        for p in path:
            section = section[p]
        section[key] = v
    return config_lib.from_configdict(tiny_config), overrides


def test_sigterm_saves_a_checkpoint_at_the_step_and_a_rerun_resumes_it(tiny_config, tmp_path, monkeypatch, caplog):
    """A SIGTERM (a preemption notice) at step 5 of 30, no checkpoint due before step 30: the
    stage stops after step 5, saves a checkpoint there and says so; a rerun resumes at step 5
    and ends with the params of an uninterrupted run."""
    steps, at = 30, 5
    settings, _ = _interrupt_config(tiny_config, steps, log_every=1)
    flush = loop.MetricsLog.flush

    def flush_and_signal(self, step, state, metrics):
        flush(self, step, state, metrics)
        if step == at:
            os.kill(os.getpid(), signal.SIGTERM)  # delivered to this (main) thread's handler at once

    work = tmp_path / "interrupted"
    with monkeypatch.context() as m:
        m.setattr(loop.MetricsLog, "flush", flush_and_signal)
        with pytest.raises(runtime.Interrupted) as e:
            stages.train(settings, work)
    assert str(e.value) == (
        f"training stopped by SIGTERM at step {at} of {steps}; checkpoint saved in {work}/checkpoints/{at}; "
        "rerun the same command to resume"
    )
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the stage's handlers are gone
    mngr = checkpoint.CheckpointManager(work / "checkpoints")
    assert mngr.all_steps() == [at]
    mngr.close()
    with caplog.at_level(logging.INFO):
        resumed = stages.train(settings, work)
    assert f"resumed from {work / 'checkpoints'} at step {at}" in caplog.text
    assert resumed["step"] == steps
    whole = tmp_path / "whole"
    stages.train(settings, whole)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        _final_params(work, settings, steps),
        _final_params(whole, settings, steps),
    )


@pytest.mark.slow
def test_launch_train_sigterm_exits_in_one_line_with_a_checkpoint(tiny_config, tmp_path):
    """`launch.train` sent SIGTERM while it trains: exit status 130, one line naming the saved
    checkpoint, no traceback, the checkpoint at the step it reached."""
    steps = 200
    _, overrides = _interrupt_config(tiny_config, steps, log_every=1)  # metrics.jsonl shows it is running
    work = tmp_path / "interrupted"
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_DISABLE_MOST_OPTIMIZATIONS": str(jax.config.read("jax_disable_most_optimizations")),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.train", "--config=experiments/tiny.py", f"--workdir={work}"]
        + [f"--config.{k}={v}" for k, v in overrides.items()],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 300
        metrics = work / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            if proc.poll() is not None:
                pytest.fail(f"launch.train exited early ({proc.returncode}): {proc.stderr.read()[-2000:]}")
            assert time.time() < deadline, "launch.train logged no step in time"
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    saved = sorted(int(p.name) for p in (work / "checkpoints").iterdir() if p.name.isdigit())
    assert len(saved) == 1 and 2 <= saved[0] < steps, (saved, err[-2000:])
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        f"training stopped by SIGTERM at step {saved[0]} of {steps}; checkpoint saved in "
        f"{work}/checkpoints/{saved[0]}; rerun the same command to resume"
    )
    assert "Traceback" not in err
