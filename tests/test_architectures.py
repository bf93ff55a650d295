"""The architecture registry (`models.lm.register`): one module per architecture, nothing else to touch."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trackstar_jax import config as config_lib
from trackstar_jax.models import gguf, hf, llama, lm

pytestmark = pytest.mark.usefixtures("fast_compile")

SMALL = dict(vocab_size=64, num_layers=2, embed_dim=16, num_heads=2, head_dim=8, mlp_dim=32, max_len=16)


def _small_config(arch: lm.Architecture, **kw) -> lm.LMConfig:
    """A small config of `arch`: each field it fixes takes its first allowed value."""
    fixed = arch.fixed(lm.LMConfig(**SMALL, **kw))  # palm's rules are the loosest default to ask
    values = {f: allowed[0] for f, allowed in fixed.items()}
    return lm.LMConfig(arch=arch.name, **SMALL, **{**values, **kw})


def test_unknown_architecture_is_refused_by_name():
    with pytest.raises(ValueError, match=r"model.arch='mamba' is not a registered architecture \(known: .*llama"):
        lm.LMConfig(arch="mamba")
    with pytest.raises(config_lib.ConfigError, match="config.model.arch='mamba'.*known: .*gpt_neox"):
        config_lib.section("model", {"arch": "mamba"})
    with pytest.raises(ValueError, match="model_type 'mamba' is not supported.*mistral"):
        hf.config_from_hf({"model_type": "mamba"})
    with pytest.raises(ValueError, match="GGUF architecture 'mamba' in f.gguf is not supported"):
        gguf.hf_config_from_metadata({"general.architecture": "mamba"}, path="f.gguf")


def test_constraints_come_from_the_architecture():
    """A field an architecture does not implement is refused (before, any new arch got GPT-NeoX's rules)."""
    with pytest.raises(ValueError, match="model.norm='layer' is not supported by model.arch='llama'"):
        lm.LMConfig(arch="llama", norm="layer")
    with pytest.raises(ValueError, match="model.num_kv_heads=2 is not supported by model.arch='palm'"):
        lm.LMConfig(arch="palm", num_heads=4, num_kv_heads=2)
    assert lm.LMConfig(arch="palm").kv_heads == 1 and lm.LMConfig(arch="llama", num_heads=4).kv_heads == 4


@pytest.mark.parametrize("name", sorted(lm.ARCHITECTURES))
def test_every_registered_architecture_round_trips(name):
    """config -> config.json -> config; the model builds with the abstract shapes; HF tensors
    (random, at the architecture's names) land on every parameter exactly once."""
    arch = lm.architecture(name)
    cfg = _small_config(arch)
    assert config_lib.section("model", config_lib.to_dict(cfg)) == cfg
    graphdef, params = lm.split_model(lm.make_model(cfg, seed=0))
    _, abstract = lm.abstract_params(cfg)
    shapes = lambda t: {p: tuple(x.shape) for p, x in lm.flat_params(t).items()}  # noqa: E731
    assert shapes(params) == shapes(abstract)
    tokens = jnp.asarray([[1, 5, 2, 7]], jnp.int32)
    logits = lm.apply(graphdef, params, tokens)
    assert logits.shape == (1, 4, cfg.vocab_size)
    # greedy generation's cached path (`DecoderLM.decode`) is the same model
    model = nnx.merge(graphdef, params)
    h, _ = model.decode(tokens, model.init_cache(1, 4), jnp.zeros(1, jnp.int32))
    np.testing.assert_allclose(model.logits(h), logits, rtol=1e-5, atol=1e-5)
    if arch.hf_tensors is None:
        return
    rng = np.random.default_rng(0)
    tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in hf.expected_tensor_shapes(cfg).items()}
    ours = hf.params_from_state_dict(cfg, tensors)
    # The conversions only move entries (transpose, split, reshape): none is lost or repeated.
    total = lambda xs: sum(float(np.sum(np.square(x, dtype=np.float64))) for x in xs)  # noqa: E731
    assert total(lm.flat_params(ours).values()) == pytest.approx(total(tensors.values()), rel=1e-12)


class _FakeTransformer(llama.Transformer):
    ARCH = "fake"


def _fake_from_hf(hf_cfg, *, dtype, param_dtype, max_len):
    theta, _ = hf.rope(hf_cfg)
    common = hf.common_fields(hf_cfg, theta=theta, dtype=dtype, param_dtype=param_dtype, max_len=max_len)
    return lm.LMConfig(arch="fake", num_kv_heads=int(hf_cfg["num_key_value_heads"]), **common)


@pytest.fixture
def fake_arch():
    """A Llama-shaped architecture registered from this file alone (HF model_type "fake_llama",
    GGUF architecture "fakellama")."""
    base = lm.architecture("llama")
    gnames = dataclasses.replace(
        base.gguf,
        architecture="fakellama",
        hf_config=lambda meta, names, path: {
            **base.gguf.hf_config({k.replace("fakellama.", "llama."): v for k, v in meta.items()}, names, path),
            "model_type": "fake_llama",
        },
    )
    arch = lm.register(
        dataclasses.replace(
            base,
            name="fake",
            model=_FakeTransformer,
            hf_model_types=("fake_llama",),
            from_hf=_fake_from_hf,
            gguf=gnames,
        )
    )
    yield arch
    del lm.ARCHITECTURES["fake"]


def test_a_registered_architecture_is_picked_up_by_hf_and_gguf(fake_arch):
    hf_cfg = {
        "model_type": "fake_llama",
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_hidden_layers": 2,
        "vocab_size": 64,
        "max_position_embeddings": 16,
        "tie_word_embeddings": True,
    }
    cfg = hf.config_from_hf(hf_cfg)
    assert cfg.arch == "fake" and cfg.kv_heads == 1
    tensors = {n: np.zeros(s, np.float32) for n, s in hf.expected_tensor_shapes(cfg).items()}
    cfg2, params = hf.from_hf_state_dict(hf_cfg, tensors)
    assert cfg2 == cfg and type(lm.make_model(cfg)) is _FakeTransformer
    assert set(lm.flat_params(params)) == set(lm.flat_params(lm.abstract_params(cfg)[1]))
    meta = {
        "general.architecture": "fakellama",
        "fakellama.embedding_length": 16,
        "fakellama.attention.head_count": 2,
        "fakellama.block_count": 2,
        "fakellama.feed_forward_length": 32,
        "fakellama.attention.layer_norm_rms_epsilon": 1e-5,
        "fakellama.context_length": 16,
        "fakellama.vocab_size": 64,
    }
    assert gguf.hf_config_from_metadata(meta, {"token_embd.weight"})["model_type"] == "fake_llama"
    assert gguf.hf_name("blk.1.attn_q.weight", 2, fake_arch.gguf) == "model.layers.1.self_attn.q_proj.weight"
    assert "fake_llama" in hf.supported_model_types() and "fakellama" in gguf.supported_architectures()


def test_a_name_registered_twice_is_refused(fake_arch):
    with pytest.raises(ValueError, match="'fake' is already registered"):
        lm.register(dataclasses.replace(fake_arch, model=llama.Transformer))
    with pytest.raises(ValueError, match=r"\['llama'\] already belong to 'llama'"):
        lm.register(dataclasses.replace(fake_arch, name="other", hf_model_types=("llama",), gguf=None))
