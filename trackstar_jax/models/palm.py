"""Decoder-only language model in Flax NNX with the paper's architecture (§A.3, Table A.3).

PaLM-style (Chowdhery et al., 2022): RoPE, multi-query attention (many query heads, one
shared key/value head), SwiGLU MLP, no biases anywhere, RMS (or bias-free Layer) norm,
tied or untied input/output embeddings.

Every dense kernel is a 2-D matrix `[in, out]` and every norm has a 1-D `scale`, so that
TrackStar's two-sided projection (§A.1.2) sees plain matrices. Each parameterised layer
knows its own parameter path (`layer_3/attn/query/kernel`, the path in
`nnx.state(model, nnx.Param)` joined by '/'). A `Tap` passed to `__call__` sees every layer's
input and output by that path: the fast factored gradient path uses it to capture layer
inputs and to add zero perturbations whose gradients are the per-token output gradients.

Batch convention (shared by training, featurization, retrieval and tail-patch):
`tokens [B, T] int32` (BOS first, PAD_ID padding at the end), `loss_mask [B, T]`
(1 where token t is a target, i.e. predicted from tokens < t; 0 on BOS, prompt and padding),
`example_id [B] int32` (-1 for padding rows).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

PAD_ID = 0

NORM_TYPES = ("rms", "layer")


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Model hyperparameters (hashable, so it can be a jit static argument)."""

    vocab_size: int = 32_000
    num_layers: int = 8
    embed_dim: int = 1024  # Table A.3 "embedding size" = "hidden size"
    num_heads: int = 4
    head_dim: int = 256
    mlp_dim: int = 4096
    max_len: int = 2048
    tie_embeddings: bool = True
    norm: str = "rms"
    rope_base: float = 10_000.0
    dtype: str = "float32"  # activation / compute dtype
    param_dtype: str = "float32"

    def __post_init__(self):
        if self.norm not in NORM_TYPES:
            raise ValueError(f"model.norm must be one of {NORM_TYPES}, got {self.norm!r}")
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim must be even for RoPE, got {self.head_dim}")
        for field in ("vocab_size", "num_layers", "embed_dim", "num_heads", "head_dim", "mlp_dim", "max_len"):
            if getattr(self, field) <= 0:
                raise ValueError(f"model.{field} must be positive, got {getattr(self, field)}")


class Tap(Protocol):
    """Observer of every parameterised layer: `tap(path, x, y) -> y'`.

    `path` is the layer's parameter path (e.g. `layer_0/mlp/up/kernel`), `x` the array that
    multiplies the parameter (the dense input, or the normalised input of a norm) and `y` the
    layer output. The returned array replaces `y`.
    """

    def __call__(self, path: str, x: Array, y: Array) -> Array: ...


def param_path_str(path: tuple[Any, ...]) -> str:
    """Joins an `nnx.state` / pytree key path into the canonical 'layer_0/attn/query/kernel' string."""
    parts = []
    for p in path:
        for attr in ("key", "idx", "name"):  # jax.tree_util key entries
            if hasattr(p, attr):
                p = getattr(p, attr)
                break
        parts.append(str(p))
    return "/".join(parts)


def _dtype(name: str):
    return jnp.dtype(name)


class Linear(nnx.Module):
    """Bias-free dense layer `y = x @ kernel`, kernel `[in, out]`."""

    def __init__(self, in_features: int, out_features: int, path: str, cfg: LMConfig, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(stddev=1.0 / math.sqrt(in_features))
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), _dtype(cfg.param_dtype)))
        self.path = path + "/kernel"
        self.dtype = cfg.dtype

    def __call__(self, x: Float[Array, "... i"], tap: Tap | None = None) -> Float[Array, "... o"]:
        y = jnp.einsum("...i,io->...o", x, self.kernel[...].astype(self.dtype))
        return tap(self.path, x, y) if tap is not None else y


class Norm(nnx.Module):
    """RMSNorm, or LayerNorm without bias, with a learned `scale` `[dim]`."""

    def __init__(self, dim: int, path: str, cfg: LMConfig, eps: float = 1e-6):
        self.scale = nnx.Param(jnp.ones((dim,), _dtype(cfg.param_dtype)))
        self.kind = cfg.norm
        self.eps = eps
        self.path = path + "/scale"
        self.dtype = cfg.dtype

    def __call__(self, x: Float[Array, "... d"], tap: Tap | None = None) -> Float[Array, "... d"]:
        xf = x.astype(jnp.float32)
        if self.kind == "layer":
            xf = xf - jnp.mean(xf, axis=-1, keepdims=True)
        xhat = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)).astype(self.dtype)
        y = xhat * self.scale[...].astype(self.dtype)
        return tap(self.path, xhat, y) if tap is not None else y


def rope(x: Float[Array, "b t ... h"], base: float) -> Float[Array, "b t ... h"]:
    """Rotary position embedding (rotate-half form) over the last axis, positions 0..T-1."""
    t, h = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / (base ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))  # [h/2]
    angles = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # [t, h/2]
    shape = (1, t) + (1,) * (x.ndim - 3) + (h // 2,)
    sin, cos = jnp.sin(angles).reshape(shape), jnp.cos(angles).reshape(shape)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class MultiQueryAttention(nnx.Module):
    """Causal multi-query attention: `num_heads` query heads share one key/value head."""

    def __init__(self, cfg: LMConfig, path: str, *, rngs: nnx.Rngs):
        d, h, hd = cfg.embed_dim, cfg.num_heads, cfg.head_dim
        self.query = Linear(d, h * hd, f"{path}/query", cfg, rngs=rngs)
        self.key = Linear(d, hd, f"{path}/key", cfg, rngs=rngs)
        self.value = Linear(d, hd, f"{path}/value", cfg, rngs=rngs)
        self.out = Linear(h * hd, d, f"{path}/out", cfg, rngs=rngs)
        self.num_heads, self.head_dim, self.rope_base = h, hd, cfg.rope_base

    def __call__(self, x: Float[Array, "b t d"], tap: Tap | None = None) -> Float[Array, "b t d"]:
        b, t, _ = x.shape
        q = self.query(x, tap).reshape(b, t, self.num_heads, self.head_dim)
        k = self.key(x, tap)  # [b, t, hd]: the single shared head
        v = self.value(x, tap)
        q, k = rope(q, self.rope_base), rope(k, self.rope_base)
        logits = jnp.einsum("bqhd,bkd->bhqk", q, k).astype(jnp.float32) / math.sqrt(self.head_dim)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        logits = jnp.where(causal[None, None], logits, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        ctx = jnp.einsum("bhqk,bkd->bqhd", probs, v).reshape(b, t, self.num_heads * self.head_dim)
        return self.out(ctx, tap)


class SwiGLU(nnx.Module):
    """SwiGLU MLP: `down(silu(gate(x)) * up(x))`."""

    def __init__(self, cfg: LMConfig, path: str, *, rngs: nnx.Rngs):
        d, m = cfg.embed_dim, cfg.mlp_dim
        self.gate = Linear(d, m, f"{path}/gate", cfg, rngs=rngs)
        self.up = Linear(d, m, f"{path}/up", cfg, rngs=rngs)
        self.down = Linear(m, d, f"{path}/down", cfg, rngs=rngs)

    def __call__(self, x: Float[Array, "b t d"], tap: Tap | None = None) -> Float[Array, "b t d"]:
        return self.down(jax.nn.silu(self.gate(x, tap)) * self.up(x, tap), tap)


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, cfg: LMConfig, path: str, *, rngs: nnx.Rngs):
        self.attn_norm = Norm(cfg.embed_dim, f"{path}/attn_norm", cfg)
        self.attn = MultiQueryAttention(cfg, f"{path}/attn", rngs=rngs)
        self.mlp_norm = Norm(cfg.embed_dim, f"{path}/mlp_norm", cfg)
        self.mlp = SwiGLU(cfg, f"{path}/mlp", rngs=rngs)

    def __call__(self, x: Float[Array, "b t d"], tap: Tap | None = None) -> Float[Array, "b t d"]:
        x = x + self.attn(self.attn_norm(x, tap), tap)
        return x + self.mlp(self.mlp_norm(x, tap), tap)


class Transformer(nnx.Module):
    """The language model. `__call__(tokens) -> logits [B, T, vocab]` (float32)."""

    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        emb_init = nnx.initializers.normal(stddev=1.0)
        self.embed = nnx.Param(emb_init(rngs.params(), (cfg.vocab_size, cfg.embed_dim), _dtype(cfg.param_dtype)))
        # Layers are named attributes (`layer_0`, ...), not a list, so that parameter paths
        # contain only string keys (clean checkpoint / tensorstore paths).
        for i in range(cfg.num_layers):
            setattr(self, f"layer_{i}", DecoderLayer(cfg, f"layer_{i}", rngs=rngs))
        self.final_norm = Norm(cfg.embed_dim, "final_norm", cfg)
        if not cfg.tie_embeddings:
            self.unembed = Linear(cfg.embed_dim, cfg.vocab_size, "unembed", cfg, rngs=rngs)

    def __call__(self, tokens: Int[Array, "b t"], tap: Tap | None = None) -> Float[Array, "b t v"]:
        if tokens.shape[1] > self.cfg.max_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds model.max_len={self.cfg.max_len}")
        x = jnp.take(self.embed[...], tokens, axis=0).astype(self.cfg.dtype)
        for i in range(self.cfg.num_layers):
            x = getattr(self, f"layer_{i}")(x, tap)
        x = self.final_norm(x, tap)
        if self.cfg.tie_embeddings:
            # Tied output embedding, scaled by 1/sqrt(d) (T5X/PaLM) so logits start O(1).
            logits = jnp.einsum("btd,vd->btv", x, self.embed[...].astype(x.dtype)) / math.sqrt(self.cfg.embed_dim)
        else:
            logits = self.unembed(x, tap)
        return logits.astype(jnp.float32)


# Parameters TrackStar never attributes (§3: "all model parameters except the token
# embedding layer"); with tied embeddings this is also the output embedding.
EXCLUDED_PARAMS = ("embed",)


def make_model(cfg: LMConfig, seed: int = 0) -> Transformer:
    """Initialises a model with `seed`."""
    return Transformer(cfg, rngs=nnx.Rngs(params=seed))


def split_model(model: Transformer) -> tuple[nnx.GraphDef, nnx.State]:
    """Functional form at the step boundary: `(graphdef, params)`."""
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, params


def apply(graphdef: nnx.GraphDef, params: nnx.State, tokens: Int[Array, "b t"], tap: Tap | None = None) -> Float[Array, "b t v"]:
    """Pure forward pass: logits for `tokens` under `params`."""
    return nnx.merge(graphdef, params)(tokens, tap)


def abstract_params(cfg: LMConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """Shapes of the parameters without allocating them (works for the 8B config)."""
    graphdef, params = nnx.eval_shape(lambda: split_model(make_model(cfg)))
    return graphdef, params


def param_count(params: Any) -> int:
    """Total number of parameters in a (possibly abstract) parameter tree."""
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(params)))


def flat_params(params: Any) -> dict[str, Any]:
    """`{'layer_0/attn/query/kernel': array, ...}` for a parameter tree (state or dict)."""
    leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params)[0]
    return {param_path_str(path): leaf for path, leaf in leaves}


def attributed_paths(params: Any) -> list[str]:
    """Parameter paths that TrackStar attributes: all but the token embedding."""
    return [p for p in flat_params(params) if p.split("/")[0] not in EXCLUDED_PARAMS]


def lm_targets(batch: Mapping[str, Array]) -> tuple[Int[Array, "b t1"], Int[Array, "b t1"], Float[Array, "b t1"]]:
    """Splits a batch into (inputs, targets, weights) for next-token prediction (T1 = T-1)."""
    tokens = batch["tokens"]
    return tokens[:, :-1], tokens[:, 1:], batch["loss_mask"][:, 1:].astype(jnp.float32)


def token_log_probs(logits: Float[Array, "b t v"], targets: Int[Array, "b t"]) -> Float[Array, "b t"]:
    """log p(target_t | prefix) for every position, in float32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def example_losses(logits_fn: Callable[[Array], Array], batch: Mapping[str, Array]) -> Float[Array, "b"]:
    """Per-example loss summed over target tokens: `-sum_t mask_t log p(y_t)`."""
    inputs, targets, weights = lm_targets(batch)
    return -jnp.sum(token_log_probs(logits_fn(inputs), targets) * weights, axis=-1)


def layer_index(path: str) -> int | None:
    """Decoder layer number of a parameter path (`layer_3/...` -> 3); None outside layers."""
    head = path.split("/", 1)[0]
    return int(head[len("layer_"):]) if head.startswith("layer_") else None
