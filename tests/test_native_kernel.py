"""native.py + kernels/scores.cc: the FFI kernel's scores vs a float64 numpy reference
(bfloat16 and float32 rows, both code paths, odd dims, one row), NaN/inf propagation, exact
top-k with ties through retrieval's "native" plan on 1 and 8 devices, the env-var /
failed-build fallbacks, and the build cache (reused; a corrupted or unverified library is
rebuilt, never loaded)."""

import ctypes
import logging

import jax
import ml_dtypes
import numpy as np
import pytest
from test_retrieval import assert_exact, mesh_of, tied_data

from trackstar_jax.retrieval import native
from trackstar_jax.retrieval import topk as retrieval

BF16 = ml_dtypes.bfloat16
ROW_DTYPES = {"bfloat16": BF16, "float32": np.float32}
EPS32 = float(np.finfo(np.float32).eps)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not native.enabled() or native._compiler() is None:
        pytest.skip("native kernels disabled (TRACKSTAR_JAX_NATIVE=0) or no C++ compiler")
    # With a compiler present a failed build is a defect, not a reason to skip 60 tests.
    assert native.available(), f"native kernels failed to build or load: {native._state.get('error')}"


@pytest.fixture(params=["best", "portable"])
def code_path(request):
    """Runs a test on the CPU's best path and on the portable path (forced through the test hook)."""
    native.force_portable(request.param == "portable")
    if request.param == "portable":
        assert native.isa() == "portable"
    yield request.param
    native.force_portable(False)


def _reference_scores(x, q):
    """float64 scores and the float32 error scale sum_j |q_j x_j| (both [Q, b])."""
    x64, q64 = np.asarray(x).astype(np.float64), np.asarray(q, np.float64)
    return q64 @ x64.T, np.abs(q64) @ np.abs(x64).T


_scores = jax.jit(native.scores)


@pytest.mark.parametrize("dtype", list(ROW_DTYPES))
@pytest.mark.parametrize(
    "b, d, nq",
    [
        (1, 1, 1),
        (1, 4096, 1),
        (7, 33, 3),
        (64, 16, 5),
        (37, 63, 16),
        (200, 1000, 2),
        (130, 257, 9),
        (19, 96, 4),
        (5, 31, 13),
    ],
)
def test_scores_match_float64_reference(code_path, dtype, b, d, nq):
    rng = np.random.default_rng(1000 * b + 10 * d + nq)  # a fresh seed per shape
    x = rng.standard_normal((b, d)).astype(ROW_DTYPES[dtype])
    q = rng.standard_normal((nq, d)).astype(np.float32)
    got = np.asarray(_scores(x, q))
    ref, scale = _reference_scores(x, q)
    assert got.shape == (nq, b) and got.dtype == np.float32
    # Each product is rounded once to float32, and each accumulator chain sums <= d/64 + 8
    # terms (16 lanes x 2-4 chains, then the lane reduction): a float32 summation bound.
    bound = (d / 64 + 8) * EPS32 * scale
    assert (np.abs(got - ref) <= bound).all(), float(np.max(np.abs(got - ref) / np.maximum(scale, 1e-30)))


@pytest.mark.parametrize("dtype", list(ROW_DTYPES))
def test_small_integer_scores_are_exact(code_path, dtype):
    x, q = tied_data(45, d=77, q=6)
    np.testing.assert_array_equal(np.asarray(_scores(x.astype(ROW_DTYPES[dtype]), q)), q @ x.T)


@pytest.mark.parametrize("dtype", list(ROW_DTYPES))
def test_non_finite_rows_propagate(code_path, dtype):
    x = np.ones((6, 40), np.float32)
    x[1, 3], x[2, 39], x[4, 0] = np.nan, np.inf, -np.inf
    q = np.ones((2, 40), np.float32)
    q[1, 39] = 0.0  # inf * 0 = NaN (IEEE), as a float32 dot gives
    got = np.asarray(_scores(x.astype(ROW_DTYPES[dtype]), q))
    with np.errstate(invalid="ignore"):
        want = q.astype(np.float64) @ x.T.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[np.isfinite(want)], want[np.isfinite(want)].astype(np.float32))
    np.testing.assert_array_equal(got[np.isinf(want)], want[np.isinf(want)])
    plan = retrieval.make_score_plan(2, 40, ROW_DTYPES[dtype], upcast="native")
    with pytest.raises(ValueError, match=r"non-finite retrieval scores .* \[1, 2, 4\]"):
        retrieval.topk(q, x.astype(ROW_DTYPES[dtype]), 6, mesh=mesh_of(8), plan=plan)


@pytest.mark.parametrize("dtype", list(ROW_DTYPES))
@pytest.mark.parametrize("num_devices", [1, 8])
@pytest.mark.parametrize("n, k, block_rows", [(1, 1, None), (9, 9, None), (37, 10, None), (1001, 7, 64)])
def test_topk_with_ties_native_plan(dtype, num_devices, n, k, block_rows):
    # n=1 / 9 on 8 devices: shards of 1-2 rows, mostly padding; n=1001 with blocks of 64:
    # several (copied) blocks per shard with the running merge.
    x, q = tied_data(max(n, 8))
    x = x[:n]
    plan = retrieval.make_score_plan(len(q), x.shape[1], ROW_DTYPES[dtype], upcast="native", block_rows=block_rows)
    ref = retrieval.reference_topk(q, x, k)
    mesh = mesh_of(num_devices)
    assert_exact(retrieval.topk(q, x.astype(ROW_DTYPES[dtype]), k, mesh=mesh, plan=plan), ref)
    reader = retrieval.ArrayReader(x.astype(ROW_DTYPES[dtype]))
    assert_exact(retrieval.stream_topk(q, reader, k, max(1, n // 3), mesh=mesh, plan=plan, query_batch_size=2), ref)


def test_plan_uses_native_kernel_and_env_var_forces_fallback(monkeypatch):
    x, q = tied_data(301, d=48, q=3)
    x = x.astype(BF16)
    auto = retrieval.make_score_plan(len(q), 48, BF16, backend="cpu")
    assert auto.upcast == ("native" if native.isa() == "avx512" else "bf16_split3")
    fast = retrieval.topk(q, x, 25, mesh=mesh_of(8), plan=retrieval.make_score_plan(len(q), 48, BF16, upcast="native"))
    monkeypatch.setenv(native.ENV_ENABLE, "0")
    assert not native.available() and native.isa() == "unavailable"
    fallback_plan = retrieval.make_score_plan(len(q), 48, BF16, backend="cpu")
    assert fallback_plan.upcast == "bf16_split3"
    fallback = retrieval.topk(q, x, 25, mesh=mesh_of(8), plan=fallback_plan)
    for a, b in zip(fast, fallback):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(RuntimeError, match="native kernels unavailable"):
        native.scores(x, q)


def test_native_plan_rejects_other_dtypes():
    with pytest.raises(ValueError, match="upcast='native' scores"):
        retrieval.make_score_plan(1, 64, np.int8, upcast="native")


def test_failed_build_warns_once_and_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(native, "_state", {})  # a process that has not loaded the kernels yet
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(native.ENV_CACHE, str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING):
        assert not native.available()
        assert not native.available()
    warnings = [r for r in caplog.records if "native CPU kernels unavailable" in r.getMessage()]
    assert len(warnings) == 1
    assert retrieval.make_score_plan(1, 64, BF16, backend="cpu").upcast == "bf16_split3"


def test_build_cache_is_reused_and_bad_libraries_are_rebuilt(monkeypatch, tmp_path):
    monkeypatch.setenv(native.ENV_CACHE, str(tmp_path))
    # the cache, not the code, is under test: three builds at -O0 (2.5 s each, not 5.3 s at -O3)
    monkeypatch.setattr(native, "FLAGS", ("-O0", *native.FLAGS[1:]))
    so = native.build()
    assert so.is_relative_to(tmp_path / "kernels") and so.with_name(so.name + ".sha256").exists()
    stat = so.stat()
    assert native.build() == so and so.stat().st_ino == stat.st_ino and so.stat().st_mtime_ns == stat.st_mtime_ns
    good = so.read_bytes()
    so.write_bytes(good[: len(good) // 2])  # a partial / corrupted library under the final name
    assert native.build() == so and so.read_bytes() != good[: len(good) // 2]
    assert ctypes.CDLL(str(so)).TrackstarKernelIsa() in (0, 1)
    so.with_name(so.name + ".sha256").unlink()  # an unverified library is not trusted either
    inode = so.stat().st_ino
    assert native.build() == so and so.stat().st_ino != inode
    assert not list(so.parent.glob("*.tmp*"))  # no temporary files left behind
