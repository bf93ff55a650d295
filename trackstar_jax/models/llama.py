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

from typing import Any, Mapping

import jax
from flax import nnx
from jaxtyping import Array, Float

from trackstar_jax.models import gguf, hf, layers, lm


class Attention(layers.RotaryAttention):
    """Causal grouped-query attention: `num_heads` query heads over `kv_heads` key/value heads."""

    def __init__(self, cfg: lm.LMConfig, path: str, *, rngs: nnx.Rngs):
        d, h, g, hd = cfg.embed_dim, cfg.num_heads, cfg.kv_heads, cfg.head_dim
        self.query = layers.Linear(d, h * hd, f"{path}/query", cfg, rngs=rngs, bias=cfg.qkv_bias)
        self.key = layers.Linear(d, g * hd, f"{path}/key", cfg, rngs=rngs, bias=cfg.qkv_bias)
        self.value = layers.Linear(d, g * hd, f"{path}/value", cfg, rngs=rngs, bias=cfg.qkv_bias)
        self.out = layers.Linear(h * hd, d, f"{path}/out", cfg, rngs=rngs, bias=cfg.out_bias)
        self.num_heads, self.kv_heads, self.head_dim, self.rope_base = h, g, hd, cfg.rope_base
        self.matmul_dtype = cfg.matmul_dtype or None

    def qkv(self, x: Float[Array, "b t d"], tap: layers.Tap | None) -> tuple[Array, Array, Array]:
        b, t, _ = x.shape
        q = self.query(x, tap).reshape(b, t, self.num_heads, self.head_dim)
        k = self.key(x, tap).reshape(b, t, self.kv_heads, self.head_dim)
        v = self.value(x, tap).reshape(b, t, self.kv_heads, self.head_dim)
        return q, k, v


class SwiGLU(nnx.Module):
    """SwiGLU MLP `down(silu(gate(x)) * up(x))`, optional biases (Llama's `mlp_bias`)."""

    def __init__(self, cfg: lm.LMConfig, path: str, *, rngs: nnx.Rngs):
        d, m, bias = cfg.embed_dim, cfg.mlp_dim, cfg.mlp_bias
        self.gate = layers.Linear(d, m, f"{path}/gate", cfg, rngs=rngs, bias=bias)
        self.up = layers.Linear(d, m, f"{path}/up", cfg, rngs=rngs, bias=bias)
        self.down = layers.Linear(m, d, f"{path}/down", cfg, rngs=rngs, bias=bias)

    def __call__(self, x: Float[Array, "b t d"], tap: layers.Tap | None = None) -> Float[Array, "b t d"]:
        return self.down(jax.nn.silu(self.gate(x, tap)) * self.up(x, tap), tap)


class DecoderLayer(layers.ResidualBlock):
    """Pre-norm residual block: `x + attn(norm(x))`, then `x + mlp(norm(x))`."""

    def __init__(self, cfg: lm.LMConfig, path: str, *, rngs: nnx.Rngs):
        self.attn_norm = layers.Norm(cfg.embed_dim, f"{path}/attn_norm", cfg)
        self.attn = Attention(cfg, f"{path}/attn", rngs=rngs)
        self.mlp_norm = layers.Norm(cfg.embed_dim, f"{path}/mlp_norm", cfg)
        self.mlp = SwiGLU(cfg, f"{path}/mlp", rngs=rngs)


class Transformer(lm.DecoderLM):
    """The Llama-family LM. `__call__(tokens, tap=None) -> logits [B, T, vocab]` (float32)."""

    ARCH = "llama"
    DECODER_LAYER = DecoderLayer
    SCALE_TIED_LOGITS = False


# ---------------------------------------------------------------------------------------
# Registration: Hugging Face (llama / mistral / qwen2) and GGUF (llama.cpp's "llama")
# ---------------------------------------------------------------------------------------


def _from_hf(hf_cfg: Mapping[str, Any], *, dtype: str, param_dtype: str, max_len: int | None) -> lm.LMConfig:
    """A Llama / Mistral / Qwen2 `config.json` -> `LMConfig` (see `models.hf.config_from_hf`)."""
    model_type = hf_cfg["model_type"]
    theta, pct = hf.rope(hf_cfg)
    window = hf_cfg.get("sliding_window")
    if model_type == "qwen2" and not hf_cfg.get("use_sliding_window", False):
        window = None
    if model_type == "llama":
        window = None
    common = hf.common_fields(hf_cfg, theta=theta, dtype=dtype, param_dtype=param_dtype, max_len=max_len, window=window)
    act = hf_cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json hidden_act {act!r} is not supported for {model_type} (only 'silu', SwiGLU)")
    if pct != 1.0:
        raise ValueError(f"config.json partial_rotary_factor {pct} is not supported for {model_type}")
    if model_type == "qwen2":
        qkv_bias, out_bias, mlp_bias = True, False, False
    elif model_type == "llama":
        qkv_bias = out_bias = bool(hf_cfg.get("attention_bias", False))
        mlp_bias = bool(hf_cfg.get("mlp_bias", False))
    else:  # mistral: no biases
        qkv_bias = out_bias = mlp_bias = False
    return lm.LMConfig(
        arch="llama",
        norm="rms",
        norm_eps=float(hf_cfg.get("rms_norm_eps", 1e-6)),
        num_kv_heads=int(hf_cfg.get("num_key_value_heads") or common["num_heads"]),
        qkv_bias=qkv_bias,
        out_bias=out_bias,
        mlp_bias=mlp_bias,
        **common,
    )


def _hf_tensors(cfg: lm.LMConfig) -> list[hf.Tensor]:
    d, h, g, hd, m = cfg.embed_dim, cfg.num_heads, cfg.kv_heads, cfg.head_dim, cfg.mlp_dim
    spec = [
        hf.Tensor("model.embed_tokens.weight", (cfg.vocab_size, d), hf.same("embed")),
        hf.Tensor("model.norm.weight", (d,), hf.same("final_norm/scale")),
    ]
    for i in range(cfg.num_layers):
        pre, ours = f"model.layers.{i}", f"layer_{i}"
        spec += hf.linear(f"{pre}.self_attn.q_proj", f"{ours}/attn/query", d, h * hd, cfg.qkv_bias)
        spec += hf.linear(f"{pre}.self_attn.k_proj", f"{ours}/attn/key", d, g * hd, cfg.qkv_bias)
        spec += hf.linear(f"{pre}.self_attn.v_proj", f"{ours}/attn/value", d, g * hd, cfg.qkv_bias)
        spec += hf.linear(f"{pre}.self_attn.o_proj", f"{ours}/attn/out", h * hd, d, cfg.out_bias)
        spec += hf.linear(f"{pre}.mlp.gate_proj", f"{ours}/mlp/gate", d, m, cfg.mlp_bias)
        spec += hf.linear(f"{pre}.mlp.up_proj", f"{ours}/mlp/up", d, m, cfg.mlp_bias)
        spec += hf.linear(f"{pre}.mlp.down_proj", f"{ours}/mlp/down", m, d, cfg.mlp_bias)
        spec += [
            hf.Tensor(f"{pre}.input_layernorm.weight", (d,), hf.same(f"{ours}/attn_norm/scale")),
            hf.Tensor(f"{pre}.post_attention_layernorm.weight", (d,), hf.same(f"{ours}/mlp_norm/scale")),
        ]
    return spec


def _to_hf(cfg: lm.LMConfig) -> dict[str, Any]:
    """`cfg` as a `config.json`: Qwen2's when only q/k/v have biases (its fixed layout), else Llama's."""
    if cfg.qkv_bias and not cfg.out_bias and not cfg.mlp_bias:
        kind, extra = ("qwen2", "Qwen2ForCausalLM"), {"use_sliding_window": False}
    else:  # `attention_bias` covers q/k/v and the output: `hf.to_hf_config` refuses them unequal
        kind, extra = ("llama", "LlamaForCausalLM"), {"attention_bias": cfg.out_bias, "mlp_bias": cfg.mlp_bias}
    return {
        "model_type": kind[0],
        "architectures": [kind[1]],
        **hf.common_to_hf(cfg),
        "head_dim": cfg.head_dim,
        "num_key_value_heads": cfg.kv_heads,
        "rms_norm_eps": cfg.norm_eps,
        "hidden_act": "silu",
        **extra,
    }


def _hf_config_from_gguf(meta: Mapping[str, Any], tensor_names: frozenset[str], path: Any) -> dict[str, Any]:
    """The transformers Llama `config.json` dict that GGUF `llama.*` metadata describes
    (`rope_theta` at top level, as in transformers 4.x files; see `gguf.hf_config_from_metadata`)."""
    a = "llama."
    hidden = int(gguf.required(meta, a + "embedding_length", path))
    heads = int(gguf.required(meta, a + "attention.head_count", path))
    # llama.cpp's own defaults when a key is absent: kv heads = heads, rope base 10000.
    kv_heads = int(meta.get(a + "attention.head_count_kv", heads))
    head_dim = int(meta.get(a + "rope.dimension_count", hidden // heads))
    if head_dim * heads != hidden:
        raise ValueError(
            f"{path}: rope.dimension_count {head_dim} x head_count {heads} != embedding_length {hidden} "
            "(partial rotary or a separate head_dim is not supported)"
        )
    if "tokenizer.ggml.tokens" in meta:
        default_vocab = len(meta["tokenizer.ggml.tokens"])
    else:
        default_vocab = None
    vocab = meta.get(a + "vocab_size", default_vocab)
    if vocab is None:
        raise ValueError(f"GGUF metadata key {a + 'vocab_size'!r} (or tokenizer.ggml.tokens) is missing in {path}")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": int(gguf.required(meta, a + "block_count", path)),
        "hidden_size": hidden,
        "intermediate_size": int(gguf.required(meta, a + "feed_forward_length", path)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        # Stored as float32: 1e-5 reads back as 9.999999747378752e-06, kept as transformers keeps it.
        "rms_norm_eps": float(gguf.required(meta, a + "attention.layer_norm_rms_epsilon", path)),
        "rope_theta": float(meta.get(a + "rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(gguf.required(meta, a + "context_length", path)),
        "vocab_size": int(vocab),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    return config


lm.register(
    lm.Architecture(
        name="llama",
        model=Transformer,
        fixed=lambda cfg: {
            "norm": ("rms",),
            "rotary_pct": (1.0,),
            "parallel_residual": (False,),
            "activation": ("silu",),
        },
        hf_model_types=("llama", "mistral", "qwen2"),
        from_hf=_from_hf,
        hf_tensors=_hf_tensors,
        to_hf=_to_hf,
        gguf=lm.GGUFNames(
            architecture="llama",
            hf_config=_hf_config_from_gguf,
            global_names={
                "token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight",
            },
            layer_names={
                "attn_norm.weight": "input_layernorm.weight",
                "attn_q.weight": "self_attn.q_proj.weight",
                "attn_k.weight": "self_attn.k_proj.weight",
                "attn_v.weight": "self_attn.v_proj.weight",
                "attn_output.weight": "self_attn.o_proj.weight",
                "ffn_norm.weight": "post_attention_layernorm.weight",
                "ffn_gate.weight": "mlp.gate_proj.weight",
                "ffn_up.weight": "mlp.up_proj.weight",
                "ffn_down.weight": "mlp.down_proj.weight",
            },
            # llama.cpp's converter interleaves the RoPE pairs of these rows (`gguf._unpermute_rows`)
            permuted_rows={"q_proj.weight": "num_attention_heads", "k_proj.weight": "num_key_value_heads"},
        ),
    )
)
