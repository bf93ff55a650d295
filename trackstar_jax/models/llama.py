"""Llama-family decoder (Llama 2/3 without rope scaling, Mistral, Qwen2, SmolLM2) in Flax NNX.

Matches Hugging Face's `LlamaForCausalLM` / `MistralForCausalLM` / `Qwen2ForCausalLM`
(checked against transformers' logits in tests/test_models_hf.py): pre-norm residual blocks,
RMSNorm (`model.norm_eps`), RoPE in HF's rotate-half layout (`model.rope_base`), grouped-query
attention with `model.num_kv_heads` key/value heads (MHA, GQA and MQA alike), SwiGLU MLP,
optional q/k/v biases (`model.qkv_bias`, Qwen2), output-projection and MLP biases
(`model.out_bias`, `model.mlp_bias`, Llama's `attention_bias` / `mlp_bias`), and a tied or
untied output embedding (tied: `logits = x @ embed^T`, unscaled, as HF does).

Parameter paths follow the family's convention (`lm.py`): `layer_i/attn/{query,key,value,out}`,
`layer_i/mlp/{gate,up,down}`, `layer_i/{attn,mlp}_norm/scale`, `final_norm/scale`,
`unembed/kernel`, `embed`.
"""

from __future__ import annotations

import jax
from flax import nnx
from jaxtyping import Array, Float

from trackstar_jax.models import layers, lm


class Attention(nnx.Module):
    """Causal grouped-query attention: `num_heads` query heads over `kv_heads` key/value heads."""

    def __init__(self, cfg: lm.LMConfig, path: str, *, rngs: nnx.Rngs):
        d, h, g, hd = cfg.embed_dim, cfg.num_heads, cfg.kv_heads, cfg.head_dim
        self.query = layers.Linear(d, h * hd, f"{path}/query", cfg, rngs=rngs, bias=cfg.qkv_bias)
        self.key = layers.Linear(d, g * hd, f"{path}/key", cfg, rngs=rngs, bias=cfg.qkv_bias)
        self.value = layers.Linear(d, g * hd, f"{path}/value", cfg, rngs=rngs, bias=cfg.qkv_bias)
        self.out = layers.Linear(h * hd, d, f"{path}/out", cfg, rngs=rngs, bias=cfg.out_bias)
        self.num_heads, self.kv_heads, self.head_dim, self.rope_base = h, g, hd, cfg.rope_base
        self.matmul_dtype = cfg.matmul_dtype or None

    def __call__(self, x: Float[Array, "b t d"], tap: layers.Tap | None = None) -> Float[Array, "b t d"]:
        b, t, _ = x.shape
        q = self.query(x, tap).reshape(b, t, self.num_heads, self.head_dim)
        k = self.key(x, tap).reshape(b, t, self.kv_heads, self.head_dim)
        v = self.value(x, tap).reshape(b, t, self.kv_heads, self.head_dim)
        q, k = layers.rope(q, self.rope_base), layers.rope(k, self.rope_base)
        ctx = layers.causal_attention(q, k, v, self.matmul_dtype).reshape(b, t, self.num_heads * self.head_dim)
        return self.out(ctx, tap)


class SwiGLU(nnx.Module):
    """SwiGLU MLP `down(silu(gate(x)) * up(x))`, optional biases (Llama's `mlp_bias`)."""

    def __init__(self, cfg: lm.LMConfig, path: str, *, rngs: nnx.Rngs):
        d, m, bias = cfg.embed_dim, cfg.mlp_dim, cfg.mlp_bias
        self.gate = layers.Linear(d, m, f"{path}/gate", cfg, rngs=rngs, bias=bias)
        self.up = layers.Linear(d, m, f"{path}/up", cfg, rngs=rngs, bias=bias)
        self.down = layers.Linear(m, d, f"{path}/down", cfg, rngs=rngs, bias=bias)

    def __call__(self, x: Float[Array, "b t d"], tap: layers.Tap | None = None) -> Float[Array, "b t d"]:
        return self.down(jax.nn.silu(self.gate(x, tap)) * self.up(x, tap), tap)


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: `x + attn(norm(x))`, then `x + mlp(norm(x))`."""

    def __init__(self, cfg: lm.LMConfig, path: str, *, rngs: nnx.Rngs):
        self.attn_norm = layers.Norm(cfg.embed_dim, f"{path}/attn_norm", cfg)
        self.attn = Attention(cfg, f"{path}/attn", rngs=rngs)
        self.mlp_norm = layers.Norm(cfg.embed_dim, f"{path}/mlp_norm", cfg)
        self.mlp = SwiGLU(cfg, f"{path}/mlp", rngs=rngs)

    def __call__(self, x: Float[Array, "b t d"], tap: layers.Tap | None = None) -> Float[Array, "b t d"]:
        x = x + self.attn(self.attn_norm(x, tap), tap)
        return x + self.mlp(self.mlp_norm(x, tap), tap)


class Transformer(lm.DecoderLM):
    """The Llama-family LM. `__call__(tokens, tap=None) -> logits [B, T, vocab]` (float32)."""

    ARCH = "llama"
    DECODER_LAYER = DecoderLayer
    SCALE_TIED_LOGITS = False
