"""hessian.py against numpy references: R (block autocorrelation), automatic λ, R^{-1/2}, unit norm."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trackstar_jax.index import hessian


def _reference_autocorrelation(x: np.ndarray, blocks: int) -> np.ndarray:
    """Loop over blocks of float64 XᵀX (the paper's Φ̃ᵀΦ̃ per layer block)."""
    x = np.asarray(x, np.float64)
    k2 = x.shape[1] // blocks
    return np.stack([x[:, b * k2 : (b + 1) * k2].T @ x[:, b * k2 : (b + 1) * k2] for b in range(blocks)])


def _block_diag(blocks: np.ndarray) -> np.ndarray:
    b, k, _ = blocks.shape
    out = np.zeros((b * k, b * k), blocks.dtype)
    for i in range(b):
        out[i * k : (i + 1) * k, i * k : (i + 1) * k] = blocks[i]
    return out


def _random_spd(rng, blocks: int, k2: int, cond: float) -> np.ndarray:
    """Blocks Q diag(w) Qᵀ with eigenvalues log-spaced in [1/cond, 1]."""
    out = []
    for _ in range(blocks):
        q, _ = np.linalg.qr(rng.standard_normal((k2, k2)))
        w = np.logspace(0, -np.log10(cond), k2)
        out.append((q * w) @ q.T)
    return np.stack(out)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("blocks", [1, 4])
def test_autocorrelation_matches_numpy(dtype, blocks):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((37, blocks * 16)).astype(dtype)
    got = np.asarray(hessian.autocorrelation(x, blocks))
    assert got.dtype == np.float32 and got.shape == (blocks, 16, 16)
    np.testing.assert_allclose(got, _reference_autocorrelation(x.astype(np.float32), blocks), rtol=1e-5, atol=1e-5)


def test_autocorrelation_sharded_rows_match_numpy():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:8])
    x = np.random.default_rng(1).standard_normal((64, 4 * 9)).astype(np.float32)
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    got = jax.jit(hessian.autocorrelation, static_argnums=1)(xs, 4)
    np.testing.assert_allclose(np.asarray(got), _reference_autocorrelation(x, 4), rtol=1e-5, atol=1e-5)


def test_rstats_compose_and_mean():
    x = np.random.default_rng(2).standard_normal((50, 32)).astype(np.float32)
    whole = hessian.r_eval(x, 2)
    halves = hessian.r_eval(x[:20], 2), hessian.r_eval(x[20:], 2)
    total = hessian.RStats(np.asarray(halves[0].total, np.float64) + halves[1].total, halves[0].count + halves[1].count)
    np.testing.assert_allclose(total.mean(), whole.mean(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(whole.mean(), _reference_autocorrelation(x, 2) / 50, rtol=1e-5, atol=1e-6)


def test_r_eval_rejects_nonfinite_queries():
    q = np.ones((3, 8), np.float32)
    q[1, 2] = np.nan
    with pytest.raises(ValueError, match=r"query vectors \[1\]"):
        hessian.r_eval(q, 2)


def test_sorted_eigenvalues_of_block_diagonal():
    r = _random_spd(np.random.default_rng(3), 3, 8, 50.0)
    np.testing.assert_allclose(
        hessian.sorted_eigenvalues(r), np.sort(np.linalg.eigvalsh(_block_diag(r)))[::-1], rtol=1e-10
    )


def _constructed(rng, spectrum: np.ndarray, blocks: int) -> np.ndarray:
    """Block-diagonal matrix with exactly the given eigenvalues, shuffled across blocks."""
    k2 = spectrum.size // blocks
    w = rng.permutation(spectrum).reshape(blocks, k2)
    out = []
    for b in range(blocks):
        q, _ = np.linalg.qr(rng.standard_normal((k2, k2)))
        out.append((q * w[b]) @ q.T)
    return np.stack(out)


@pytest.mark.parametrize("component", [1, 4, 40, 200])
def test_choose_lambda_finds_the_crossing(component):
    """§A.1.3: the sorted eigenvalue curves of λR_eval and (1-λ)R_train cross at `component`.

    R_eval's spectrum falls much faster than R_train's (a few task-common directions), so the
    curves cross once; above the crossing λR_eval dominates, below it (1-λ)R_train does.
    """
    rng = np.random.default_rng(component)
    d, blocks = 256, 4
    i = np.arange(d)
    e_eval = 50.0 * 2.0 ** (-i / 24)
    e_train = 2.0 * 2.0 ** (-i / 128)
    r_eval, r_train = _constructed(rng, e_eval, blocks), _constructed(rng, e_train, blocks)
    lam = hessian.choose_lambda(r_eval, r_train, component)
    assert 0.0 < lam < 1.0
    a, b = lam * e_eval, (1 - lam) * e_train  # the sorted curves (constructed, exact)
    np.testing.assert_allclose(a[component - 1], b[component - 1], rtol=1e-8)
    assert np.all(a[: component - 1] > b[: component - 1])
    assert np.all(a[component:] < b[component:])
    # Independent reference: bisection on the number of components where λR_eval is above.
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        above = np.sum(mid * e_eval >= (1 - mid) * e_train)
        lo, hi = (mid, hi) if above < component else (lo, mid)
    np.testing.assert_allclose(lam, hi, rtol=1e-6)


def test_choose_lambda_refuses_rank_deficient_r_eval():
    rng = np.random.default_rng(4)
    q = rng.standard_normal((3, 64)).astype(np.float32)  # 3 queries: rank <= 3 per block
    r_eval = hessian.r_eval(q, 2).mean()
    r_train = _random_spd(rng, 2, 32, 10.0)
    with pytest.raises(ValueError, match="R_eval has numerical rank 6 < crossing component 10"):
        hessian.choose_lambda(r_eval, r_train, 10)


def test_lambda_component_scales_with_d():
    assert hessian.lambda_component(65536, 1000 / 65536) == 1000
    assert hessian.lambda_component(256, 1000 / 65536) == 4
    assert hessian.lambda_component(16, 1e-9) == 1


@pytest.mark.parametrize("cond", [1.0, 1e2, 1e4])
def test_inverse_sqrt_whitens_well_conditioned(cond):
    r = _random_spd(np.random.default_rng(5), 3, 16, cond) * 7.0
    inv = hessian.inverse_sqrt(r, damping=1e-6)
    assert inv.num_floored == 0
    w = inv.matrix.astype(np.float64)
    np.testing.assert_allclose(w, np.swapaxes(w, 1, 2), atol=1e-6 * np.abs(w).max())
    ident = np.einsum("bij,bjk,bkl->bil", w, r, w)
    np.testing.assert_allclose(ident, np.broadcast_to(np.eye(16), ident.shape), atol=1e-4)


def test_inverse_sqrt_damping_floors_small_eigenvalues():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, 32))
    r = _reference_autocorrelation(x, 2)  # rank 5 per 16-dim block: 11 zero eigenvalues each
    inv = hessian.inverse_sqrt(r, damping=1e-4)
    top = np.linalg.eigvalsh(r).max()
    assert inv.num_floored == 2 * 11
    assert np.isclose(inv.floor, 1e-4 * top)
    # The largest gain is 1/sqrt(floor): bounded amplification of no-variance directions.
    gains = np.linalg.eigvalsh(inv.matrix.astype(np.float64))
    np.testing.assert_allclose(gains.max(), (1e-4 * top) ** -0.5, rtol=1e-4)
    # On the data's span it still whitens: W R W restricted to the span is the identity.
    proj = np.einsum("bij,bjk,bkl->bil", inv.matrix.astype(np.float64), r, inv.matrix.astype(np.float64))
    np.testing.assert_allclose(np.linalg.eigvalsh(proj)[:, -5:], 1.0, atol=1e-3)


def test_inverse_sqrt_rejects_zero():
    with pytest.raises(ValueError, match="R is zero"):
        hessian.inverse_sqrt(np.zeros((2, 4, 4)), 1e-6)


def test_unit_norm_holds_and_zero_rows_stay_zero():
    x = np.random.default_rng(7).standard_normal((6, 32)).astype(np.float32) * 100
    x[3] = 0
    w = hessian.inverse_sqrt(_random_spd(np.random.default_rng(8), 2, 16, 10.0), 1e-6).matrix
    g = np.asarray(hessian.finalize_rows(x, jnp.asarray(w), unit_norm=True))
    norms = np.linalg.norm(g, axis=1)
    np.testing.assert_allclose(np.delete(norms, 3), 1.0, rtol=1e-5)
    assert norms[3] == 0 and np.isfinite(g).all()


def test_normalise_after_whitening_not_before():
    """Ḡ = normalise(R^{-1/2} g) (bergson #157): unit norm is the last step."""
    x = np.random.default_rng(9).standard_normal((4, 32)).astype(np.float32)
    w = hessian.inverse_sqrt(_random_spd(np.random.default_rng(10), 2, 16, 1e3), 1e-6).matrix
    got = np.asarray(hessian.finalize_rows(x, jnp.asarray(w), True))
    wd = _block_diag(w.astype(np.float64))
    ref = (wd @ x.T.astype(np.float64)).T
    ref /= np.linalg.norm(ref, axis=1, keepdims=True)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    wrong = (wd @ (x / np.linalg.norm(x, axis=1, keepdims=True)).T).T
    assert not np.allclose(got, wrong, atol=1e-3)


def _reference_scores(q, g, r_dense, unit_norm):
    """Eq. 1-2 with a dense d×d R: Ḡ_q · Ḡ_m, R^{-1/2} by dense float64 eigh."""
    if r_dense is None:
        wq, wg = q.astype(np.float64), g.astype(np.float64)
    else:
        e, v = np.linalg.eigh(r_dense)
        w = (v * e**-0.5) @ v.T
        wq, wg = q @ w, g @ w
    if unit_norm:
        wq = wq / np.linalg.norm(wq, axis=1, keepdims=True)
        wg = wg / np.linalg.norm(wg, axis=1, keepdims=True)
    return wq @ wg.T


@pytest.mark.parametrize("mode", ["none", "train", "mixed"])
@pytest.mark.parametrize("unit_norm", [True, False])
def test_on_the_fly_scores_equal_finalised_and_dense_reference(mode, unit_norm):
    """q' = W normalise(W q) against raw rows times 1/||W g||  ==  Ḡ_q · Ḡ_m (both paths, Eq. 1)."""
    rng = np.random.default_rng(11)
    blocks, k2 = 4, 16
    g = rng.standard_normal((300, blocks * k2)).astype(np.float32) * rng.uniform(0.1, 10, (300, 1)).astype(np.float32)
    q = rng.standard_normal((12, blocks * k2)).astype(np.float32)
    r_train = hessian.r_eval(g, blocks)  # same accumulation as the index
    r_ev = hessian.r_eval(q, blocks)
    # the paper's R_train, unshrunk (the shrinkage has tests of its own)
    cfg = hessian.HessianConfig(mode=mode, mix_lambda=0.3, damping=0.0, unit_norm=unit_norm, r_train_shrinkage=0.0)
    wh = hessian.make_whitening(cfg, r_train, r_ev)
    w = None if wh.matrix is None else jnp.asarray(wh.matrix)
    on_the_fly = np.asarray(
        hessian.scores_on_the_fly(hessian.finalize_queries(q, w, unit_norm), g, hessian.row_scale(g, w, unit_norm))
    )
    finalised = (
        np.asarray(hessian.finalize_rows(q, w, unit_norm)) @ np.asarray(hessian.finalize_rows(g, w, unit_norm)).T
    )
    r_dense = {
        "none": None,
        "train": _block_diag(r_train.mean()),
        "mixed": _block_diag(0.3 * r_ev.mean() + 0.7 * r_train.mean()),
    }[mode]
    ref = _reference_scores(q, g, r_dense, unit_norm)
    scale = np.abs(ref).max()
    np.testing.assert_allclose(on_the_fly, finalised, rtol=1e-4, atol=1e-5 * scale)
    np.testing.assert_allclose(on_the_fly, ref, rtol=1e-4, atol=1e-4 * scale)


def test_inverse_sqrt_equals_the_reference_formula():
    """V diag(w^-1/2) Vᵀ per block, written out with numpy's eigh and a loop (float64)."""
    r = _random_spd(np.random.default_rng(21), 3, 24, 1e4)
    got = hessian.inverse_sqrt(r, damping=1e-3)
    ref = []
    for b in r:
        w, v = np.linalg.eigh(0.5 * (b + b.T))
        ref.append(v @ np.diag(np.maximum(w, 1e-3 * np.linalg.eigvalsh(r).max()) ** -0.5) @ v.T)
    np.testing.assert_allclose(got.matrix, np.stack(ref), rtol=1e-5, atol=1e-6 * np.abs(ref).max())


def test_rows_on_one_index_decompose_r_train_and_r_eval_once(monkeypatch):
    """A λ sweep on one index: the second row's only eigendecomposition is its own mixture's
    (one batched eigh); the spectra and R_train^{-1/2} of the first are reused, read-only."""
    rng = np.random.default_rng(22)
    g = rng.standard_normal((300, 48)).astype(np.float32)
    q = rng.standard_normal((60, 48)).astype(np.float32) + 2.0
    rt, re = hessian.r_eval(g, 3), hessian.r_eval(q, 3)
    calls = {"eigh": 0, "eigvalsh": 0}
    for name in calls:
        real = getattr(np.linalg, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(hessian.np.linalg, name, counted)
    cfg = hessian.HessianConfig(mode="mixed", lambda_component_fraction=4 / 48, damping=1e-6)
    first = hessian.make_whitening(cfg, rt, re)
    assert calls["eigh"] >= 2 and calls["eigvalsh"] >= 2
    calls.update(eigh=0, eigvalsh=0)
    for lam in (0.5, 0.9):
        other = hessian.make_whitening(dataclasses.replace(cfg, mix_lambda=lam), rt, re)
        assert other.mix_lambda == lam and other.r_eval["dim"] == first.r_eval["dim"]
    assert calls == {"eigh": 2, "eigvalsh": 0}
    # the same values as computed afresh (nothing stale), and a cached spectrum cannot be changed
    hessian._MEMO.clear()
    again = hessian.make_whitening(dataclasses.replace(cfg, mix_lambda=0.9), rt, re)
    np.testing.assert_array_equal(again.matrix, other.matrix)
    assert again.r_eval == other.r_eval
    spectrum = hessian.block_eigenvalues(re.mean())
    with pytest.raises(ValueError, match="read-only"):
        spectrum[0, 0] = 1.0


def test_make_whitening_modes():
    rng = np.random.default_rng(12)
    g = rng.standard_normal((200, 32)).astype(np.float32)
    q = rng.standard_normal((40, 32)).astype(np.float32) + 3.0  # a shared "template" direction
    rt, re = hessian.r_eval(g, 2), hessian.r_eval(q, 2)
    none = hessian.make_whitening(hessian.HessianConfig(mode="none"), None)
    assert none.matrix is None and none.mix_lambda is None
    exact = dict(damping=0.0, r_train_shrinkage=0.0)
    train = hessian.make_whitening(hessian.HessianConfig(mode="train", **exact), rt)
    lam0 = hessian.make_whitening(hessian.HessianConfig(mode="mixed", mix_lambda=0.0, **exact), rt, re)
    np.testing.assert_allclose(train.matrix, lam0.matrix, rtol=1e-5, atol=1e-6)
    auto = hessian.make_whitening(
        hessian.HessianConfig(mode="mixed", lambda_component_fraction=2 / 32, **exact), rt, re
    )
    assert auto.component == 2
    assert auto.mix_lambda == pytest.approx(hessian.choose_lambda(re.mean(), rt.mean(), 2))
    # The shared query direction is downweighted relative to R_train-only whitening.
    t = np.ones(32, np.float32) / np.sqrt(32)
    gain = lambda wh: np.linalg.norm(np.asarray(hessian.apply_blocks(jnp.asarray(wh.matrix), t[None])))  # noqa: E731
    assert gain(auto) < 0.75 * gain(train)
    with pytest.raises(ValueError, match="needs query vectors"):
        hessian.make_whitening(hessian.HessianConfig(mode="mixed"), rt, None)
    with pytest.raises(ValueError, match="needs R_train"):
        hessian.make_whitening(hessian.HessianConfig(mode="train"), None)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mode": "full"}, "hessian.mode"),
        ({"mix_lambda": 1.5}, "hessian.mix_lambda"),
        ({"lambda_component_fraction": 0.0}, "lambda_component_fraction"),
        ({"damping": -1.0}, "hessian.damping"),
        ({"r_train_shrinkage": 1.5}, "hessian.r_train_shrinkage"),
        ({"fallback_lambda": 2.0}, "hessian.fallback_lambda"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hessian.HessianConfig(**kwargs)


def test_mixing_diagnostics_against_scipy_generalized_eigenvalues():
    """num_downweighted is the paper's count (components above the crossing of the sorted
    spectra); the weights 1/mu (mu: generalized eigenvalues of (R, R_train)) are reported
    relative to their median, since unit norm removes any global scale of R."""
    import scipy.linalg

    rng = np.random.default_rng(0)
    blocks, k2 = 3, 12
    xt = rng.standard_normal((400, blocks, k2)) * np.linspace(3, 0.2, k2)
    xe = rng.standard_normal((9, blocks, k2)) * 2.0  # 9 < k2: R_eval is rank-deficient per block
    rt = np.einsum("nbi,nbj->bij", xt, xt) / 400
    re = np.einsum("nbi,nbj->bij", xe, xe) / 9
    lam = 0.7
    info = hessian.mixing_diagnostics(re, rt, lam, damping=1e-12)
    mu = np.concatenate([scipy.linalg.eigh(lam * e + (1 - lam) * t, t, eigvals_only=True) for e, t in zip(re, rt)])
    rel = (1 / mu) / np.median(1 / mu)
    assert info["num_downweighted_2x"] == int((rel <= 0.5).sum()) > 0
    np.testing.assert_allclose(
        [info["weight_spread"][k] for k in ("p01", "p10", "p50", "p90", "p99")],
        np.quantile(rel, [0.01, 0.1, 0.5, 0.9, 0.99]),
        rtol=1e-6,
    )
    np.testing.assert_allclose(info["weight_spread"]["max_over_min"], mu.max() / mu.min(), rtol=1e-6)
    assert info["r_eval_rank_per_block"] == [9, 9, 9] and info["r_train_rank_per_block"] == [k2] * 3
    e_eval = np.sort(np.linalg.eigvalsh(re).ravel())[::-1]
    e_train = np.sort(np.linalg.eigvalsh(rt).ravel())[::-1]
    assert info["num_downweighted"] == int((lam * e_eval > (1 - lam) * e_train).sum()) and info["dim"] == blocks * k2


def test_num_downweighted_is_the_crossing_count_whatever_the_scale():
    """The old count (mu > 1 at an absolute scale) was 0 whenever R_eval was nowhere larger than
    R_train, though unit norm makes that scale irrelevant; the paper's count is the number of
    components above the crossing, which the automatic λ puts at the chosen component."""
    rng = np.random.default_rng(1)
    xt = rng.standard_normal((300, 2, 8)) * np.linspace(2, 0.5, 8)
    xe = rng.standard_normal((40, 2, 8)) * np.linspace(0.5, 2, 8) * 1e-2  # R_eval << R_train everywhere
    rt = np.einsum("nbi,nbj->bij", xt, xt) / 300
    re = np.einsum("nbi,nbj->bij", xe, xe) / 40
    lam = hessian.choose_lambda(re, rt, 4)
    info = hessian.mixing_diagnostics(re, rt, lam, 1e-12)
    e_eval = np.sort(np.linalg.eigvalsh(re).ravel())[::-1]
    e_train = np.sort(np.linalg.eigvalsh(rt).ravel())[::-1]
    assert info["num_downweighted"] == int((lam * e_eval > (1 - lam) * e_train).sum()) >= 3  # old count: 0
    mu = lam * np.concatenate(
        [
            np.linalg.eigvalsh(np.linalg.solve(np.linalg.cholesky(t), np.linalg.solve(np.linalg.cholesky(t), e).T))
            for e, t in zip(re, rt)
        ]
    ) + (1 - lam)
    assert int((mu > 1 + 1e-9).sum()) == 0  # what the old diagnostic reported here
    assert info["num_downweighted_2x"] > 0 and info["weight_spread"]["max_over_min"] > 2


def test_whitening_benchmark_runs_and_agrees_with_the_old_formula():
    import json
    import subprocess
    import sys

    from conftest import REPO

    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.whitening", "--shapes=2x32"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    (row,) = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert row["d"] == 64 and row["rel_err_vs_einsum"] < 1e-6
    assert row["einsum_s"] > 0 and row["inverse_sqrt_s"] > 0 and row["first_row_s"] > 0 and row["next_row_s"] > 0


# ------------------------------------------------------------------------------------------
# R_train from few examples: OAS shrinkage, λ fallback, what each statistic came from (issue 58)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [8, 64, 1024])
def test_oas_shrinkage_approximates_the_oracle(n):
    """OAS's ρ from S and n alone against the oracle ρ* = E<S-Σ, S-F> / E||S-F||² (F = tr S / p · I,
    the ρ minimising E||(1-ρ)S + ρF - Σ||²), estimated by Monte Carlo with Σ known."""
    rng = np.random.default_rng(0)
    p = 16
    q, _ = np.linalg.qr(rng.standard_normal((p, p)))
    chol = q * np.sqrt(1.0 / np.arange(1, p + 1) ** 1.5)
    sigma = chol @ chol.T
    num = den = 0.0
    rhos = []
    for _ in range(400):
        x = rng.standard_normal((n, p)) @ chol.T
        s = x.T @ x / n
        f = np.trace(s) / p * np.eye(p)
        num += np.sum((s - sigma) * (s - f))
        den += np.sum((s - f) ** 2)
        rhos.append(hessian.oas_shrinkage(s[None], n)[0])
    assert np.mean(rhos) == pytest.approx(num / den, rel=0.25)


def test_oas_shrinkage_is_negligible_at_the_paper_scale_and_large_when_thin():
    """ρ needs only tr S and tr S²: a diagonal S with the spectrum stands for any S. At the paper's
    19.6M rows per 4096-wide block (effective rank <= p/2) ρ <= 2.1e-4, so a direction with 1% of
    the mean eigenvalue keeps its weight to 1%; 50 rows of a 64-wide block shrink strongly."""
    p = 4096
    for decay in (0.5, 1.0, 2.0):  # power-law spectra, effective rank 2,000 down to 1.6
        e = 1.0 / np.arange(1, p + 1) ** decay
        s = np.diag(e)[None]
        assert (e.sum() ** 2 / (e**2).sum()) <= p / 2
        rho = float(hessian.oas_shrinkage(s, 19_600_000)[0])
        assert rho <= 2.1e-4
        mu = e.mean()
        shrunk = (1 - rho) * e + rho * mu
        weights = (shrunk / shrunk.sum()) ** -0.5 / (e / e.sum()) ** -0.5  # relative to unshrunk, scale-free
        assert np.abs(weights[e >= 0.01 * mu] - 1).max() < 0.01
    thin = np.diag(1.0 / np.arange(1, 65))[None] * (np.arange(64) < 50)  # 50 rows: rank 50 of 64
    assert 0.1 < float(hessian.oas_shrinkage(thin, 50)[0]) <= 1.0
    assert float(hessian.oas_shrinkage(np.eye(8)[None], 10)[0]) == 1.0  # isotropic: the target is exact
    assert float(hessian.oas_shrinkage(np.zeros((1, 8, 8)), 10)[0]) == 1.0


def _thin_case(n, seed=0, blocks=4, p=64):
    """Gradient-like rows (10 shared directions of falling strength, each row's own small part)
    and 8 queries, each one row plus noise of its own: query i's right answer is row i."""
    rng = np.random.default_rng(seed)
    shared = rng.standard_normal((10, blocks * p)) * np.linspace(3, 0.3, 10)[:, None]
    rows = rng.standard_normal((n, 10)) @ shared + 0.3 * rng.standard_normal((n, blocks * p))
    q = rows[:8] + rng.standard_normal((8, blocks * p))
    return rows.astype(np.float32), q.astype(np.float32), blocks


def _top(cfg, rows, q, blocks, k=1):
    wh = hessian.make_whitening(cfg, hessian.r_eval(rows, blocks), hessian.r_eval(q, blocks))
    w = None if wh.matrix is None else jnp.asarray(wh.matrix)
    s = np.asarray(hessian.finalize_rows(q, w, True)) @ np.asarray(hessian.finalize_rows(rows, w, True)).T
    return np.argsort(-s, axis=1, kind="stable")[:, :k], wh


def test_thin_r_train_is_shrunk_so_unspanned_directions_do_not_dominate(caplog):
    """50 rows in 64-wide blocks: the unshrunk R_train^{-1/2} ranks rows by their regression
    coefficients on the query (n <= p whitened rows are orthonormal), and the query's noise
    wins; the default (OAS) finds every query's row, as the scores without R do. The run says so
    in one line, and the record names the row count against the block width."""
    rows, q, blocks = _thin_case(50)
    want = np.arange(8)[:, None]
    none, _ = _top(hessian.HessianConfig(mode="none"), rows, q, blocks)
    raw, _ = _top(hessian.HessianConfig(mode="train", r_train_shrinkage=0.0), rows, q, blocks)
    caplog.clear()
    with caplog.at_level("WARNING"):
        oas, wh = _top(hessian.HessianConfig(mode="train"), rows, q, blocks)
    assert (none == want).sum() == 8 and (raw == want).sum() <= 4 and (oas == want).sum() == 8
    rec = wh.statistics["r_train"]
    assert (rec["num_examples"], rec["block_width"], rec["thin"], rec["shrinkage"]["method"]) == (50, 64, True, "oas")
    assert 0.1 < rec["shrinkage"]["rho_min"] <= rec["shrinkage"]["rho_max"] <= 1.0
    notes = hessian.thin_notes(wh.statistics)
    assert len(notes) == 1 and "50 examples, fewer than the block width 64" in notes[0]
    assert [r.getMessage() for r in caplog.records if "R_train is estimated" in r.getMessage()] == notes


def test_shrinkage_leaves_a_well_estimated_r_train_as_it_was():
    """20,000 rows per 64-wide block (n/p = 312; the paper's is 4,800): ρ < 4e-4, every query's
    top proponent and >= 90% of its top 10 as with the paper's unshrunk R_train (below the top
    one the rows are near-ties of noise), nothing reported thin. (At 500 rows ρ is 1.3%: the
    top proponent is kept for 7 of 8 queries, the near-ties below it reshuffle.)"""
    rows, q, blocks = _thin_case(20_000)
    raw, _ = _top(hessian.HessianConfig(mode="train", r_train_shrinkage=0.0), rows, q, blocks, k=10)
    oas, wh = _top(hessian.HessianConfig(mode="train"), rows, q, blocks, k=10)
    np.testing.assert_array_equal(oas[:, 0], raw[:, 0])
    assert np.mean([len(set(a) & set(b)) for a, b in zip(oas, raw)]) >= 9
    rec = wh.statistics["r_train"]
    assert rec["shrinkage"]["rho_max"] < 4e-4 and not rec["thin"] and hessian.thin_notes(wh.statistics) == []


def test_automatic_lambda_falls_back_when_r_eval_is_too_thin(caplog):
    """Two queries over 2 blocks of 16: R_eval's rank 4 is below the crossing component 8, so
    automatic λ falls back to hessian.fallback_lambda (0.9, the paper's T-REx value), saying so
    in one line and in the record; a negative fallback refuses as before."""
    rng = np.random.default_rng(3)
    rt = hessian.r_eval(rng.standard_normal((400, 32)).astype(np.float32), 2)
    re = hessian.r_eval(rng.standard_normal((2, 32)).astype(np.float32), 2)
    cfg = hessian.HessianConfig(mode="mixed", lambda_component_fraction=8 / 32)
    with caplog.at_level("WARNING"):
        wh = hessian.make_whitening(cfg, rt, re)
    assert wh.mix_lambda == 0.9
    lam = wh.statistics["lambda"]
    assert (lam["how"], lam["value"], lam["component"]) == ("fallback", 0.9, 8) and "rank 4 < crossing" in lam["reason"]
    ev = wh.statistics["r_eval"]
    assert (ev["num_examples"], ev["rank_min"], ev["needed_for_automatic_lambda"], ev["thin"]) == (2, 2, 8, True)
    lines = [r.getMessage() for r in caplog.records if "lambda falls back" in r.getMessage()]
    assert len(lines) == 1 and "hessian.fallback_lambda = 0.9" in lines[0] and "2 examples" in lines[0]
    np.testing.assert_array_equal(
        wh.matrix, hessian.make_whitening(dataclasses.replace(cfg, mix_lambda=0.9), rt, re).matrix
    )
    with pytest.raises(hessian.LambdaUndetermined, match="R_eval has numerical rank 4 < crossing component 8"):
        hessian.make_whitening(dataclasses.replace(cfg, fallback_lambda=-1.0), rt, re)
    ok = hessian.make_whitening(dataclasses.replace(cfg, lambda_component_fraction=2 / 32), rt, re)
    assert ok.statistics["lambda"]["how"] == "automatic" and "thin" not in ok.statistics["r_eval"]


def test_describe_statistics_names_each_estimate_of_v_by_its_own_counts():
    """The scoring log line says what V was estimated from for either import estimate (the
    minibatch record has no `num_examples`: it once logged "from None examples")."""
    mb = {
        "source": "import estimate",
        "estimate_v_method": "minibatch",
        "estimate_v_source": "lama:P108",
        "estimate_v_batch_sequences": 64,
        "num_steps": 16,
        "num_sequences": 1024,
        "optimizer": "adafactor",
    }
    pe = {
        "source": "import estimate",
        "estimate_v_method": "per_example",
        "estimate_v_source": "candidates",
        "num_examples": 64,
    }
    state = {"source": "optimizer state", "optimizer": "adafactor", "checkpoint_step": 5000, "effective_steps": 912}
    assert hessian.describe_statistics({"v": mb}) == (
        "V estimated at import as adafactor holds it: 16 steps x 64 sequences of lama:P108"
    )
    assert hessian.describe_statistics({"v": pe}) == "V estimated at import from 64 per-example gradients of candidates"
    assert hessian.describe_statistics({"v": state}) == "V from the adafactor state at step 5000 (~912 steps)"
    assert "None" not in hessian.describe_statistics({"v": mb, "r_train": {"num_examples": 50, "block_width": 64}})
