"""`model.matmul_dtype`: GEMM operands rounded to bf16, products accumulated in float32.

`layers.lowp_matmul` and the head against float64 numpy of the rounded operands; on the CPU
every one of their GEMMs keeps bf16 operands in the compiled program (XLA:CPU upcasts a bf16
dot with a transposed operand to float32, at about half the rate); the model's loss and
gradients on the CPU path equal the accelerators' plain-einsum path; the featurizer's vectors
stay within bf16 rounding of the float32 ones."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import arch_config, skip_if_not_enough_devices, update_compiler_config

from trackstar_jax.distributed import runtime, sharding
from trackstar_jax.features import vectors
from trackstar_jax.models import head as head_lib
from trackstar_jax.models import layers
from trackstar_jax.models import lm as model_lib
from trackstar_jax.training import step as train_lib

# Cheaper compiles (conftest.py) for the numerics; the one test that reads what XLA's passes make
# of the GEMMs compiles with them on (`xla_passes_on`).
pytestmark = pytest.mark.usefixtures("fast_compile")


@pytest.fixture
def xla_passes_on():
    """XLA's optimisation passes on for one test (the module runs with most of them off)."""
    old = update_compiler_config({"jax_disable_most_optimizations": False})
    yield
    update_compiler_config(old)


def _rounded(a) -> np.ndarray:
    """`a` rounded to bf16, as float64."""
    return np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("shape", [(4, 6), (5, 3), (1, 7), (6, 1), (3, 3)])
def test_physical_transpose_is_the_transpose(shape):
    a = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
    np.testing.assert_array_equal(np.asarray(jax.jit(layers.physical_transpose)(a)), np.asarray(a).T)


# (2, 16, 24), (1, 4, 3): fewer rows than the weight has, whose `dx` transposes the cotangent
@pytest.mark.parametrize("n,i,o", [(6, 5, 7), (16, 8, 12), (2, 16, 24), (1, 4, 3)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lowp_matmul_and_its_gradients_multiply_the_rounded_operands(n, i, o, dtype):
    """Value `x_r @ w_r` in float32; gradients `ct_r @ w_r^T` and `x_r^T @ ct_r` (`_r`: rounded
    to bf16), returned in the inputs' dtypes: float64 numpy references."""
    rng = np.random.default_rng(0)
    x, w = (jnp.asarray(rng.standard_normal(s), dtype) for s in ((n, i), (i, o)))
    ct = jnp.asarray(rng.standard_normal((n, o)), jnp.float32)
    y, vjp = jax.vjp(jax.jit(layers.lowp_matmul), x, w)
    dx, dw = jax.jit(vjp)(ct)
    assert y.dtype == jnp.float32 and dx.dtype == x.dtype and dw.dtype == w.dtype
    xr, wr, cr = _rounded(x), _rounded(w), _rounded(ct)
    out_tol = 1e-6 if dtype == "float32" else 8e-3  # bf16 inputs get bf16 gradients back
    np.testing.assert_allclose(np.asarray(y, np.float64), xr @ wr, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dx, np.float64), cr @ wr.T, rtol=out_tol, atol=out_tol)
    np.testing.assert_allclose(np.asarray(dw, np.float64), xr.T @ cr, rtol=out_tol, atol=out_tol)


def _np_attention(q, k, v, do, rnd):
    """Causal GQA attention and its VJP in float64 numpy, one (example, head) at a time; `rnd`
    rounds each GEMM's operands (`_rounded`, or the identity for the float32 reference)."""
    b, t, h, d = q.shape
    r = h // k.shape[2]
    o, dq, dk, dv = np.zeros(q.shape), np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for bi in range(b):
        for hi in range(h):
            qi, ki, vi, doi = q[bi, :, hi], k[bi, :, hi // r], v[bi, :, hi // r], do[bi, :, hi]
            s = np.where(np.tril(np.ones((t, t), bool)), rnd(qi) @ rnd(ki).T / np.sqrt(d), -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            o[bi, :, hi] = rnd(p) @ rnd(vi)
            dp = rnd(doi) @ rnd(vi).T
            ds = p * (dp - np.sum(dp * p, -1, keepdims=True)) / np.sqrt(d)
            dq[bi, :, hi] = rnd(ds) @ rnd(ki)
            dk[bi, :, hi // r] += rnd(ds).T @ rnd(qi)
            dv[bi, :, hi // r] += rnd(p).T @ rnd(doi)
    return o, (dq, dk, dv)


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
@pytest.mark.parametrize("g", [4, 2, 1])  # multi-head, grouped-query, multi-query (4 query heads)
@pytest.mark.parametrize("operand_dtype", [None, "bfloat16"])
def test_causal_attention_and_its_gradients_against_a_loop(operand_dtype, g, platform, monkeypatch):
    """`causal_attention` on the CPU's heads-first layout and on the accelerators' einsum path:
    output and the gradients of q, k, v against float64 numpy, one head at a time. With bf16
    operands every GEMM's operands rounded (the softmax's probabilities, the cotangent and the
    softmax's VJP too) and float32 accumulation: to 2e-4, where the float32 reference is 10x
    further off."""
    monkeypatch.setenv(runtime.TARGET_ENV, platform)
    rng = np.random.default_rng(7)
    b, t, h, d = 2, 9, 4, 8
    q, do = (rng.standard_normal((b, t, h, d)) for _ in range(2))
    k, v = (rng.standard_normal((b, t, g, d)) for _ in range(2))
    args = [jnp.asarray(a, jnp.float32) for a in (q, k, v)]
    f = jax.jit(functools.partial(layers.causal_attention, operand_dtype=operand_dtype))
    o, vjp = jax.vjp(f, *args)
    grads = jax.jit(vjp)(jnp.asarray(do, jnp.float32))
    assert o.dtype == jnp.float32 and all(x.dtype == jnp.float32 for x in grads)
    if operand_dtype is None:
        o_r, g_r = _np_attention(q, k, v, do, lambda a: a)
        tol = 2e-6
    else:
        o_r, g_r = _np_attention(*(np.asarray(a, np.float64) for a in args), do, _rounded)
        o_f, g_f = _np_attention(q, k, v, do, lambda a: a)
        tol = 2e-4
        assert _rel(o_f, o_r) > 10 * tol and all(_rel(x, y) > 10 * tol for x, y in zip(g_f, g_r))
    assert _rel(o, o_r) < tol
    for name, x, y in zip("qkv", grads, g_r):
        assert _rel(x, y) < tol, name


def _dot_operand_types(hlo: str) -> list[tuple[str, str]]:
    """The element types of every dot's two operands in a compiled HLO module's text."""
    out = []
    for comp in re.split(r"\n(?=\S)", hlo):  # one computation per block of indented lines
        header, _, body = comp.partition("\n")
        types = dict(re.findall(r"([\w.\-]+): (\w+)\[", header))
        types.update(re.findall(r"%([\w.\-]+) = (\w+)\[", body))
        for a, b in re.findall(r" dot\(%([\w.\-]+), %([\w.\-]+)\)", body):
            out.append((types.get(a, "?"), types.get(b, "?")))
    return out


def test_every_gemm_of_a_bf16_dense_layer_and_the_head_runs_in_bf16_on_the_cpu(monkeypatch, xla_passes_on):
    """The forward and both backward GEMMs of a dense layer, and the featurizer's head (its
    logits and `dx` GEMMs, vocabulary blocked or whole), keep bf16 operands once compiled with
    XLA's passes on, as the package compiles. Fails if XLA folds a written-out transpose back into
    a dot (then upcast to float32)."""
    assert not jax.config.read("jax_disable_most_optimizations")
    assert jax.default_backend() == "cpu"
    monkeypatch.delenv(runtime.TARGET_ENV, raising=False)
    w = jnp.ones((32, 48), jnp.float32)
    dense = jax.jit(jax.grad(lambda x, w: jnp.sum(layers.dense_matmul(x, w, "bfloat16") ** 2), argnums=(0, 1)))
    for rows in (64, 4):  # a batch's rows, and a query's fewer rows than the weight has
        x = jnp.ones((rows, 32), jnp.float32)
        types = _dot_operand_types(dense.lower(x, w).compile().as_text())
        assert len(types) == 3 and all(t == ("bf16", "bf16") for t in types), (rows, types)
    wh = jnp.ones((32, 300), jnp.float32)
    for (b, t), block in [((4, 31), 0), ((4, 31), 64), ((1, 7), 64)]:
        h, y, wt = jnp.ones((b, t, 32), jnp.float32), jnp.ones((b, t), jnp.int32), jnp.ones((b, t), jnp.float32)
        head = functools.partial(
            head_lib.head_nll_sum, targets=y, weights=wt, weight_grad=False, vocab_block=block, operand_dtype="bfloat16"
        )
        types = _dot_operand_types(jax.jit(jax.grad(head)).lower(h, wh).compile().as_text())
        assert len(types) >= 2 and all(t == ("bf16", "bf16") for t in types), (b, t, block, types)
    q, k = jnp.ones((2, 16, 4, 8), jnp.float32), jnp.ones((2, 16, 2, 8), jnp.float32)
    attn = jax.jit(jax.grad(lambda q, k: jnp.sum(layers.causal_attention(q, k, k, "bfloat16") ** 2), argnums=(0, 1)))
    types = _dot_operand_types(attn.lower(q, k).compile().as_text())
    assert len(types) == 6 and all(t == ("bf16", "bf16") for t in types), types
    # without the operand dtype: float32 GEMMs (the test can tell the two apart)
    x = jnp.ones((64, 32), jnp.float32)
    plain = jax.jit(jax.grad(lambda x, w: jnp.sum(layers.dense_matmul(x, w) ** 2), argnums=(0, 1)))
    assert all(t == ("f32", "f32") for t in _dot_operand_types(plain.lower(x, w).compile().as_text()))


@pytest.mark.parametrize("d", [16, 48])  # 48: wider than the 33 rows (`dx` transposes `softmax - onehot`)
@pytest.mark.parametrize("weight_grad,vocab_block", [(True, 0), (False, 0), (False, 8), (False, 37)])
def test_the_bf16_head_is_the_head_of_the_rounded_operands(weight_grad, vocab_block, d):
    """Loss and gradients of `head_nll_sum(..., operand_dtype="bfloat16")` against float64 numpy
    on bf16-rounded `x` and `W`: the loss to float32 accumulation; with the vocabulary whole,
    `dx = r(D) W_r^T` and `dW = x_r^T r(D)` (`D = weights * (softmax - onehot)`, `r`: rounded
    to bf16, as the GEMMs take it) to 1e-4, where the float32 head is 20x further off; in
    vocabulary blocks each block's unnormalised exponentials are what is rounded (3e-3)."""
    rng = np.random.default_rng(1)
    b, t, v = 3, 11, 37
    x = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((d, v)), jnp.float32)
    y = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    wt = jnp.asarray(rng.random((b, t)), jnp.float32)

    def ref(x64, w64, round_d):
        logits = x64 @ w64
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        nll = -np.log(np.take_along_axis(p, np.asarray(y)[..., None], -1)[..., 0])
        dl = np.asarray(wt, np.float64)[..., None] * (p - np.eye(v)[np.asarray(y)])
        dl = _rounded(dl) if round_d else dl
        return (np.asarray(wt) * nll).sum(), dl @ w64.T, np.einsum("btd,btv->dv", x64, dl)

    loss_r, dx_r, dw_r = ref(_rounded(x), _rounded(w), True)
    f = functools.partial(
        head_lib.head_nll_sum,
        targets=y,
        weights=wt,
        weight_grad=weight_grad,
        vocab_block=vocab_block,
        operand_dtype="bfloat16",
    )
    loss, (dx, dw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, w)
    assert dx.dtype == jnp.float32 and dw.dtype == jnp.float32
    np.testing.assert_allclose(float(loss), loss_r, rtol=1e-6)
    np.testing.assert_allclose(float(jax.jit(f)(x, w)), loss_r, rtol=1e-6)  # the undifferentiated primal
    if vocab_block:
        assert _rel(dx, dx_r) < 3e-3
    else:
        assert _rel(dx, dx_r) < 1e-4
        _, dx_f, _ = ref(np.asarray(x, np.float64), np.asarray(w, np.float64), False)
        assert _rel(dx_f, dx_r) > 20 * 1e-4  # the rounding the reference models is what the head does
    if weight_grad:
        assert _rel(dw, dw_r) < 1e-4
    else:
        assert not np.any(np.asarray(dw))


@pytest.mark.parametrize("arch,tie", [("llama", True), ("gpt_neox", False)])
def test_the_cpu_bf16_path_equals_the_accelerators_einsum_path(arch, tie, monkeypatch):
    """Loss and every parameter gradient of a model with `matmul_dtype="bfloat16"`: the CPU's
    flattened GEMMs with written-out transposes against the path accelerators trace (`einsum`
    of the rounded operands, float32 accumulation), both traced here; and within bf16 rounding
    of the float32 model."""
    cfg = arch_config(arch, tie_embeddings=tie)
    bf = dataclasses.replace(cfg, matmul_dtype="bfloat16")
    graphdef, params = model_lib.split_model(model_lib.make_model(bf, seed=3))
    graphdef32, _ = model_lib.split_model(model_lib.make_model(cfg, seed=3))
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (3, 12)), jnp.int32)
    weights = jnp.asarray(rng.random((3, 11)), jnp.float32)

    def grads(gd, weight_grad):
        f = lambda p: model_lib.nll_sum(gd, p, tokens[:, :-1], tokens[:, 1:], weights, weight_grad=weight_grad)  # noqa: E731
        loss, g = jax.jit(jax.value_and_grad(f))(params)
        return float(loss), layers.flat_params(g)

    # the head's vocabulary whole on both (the blocked head rounds other numbers: tested above)
    monkeypatch.setitem(head_lib.HEAD_VOCAB_BLOCK, "cpu", 0)
    jax.clear_caches()  # read at trace time
    for weight_grad in (True, False):
        monkeypatch.delenv(runtime.TARGET_ENV, raising=False)
        cpu = grads(graphdef, weight_grad)
        f32 = grads(graphdef32, weight_grad)
        monkeypatch.setenv(runtime.TARGET_ENV, "gpu")
        acc = grads(graphdef, weight_grad)
        np.testing.assert_allclose(cpu[0], acc[0], rtol=2e-6)
        np.testing.assert_allclose(cpu[0], f32[0], rtol=2e-2)
        for path, g in acc[1].items():
            if not np.any(np.asarray(g)):  # the untied head's matrix under weight_grad=False
                assert not np.any(np.asarray(cpu[1][path])), path
                continue
            assert _rel(cpu[1][path], g) < 2e-4, path
            assert _rel(cpu[1][path], f32[1][path]) < 3e-2, path


@functools.lru_cache(maxsize=None)
def _trained(correction: str):
    """A small untied GPT-NeoX after one optimizer step (`correction`'s second moment), and a
    batch of 2 rows (featurized on one device: `_vectors`)."""
    cfg = arch_config("gpt_neox", tie_embeddings=False)
    if correction == "adafactor":
        opt = train_lib.make_optimizer(train_lib.OptimizerConfig(min_dim_size_to_factor=8, warmup_steps=1))
    else:
        opt = optax.adam(1e-2)
    graphdef, state = train_lib.init_state(cfg, opt, seed=0)
    rng = np.random.default_rng(4)
    tokens = rng.integers(1, cfg.vocab_size, (2, 16)).astype(np.int32)
    batch = {"tokens": tokens, "loss_mask": np.ones_like(tokens), "example_id": np.arange(2, dtype=np.int32)}
    state, _ = train_lib.train_step(state, batch, graphdef=graphdef, opt=opt)  # a second moment of real gradients
    return cfg, state.params, state.opt_state, batch


def _vectors(cfg, matmul_dtype, vc, params, opt_state, batch, mesh=None):
    c = dataclasses.replace(cfg, matmul_dtype=matmul_dtype)
    gd, _ = model_lib.split_model(model_lib.make_model(c, seed=0))
    mesh = mesh or sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    fn = vectors.make_vector_fn(gd, c, vc, params, opt_state, mesh=mesh)
    return np.asarray(fn(params, fn.precond, batch), np.float64)


@pytest.mark.parametrize("correction,exact_v", [("adafactor", False), ("adam", True)])
def test_bf16_vectors_are_the_float32_vectors_within_rounding(correction, exact_v):
    """The fast featurizer with `matmul_dtype="bfloat16"`: every row's cosine with the float32
    model's row above 0.999, the two unequal (the option is on)."""
    cfg, params, opt_state, batch = _trained(correction)
    vc = vectors.VectorConfig(num_blocks=2, proj_dim=8, correction=True, exact_v=exact_v, batch_size=2)
    a, b = (_vectors(cfg, md, vc, params, opt_state, batch) for md in ("", "bfloat16"))
    cos = np.sum(a * b, 1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert np.all(cos > 0.999), cos
    assert not np.array_equal(a, b)


def test_bf16_vectors_on_1_and_8_devices_and_fsdp():
    """`matmul_dtype="bfloat16"` through the sharded step (Adafactor, the fast path): 8 devices on
    the data axis and the parameters sharded over fsdp (2 x 4) give the one-device bf16 vectors
    to float32 round-off (9e-8 measured), while the float32 model's are bf16 rounding away
    (5e-3): a mesh that lost the option would fail."""
    skip_if_not_enough_devices(8)
    cfg, params, opt_state, _ = _trained("adafactor")
    rng = np.random.default_rng(5)
    tokens = rng.integers(1, cfg.vocab_size, (8, 16)).astype(np.int32)
    batch = {"tokens": tokens, "loss_mask": np.ones_like(tokens), "example_id": np.arange(8, dtype=np.int32)}
    vc = vectors.VectorConfig(num_blocks=2, proj_dim=8, correction=True, batch_size=8)
    one = _vectors(cfg, "bfloat16", vc, params, opt_state, batch)
    assert _rel(_vectors(cfg, "", vc, params, opt_state, batch), one) > 1e-3
    for shape in ((8, 1, 1), (2, 4, 1)):
        mesh = sharding.make_mesh(shape, devices=jax.devices()[:8])
        got = _vectors(cfg, "bfloat16", vc, params, opt_state, batch, mesh=mesh)
        assert _rel(got, one) < 1e-5, (shape, _rel(got, one))


def test_the_bf16_exact_path_equals_the_bf16_reference_path(monkeypatch):
    """Adam's V applied exactly under `matmul_dtype="bfloat16"`: the fast path's per-example
    layer gradients (`x_r^T g_r`, one layer at a time, `factored._capture_dense_exact`) against
    the reference path's vmap(grad) through `lowp_matmul` (its weight gradient `x_r^T ct_r`):
    equal but for a few bf16 roundings that fall the other way (the two paths' heads make
    `softmax - onehot` in float32 by different sums), the head's vocabulary whole on both."""
    monkeypatch.setitem(head_lib.HEAD_VOCAB_BLOCK, "cpu", 0)
    jax.clear_caches()  # read at trace time: no step traced under the default may be reused
    cfg, params, opt_state, batch = _trained("adam")
    vc = vectors.VectorConfig(num_blocks=2, proj_dim=8, correction=True, exact_v=True, batch_size=2)
    fast = _vectors(cfg, "bfloat16", vc, params, opt_state, batch)
    ref = _vectors(cfg, "bfloat16", dataclasses.replace(vc, path="reference"), params, opt_state, batch)
    f32 = _vectors(cfg, "", vc, params, opt_state, batch)
    assert _rel(fast, ref) < 1e-3, _rel(fast, ref)  # 1.6e-4 measured; float32 paths: 1.2e-7
    assert _rel(f32, ref) > 10 * _rel(fast, ref)  # the rounding is what both paths share (9.3e-3)
    jax.clear_caches()


def test_a_bad_matmul_dtype_is_refused():
    with pytest.raises(ValueError, match=r"model.matmul_dtype must be one of .*'float16'"):
        model_lib.LMConfig(matmul_dtype="float16")
