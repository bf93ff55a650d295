"""Every experiments/*.py loads, and its sections turn into the typed objects the stages use."""

import importlib
import pathlib

import jax
import ml_collections
import pytest

from trackstar_jax import config as config_lib
from trackstar_jax import data as data
from trackstar_jax.models import lm as model

EXPERIMENTS = sorted(
    p.stem for p in (pathlib.Path(__file__).resolve().parents[1] / "experiments").glob("*.py") if p.stem != "__init__"
)


def test_the_expected_configs_exist():
    assert {"base", "tiny", "small", "paper_154m", "paper_1b", "paper_8b"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_config_loads_and_types(name):
    config = importlib.import_module(f"experiments.{name}").get_config()
    assert isinstance(config, ml_collections.ConfigDict)
    model_cfg = config_lib.from_configdict(config).model  # unknown model keys would raise
    config_lib.from_configdict(config).train.optimizer
    config_lib.from_configdict(config)  # unknown train keys would raise
    data_cfg = config_lib.from_configdict(config).data  # unknown data keys would raise
    assert data_cfg.source in data.SOURCES
    _, params = model.abstract_params(model_cfg)  # builds abstractly (no allocation)
    assert model.param_count(params) > 0 and all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
    assert config.train.global_batch_size > 0 and config.train.num_steps > 0


def test_tiny_and_small_sizes():
    tiny = config_lib.from_configdict(importlib.import_module("experiments.tiny").get_config()).model
    small = config_lib.from_configdict(importlib.import_module("experiments.small").get_config()).model
    assert model.param_count(model.abstract_params(tiny)[1]) < 1_000_000
    assert 5e6 <= model.param_count(model.abstract_params(small)[1]) <= 20e6


def test_unknown_keys_in_a_config_file_are_named(tiny_config):
    tiny_config.model.embed_dims = 32  # a typo in an experiment file (not a CLI override)
    with pytest.raises(ValueError, match=r"config\.model: embed_dims"):
        config_lib.from_configdict(tiny_config).model
    del tiny_config.model.embed_dims  # every section is checked by the one builder
    tiny_config.train.warmup = 5
    with pytest.raises(ValueError, match=r"config\.train: warmup"):
        config_lib.from_configdict(tiny_config)
