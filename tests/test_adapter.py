"""The "any Flax model" adapter (`models/adapter.py`): a linen Transformer LM written in the style of
flax's examples, attributed with fast == reference, with and without correction, on 1 and 8 devices."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import skip_if_not_enough_devices
from flax import nnx

from trackstar_jax.distributed import sharding
from trackstar_jax.features import vectors
from trackstar_jax.models import adapter
from trackstar_jax.models import lm as model_lib
from trackstar_jax.training import step as train

VOCAB, B, T, D, HEADS, LAYERS = 61, 8, 10, 32, 2, 2

pytestmark = pytest.mark.usefixtures("fast_compile")  # conftest.py


class Block(nn.Module):
    """Pre-LN decoder block: causal self-attention (DenseGeneral q/k/v/out) and a GELU MLP (Dense)."""

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(name="ln_attn")(x)
        q, k, v = (nn.DenseGeneral((HEADS, D // HEADS), name=n)(h) for n in ("query", "key", "value"))
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        a = nn.dot_product_attention(q, k, v, mask=mask)
        x = x + nn.DenseGeneral(D, axis=(-2, -1), name="out")(a)
        h = nn.LayerNorm(name="ln_mlp")(x)
        h = nn.Dense(4 * D, name="up")(h)
        return x + nn.Dense(D, name="down")(nn.gelu(h))


class TransformerLM(nn.Module):
    """Token + learned position embeddings, `LAYERS` blocks, final LayerNorm, tied logits."""

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(VOCAB, D, name="token_embed")
        pos = nn.Embed(T, D, name="pos_embed")(jnp.arange(tokens.shape[1])[None])
        x = embed(tokens) + pos
        for i in range(LAYERS):
            x = Block(name=f"blocks_{i}")(x)
        return embed.attend(nn.LayerNorm(name="ln_final")(x))


# Block's submodules are named inside `attn` / `mlp` only by their rule: the rules say what is what.
RULES = [
    (r"blocks_(\d+)/(query|key|value|out)", r"layer_\1/attn/\2"),
    (r"blocks_(\d+)/ln_attn", r"layer_\1/attn_norm"),
    (r"blocks_(\d+)/(up|down)", r"layer_\1/mlp/\2"),
    (r"blocks_(\d+)/ln_mlp", r"layer_\1/mlp_norm"),
    (r"ln_final", "final_norm"),
    (r"(token_embed|pos_embed)", None),
]


def _batch(seed, prompt=2):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCAB, size=(B, T)).astype(np.int32)
    tokens[:, 0] = 1
    mask = np.ones((B, T), np.float32)
    mask[:, : 1 + prompt] = 0
    return {"tokens": tokens, "loss_mask": mask}


@functools.lru_cache(maxsize=None)
def _adapted():
    """The linen LM, adapted, after two Adafactor steps on the canonical parameters (a real V)."""
    lm = TransformerLM()
    variables = lm.init(jax.random.key(0), jnp.ones((1, T), jnp.int32))
    model = adapter.LinenLM(lm, variables["params"], RULES, num_layers=LAYERS)
    graphdef, params = model_lib.split_model(model)
    params = nnx.to_pure_dict(params)
    opt = train.make_optimizer(train.OptimizerConfig(min_dim_size_to_factor=16, warmup_steps=1))
    state = train.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt.init(params))
    step = jax.jit(functools.partial(train.train_step, graphdef=graphdef, opt=opt))
    for s in range(2):
        state, _ = step(state, _batch(10 + s))
    return lm, variables, model, graphdef, state


def test_adapter_logits_equal_the_linen_model_and_paths_are_canonical():
    lm, variables, model, graphdef, _ = _adapted()
    tokens = _batch(0)["tokens"]
    want = lm.apply(variables, tokens)
    _, params = model_lib.split_model(model)
    got = model_lib.apply(graphdef, params, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    paths = model_lib.attributed_paths(params)
    assert "layer_1/attn/query/kernel" in paths and "layer_0/mlp_norm/bias" in paths
    assert "final_norm/scale" in paths and not any("embed" in p for p in paths)
    flat = model_lib.flat_params(params)
    assert flat["layer_0/attn/query/kernel"].shape == (D, D)  # DenseGeneral [D, H, D/H] as a matrix
    assert flat["layer_0/attn/out/kernel"].shape == (D, D)  # [H, D/H, D]
    assert "unattributed/token_embed.embedding" in flat


# ~70 s each on the shared 2-core CPU (4 compiles): the correction case runs in CI, the other is slow.
@pytest.mark.parametrize("correction", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_adapter_fast_equals_reference_on_1_and_8_devices(correction):
    skip_if_not_enough_devices(8)
    _, _, model, graphdef, state = _adapted()
    batch = _batch(3)
    out = {}
    for path in ("fast", "reference"):
        vc = vectors.VectorConfig(num_blocks=2, proj_dim=4, correction=correction, proj_seed=3, path=path)
        for n in (1, 8):
            mesh = sharding.make_mesh(devices=jax.devices()[:n])
            fn = vectors.make_vector_fn(graphdef, model.cfg, vc, state.params, state.opt_state, mesh=mesh)
            with jax.default_matmul_precision("highest"):
                out[path, n] = fn(state.params, fn.precond, batch)
    want = out["reference", 1]
    assert want.shape == (B, 2 * 2 * 4 * 4) and np.abs(want).max() > 0
    for key, got in out.items():
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max(), err_msg=str(key))


def test_adapter_refuses_what_it_cannot_place():
    lm = TransformerLM()
    params = lm.init(jax.random.key(0), jnp.ones((1, T), jnp.int32))["params"]
    with pytest.raises(ValueError, match="blocks_0/down/bias.*matches no adapter rule"):
        adapter.LinenLM(lm, params, [r for r in RULES if "up|down" not in r[0]], num_layers=LAYERS)
    with pytest.raises(ValueError, match="token_embed/embedding.*not one the adapter can tap"):
        adapter.LinenLM(lm, params, [*RULES[:-1], (r"token_embed", "layer_0/attn/embed"), (r"pos_embed", None)], 2)
    with pytest.raises(ValueError, match="two linen parameters map to"):
        adapter.LinenLM(lm, params, [(r"blocks_\d+/(query|key|value|out)", r"layer_0/attn/\1"), *RULES], LAYERS)
