"""GPT-NeoX / Pythia decoder in Flax NNX.

Matches Hugging Face's `GPTNeoXForCausalLM` (checked against transformers' logits in
tests/test_models_hf.py): LayerNorm with bias (`model.norm_eps`), biases on every linear
layer (`model.qkv_bias` / `model.out_bias` for attention, HF's `attention_bias`;
`model.mlp_bias`), multi-head attention with partial rotary embeddings (the first
`int(head_dim * model.rotary_pct)` features of each head, HF's rotate-half layout), a GELU
MLP (`model.activation`), parallel (`x + attn(ln1(x)) + mlp(ln2(x))`) or sequential residual
(`model.parallel_residual`), and an untied `embed_out` (`unembed/kernel`) unless tied.

HF stores the query/key/value projection fused and interleaved per head
(`query_key_value`, rows `[head, (q|k|v), head_dim]`); we keep three separate `query`,
`key`, `value` layers (split by `hf.py`), so every architecture has the same paths:
`layer_i/attn/{query,key,value,out}`, `layer_i/mlp/{up,down}`,
`layer_i/{attn,mlp}_norm/{scale,bias}`, `final_norm/{scale,bias}`, `unembed/kernel`, `embed`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import jax
import numpy as np
from flax import nnx
from jaxtyping import Array, Float

from trackstar_jax.models import hf, layers, lm

_ACTIVATIONS = {
    "gelu": functools.partial(jax.nn.gelu, approximate=False),  # HF "gelu" is the exact erf form
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),  # HF "gelu_new" / "gelu_pytorch_tanh"
    "relu": jax.nn.relu,
}


class Attention(layers.RotaryAttention):
    """Causal multi-head attention with partial rotary embeddings."""

    def __init__(self, cfg: lm.LMConfig, path: str, *, rngs: nnx.Rngs):
        d, h, hd = cfg.embed_dim, cfg.num_heads, cfg.head_dim
        self.query = layers.Linear(d, h * hd, f"{path}/query", cfg, rngs=rngs, bias=cfg.qkv_bias)
        self.key = layers.Linear(d, h * hd, f"{path}/key", cfg, rngs=rngs, bias=cfg.qkv_bias)
        self.value = layers.Linear(d, h * hd, f"{path}/value", cfg, rngs=rngs, bias=cfg.qkv_bias)
        self.out = layers.Linear(h * hd, d, f"{path}/out", cfg, rngs=rngs, bias=cfg.out_bias)
        self.num_heads, self.head_dim = h, hd
        self.rope_base, self.rotary_dim = cfg.rope_base, cfg.rotary_dim
        self.matmul_dtype = cfg.matmul_dtype or None

    def qkv(self, x: Float[Array, "b t d"], tap: layers.Tap | None) -> tuple[Array, Array, Array]:
        b, t, _ = x.shape
        shape = (b, t, self.num_heads, self.head_dim)
        return self.query(x, tap).reshape(shape), self.key(x, tap).reshape(shape), self.value(x, tap).reshape(shape)


class MLP(nnx.Module):
    """`down(act(up(x)))` (HF's `dense_h_to_4h` / `dense_4h_to_h`)."""

    def __init__(self, cfg: lm.LMConfig, path: str, *, rngs: nnx.Rngs):
        d, m = cfg.embed_dim, cfg.mlp_dim
        self.up = layers.Linear(d, m, f"{path}/up", cfg, rngs=rngs, bias=cfg.mlp_bias)
        self.down = layers.Linear(m, d, f"{path}/down", cfg, rngs=rngs, bias=cfg.mlp_bias)
        self.activation = cfg.activation

    def __call__(self, x: Float[Array, "b t d"], tap: layers.Tap | None = None) -> Float[Array, "b t d"]:
        return self.down(_ACTIVATIONS[self.activation](self.up(x, tap)), tap)


class DecoderLayer(layers.ResidualBlock):
    """GPT-NeoX block, parallel or sequential residual."""

    def __init__(self, cfg: lm.LMConfig, path: str, *, rngs: nnx.Rngs):
        self.attn_norm = layers.Norm(cfg.embed_dim, f"{path}/attn_norm", cfg)
        self.attn = Attention(cfg, f"{path}/attn", rngs=rngs)
        self.mlp_norm = layers.Norm(cfg.embed_dim, f"{path}/mlp_norm", cfg)
        self.mlp = MLP(cfg, f"{path}/mlp", rngs=rngs)
        self.parallel = cfg.parallel_residual


class Transformer(lm.DecoderLM):
    """The GPT-NeoX LM. `__call__(tokens, tap=None) -> logits [B, T, vocab]` (float32)."""

    ARCH = "gpt_neox"
    DECODER_LAYER = DecoderLayer
    SCALE_TIED_LOGITS = False


# ---------------------------------------------------------------------------------------
# Registration: Hugging Face `gpt_neox` (Pythia)
# ---------------------------------------------------------------------------------------

# HF hidden_act -> our activation
_HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


def _from_hf(hf_cfg: Mapping[str, Any], *, dtype: str, param_dtype: str, max_len: int | None) -> lm.LMConfig:
    """A GPT-NeoX `config.json` -> `LMConfig` (see `models.hf.config_from_hf`)."""
    theta, pct = hf.rope(hf_cfg, default_pct=0.25)  # GPTNeoXConfig's default rotary_pct
    common = hf.common_fields(hf_cfg, theta=theta, dtype=dtype, param_dtype=param_dtype, max_len=max_len)
    act = hf_cfg.get("hidden_act", "gelu")
    if act not in _HF_ACTIVATIONS:
        raise ValueError(
            f"config.json hidden_act {act!r} is not supported for gpt_neox (supported: {', '.join(_HF_ACTIVATIONS)})"
        )
    attn_bias = bool(hf_cfg.get("attention_bias", True))
    return lm.LMConfig(
        arch="gpt_neox",
        norm="layer",
        norm_bias=True,
        norm_eps=float(hf_cfg.get("layer_norm_eps", 1e-5)),
        rotary_pct=pct,
        qkv_bias=attn_bias,
        out_bias=attn_bias,
        mlp_bias=True,
        parallel_residual=bool(hf_cfg.get("use_parallel_residual", True)),
        activation=_HF_ACTIVATIONS[act],
        **common,
    )


def _to_hf(cfg: lm.LMConfig) -> dict[str, Any]:
    """`cfg` as a GPT-NeoX `config.json` (norm, MLP and attention biases are HF's fixed layout:
    `hf.to_hf_config` refuses a model without them; head_dim is `hidden_size / heads` there)."""
    act = next(k for k, v in _HF_ACTIVATIONS.items() if v == cfg.activation)
    return {
        "model_type": "gpt_neox",
        "architectures": ["GPTNeoXForCausalLM"],
        **hf.common_to_hf(cfg),
        "rotary_pct": cfg.rotary_pct,
        "layer_norm_eps": cfg.norm_eps,
        "use_parallel_residual": cfg.parallel_residual,
        "hidden_act": act,
        "attention_bias": cfg.qkv_bias,
    }


def _qkv(path: str, h: int, hd: int, what: str) -> Callable[[np.ndarray], dict[str, np.ndarray]]:
    """Splits HF's fused `query_key_value` (rows ordered `[head, q|k|v, head_dim]`) into
    our `query`, `key`, `value` (kernels `[in, h * hd]`, biases `[h * hd]`)."""

    def convert(w):
        parts = w.reshape((h, 3, hd) + w.shape[1:])
        out = {}
        for j, name in enumerate(("query", "key", "value")):
            x = parts[:, j].reshape((h * hd,) + w.shape[1:])
            out[f"{path}/{name}/{what}"] = x.T if what == "kernel" else x
        return out

    return convert


def _hf_tensors(cfg: lm.LMConfig) -> list[hf.Tensor]:
    d, h, hd, m = cfg.embed_dim, cfg.num_heads, cfg.head_dim, cfg.mlp_dim

    def norm(hf_name: str, path: str) -> list[hf.Tensor]:  # HF's always has a bias; ours when `norm_bias`
        out = [hf.Tensor(f"{hf_name}.weight", (d,), hf.same(f"{path}/scale"))]
        return out + [hf.Tensor(f"{hf_name}.bias", (d,), hf.same(f"{path}/bias"))] if cfg.norm_bias else out

    spec = [hf.Tensor("gpt_neox.embed_in.weight", (cfg.vocab_size, d), hf.same("embed"))]
    spec += norm("gpt_neox.final_layer_norm", "final_norm")
    for i in range(cfg.num_layers):
        pre, ours = f"gpt_neox.layers.{i}", f"layer_{i}"
        qkv = f"{pre}.attention.query_key_value"
        spec.append(hf.Tensor(f"{qkv}.weight", (3 * h * hd, d), _qkv(f"{ours}/attn", h, hd, "kernel")))
        if cfg.qkv_bias:
            spec.append(hf.Tensor(f"{qkv}.bias", (3 * h * hd,), _qkv(f"{ours}/attn", h, hd, "bias")))
        spec += hf.linear(f"{pre}.attention.dense", f"{ours}/attn/out", h * hd, d, cfg.out_bias)
        spec += hf.linear(f"{pre}.mlp.dense_h_to_4h", f"{ours}/mlp/up", d, m, cfg.mlp_bias)
        spec += hf.linear(f"{pre}.mlp.dense_4h_to_h", f"{ours}/mlp/down", m, d, cfg.mlp_bias)
        spec += norm(f"{pre}.input_layernorm", f"{ours}/attn_norm")
        spec += norm(f"{pre}.post_attention_layernorm", f"{ours}/mlp_norm")
    return spec


lm.register(
    lm.Architecture(
        name="gpt_neox",
        model=Transformer,
        fixed=lambda cfg: {
            "norm": ("layer",),
            "num_kv_heads": (None, cfg.num_heads),
            "activation": ("gelu", "gelu_tanh", "relu"),
        },
        hf_model_types=("gpt_neox",),
        from_hf=_from_hf,
        hf_tensors=_hf_tensors,
        to_hf=_to_hf,
        hf_output_names=("embed_out.weight", "lm_head.weight"),  # `embed_out` before transformers 5
    )
)
