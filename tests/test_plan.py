"""The planner's figures against hand arithmetic (tiny config), and the refusal of a step that
does not fit a forced device-memory limit."""

import jax
import numpy as np
import pytest
from conftest import tiny_run_config

from trackstar_jax import config as config_lib
from trackstar_jax import plan, training
from trackstar_jax.distributed import memory, sharding
from trackstar_jax.models import lm as model_lib

pytestmark = pytest.mark.usefixtures("fast_compile")


def _hand_params(m) -> int:
    """Parameter count of the abstract model (no arrays); 155,968 is the figure README states."""
    _, params = model_lib.abstract_params(m)
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def test_figures_equal_hand_arithmetic(tiny_config):
    settings = config_lib.from_configdict(tiny_config)
    mesh = sharding.make_mesh((1, 8, 1), devices=jax.devices()[:8])
    rates = plan.Rates(flops_per_s=1e12, bytes_per_s=1e11, source="stated")
    out = plan.plan(settings, mesh, num_examples=10_000, tokens_per_example=50, rates=rates, num_queries=1000)
    n_params = out["num_params"]
    assert n_params == _hand_params(settings.model) == 155_968  # README: the 156K-parameter tiny model
    assert out["params"]["total_bytes"] == 4 * n_params  # float32
    # fsdp 8: each leaf's shard by the rule, summed by hand
    by_hand = 0
    _, abstract = model_lib.abstract_params(settings.model)
    for x in jax.tree.leaves(abstract):
        spec = sharding.fsdp_spec(x.shape, mesh)
        shape = [s // 8 if ax == "fsdp" else s for s, ax in zip(x.shape, tuple(spec) + (None,) * 8)]
        by_hand += 4 * int(np.prod(shape))
    assert out["params"]["per_device_bytes"] == by_hand < out["params"]["total_bytes"] / 4
    d = 2 * 2 * 8**2  # tiny: 2 blocks x 2 sides x k^2, k = 8
    assert out["dim"] == d
    assert out["index_bytes"] == {
        "float32": 10_000 * d * 4,
        "bfloat16": 10_000 * d * 2,
        "float16": 10_000 * d * 2,
        "int8": 10_000 * (d + 4),
    }
    assert out["r_bytes"] == 4 * 64 * 64 * 4
    assert out["retrieval_bytes_per_query_batch"] == 10_000 * d * 2
    assert out["featurize_flops"] == 6 * n_params * 10_000 * 50
    assert out["featurize_seconds"] == pytest.approx(6 * n_params * 10_000 * 50 / (1e12 * 8))
    assert out["retrieval_seconds_per_1k_queries"] == pytest.approx(16 * 10_000 * d * 2 / (1e11 * 8))  # 1000/64 -> 16
    m = out["train_step"]
    assert m["argument_bytes"] >= out["params"]["per_device_bytes"] + out["opt_state"]["per_device_bytes"]
    assert m["peak_bytes"] == m["argument_bytes"] + m["output_bytes"] + m["temp_bytes"] - m["alias_bytes"] > 0


def test_a_step_that_does_not_fit_is_refused_before_training(tmp_path, monkeypatch):
    c = tiny_run_config(num_facts=4, num_distractors=4, num_steps=2, chunk_rows=8)
    monkeypatch.setenv(memory.MEMORY_ENV, "100000")  # 100 kB: far below the train step's ~50 MB
    with pytest.raises(memory.DoesNotFitError, match=r"lower config\.train\.global_batch_size .* fsdp axis"):
        training.train(config_lib.from_configdict(c), tmp_path)
    assert not list(tmp_path.glob("checkpoints/*"))  # no step ran, nothing saved
    monkeypatch.delenv(memory.MEMORY_ENV)
    assert memory.device_memory_limit() is None  # CPU reports no limit of its own
    memory.check_fits("train", 10**12, limit=None)  # no limit: never refused
