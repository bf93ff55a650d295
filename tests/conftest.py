"""Test setup: 8 fake CPU devices, set before JAX initialises its backend (style.md §4.2)."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def skip_if_not_enough_devices(n: int):
    """Skips the calling test when fewer than `n` devices exist."""
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices, have {len(jax.devices())}")


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
    """`../shared/data` (LAMA T-REx, ParaRel); skips when absent (a user's fresh machine)."""
    if not (SHARED_DATA / "lama").is_dir():
        pytest.skip(f"real data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture
def tiny_config():
    """A fresh copy of experiments/tiny.py's config."""
    from experiments import tiny

    return tiny.get_config()


@pytest.fixture(scope="module")
def fast_compile():
    """Cheaper XLA compiles for one test module (`pytestmark = pytest.mark.usefixtures("fast_compile")`).

    The flag is process-global, so it is set per module and restored on exit (style.md §5.6.7).
    """
    old = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", old)
