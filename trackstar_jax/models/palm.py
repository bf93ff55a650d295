"""Decoder-only language model in Flax NNX with the paper's architecture (§A.3, Table A.3).

PaLM-style (Chowdhery et al., 2022): RoPE, multi-query attention (many query heads, one
shared key/value head), SwiGLU MLP, no biases anywhere, RMS (or bias-free Layer) norm,
tied or untied input/output embeddings.

Every dense kernel is a 2-D matrix `[in, out]` and every norm has a 1-D `scale`, so that
TrackStar's two-sided projection (§A.1.2) sees plain matrices. The shared layers, the `Tap`
protocol and the batch convention are in `layers.py`; the config and the functions that
dispatch on `model.arch` (`make_model`, `apply`, ...) are in `lm.py`.
"""

from __future__ import annotations

import jax
from flax import nnx
from jaxtyping import Array, Float

from trackstar_jax.models import layers, lm
from trackstar_jax.models.layers import Linear, Norm, Tap
from trackstar_jax.models.lm import LMConfig


class MultiQueryAttention(layers.RotaryAttention):
    """Causal multi-query attention: `num_heads` query heads share one key/value head."""

    def __init__(self, cfg: LMConfig, path: str, *, rngs: nnx.Rngs):
        d, h, hd = cfg.embed_dim, cfg.num_heads, cfg.head_dim
        self.query = Linear(d, h * hd, f"{path}/query", cfg, rngs=rngs)
        self.key = Linear(d, hd, f"{path}/key", cfg, rngs=rngs)
        self.value = Linear(d, hd, f"{path}/value", cfg, rngs=rngs)
        self.out = Linear(h * hd, d, f"{path}/out", cfg, rngs=rngs)
        self.num_heads, self.head_dim, self.rope_base = h, hd, cfg.rope_base
        self.matmul_dtype = cfg.matmul_dtype or None

    def qkv(self, x: Float[Array, "b t d"], tap: Tap | None) -> tuple[Array, Array, Array]:
        b, t, _ = x.shape
        q = self.query(x, tap).reshape(b, t, self.num_heads, self.head_dim)
        # [b, t, 1, hd]: the single shared head
        return q, self.key(x, tap)[:, :, None], self.value(x, tap)[:, :, None]


class SwiGLU(nnx.Module):
    """SwiGLU MLP: `down(silu(gate(x)) * up(x))`."""

    def __init__(self, cfg: LMConfig, path: str, *, rngs: nnx.Rngs):
        d, m = cfg.embed_dim, cfg.mlp_dim
        self.gate = Linear(d, m, f"{path}/gate", cfg, rngs=rngs)
        self.up = Linear(d, m, f"{path}/up", cfg, rngs=rngs)
        self.down = Linear(m, d, f"{path}/down", cfg, rngs=rngs)

    def __call__(self, x: Float[Array, "b t d"], tap: Tap | None = None) -> Float[Array, "b t d"]:
        return self.down(jax.nn.silu(self.gate(x, tap)) * self.up(x, tap), tap)


class DecoderLayer(layers.ResidualBlock):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, cfg: LMConfig, path: str, *, rngs: nnx.Rngs):
        self.attn_norm = Norm(cfg.embed_dim, f"{path}/attn_norm", cfg)
        self.attn = MultiQueryAttention(cfg, f"{path}/attn", rngs=rngs)
        self.mlp_norm = Norm(cfg.embed_dim, f"{path}/mlp_norm", cfg)
        self.mlp = SwiGLU(cfg, f"{path}/mlp", rngs=rngs)


class Transformer(lm.DecoderLM):
    """The PaLM-style LM (§A.3). `__call__(tokens, tap=None) -> logits [B, T, vocab]` (float32)."""

    ARCH = "palm"
    DECODER_LAYER = DecoderLayer
    SCALE_TIED_LOGITS = True


lm.register(
    lm.Architecture(
        name="palm",
        model=Transformer,
        fixed=lambda cfg: {
            "num_kv_heads": (None, 1),
            "rotary_pct": (1.0,),
            "qkv_bias": (False,),
            "out_bias": (False,),
            "mlp_bias": (False,),
            "parallel_residual": (False,),
            "activation": ("silu",),
            "norm_bias": (False,),
        },
        default_kv_heads=1,  # multi-query
    )
)
