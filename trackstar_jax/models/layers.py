"""Building blocks shared by every architecture (PaLM, Llama, GPT-NeoX) and the loss helpers; the
fused output head is in `head.py`.

Every parameterised layer knows its own parameter path (`layer_3/attn/query/kernel`, the
path in `nnx.state(model, nnx.Param)` joined by '/') and hands its input and output to a
`Tap` when one is given: the fast factored gradient path (`features/factored.py`) uses this
to capture layer inputs and per-token output gradients without weight gradients.

Parameter kinds, by the last path component:

* `kernel [in, out]`: dense `y = x @ kernel`; the tap sees `x` (the layer input);
* `scale [n]`: norm `y = xhat * scale`; the tap sees `xhat` (the normalised input);
* `bias [n]`: `y = ... + bias`; the tap sees `x = None` (a bias multiplies a constant 1,
  so its per-example gradient is the sum over tokens of the output gradient).
* `embed [V, d]` (a `DecoderLM`'s token embedding, path `embed`): `y = embed[tokens]`; the tap
  sees `x = tokens [B, T]` int (the one-hot rows that multiply the table). Taps that do not
  attribute the embedding return `y` unchanged (`lm.is_attributed("embed")` is False).

Batch convention (shared by training, featurization, retrieval and tail-patch):
`tokens [B, T] int32` (BOS first, `data.tokenizer.PAD_ID` padding at the end), `loss_mask [B, T]`
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

from trackstar_jax.distributed import runtime

NORM_TYPES = ("rms", "layer")
PARAM_KINDS = ("kernel", "scale", "bias")


class LayerConfig(Protocol):
    """What the layers read of a model's config; `lm.LMConfig` satisfies it (lm.py builds on this
    module, so this module names what it reads rather than importing the config)."""

    @property
    def dtype(self) -> str: ...  # activations
    @property
    def param_dtype(self) -> str: ...
    @property
    def matmul_dtype(self) -> str: ...  # "": the activations' dtype
    @property
    def norm(self) -> str: ...  # one of NORM_TYPES
    @property
    def norm_eps(self) -> float: ...
    @property
    def norm_bias(self) -> bool: ...


class Tap(Protocol):
    """Observer of every parameterised layer: `tap(path, x, y) -> y'`.

    `path` is the parameter's path (e.g. `layer_0/mlp/up/kernel`), `x` the array that
    multiplies the parameter (the dense input, the normalised input of a norm scale, or None
    for a bias, which multiplies a constant 1) and `y` the layer output so far (a kernel's
    tap sees `x @ kernel`, the bias's tap that plus the bias). The returned array replaces `y`.
    """

    def __call__(self, path: str, x: Array | None, y: Array) -> Array: ...


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


def flat_params(params: Any) -> dict[str, Any]:
    """`{'layer_0/attn/query/kernel': array, ...}` for a parameter tree (state or dict)."""
    leaves = jax.tree_util.tree_flatten_with_path(
        nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
    )[0]
    return {param_path_str(path): leaf for path, leaf in leaves}


def param_count(params: Any) -> int:
    """Total number of parameters in a (possibly abstract) parameter tree."""
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(params)))


def matmul_2d(x: Float[Array, "... i"], w: Float[Array, "i o"]) -> Float[Array, "... o"]:
    """`x @ w` with the leading axes flattened into one: the weight gradient is then a plain
    `[i, N] x [N, o]` GEMM. XLA:CPU lowers the contraction over two axes (`btd,btv->dv`) that an
    `einsum("...i,io->...o")` differentiates into to far slower code (a 50k-vocabulary head's
    weight gradient took 2.7x as long; BUILD_NOTES, issue 13)."""
    return (x.reshape(-1, x.shape[-1]) @ w).reshape(*x.shape[:-1], w.shape[-1])


# Platforms whose dense layers flatten the leading axes (`matmul_2d`); elsewhere a plain
# `einsum`. With the flattening reshape, the 8B train step on 8 devices (one sequence each)
# compiled to 8.5 GB more per device (66.2 against 57.7 GB; BUILD_NOTES, issue 14; presumably the
# SPMD partitioner does not carry the batch's fsdp sharding through the reshape, not verified),
# while only XLA:CPU needs the 2-D form for speed.
MATMUL_FLATTEN = {"cpu": True}
# Operand dtypes whose GEMMs `lowp_matmul` runs with every transposed operand materialised, on
# the platforms listed. XLA:CPU (YNNPACK) multiplies bf16 x bf16 -> f32 at ~2x its float32 rate
# on a CPU with AVX512-BF16 (410-420 against 200-215 GFLOP/s, 2-core EPYC), but only in the
# `[M, K] x [K, N]` layout: a dot whose operand is transposed (every backward GEMM: `dy W^T`,
# `x^T dy`) or whose output is bf16 is upcast to float32 and runs at ~180-200 (BUILD_NOTES, issue 13).
LOWP_MATMUL = {"cpu": ("bfloat16",)}


def physical_transpose(a: Float[Array, "... m n"]) -> Float[Array, "... n m"]:
    """`a` with its last two axes swapped, written out row-major. XLA folds a plain transpose
    into the dot that reads it (as a column-major operand, which XLA:CPU's bf16 GEMM does not
    take); going through a transpose of one more axis (the rows split in two) it does not, so
    the copy is made (~1 ms per 4M bf16 elements)."""
    *lead, m, n = a.shape
    s = 2 if m % 2 == 0 else 1
    k = len(lead)
    b = a.reshape(*lead, s, m // s, n)
    return jnp.transpose(b, (*range(k), k + 2, k, k + 1)).reshape(*lead, n, m)


def lowp_dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _lowp_mm(x, w, operand_dtype, x_dtype, w_dtype, written_out):
    del x_dtype, w_dtype, written_out
    return jnp.einsum(
        "...i,io->...o", x.astype(operand_dtype), w.astype(operand_dtype), preferred_element_type=jnp.float32
    )


def _lowp_mm_fwd(x, w, operand_dtype, x_dtype, w_dtype, written_out):
    xo, wo = x.astype(operand_dtype), w.astype(operand_dtype)  # the residuals: the rounded operands
    return _lowp_mm(xo, wo, operand_dtype, x_dtype, w_dtype, written_out), (xo, wo)


def _lowp_mm_bwd(operand_dtype, x_dtype, w_dtype, written_out, res, ct):
    xo, wo = res
    ct = ct.astype(operand_dtype)
    if written_out:  # 2-D operands; the transposed ones written out (`physical_transpose`)
        n, (i, o) = xo.shape[0], wo.shape
        if i * o <= n * (i + o):
            dx = lowp_dot(ct, physical_transpose(wo))
        else:
            # fewer rows than the weight has (a query): `(W ct^T)^T`, the activations transposed
            # instead of W, the result written out too (XLA:CPU lays a plain `.T` into the dot,
            # which then fails at run time)
            dx = physical_transpose(lowp_dot(wo, physical_transpose(ct)))
        dw = lowp_dot(physical_transpose(xo), ct)
    else:
        dx = jnp.einsum("...o,io->...i", ct, wo, preferred_element_type=jnp.float32)
        dw = jnp.einsum("...i,...o->io", xo, ct, preferred_element_type=jnp.float32)
    return dx.astype(x_dtype), dw.astype(w_dtype)


_lowp_mm = jax.custom_vjp(_lowp_mm, nondiff_argnums=(2, 3, 4, 5))
_lowp_mm.defvjp(_lowp_mm_fwd, _lowp_mm_bwd)


def lowp_matmul(
    x: Float[Array, "... i"], w: Float[Array, "i o"], operand_dtype: str = "bfloat16", *, written_out: bool = True
) -> Float[Array, "... o"]:
    """`x @ w` with both operands rounded to `operand_dtype` (e.g. bf16), accumulated and
    returned in float32, and differentiated the same way: each gradient GEMM takes the
    cotangent rounded to `operand_dtype` and accumulates in float32; the gradients come back
    in `x`'s and `w`'s dtypes (not rounded to `operand_dtype`: TPU's default precision for a
    float32 matmul). With `written_out` (2-D `x`), the gradient GEMMs read the transposed
    operands written out (`physical_transpose`), the layout XLA:CPU's bf16 kernel takes
    (`LOWP_MATMUL`)."""
    return _lowp_mm(x, w, jnp.dtype(operand_dtype).name, x.dtype.name, w.dtype.name, bool(written_out))


def dense_matmul(
    x: Float[Array, "... i"], w: Float[Array, "i o"], operand_dtype: str | None = None
) -> Float[Array, "... o"]:
    """`x @ w` over the last axis as the target platform runs it best, in `x`'s dtype.

    `operand_dtype` (None: `x`'s) is the dtype the two operands are rounded to (`LMConfig.
    matmul_dtype`); products accumulate in float32 and gradients are not rounded to it
    whenever it differs from `x`'s (`lowp_matmul`). On the CPU a low-precision operand dtype
    (`LOWP_MATMUL`) always goes through `lowp_matmul` with the leading axes flattened and the
    transposes written out; otherwise the CPU flattens the leading axes (`matmul_2d`) and
    other platforms use `einsum("...i,io->...o")` (`MATMUL_FLATTEN`, `runtime.target_platform`)."""
    platform = runtime.target_platform()
    od = jnp.dtype(operand_dtype or x.dtype)
    if od.name in LOWP_MATMUL.get(platform, ()):
        y = lowp_matmul(x.reshape(-1, x.shape[-1]), w, od.name, written_out=True)
        return y.astype(x.dtype).reshape(*x.shape[:-1], w.shape[-1])
    if od != x.dtype:
        return lowp_matmul(x, w, od.name, written_out=False).astype(x.dtype)
    if MATMUL_FLATTEN.get(platform, False):
        return matmul_2d(x, w)
    return jnp.einsum("...i,io->...o", x, w)


class Linear(nnx.Module):
    """Dense layer `y = x @ kernel (+ bias)`, kernel `[in, out]`, optional bias `[out]`."""

    def __init__(
        self, in_features: int, out_features: int, path: str, cfg: LayerConfig, *, rngs: nnx.Rngs, bias: bool = False
    ):
        init = nnx.initializers.normal(stddev=1.0 / math.sqrt(in_features))
        pdt = jnp.dtype(cfg.param_dtype)
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), pdt))
        self.bias = nnx.Param(jnp.zeros((out_features,), pdt)) if bias else None
        self.path = path
        self.dtype = cfg.dtype
        self.matmul_dtype = cfg.matmul_dtype or None

    def __call__(self, x: Float[Array, "... i"], tap: Tap | None = None) -> Float[Array, "... o"]:
        y = dense_matmul(x, self.kernel[...].astype(self.dtype), self.matmul_dtype)
        if tap is not None:
            y = tap(self.path + "/kernel", x, y)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
            if tap is not None:
                y = tap(self.path + "/bias", None, y)
        return y


class Norm(nnx.Module):
    """RMSNorm or LayerNorm with a learned `scale [dim]` and an optional `bias [dim]`.

    `kind`, `eps` and `bias` default to `cfg.norm`, `cfg.norm_eps`, `cfg.norm_bias`.
    Statistics are taken in float32 (as HF's Llama / NeoX norms do), the result cast to
    `cfg.dtype` before the scale.
    """

    def __init__(
        self,
        dim: int,
        path: str,
        cfg: LayerConfig,
        eps: float | None = None,
        *,
        kind: str | None = None,
        bias: bool | None = None,
    ):
        pdt = jnp.dtype(cfg.param_dtype)
        self.scale = nnx.Param(jnp.ones((dim,), pdt))
        use_bias = cfg.norm_bias if bias is None else bias
        self.bias = nnx.Param(jnp.zeros((dim,), pdt)) if use_bias else None
        self.kind = cfg.norm if kind is None else kind
        if self.kind not in NORM_TYPES:
            raise ValueError(f"norm kind must be one of {NORM_TYPES}, got {self.kind!r}")
        self.eps = cfg.norm_eps if eps is None else eps
        self.path = path
        self.dtype = cfg.dtype

    def __call__(self, x: Float[Array, "... d"], tap: Tap | None = None) -> Float[Array, "... d"]:
        xf = x.astype(jnp.float32)
        if self.kind == "layer":
            xf = xf - jnp.mean(xf, axis=-1, keepdims=True)
        xhat = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)).astype(self.dtype)
        y = xhat * self.scale[...].astype(self.dtype)
        if tap is not None:
            y = tap(self.path + "/scale", xhat, y)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
            if tap is not None:
                y = tap(self.path + "/bias", None, y)
        return y


def rope(
    x: Float[Array, "b t ... h"],
    base: float,
    rotary_dim: int | None = None,
    positions: Int[Array, "b t"] | None = None,
) -> Float[Array, "b t ... h"]:
    """Rotary position embedding over the last axis, at `positions` (None: 0..T-1 in every row).

    Rotate-half layout (HF's `rotate_half`, GPT-NeoX and Llama): within the first
    `rotary_dim` features (all by default), feature i is paired with i + rotary_dim/2 and
    rotated by angle `p / base^(2i / rotary_dim)`; the remaining features pass through
    unchanged (GPT-NeoX's partial rotary, `rotary_pct`).
    """
    t, h = x.shape[1], x.shape[-1]
    r = h if rotary_dim is None else rotary_dim
    inv_freq = 1.0 / (base ** (jnp.arange(0, r, 2, dtype=jnp.float32) / r))  # [r/2]
    if positions is None:
        angles = jnp.arange(t, dtype=jnp.float32)[None, :, None] * inv_freq  # [1, t, r/2]
    else:
        angles = positions.astype(jnp.float32)[:, :, None] * inv_freq  # [b, t, r/2]
    shape = angles.shape[:2] + (1,) * (x.ndim - 3) + (r // 2,)
    sin, cos = jnp.sin(angles).reshape(shape), jnp.cos(angles).reshape(shape)
    xf = x.astype(jnp.float32)
    x1, x2, rest = xf[..., : r // 2], xf[..., r // 2 : r], xf[..., r:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1).astype(x.dtype)


# Platforms whose attention lays the heads out first (`[b*g, r*t, d]`, each key/value head's
# queries stacked as rows): XLA:CPU's batched GEMMs then read contiguous row-major operands;
# with the `[b, t, h, d]` layout one layer's attention ran at 19-30 GFLOP/s against 35-60 (70m
# shape; BUILD_NOTES, issue 13). Elsewhere XLA's layout assignment chooses (the einsum on `[b, t, h, d]`).
ATTENTION_HEAD_MAJOR = {"cpu": True}


def _scores_mask(t: int, r: int) -> Array:
    """`[r*t, t]` bool: row `i` (query position `i % t` of one of `r` stacked heads) sees keys <= it."""
    return jnp.tile(jnp.tril(jnp.ones((t, t), dtype=bool)), (r, 1))


def _causal_softmax(s: Array, mask: Array, d: int) -> Float[Array, "... m k"]:
    """Scores `s [..., m, k]` -> float32 softmax over the keys of `s / sqrt(d)`, the entries where
    `mask` is False set to float32's min first (one source for every attention path)."""
    s = s.astype(jnp.float32) / math.sqrt(d)
    return jax.nn.softmax(jnp.where(mask, s, jnp.finfo(jnp.float32).min), axis=-1)


def _bdot(a, b, written_out):
    """`[n, m, k] x [n, k, p] -> [n, m, p]` in float32; `written_out`: `b` is given as `[n, p, k]`
    and is written out transposed (`physical_transpose`; the layout XLA:CPU's bf16 GEMM takes)."""
    if written_out:
        b = physical_transpose(b)
    return jax.lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32)


def _lowp_attn(qh, kh, vh, r, operand_dtype, written_out, dtype):
    del dtype
    return _lowp_attn_fwd(qh, kh, vh, r, operand_dtype, written_out)[0]


def _lowp_attn_fwd(qh, kh, vh, r, operand_dtype, written_out, dtype=None):
    """`qh [n, r*t, d]`, `kh, vh [n, t, d]` (`causal_attention`'s heads-first layout) -> the
    attention output `[n, r*t, d]` in `qh`'s dtype, and the residuals: the rounded operands and
    the float32 probabilities."""
    od, d = jnp.dtype(operand_dtype), qh.shape[-1]
    qo, ko, vo = qh.astype(od), kh.astype(od), vh.astype(od)
    if written_out:
        s = _bdot(qo, ko, True)
    else:
        s = jnp.einsum("nmd,nkd->nmk", qo, ko, preferred_element_type=jnp.float32)
    p = _causal_softmax(s, _scores_mask(kh.shape[1], r), d)  # [n, r*t, t] float32
    o = _bdot(p.astype(od), vo, False)
    return o.astype(qh.dtype), (qo, ko, vo, p)


def _lowp_attn_bwd(r, operand_dtype, written_out, dtype, res, do):
    qo, ko, vo, p = res
    od, d = jnp.dtype(operand_dtype), qo.shape[-1]
    do, po = do.astype(od), p.astype(od)
    if written_out:
        dp = _bdot(do, vo, True)  # do v^T  [n, m, k]
        dv = _bdot(physical_transpose(po), do, False)  # p^T do  [n, k, d]
    else:
        dp = jnp.einsum("nmd,nkd->nmk", do, vo, preferred_element_type=jnp.float32)
        dv = jnp.einsum("nmk,nmd->nkd", po, do, preferred_element_type=jnp.float32)
    ds = (p * (dp - jnp.sum(dp * p, axis=-1, keepdims=True)) / math.sqrt(d)).astype(od)  # softmax's VJP
    if written_out:
        dq = _bdot(ds, ko, False)  # ds k  [n, m, d]
        dk = _bdot(physical_transpose(ds), qo, False)  # ds^T q  [n, k, d]
    else:
        dq = jnp.einsum("nmk,nkd->nmd", ds, ko, preferred_element_type=jnp.float32)
        dk = jnp.einsum("nmk,nmd->nkd", ds, qo, preferred_element_type=jnp.float32)
    dt = jnp.dtype(dtype)
    return dq.astype(dt), dk.astype(dt), dv.astype(dt)


_lowp_attn = jax.custom_vjp(_lowp_attn, nondiff_argnums=(3, 4, 5, 6))
_lowp_attn.defvjp(_lowp_attn_fwd, _lowp_attn_bwd)


def causal_attention(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b t g d"],
    v: Float[Array, "b t g d"],
    operand_dtype: str | None = None,
) -> Float[Array, "b t h d"]:
    """Causal softmax attention with `h` query heads over `g` key/value heads (h % g == 0).

    Query head j reads key/value head `j // (h / g)` (HF's `repeat_kv` order), which covers
    multi-head (g = h), grouped-query and multi-query (g = 1) attention. Scores and softmax
    in float32, scaled by 1/sqrt(d).

    `operand_dtype` (None: `q`'s; `LMConfig.matmul_dtype`): when it differs from `q`'s, the
    six GEMMs (`q k^T`, `p v` and, in the backward pass, `do v^T`, `p^T do`, `ds k`,
    `ds^T q`) take operands rounded to it and accumulate in float32, the gradients returned
    unrounded, as `lowp_matmul` does; on the CPU (`LOWP_MATMUL`) with every transposed operand
    written out. The heads are laid out first where `ATTENTION_HEAD_MAJOR` says so.
    """
    b, t, h, d = q.shape
    g = k.shape[2]
    r = h // g
    platform = runtime.target_platform()
    od = jnp.dtype(operand_dtype or q.dtype)
    if od == q.dtype and not ATTENTION_HEAD_MAJOR.get(platform, False):
        qg = q.reshape(b, t, g, r, d)
        logits = jnp.einsum("bqgrd,bkgd->bgrqk", qg, k)
        probs = _causal_softmax(logits, jnp.tril(jnp.ones((t, t), dtype=bool)), d).astype(v.dtype)
        return jnp.einsum("bgrqk,bkgd->bqgrd", probs, v).reshape(b, t, h, d)
    # heads first: [b*g, r*t, d] queries (the r heads sharing a key/value head stacked as rows),
    # [b*g, t, d] keys and values
    qh = jnp.transpose(q.reshape(b, t, g, r, d), (0, 2, 3, 1, 4)).reshape(b * g, r * t, d)
    kh, vh = (jnp.transpose(a, (0, 2, 1, 3)).reshape(b * g, t, d) for a in (k, v))
    if od != q.dtype:
        written_out = od.name in LOWP_MATMUL.get(platform, ())
        o = _lowp_attn(qh, kh, vh, r, od.name, written_out, q.dtype.name)
    else:
        logits = jnp.einsum("nmd,nkd->nmk", qh, kh)
        probs = _causal_softmax(logits, _scores_mask(t, r), d).astype(v.dtype)
        o = jnp.einsum("nmk,nkd->nmd", probs, vh)
    return jnp.transpose(o.reshape(b, g, r, t, d), (0, 3, 1, 2, 4)).reshape(b, t, h, d)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """One attention layer's keys and values for incremental decoding, `k, v [b, s, g, d]`:
    positions 0..s-1 of each row, keys after the rotary embedding. Rows advance at their own
    pace (right-padded prompts of different lengths): `attend` writes row i's new tokens at its
    own positions, and an entry past what a row has written is never read by that row."""

    k: Float[Array, "b s g d"]
    v: Float[Array, "b s g d"]

    @classmethod
    def empty(cls, batch: int, length: int, kv_heads: int, head_dim: int, dtype: Any) -> KVCache:
        z = jnp.zeros((batch, length, kv_heads, head_dim), dtype)
        return cls(z, z)


def cached_attention(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b t g d"],
    v: Float[Array, "b t g d"],
    cache: KVCache,
    pos: Int[Array, " b"],
    operand_dtype: str | None = None,
) -> tuple[Float[Array, "b t h d"], KVCache]:
    """`causal_attention` for `t` new tokens per row at positions `pos[b] + 0..t-1`: their keys
    and values are written into `cache` first (positions past its length are dropped), then
    each new token attends to the cache's positions up to its own.

    Same head order, float32 scores and softmax (`_causal_softmax`) and operand rounding
    (`operand_dtype`, float32 accumulation) as `causal_attention`, whose output it equals at
    those positions (a test pins it per architecture).
    """
    b, t, h, d = q.shape
    s, g = cache.k.shape[1], cache.k.shape[2]
    at = pos[:, None] + jnp.arange(t)  # [b, t]
    rows = jnp.arange(b)[:, None]
    ck = cache.k.at[rows, at].set(k.astype(cache.k.dtype), mode="drop")
    cv = cache.v.at[rows, at].set(v.astype(cache.v.dtype), mode="drop")
    od = jnp.dtype(operand_dtype or q.dtype)
    qg = q.reshape(b, t, g, h // g, d).astype(od)
    logits = jnp.einsum("bqgrd,bkgd->bgrqk", qg, ck.astype(od), preferred_element_type=jnp.float32)
    sees = jnp.arange(s)[None, None, :] <= at[:, :, None]  # [b, t, s]
    probs = _causal_softmax(logits, sees[:, None, None], d)
    o = jnp.einsum("bgrqk,bkgd->bqgrd", probs.astype(od), cv.astype(od), preferred_element_type=jnp.float32)
    return o.astype(q.dtype).reshape(b, t, h, d), KVCache(ck, cv)


def rotary_attention(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b t g d"],
    v: Float[Array, "b t g d"],
    *,
    base: float,
    rotary_dim: int | None = None,
    operand_dtype: str | None = None,
    cache: KVCache | None = None,
    pos: Int[Array, " b"] | None = None,
) -> tuple[Float[Array, "b t h d"], KVCache | None]:
    """Rotary embedding on `q` and `k`, then causal attention: what every architecture's attention
    does between its projections. Without a cache the tokens sit at positions 0..T-1
    (`causal_attention`; returns `(out, None)`); with one, at `pos[b] + 0..T-1`
    (`cached_attention`; returns `(out, updated cache)`)."""
    if cache is None:
        q, k = rope(q, base, rotary_dim), rope(k, base, rotary_dim)
        return causal_attention(q, k, v, operand_dtype), None
    positions = pos[:, None] + jnp.arange(q.shape[1])
    q, k = rope(q, base, rotary_dim, positions), rope(k, base, rotary_dim, positions)
    return cached_attention(q, k, v, cache, pos, operand_dtype)


class RotaryAttention(nnx.Module):
    """Causal attention with rotary embeddings, the part every architecture shares: subclasses
    build `query`, `key`, `value` and `out` (`Linear`s), set `rope_base`, `rotary_dim` (None:
    the whole head), `matmul_dtype`, `num_heads`, `head_dim`, and split `qkv`."""

    rotary_dim: int | None = None

    def qkv(self, x: Float[Array, "b t d"], tap: Tap | None) -> tuple[Array, Array, Array]:
        """`q [b, t, h, hd]`, `k, v [b, t, g, hd]`, before the rotary embedding."""
        raise NotImplementedError

    def __call__(
        self,
        x: Float[Array, "b t d"],
        tap: Tap | None = None,
        cache: KVCache | None = None,
        pos: Int[Array, " b"] | None = None,
    ) -> Any:
        """`y [b, t, d]`; with a `cache` (decoding at positions `pos + 0..t-1`), `(y, cache)`."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x, tap)
        ctx, cache = rotary_attention(
            q,
            k,
            v,
            base=self.rope_base,
            rotary_dim=self.rotary_dim,
            operand_dtype=self.matmul_dtype,
            cache=cache,
            pos=pos,
        )
        y = self.out(ctx.reshape(b, t, self.num_heads * self.head_dim), tap)
        return y if cache is None else (y, cache)


class ResidualBlock(nnx.Module):
    """Pre-norm residual decoder block: `x + attn(attn_norm(x))`, then `x + mlp(mlp_norm(x))`, or
    both branches from `x` when `parallel` (GPT-NeoX's `use_parallel_residual`). Subclasses
    build `attn_norm`, `attn` (a `RotaryAttention`), `mlp_norm` and `mlp`. With a `cache`
    (`DecoderLM.decode`) returns `(x, cache)`."""

    parallel: bool = False

    def __call__(
        self,
        x: Float[Array, "b t d"],
        tap: Tap | None = None,
        cache: KVCache | None = None,
        pos: Int[Array, " b"] | None = None,
    ) -> Any:
        a = self.attn(self.attn_norm(x, tap), tap, cache, pos)
        if cache is not None:
            a, cache = a
        if self.parallel:
            x = x + a + self.mlp(self.mlp_norm(x, tap), tap)
        else:
            x = x + a
            x = x + self.mlp(self.mlp_norm(x, tap), tap)
        return x if cache is None else (x, cache)


def lm_targets(batch: Mapping[str, Array]) -> tuple[Int[Array, "b t1"], Int[Array, "b t1"], Float[Array, "b t1"]]:
    """Splits a batch into (inputs, targets, weights) for next-token prediction (T1 = T-1)."""
    tokens = batch["tokens"]
    return tokens[:, :-1], tokens[:, 1:], batch["loss_mask"][:, 1:].astype(jnp.float32)


def token_log_probs(logits: Float[Array, "b t v"], targets: Int[Array, "b t"]) -> Float[Array, "b t"]:
    """log p(target_t | prefix) for every position, in float32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def example_losses(logits_fn: Callable[[Array], Array], batch: Mapping[str, Array]) -> Float[Array, " b"]:
    """Per-example loss summed over target tokens: `-sum_t mask_t log p(y_t)`."""
    inputs, targets, weights = lm_targets(batch)
    return -jnp.sum(token_log_probs(logits_fn(inputs), targets) * weights, axis=-1)
