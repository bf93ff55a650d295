"""Checkpoints: bit-exact round trip of params + full Adafactor state, refusals, run config."""

import functools
import json

import jax
import numpy as np
import optax
import pytest
from conftest import skip_if_not_enough_devices

from trackstar_jax import config as config_lib
from trackstar_jax import stages
from trackstar_jax.distributed import sharding
from trackstar_jax.training import checkpoint
from trackstar_jax.training import step as train


@pytest.fixture(scope="module", autouse=True)
def _fast_compile():
    """Cheaper XLA compiles for this module (process-global flag, restored on exit)."""
    old = jax.config.jax_optimization_level
    jax.config.update("jax_optimization_level", "O0")
    yield
    jax.config.update("jax_optimization_level", old)


def _trained_state(cfg, steps=2):
    """A TrainState after `steps` Adafactor updates on random tokens (non-trivial v_row/v_col/v)."""
    cfg.model.num_layers = 1  # one block has every parameter kind; compiles faster
    key = (json.dumps(cfg.to_dict(), sort_keys=True, default=str), steps)
    if key not in _CACHE:
        _CACHE[key] = _train(cfg, steps)
    return _CACHE[key]


_CACHE = {}


def _train(cfg, steps):
    s = config_lib.from_configdict(cfg)
    model_cfg, opt = s.model, train.make_optimizer(s.train.optimizer)
    graphdef, state = train.init_state(model_cfg, opt, 0)
    step = jax.jit(functools.partial(train.train_step, graphdef=graphdef, opt=opt))
    rng = np.random.default_rng(0)
    for _ in range(steps):
        batch = {
            "tokens": rng.integers(4, cfg.model.vocab_size, (4, 16)).astype(np.int32),
            "loss_mask": np.ones((4, 16), np.int32),
            "example_id": np.arange(4, dtype=np.int32),
        }
        state, _ = step(state, batch)
    return model_cfg, opt, state


def _same_model(config):
    """A restore's check: the saved config's model section must equal `config`'s."""
    return lambda saved: config_lib.mismatches(saved, config, sections=("model",))


@pytest.mark.parametrize("param_dtype,min_dim", [("float32", 32), ("bfloat16", 32)])
def test_roundtrip_is_bit_exact_into_a_sharded_target(tiny_config, tmp_path, param_dtype, min_dim):
    skip_if_not_enough_devices(8)
    tiny_config.model.param_dtype = param_dtype
    tiny_config.train.min_dim_size_to_factor = min_dim
    model_cfg, opt, state = _trained_state(tiny_config)
    v_row = optax.tree_utils.tree_get(state.opt_state, "v_row")
    v = optax.tree_utils.tree_get(state.opt_state, "v")
    # Both regimes of Adafactor's state are present: factored (v_row / v_col) and full v.
    assert any(x.shape != (1,) and np.abs(np.asarray(x)).sum() > 0 for x in jax.tree.leaves(v_row))
    assert any(x.shape != (1,) and np.abs(np.asarray(x)).sum() > 0 for x in jax.tree.leaves(v))

    mngr = checkpoint.CheckpointManager(tmp_path / "ck")
    assert mngr.save(state, config_lib.to_dict(tiny_config)) == 2
    mngr.wait_until_finished()
    mesh = sharding.make_mesh()  # 8 devices
    _, target = checkpoint.abstract_state(model_cfg, opt, mesh)
    step, back = mngr.restore_latest(target, _same_model(tiny_config))
    mngr.close()
    assert step == 2
    assert jax.tree.structure(back) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert b.sharding.mesh.size == 8
    assert back.params["layer_0"]["attn"]["query"]["kernel"].dtype == np.dtype(param_dtype)


def test_never_overwrites_a_newer_checkpoint(tiny_config, tmp_path):
    _, _, state = _trained_state(tiny_config)
    mngr = checkpoint.CheckpointManager(tmp_path / "ck")
    mngr.save(state, config_lib.to_dict(tiny_config))
    mngr.wait_until_finished()
    older = state.replace(step=state.step - 1)
    for s in (state, older):
        with pytest.raises(ValueError, match="refusing to save step [12] .* already holds step 2"):
            mngr.save(s, config_lib.to_dict(tiny_config))
    assert mngr.all_steps() == [2]
    mngr.close()


def test_restore_names_the_mismatching_field(tiny_config, tmp_path):
    model_cfg, opt, state = _trained_state(tiny_config)
    mngr = checkpoint.CheckpointManager(tmp_path / "ck")
    mngr.save(state, config_lib.to_dict(tiny_config))
    mngr.wait_until_finished()
    _, target = checkpoint.abstract_state(model_cfg, opt)
    tiny_config.model.mlp_dim = 512
    tiny_config.model.norm = "layer"
    with pytest.raises(ValueError, match=r"model\.mlp_dim: saved 256, now 512; model\.norm: saved 'rms', now 'layer'"):
        mngr.restore_latest(target, _same_model(tiny_config))
    with pytest.raises(FileNotFoundError, match="no checkpoint for step 7"):
        mngr.restore(7, target)
    mngr.close()
    empty = checkpoint.CheckpointManager(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        empty.restore_latest(target)
    empty.close()


def test_run_config_guards_the_workdir(tiny_config, tmp_path):
    stages.save_run_config(tmp_path, config_lib.from_configdict(tiny_config))
    assert config_lib.load_run_settings(tmp_path).model.embed_dim == tiny_config.model.embed_dim
    tiny_config.train.num_steps = 5  # resumable key: allowed, recorded
    proj_dim = tiny_config.vectors.proj_dim
    tiny_config.vectors.proj_dim = 4  # a later stage's section: allowed, never rewritten
    stages.save_run_config(tmp_path, config_lib.from_configdict(tiny_config))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["train"]["num_steps"] == 5 and saved["vectors"]["proj_dim"] == proj_dim
    before = (tmp_path / "config.json").stat().st_mtime_ns
    stages.save_run_config(tmp_path, config_lib.from_configdict(tiny_config))  # same run: nothing written
    assert (tmp_path / "config.json").stat().st_mtime_ns == before
    # No checkpoint yet: every train key may change (issue 38, item 10); the data may not.
    tiny_config.train.learning_rate = 0.5
    tiny_config.data.embedded.num_facts = 7
    with pytest.raises(ValueError, match=r"different run.*Differences: data\.embedded\.num_facts: saved 120, now 7$"):
        stages.save_run_config(tmp_path, config_lib.from_configdict(tiny_config))
    with pytest.raises(FileNotFoundError, match="no run config"):
        config_lib.load_run_settings(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="no run config"):
        stages.load_run(tmp_path / "nothing")


def test_roundtrip_across_replicated_and_fsdp_meshes_is_bit_exact(tiny_config, tmp_path):
    """Saved replicated -> restored split over fsdp on a (2, 4, 1) mesh -> saved from there ->
    restored replicated on (8, 1, 1): every leaf bit-identical, each in its target's sharding."""
    skip_if_not_enough_devices(8)
    tiny_config.model.param_dtype = "float32"
    tiny_config.train.min_dim_size_to_factor = 32
    model_cfg, opt, state = _trained_state(tiny_config)
    P = jax.sharding.PartitionSpec
    meshes = {"fsdp": sharding.make_mesh((2, 4, 1)), "replicated": sharding.make_mesh((8, 1, 1))}
    cur = state
    for i, name in enumerate(("fsdp", "replicated")):
        mngr = checkpoint.CheckpointManager(tmp_path / f"ck{i}")
        mngr.save(cur, config_lib.to_dict(tiny_config))
        mngr.wait_until_finished()
        _, target = checkpoint.abstract_state(model_cfg, opt, meshes[name])
        _, back = mngr.restore_latest(target, _same_model(tiny_config))
        mngr.close()
        for a, b, t in zip(jax.tree.leaves(state), jax.tree.leaves(back), jax.tree.leaves(target)):
            assert a.dtype == b.dtype and a.shape == b.shape and b.sharding == t.sharding
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        specs = [x.sharding.spec for x in jax.tree.leaves(back)]
        if name == "fsdp":
            assert back.params["layer_0"]["mlp"]["up"]["kernel"].sharding.spec == P(None, "fsdp")
            assert sum(s != P() for s in specs) >= len(jax.tree.leaves(state.params)) // 2
        else:
            assert all(s == P() for s in specs)
        cur = back


def test_remat_is_a_runtime_key_not_part_of_the_run(tiny_config, tmp_path):
    """`model.remat` changes how steps compute, not what: a stage may set it on a run made
    without it (no refusal, config.json untouched) and an index manifest does not record it."""
    stages.save_run_config(tmp_path, config_lib.from_configdict(tiny_config))
    before = (tmp_path / "config.json").read_bytes()
    tiny_config.model.remat = True
    settings = config_lib.from_configdict(tiny_config)
    assert settings.model.remat
    config_lib.check_matches_run(settings, tmp_path)  # no ConfigError
    stages.save_run_config(tmp_path, settings)
    assert (tmp_path / "config.json").read_bytes() == before
    tiny_config.model.mlp_dim = 512  # a real model field is still refused, by name
    with pytest.raises(ValueError, match=r"model\.mlp_dim: saved 256, now 512"):
        config_lib.check_matches_run(config_lib.from_configdict(tiny_config), tmp_path)
