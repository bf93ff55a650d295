"""`conftest.update_compiler_config`: flipping `jax_disable_most_optimizations` must not leave
programs compiled under the other setting in jax's in-memory caches (they do not key on it)."""

import jax
import jax.numpy as jnp
from conftest import update_compiler_config


def test_flipping_the_optimisation_flag_recompiles_and_restores():
    traces = []

    @jax.jit
    def f(x):
        traces.append(1)  # runs once per trace: a cache hit adds nothing
        return jnp.sin(x) @ x

    x = jnp.ones((4, 4))
    flag = "jax_disable_most_optimizations"
    before = jax.config.values[flag]
    f(x)
    f(x)
    assert len(traces) == 1
    old = update_compiler_config({flag: not before})
    assert old == {flag: before} and jax.config.values[flag] is (not before)
    f(x)
    assert len(traces) == 2  # traced and compiled again under the new setting
    update_compiler_config({flag: not before})  # no change: the caches stay
    f(x)
    assert len(traces) == 2
    update_compiler_config(old)
    assert jax.config.values[flag] is before
    f(x)
    assert len(traces) == 3


def test_other_options_keep_the_caches():
    traces = []

    @jax.jit
    def f(x):
        traces.append(1)
        return x + 1

    f(jnp.ones(3))
    key = "jax_persistent_cache_min_compile_time_secs"
    old = update_compiler_config({key: 0.25})
    f(jnp.ones(3))
    update_compiler_config(old)
    assert len(traces) == 1 and jax.config.values[key] == old[key]
