"""The tail-patch pair cache's key (`evaluation.pair_cache.identity`): every setting the step
depends on starts another cache file, so no delta measured under other settings is reused."""

from __future__ import annotations

import dataclasses
import types

import jax.numpy as jnp
import pytest

from trackstar_jax.evaluation import pair_cache
from trackstar_jax.training import step as step_lib


def _run(**opt):
    params = {"w": jnp.ones((3, 2))}
    return types.SimpleNamespace(
        params=params,
        opt_state={"v": jnp.full((3, 2), 0.5)},
        step=7,
        model_cfg=types.SimpleNamespace(max_len=64),
        optimizer=dataclasses.replace(step_lib.OptimizerConfig(), **opt),
    )


def _key(tmp_path, run, lr_scale=1.0, variant=None):
    return pair_cache.ResultCache(tmp_path, pair_cache.identity(run, lr_scale, variant)).path.name


@pytest.mark.parametrize(
    "change",
    [
        {"clipping_threshold": None},
        {"clipping_threshold": 2.0},
        {"decay_rate": 0.5},
        {"learning_rate": 0.02},
        {"warmup_steps": 5},
        {"multiply_by_parameter_scale": False},
        {"weight_decay_rate": 0.1},
    ],
)
def test_a_changed_optimizer_setting_does_not_reuse_pairs(tmp_path, change):
    base = _key(tmp_path, _run())
    assert _key(tmp_path, _run(**change)) != base


def test_v_lr_and_step_variant_are_in_the_key_and_equal_settings_share_a_file(tmp_path):
    base = _run()
    cache = pair_cache.ResultCache(tmp_path, pair_cache.identity(base, 1.0))
    cache.add({"k1": 0.25})
    again = pair_cache.ResultCache(tmp_path, pair_cache.identity(_run(), 1.0))
    assert again.path == cache.path and again.values == {"k1": 0.25}  # same settings: resumed
    other_v = _run()
    other_v.opt_state = {"v": jnp.full((3, 2), 0.25)}  # another V (its fingerprint)
    assert _key(tmp_path, other_v) != cache.path.name
    assert _key(tmp_path, base, lr_scale=0.5) != cache.path.name
    assert _key(tmp_path, base, variant={"frozen": ["embed/embedding"]}) != cache.path.name
