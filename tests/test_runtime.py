"""distributed.runtime: the persistent compilation cache every launcher turns on."""

import jax
import pytest

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
