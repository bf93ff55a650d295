"""Model: shapes, causal masking, RoPE / MQA / norms / full forward vs numpy, paper sizes."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import arch_config, covering
from flax import nnx

from trackstar_jax import config as config_lib
from trackstar_jax.distributed import runtime
from trackstar_jax.models import head as head_lib
from trackstar_jax.models import layers, palm
from trackstar_jax.models import lm as model_lib

pytestmark = pytest.mark.usefixtures("fast_compile")  # conftest.py: cheaper compiles, restored on exit

SMALL = model_lib.LMConfig(vocab_size=50, num_layers=2, embed_dim=16, num_heads=2, head_dim=8, mlp_dim=24, max_len=12)


def _np_rope(x, base):
    """Reference RoPE over the last axis: pair (i, i + h/2) rotated by angle p / base^(2i/h)."""
    x = np.asarray(x, np.float64)
    out = np.empty_like(x)
    t, h = x.shape[1], x.shape[-1]
    for p in range(t):
        for i in range(h // 2):
            theta = p / base ** (2 * i / h)
            a, b = x[:, p, ..., i], x[:, p, ..., i + h // 2]
            out[:, p, ..., i] = a * math.cos(theta) - b * math.sin(theta)
            out[:, p, ..., i + h // 2] = b * math.cos(theta) + a * math.sin(theta)
    return out


def _np_norm(x, scale, kind, eps=1e-6):
    x = np.asarray(x, np.float64)
    if kind == "layer":
        x = x - x.mean(-1, keepdims=True)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * scale


def _np_softmax(z):
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def _np_mqa(x, p, h, hd, base):
    """Reference multi-query attention: h query heads, one shared key/value head, causal."""
    b, t, _ = x.shape
    q = (x @ p["query"]["kernel"]).reshape(b, t, h, hd)
    k, v = x @ p["key"]["kernel"], x @ p["value"]["kernel"]
    q, k = _np_rope(q, base), _np_rope(k, base)
    ctx = np.zeros((b, t, h, hd))
    for bi in range(b):
        for hi in range(h):
            s = q[bi, :, hi] @ k[bi].T / math.sqrt(hd)  # [t, t]
            s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
            ctx[bi, :, hi] = _np_softmax(s) @ v[bi]
    return ctx.reshape(b, t, h * hd) @ p["out"]["kernel"]


def _np_forward(cfg, params, tokens):
    """Reference forward of the whole decoder (pre-norm residual blocks, SwiGLU)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x = p["embed"][tokens]
    for i in range(cfg.num_layers):
        lp = p[f"layer_{i}"]
        x = x + _np_mqa(
            _np_norm(x, lp["attn_norm"]["scale"], cfg.norm), lp["attn"], cfg.num_heads, cfg.head_dim, cfg.rope_base
        )
        hn = _np_norm(x, lp["mlp_norm"]["scale"], cfg.norm)
        g = hn @ lp["mlp"]["gate"]["kernel"]
        x = x + (g / (1 + np.exp(-g)) * (hn @ lp["mlp"]["up"]["kernel"])) @ lp["mlp"]["down"]["kernel"]
    x = _np_norm(x, p["final_norm"]["scale"], cfg.norm)
    if cfg.tie_embeddings:
        return x @ p["embed"].T / math.sqrt(cfg.embed_dim)
    return x @ p["unembed"]["kernel"]


_apply = jax.jit(model_lib.apply, static_argnums=0)  # one dispatch per forward (fast tests)


def _random_params(cfg, seed=0):
    """Model params with random (not unit) norm scales, as a pure dict."""
    graphdef, params = model_lib.split_model(model_lib.make_model(cfg, seed))
    params = nnx.to_pure_dict(params)
    key = jax.random.key(seed + 1)
    flat = model_lib.flat_params(params)
    for i, path in enumerate(sorted(flat)):
        if path.endswith("scale"):
            node = params
            *head, last = path.split("/")
            for h in head:
                node = node[h]
            node[last] = 1.0 + 0.3 * jax.random.normal(jax.random.fold_in(key, i), node[last].shape)
    return graphdef, params


@pytest.mark.parametrize("tie,norm", [(True, "rms"), (False, "layer")])
def test_forward_matches_numpy_reference(tie, norm):
    cfg = dataclasses.replace(SMALL, tie_embeddings=tie, norm=norm)
    graphdef, params = _random_params(cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)).astype(np.int32)
    with jax.default_matmul_precision("highest"):
        logits = _apply(graphdef, params, jnp.asarray(tokens))
    assert logits.shape == (2, 9, cfg.vocab_size) and logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits), _np_forward(cfg, params, tokens), rtol=1e-4, atol=1e-4)
    assert ("unembed" in params) == (not tie)


def test_causal_masking():
    graphdef, params = _random_params(SMALL)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, SMALL.vocab_size, (1, 10)).astype(np.int32)
    base = np.asarray(_apply(graphdef, params, jnp.asarray(tokens)))
    for j in (3, 7, 9):
        changed = tokens.copy()
        changed[0, j] = (changed[0, j] + 1) % SMALL.vocab_size
        out = np.asarray(_apply(graphdef, params, jnp.asarray(changed)))
        np.testing.assert_allclose(out[0, :j], base[0, :j], rtol=1e-6, atol=1e-6)  # earlier logits untouched
        assert not np.allclose(out[0, j], base[0, j])  # the changed position itself does change


def test_rope_matches_numpy_and_is_relative():
    x = np.random.default_rng(2).standard_normal((2, 7, 3, 8)).astype(np.float32)
    np.testing.assert_allclose(
        np.asarray(layers.rope(jnp.asarray(x), 10_000.0)), _np_rope(x, 10_000.0), rtol=1e-5, atol=1e-5
    )
    # <rope(q)_m, rope(k)_n> depends only on m - n.
    q = np.tile(np.random.default_rng(3).standard_normal((1, 1, 8)), (1, 7, 1)).astype(np.float32)
    k = np.tile(np.random.default_rng(4).standard_normal((1, 1, 8)), (1, 7, 1)).astype(np.float32)
    rq, rk = np.asarray(layers.rope(jnp.asarray(q), 100.0)), np.asarray(layers.rope(jnp.asarray(k), 100.0))
    dots = np.einsum("md,nd->mn", rq[0], rk[0])
    np.testing.assert_allclose(dots[3, 1], dots[5, 3], rtol=1e-5)
    np.testing.assert_allclose(dots[6, 6], dots[0, 0], rtol=1e-5)


def test_multi_query_attention_matches_numpy():
    cfg = SMALL
    attn = palm.MultiQueryAttention(cfg, "layer_0/attn", rngs=nnx.Rngs(params=0))
    p = nnx.to_pure_dict(nnx.state(attn, nnx.Param))
    assert p["key"]["kernel"].shape == (cfg.embed_dim, cfg.head_dim)  # one shared key head
    assert p["query"]["kernel"].shape == (cfg.embed_dim, cfg.num_heads * cfg.head_dim)
    x = np.random.default_rng(5).standard_normal((2, 6, cfg.embed_dim)).astype(np.float32)
    with jax.default_matmul_precision("highest"):
        y = np.asarray(attn(jnp.asarray(x)))
    ref = _np_mqa(x.astype(np.float64), jax.tree.map(np.asarray, p), cfg.num_heads, cfg.head_dim, cfg.rope_base)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norm_matches_numpy(kind):
    cfg = dataclasses.replace(SMALL, norm=kind)
    norm = model_lib.Norm(cfg.embed_dim, "final_norm", cfg)
    norm.scale[...] = jnp.linspace(0.5, 1.5, cfg.embed_dim)
    x = np.random.default_rng(6).standard_normal((3, cfg.embed_dim)).astype(np.float32) * 3 + 1
    np.testing.assert_allclose(
        np.asarray(norm(jnp.asarray(x))), _np_norm(x, np.linspace(0.5, 1.5, cfg.embed_dim), kind), rtol=1e-5, atol=1e-5
    )


def test_tap_sees_every_attributed_layer_and_identity_tap_is_a_no_op():
    graphdef, params = _random_params(SMALL)
    tokens = jnp.asarray(np.arange(8, dtype=np.int32)[None])
    seen = {}

    def tap(path, x, y):
        seen[path] = (x.shape, y.shape)
        return y

    out = jax.jit(lambda p, t: model_lib.apply(graphdef, p, t, tap=tap))(params, tokens)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(_apply(graphdef, params, tokens)))
    # the embedding is tapped too (x = the token ids), though not attributed
    assert sorted(seen) == sorted(model_lib.attributed_paths(params) + ["embed"])
    assert seen["embed"] == ((1, 8), (1, 8, 16)) and seen["layer_1/mlp/down/kernel"] == ((1, 8, 24), (1, 8, 16))


def test_lm_targets_and_example_losses():
    graphdef, params = _random_params(SMALL)
    tokens = np.random.default_rng(7).integers(4, SMALL.vocab_size, (2, 6)).astype(np.int32)
    mask = np.array([[0, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1]], np.int32)
    losses = jax.jit(lambda p, b: model_lib.example_losses(lambda x: model_lib.apply(graphdef, p, x), b))(
        params, {"tokens": tokens, "loss_mask": mask}
    )
    logits = np.asarray(_apply(graphdef, params, jnp.asarray(tokens[:, :-1])), np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ref = [-sum(logp[b, t - 1, tokens[b, t]] for t in range(1, 6) if mask[b, t]) for b in range(2)]
    np.testing.assert_allclose(np.asarray(losses), ref, rtol=1e-5)


def test_bad_model_config_and_overlong_input():
    with pytest.raises(ValueError, match="model.norm"):
        model_lib.LMConfig(norm="batch")
    with pytest.raises(ValueError, match="head_dim must be even"):
        model_lib.LMConfig(head_dim=7)
    with pytest.raises(ValueError, match="model.num_layers must be positive"):
        model_lib.LMConfig(num_layers=0)
    graphdef, params = _random_params(SMALL)
    with pytest.raises(ValueError, match="exceeds model.max_len=12"):
        model_lib.apply(graphdef, params, jnp.zeros((1, 13), jnp.int32))


@pytest.mark.parametrize("name,target", [("paper_154m", 154e6), ("paper_1b", 1e9), ("paper_8b", 8e9)])
def test_paper_configs_build_abstractly_with_the_paper_sizes(name, target):
    import importlib

    cfg = config_lib.from_configdict(importlib.import_module(f"experiments.{name}").get_config()).model
    _, params = model_lib.abstract_params(cfg)  # jax.eval_shape: nothing is allocated
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
    n = model_lib.param_count(params)
    assert abs(n - target) / target < 0.10, f"{name}: {n:,} parameters vs the paper's {target:,.0f}"
    # Table A.3 shapes: multi-query (one key/value head), SwiGLU (gate/up/down)
    flat = model_lib.flat_params(params)
    assert flat["layer_0/attn/key/kernel"].shape == (cfg.embed_dim, cfg.head_dim)
    assert flat["layer_0/mlp/gate/kernel"].shape == (cfg.embed_dim, cfg.mlp_dim)


def test_abstract_params_are_traced_once_and_each_caller_gets_its_own_tree():
    cfg = dataclasses.replace(SMALL, num_layers=SMALL.num_layers + 1)  # a config no other test traced
    g1, s1 = model_lib.abstract_params(cfg)
    g2, s2 = model_lib.abstract_params(cfg)
    assert model_lib._abstract_params.cache_info().currsize >= 1 and g1 == g2
    assert jax.tree.structure(s1) == jax.tree.structure(s2) and s1 is not s2
    assert all(a == b for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)))
    s1["layer_0"] = None  # a caller editing its tree does not edit the next caller's
    _, s3 = model_lib.abstract_params(cfg)
    assert s3["layer_0"] is not None and model_lib.flat_params(s3) == model_lib.flat_params(s2)


@pytest.mark.parametrize("arch", ["palm", "llama", "gpt_neox"])
def test_remat_gives_the_same_gradients_and_lowers_a_recomputed_forward(arch):
    """`model.remat`: the loss gradient is unchanged, and each layer's forward is lowered a second
    time behind an optimization barrier (what makes XLA on GPU / TPU keep only layer inputs;
    XLA:CPU folds the copy back by CSE, so no CPU memory figure can show the saving)."""
    cfg = SMALL if arch == "palm" else arch_config(arch, vocab_size=SMALL.vocab_size, max_len=12)
    graphdef, params = _random_params(cfg)
    graphdef_r, _ = model_lib.split_model(model_lib.make_model(dataclasses.replace(cfg, remat=True)))
    tokens = jnp.asarray(np.random.default_rng(3).integers(1, cfg.vocab_size, (2, 10)).astype(np.int32))

    def loss(g, p):
        logits = model_lib.apply(g, p, tokens[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

    grads = {}
    for name, g in (("plain", graphdef), ("remat", graphdef_r)):
        fn = jax.jit(jax.grad(functools.partial(loss, g)))
        grads[name] = model_lib.flat_params(fn(params))
        hlo = fn.lower(params).as_text()
        assert hlo.count("optimization_barrier") == (cfg.num_layers if name == "remat" else 0)
    assert sorted(grads["plain"]) == sorted(grads["remat"])
    for path, want in grads["plain"].items():
        scale = float(np.max(np.abs(want)))  # rounding of a re-fused float32 forward, relative to the leaf
        np.testing.assert_allclose(np.asarray(grads["remat"][path]), np.asarray(want), rtol=1e-5, atol=1e-6 * scale)


# Imported architectures (issue 11): llama (GQA, biases) and gpt_neox (LayerNorm + biases,
# partial rotary, parallel residual). Their logits are checked against transformers in
# test_models_hf.py; here: parameter paths, taps and config validation.
ARCH_CONFIGS = {
    "llama": arch_config(
        "llama",
        vocab_size=50,
        embed_dim=16,
        mlp_dim=24,
        max_len=12,
        head_dim=4,
        qkv_bias=True,
        out_bias=True,
        mlp_bias=True,
        tie_embeddings=False,
    ),
    "gpt_neox": arch_config(
        "gpt_neox",
        vocab_size=50,
        embed_dim=16,
        mlp_dim=24,
        max_len=12,
        head_dim=8,
        parallel_residual=True,
        tie_embeddings=False,
    ),
}


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_tap_sees_every_parameter_of_the_imported_architectures(arch):
    cfg = ARCH_CONFIGS[arch]
    graphdef, params = model_lib.split_model(model_lib.make_model(cfg, seed=0))
    tokens = jnp.asarray(np.arange(8, dtype=np.int32)[None])
    seen = {}

    def tap(path, x, y):
        seen[path] = None if x is None else x.shape
        return y

    out = jax.jit(lambda p, t: model_lib.apply(graphdef, p, t, tap=tap))(params, tokens)
    assert out.shape == (1, 8, cfg.vocab_size)
    key_biases = [f"layer_{i}/attn/key/bias" for i in range(cfg.num_layers)]  # tapped, never attributed
    assert sorted(seen) == sorted(model_lib.attributed_paths(params, unembed=True) + key_biases + ["embed"])
    assert "unembed/kernel" not in model_lib.attributed_paths(params)  # only with vectors.unembed
    assert seen["layer_0/attn/query/bias"] is None and seen["layer_1/mlp/down/bias"] is None  # a bias multiplies 1
    flat = model_lib.flat_params(params)
    assert flat["layer_0/attn/key/kernel"].shape == (cfg.embed_dim, cfg.kv_heads * cfg.head_dim)
    if arch == "gpt_neox":
        assert "layer_0/attn_norm/bias" in seen and "final_norm/bias" in seen and "layer_0/mlp/gate/kernel" not in flat


def test_rope_partial_rotary_leaves_the_tail_alone():
    x = np.random.default_rng(8).standard_normal((2, 7, 3, 8)).astype(np.float32)
    got = np.asarray(layers.rope(jnp.asarray(x), 100.0, rotary_dim=4))
    np.testing.assert_allclose(got[..., :4], _np_rope(x[..., :4], 100.0), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[..., 4:], x[..., 4:])


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(arch="bert"), "model.arch"),
        (dict(arch="llama", num_heads=4, num_kv_heads=3), "model.num_kv_heads"),
        (dict(arch="llama", norm="layer"), "model.norm"),
        (dict(arch="palm", qkv_bias=True), "model.qkv_bias"),
        (dict(arch="palm", num_kv_heads=2, num_heads=4), "model.num_kv_heads"),
        (dict(arch="gpt_neox", norm="rms"), "model.norm"),
        (dict(arch="gpt_neox", norm="layer", activation="silu"), "model.activation"),
        (dict(arch="gpt_neox", norm="layer", head_dim=8, rotary_pct=0.25 * 1.5), "model.rotary_pct"),
        (dict(norm_bias=True), "model.norm_bias"),
        (dict(activation="swish"), "model.activation"),
    ],
)
def test_bad_architecture_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        model_lib.LMConfig(**kwargs)


@pytest.mark.parametrize(
    "dtype,chunk_tokens,chunk_rows", covering(["float32", "bfloat16"], [1, 7, 64, 10_000], [1, 4, 16])
)
def test_fused_head_equals_the_logits_path_with_its_gradients(dtype, chunk_tokens, chunk_rows):
    """`head.head_nll_sum` (chunked, gradients made in the forward pass) against the naive
    `[B, T, V]` logits + log-softmax path in float64 numpy: value, d/dx and d/dW, for chunk
    sizes that pad the time axis, split it unevenly or take it whole, and chunks whose 3
    examples are cut along time into 1, 2 or 6 row groups (`chunk_rows`; the chunk padded to a
    multiple of the groups); `weight_grad=False` gives the same value and d/dx and no d/dW,
    with the vocabulary whole or in blocks (online softmax) that divide it or pad it."""
    rng = np.random.default_rng(3)
    b, t, d, v = 3, 11, 8, 37
    x = jnp.asarray(rng.standard_normal((b, t, d)), dtype)
    w = jnp.asarray(rng.standard_normal((d, v)), dtype)
    y = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    wt = jnp.asarray(rng.random((b, t)) * (rng.random((b, t)) > 0.3), jnp.float32)

    x64, w64, wt64 = (np.asarray(a, np.float64) for a in (x, w, wt))
    logits = x64 @ w64
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    nll = -np.log(np.take_along_axis(p, np.asarray(y)[..., None], -1)[..., 0])
    dlogits = wt64[..., None] * (p - np.eye(v)[np.asarray(y)])
    ref = {"loss": (wt64 * nll).sum(), "dx": dlogits @ w64.T, "dw": np.einsum("btd,btv->dv", x64, dlogits)}

    tol = dict(rtol=2e-2, atol=2e-2) if dtype == "bfloat16" else dict(rtol=1e-5, atol=1e-5)
    f = functools.partial(
        head_lib.head_nll_sum, targets=y, weights=wt, chunk_tokens=chunk_tokens, chunk_rows=chunk_rows
    )
    loss, (dx, dw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, w)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    np.testing.assert_allclose(float(loss), ref["loss"], **tol)
    np.testing.assert_allclose(np.asarray(dx, np.float64), ref["dx"], **tol)
    np.testing.assert_allclose(np.asarray(dw, np.float64), ref["dw"], **tol)
    np.testing.assert_allclose(float(jax.jit(f)(x, w)), ref["loss"], **tol)  # the undifferentiated primal
    # input-only: unblocked, and the vocabulary in blocks of 5 (8 blocks, the last padded), 8
    # (5 blocks), 37 (one) and 100 (one, wider than the vocabulary)
    for vocab_block in (0, 5, 8, 37, 100):
        fx = functools.partial(f, weight_grad=False, vocab_block=vocab_block)
        loss_x, dx_only = jax.jit(jax.value_and_grad(fx))(x, w)
        assert dx_only.dtype == x.dtype
        np.testing.assert_allclose(float(loss_x), ref["loss"], **tol)
        np.testing.assert_allclose(np.asarray(dx_only, np.float64), ref["dx"], **tol)


def test_blocked_head_slices_w_in_place():
    """The input-only head in vocabulary blocks keeps no copy of `W` (an earlier form padded and
    transposed it: two `W`-sized temporaries) and fewer temporaries than the unblocked chunk's
    `[rows, vocab]` logits: compiled temporary bytes, a 256 x 50,000 float32 `W` (51 MB) whose
    vocabulary 2,048-column blocks do not divide."""
    b, t, d, v = 2, 16, 256, 50_000
    args = (
        jax.ShapeDtypeStruct((b, t, d), jnp.float32),
        jax.ShapeDtypeStruct((d, v), jnp.float32),
        jax.ShapeDtypeStruct((b, t), jnp.int32),
        jax.ShapeDtypeStruct((b, t), jnp.float32),
    )

    def temp_bytes(vocab_block):
        def f(x, w, y, wt):
            return head_lib.head_nll_sum(x, w, y, wt, weight_grad=False, vocab_block=vocab_block)

        return jax.jit(jax.value_and_grad(f)).lower(*args).compile().memory_analysis().temp_size_in_bytes

    blocked, whole = temp_bytes(2048), temp_bytes(0)
    assert blocked < d * v * 4 / 8, blocked  # not even an eighth of W
    assert blocked < whole, (blocked, whole)


@pytest.mark.parametrize(
    "width,want", [(None, 128), (8, 128), (128, 128), (129, 256), (384, 512), (512, 512), (4096, 4096)]
)
def test_head_chunk_on_the_cpu_is_at_least_128_tokens_and_the_width_rounded_to_a_power_of_two(width, want, monkeypatch):
    """The CPU default chunk (`head.head_chunk_tokens`): 128 tokens, or more for a wider head
    (its GEMMs repack the `[width, vocab]` matrix per chunk); accelerators keep their own."""
    assert jax.default_backend() == "cpu"
    monkeypatch.delenv(runtime.TARGET_ENV, raising=False)
    assert head_lib.head_chunk_tokens(width) == want
    monkeypatch.setenv(runtime.TARGET_ENV, "tpu")
    assert head_lib.head_chunk_tokens(width) == head_lib.HEAD_CHUNK_TOKENS_ACCELERATOR


@pytest.mark.parametrize("arch,tie", [("palm", True), ("llama", True), ("gpt_neox", False)])
def test_nll_sum_equals_example_losses_and_its_gradients(arch, tie):
    """`lm.nll_sum` (fused head; palm's tied head scaled by 1/sqrt(d), gpt_neox untied) equals
    the summed `example_losses` over the logits, and so do their parameter gradients."""
    cfg = SMALL if arch == "palm" else arch_config(arch, tie_embeddings=tie)
    graphdef, params = _random_params(cfg)
    tokens = np.random.default_rng(5).integers(4, cfg.vocab_size, (2, 9)).astype(np.int32)
    mask = (np.random.default_rng(6).random((2, 9)) > 0.2).astype(np.int32)
    batch = {"tokens": tokens, "loss_mask": mask}

    def naive(p):
        return jnp.sum(model_lib.example_losses(lambda x: model_lib.apply(graphdef, p, x), batch))

    def fused(p):
        return model_lib.nll_sum(graphdef, p, *model_lib.lm_targets(batch))

    (a, ga), (b, gb) = (jax.jit(jax.value_and_grad(fn))(params) for fn in (naive, fused))
    np.testing.assert_allclose(float(b), float(a), rtol=1e-5)
    flat_a, flat_b = model_lib.flat_params(ga), model_lib.flat_params(gb)
    assert flat_a.keys() == flat_b.keys()
    for path in flat_a:
        ref = np.asarray(flat_a[path])
        np.testing.assert_allclose(np.asarray(flat_b[path]), ref, rtol=1e-4, atol=1e-5 * max(np.abs(ref).max(), 1e-3))
