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

import jax
from flax import nnx
from jaxtyping import Array, Float

from trackstar_jax.models import layers, lm

_ACTIVATIONS = {
    "gelu": functools.partial(jax.nn.gelu, approximate=False),  # HF "gelu" is the exact erf form
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),  # HF "gelu_new" / "gelu_pytorch_tanh"
    "relu": jax.nn.relu,
}


class Attention(nnx.Module):
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

    def __call__(self, x: Float[Array, "b t d"], tap: layers.Tap | None = None) -> Float[Array, "b t d"]:
        b, t, _ = x.shape
        shape = (b, t, self.num_heads, self.head_dim)
        q = self.query(x, tap).reshape(shape)
        k = self.key(x, tap).reshape(shape)
        v = self.value(x, tap).reshape(shape)
        q = layers.rope(q, self.rope_base, self.rotary_dim)
        k = layers.rope(k, self.rope_base, self.rotary_dim)
        ctx = layers.causal_attention(q, k, v, self.matmul_dtype).reshape(b, t, self.num_heads * self.head_dim)
        return self.out(ctx, tap)


class MLP(nnx.Module):
    """`down(act(up(x)))` (HF's `dense_h_to_4h` / `dense_4h_to_h`)."""

    def __init__(self, cfg: lm.LMConfig, path: str, *, rngs: nnx.Rngs):
        d, m = cfg.embed_dim, cfg.mlp_dim
        self.up = layers.Linear(d, m, f"{path}/up", cfg, rngs=rngs, bias=cfg.mlp_bias)
        self.down = layers.Linear(m, d, f"{path}/down", cfg, rngs=rngs, bias=cfg.mlp_bias)
        self.activation = cfg.activation

    def __call__(self, x: Float[Array, "b t d"], tap: layers.Tap | None = None) -> Float[Array, "b t d"]:
        return self.down(_ACTIVATIONS[self.activation](self.up(x, tap)), tap)


class DecoderLayer(nnx.Module):
    """GPT-NeoX block, parallel or sequential residual."""

    def __init__(self, cfg: lm.LMConfig, path: str, *, rngs: nnx.Rngs):
        self.attn_norm = layers.Norm(cfg.embed_dim, f"{path}/attn_norm", cfg)
        self.attn = Attention(cfg, f"{path}/attn", rngs=rngs)
        self.mlp_norm = layers.Norm(cfg.embed_dim, f"{path}/mlp_norm", cfg)
        self.mlp = MLP(cfg, f"{path}/mlp", rngs=rngs)
        self.parallel = cfg.parallel_residual

    def __call__(self, x: Float[Array, "b t d"], tap: layers.Tap | None = None) -> Float[Array, "b t d"]:
        a = self.attn(self.attn_norm(x, tap), tap)
        if self.parallel:
            return x + a + self.mlp(self.mlp_norm(x, tap), tap)
        x = x + a
        return x + self.mlp(self.mlp_norm(x, tap), tap)


class Transformer(lm.DecoderLM):
    """The GPT-NeoX LM. `__call__(tokens, tap=None) -> logits [B, T, vocab]` (float32)."""

    ARCH = "gpt_neox"
    DECODER_LAYER = DecoderLayer
    SCALE_TIED_LOGITS = False
