"""The fused, chunked output head (`head_nll_sum`): `[B, T, V]` logits never exist.

Training takes the head's loss and both gradients in one pass over chunks of positions; the
input-only gradient (featurisation, queries) is blocked along the vocabulary on the CPU with an
online softmax. Each chunk's GEMMs use `layers`' low-precision matmul where the model's
`matmul_dtype` asks for it. BUILD_NOTES §3 (the output head).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from trackstar_jax.distributed import runtime
from trackstar_jax.models.layers import LOWP_MATMUL, lowp_dot, physical_transpose

# Tokens per chunk of the fused head (`head_nll_sum`), over the whole batch, where it is not
# blocked along the vocabulary (training, the loss alone, accelerators). CPU: at least 128
# (a `[128, vocab]` float32 logits block of a 50k vocabulary is 26 MB, in L3; 128 measured
# fastest at width 128 for the featurize step before it was blocked) and at least the width
# rounded up to a power of two: each chunk's GEMMs repack the `[width, vocab]` matrix, which
# more rows amortise once the GEMM dominates (width 512: 512 tokens 6-8% faster than 128, with
# or without the weight gradient; at widths 128 and 256 not the best with the weight gradient:
# 8% and 15% over the best time measured). BUILD_NOTES, issue 13. Accelerators: large enough
# that each device's GEMMs stay big (16,384 tokens over 8 devices: 2,048 rows each, 1 GB of float32 logits per
# device at a 128k vocabulary) and the scan short; not measured (no accelerator was lent).
HEAD_CHUNK_TOKENS = {"cpu": 128}
HEAD_CHUNK_TOKENS_ACCELERATOR = 16_384
# Rows (leading axis) of each chunk's `[rows, c/g, d]` logits GEMM. XLA:CPU fuses the chunk's
# GEMM with the softmax's max / exp (a YNNPACK fusion) and splits that fusion over threads along
# the leading axis only: a batch of one (a query) put all 127 tokens on one thread, 2.1x slower
# on the 2-core CPU than `[16, 8]` (BUILD_NOTES, issue 13). So a chunk with fewer than this many
# examples is cut along time into groups. Accelerators: no split.
HEAD_CHUNK_ROWS = {"cpu": 16}
# Vocabulary block of the head's input-only gradient (`weight_grad=False`: featurisation and
# queries) and the tokens per chunk it runs with. CPU: each chunk's logits are made `[rows,
# block]` at a time with an online softmax (running max, sum and `dx` accumulator, as flash
# attention does), so the logits never leave the cache (the unblocked chunk writes `[rows,
# vocab]` logits and reads them back four times); the temporaries are a few blocks (0.04 GB at a
# width-2,048, 128k-vocabulary head, against 0.53 GB unblocked). Width 128 (the 14m shape;
# 16 x 127 targets, vocabulary 50,304, best of 5): 287-324 ms against the unblocked head's
# 410-449; width 512: 1,076-1,152 ms against 1,201-1,332 (BUILD_NOTES, issue 13). The weight
# gradient needs the final softmax before any block's `dW`, so training keeps the unblocked
# chunks.
# Accelerators: not blocked (each block would be a kernel launch; not measured).
HEAD_VOCAB_BLOCK = {"cpu": 2048}
HEAD_BLOCKED_CHUNK_TOKENS = {"cpu": 1024}


def head_chunk_tokens(width: int | None = None, blocked: bool = False) -> int:
    """The fused head's default chunk for a head of `width` inputs on the target platform
    (`runtime.target_platform`): with `blocked` (the vocabulary in blocks), the platform's
    `HEAD_BLOCKED_CHUNK_TOKENS`; else on the CPU `max(HEAD_CHUNK_TOKENS, width rounded up to a
    power of two)`, elsewhere `HEAD_CHUNK_TOKENS_ACCELERATOR` (None: the width is not known;
    the platform's minimum)."""
    if blocked and runtime.target_platform() in HEAD_BLOCKED_CHUNK_TOKENS:
        return HEAD_BLOCKED_CHUNK_TOKENS[runtime.target_platform()]
    base = HEAD_CHUNK_TOKENS.get(runtime.target_platform())
    if base is None:
        return HEAD_CHUNK_TOKENS_ACCELERATOR
    return max(base, 1 << (int(width) - 1).bit_length()) if width else base


def head_chunk_rows() -> int:
    """The fused head's minimum rows per chunk (`HEAD_CHUNK_ROWS` for the target platform)."""
    return HEAD_CHUNK_ROWS.get(runtime.target_platform(), 1)


def head_vocab_block() -> int:
    """The input-only head's vocabulary block on the target platform (`HEAD_VOCAB_BLOCK`; 0:
    not blocked)."""
    return HEAD_VOCAB_BLOCK.get(runtime.target_platform(), 0)


def _head_chunks(x, targets, weights, chunk_tokens, min_rows):
    """`[B, T, ...]` -> `[T/c, B*g, c/g, ...]`: chunks of `c` positions along time (T padded
    with weight-0 positions), so that the scan axis is never the (sharded) batch axis, each
    chunk's example rows cut into `g = ceil(min_rows / B)` groups of `c/g` positions (`c` a
    multiple of g; the reshape keeps B the major factor, so a batch sharding carries over).

    Returns the three chunked arrays and the padding."""
    b, t = targets.shape
    g = max(1, -(-min_rows // b))
    c = max(1, min(t, -(-chunk_tokens // b)))
    c = -(-c // g) * g
    pad = (-t) % c
    pad_to = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))  # noqa: E731

    def split(a):
        a = jnp.moveaxis(pad_to(a).reshape(b, (t + pad) // c, c, *a.shape[2:]), 1, 0)
        return a.reshape(a.shape[0], b * g, c // g, *a.shape[3:])

    return split(x), split(targets), split(weights), pad


def _head_operands(x, w, operand_dtype):
    """`(x, w, wt, lowp)`: the head's GEMM operands in `operand_dtype`; `lowp`: the platform's
    low-precision GEMM needs its operands untransposed (`LOWP_MATMUL`). Then `wt = w^T [V, d]`
    is written out (`physical_transpose`) for the `dx` GEMMs when the head has at least `d` rows
    (`x`'s `B*T`); with fewer (a query) each `dx` GEMM transposes its `[rows, V]` factor
    instead, fewer bytes than `W` (`_dx_dot`). Else `wt` is None."""
    od = jnp.dtype(operand_dtype)
    xo, wo = x.astype(od), w.astype(od)
    lowp = od.name in LOWP_MATMUL.get(runtime.target_platform(), ())
    rows = math.prod(x.shape[:-1])
    return xo, wo, physical_transpose(wo) if lowp and rows >= w.shape[0] else None, lowp


def _dx_dot(d, w, wt, lowp=False):
    """`d @ w^T` `[..., V] -> [..., d]` in float32: from `wt [V, d]` when written out; else with
    `lowp` as `(w d^T)^T` with `d^T` written out (`_head_operands`)."""
    if wt is not None:
        return jnp.einsum("...v,vd->...d", d.astype(wt.dtype), wt, preferred_element_type=jnp.float32)
    if lowp:
        d2 = physical_transpose(d.reshape(-1, d.shape[-1]).astype(w.dtype))
        return physical_transpose(lowp_dot(w, d2)).reshape(*d.shape[:-1], w.shape[0])
    return jnp.einsum("...v,dv->...d", d.astype(w.dtype), w, preferred_element_type=jnp.float32)


def _head_chunk_stats(xc, w, yc):
    """Logits of one chunk `[B, c, V]` (float32), their logsumexp and the target logits."""
    lg = jnp.einsum("bcd,dv->bcv", xc, w, preferred_element_type=jnp.float32)
    m = jax.lax.stop_gradient(jnp.max(lg, axis=-1, keepdims=True))
    e = jnp.exp(lg - m)
    s = jnp.sum(e, axis=-1, keepdims=True)
    lse = (m + jnp.log(s))[..., 0]
    return lg, e, s, lse, jnp.take_along_axis(lg, yc[..., None], axis=-1)[..., 0]


def _head_nll_sum(x, w, targets, weights, chunk_tokens, min_rows, weight_grad, vocab_block, operand_dtype):
    del weight_grad, vocab_block
    x, w = x.astype(operand_dtype), w.astype(operand_dtype)
    xs, ys, ws, _ = _head_chunks(x, targets, weights, chunk_tokens, min_rows)

    def body(acc, inp):
        xc, yc, wc = inp
        _, _, _, lse, tl = _head_chunk_stats(xc, w, yc)
        return acc + jnp.sum(wc * (lse - tl)), None

    return jax.lax.scan(body, jnp.zeros((), jnp.float32), (xs, ys, ws))[0]


def head_vocab_blocks(vocab: int, vocab_block: int) -> tuple[int, int]:
    """`(nb, vb)`: the input-only head's vocabulary of `vocab` cut into `nb = ceil(vocab /
    vocab_block)` equal blocks of `vb = ceil(vocab / nb)` columns (the last padded)."""
    nb = -(-int(vocab) // max(1, int(vocab_block)))
    return nb, -(-int(vocab) // nb)


def _head_blocked_dx(xs, ys, ws, w, vocab_block, wt=None, lowp=False):
    """Loss and `dx` of chunked inputs `[n, r, k, d]` (`_head_chunks`), the vocabulary taken
    `vocab_block` columns at a time with an online softmax: per chunk a scan over the `nb`
    blocks of `W` keeps the running max `m`, sum `s` and `acc = sum_v exp(l_v - m) W[:, v]`,
    rescaled when `m` grows; then `dx = weights * (acc / s - W[:, target])`. The vocabulary is
    cut into `nb = ceil(V / vocab_block)` blocks of `vb` columns (`head_vocab_blocks`), each a
    slice of `W` (no copy of the whole matrix); the last one ends at `V` and masks to -inf the
    columns it shares with the one before. With `wt = w^T [V, d]` written out
    (`_head_operands`), each block's `dx` GEMM reads its rows.

    Returns the summed loss (float32) and `dx [n, r, k, d]` (float32)."""
    d, v = w.shape
    nb, vb = head_vocab_blocks(v, vocab_block)

    def chunk(loss, inp):
        xc, yc, wc = inp
        x2, y2, w2 = xc.reshape(-1, d), yc.reshape(-1), wc.reshape(-1)

        def block(carry, j):
            m, s, acc = carry
            # W's columns [start, start + vb): sliced in place (no copy of W); the last block
            # starts at V - vb and masks the nb * vb - V columns the block before it took
            start = jnp.minimum(j * vb, v - vb)
            wj = jax.lax.dynamic_slice_in_dim(w, start, vb, axis=1)
            lg = jnp.dot(x2, wj, preferred_element_type=jnp.float32)
            if nb * vb != v:
                lg = jnp.where(start + jnp.arange(vb) >= j * vb, lg, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(lg, axis=-1))
            scale = jnp.exp(m - m_new)
            p = jnp.exp(lg - m_new[:, None])
            s = s * scale + jnp.sum(p, axis=-1)
            wtj = None if wt is None else jax.lax.dynamic_slice_in_dim(wt, start, vb, axis=0)
            acc = acc * scale[:, None] + _dx_dot(p, wj, wtj, lowp)
            return (m_new, s, acc), None

        r = x2.shape[0]
        init = (jnp.full((r,), -jnp.inf, jnp.float32), jnp.zeros((r,), jnp.float32), jnp.zeros((r, d), jnp.float32))
        (m, s, acc), _ = jax.lax.scan(block, init, jnp.arange(nb))
        wy = jnp.take(w, y2, axis=1).T.astype(jnp.float32)  # [r, d]: the target columns
        tl = jnp.sum(x2.astype(jnp.float32) * wy, axis=-1)
        dx = w2[:, None] * (acc / s[:, None] - wy)
        return loss + jnp.sum(w2 * (m + jnp.log(s) - tl)), dx.reshape(xc.shape)

    return jax.lax.scan(chunk, jnp.zeros((), jnp.float32), (xs, ys, ws))


def _head_nll_sum_fwd(x, w, targets, weights, chunk_tokens, min_rows, weight_grad, vocab_block, operand_dtype):
    """Loss and both input gradients in one pass over the chunks: each `[B, c, V]` block of
    logits is made, turned into `weights * (softmax - onehot)` and consumed by the `dx` (and
    `dW`) GEMMs while it is still in cache; the full `[B, T, V]` logits never exist. Without
    the weight gradient and with `vocab_block`, each chunk's vocabulary is blocked
    (`_head_blocked_dx`)."""
    b, t = targets.shape
    x_dtype, w_dtype = x.dtype, w.dtype
    x, w, wt, lowp = _head_operands(x, w, operand_dtype)
    xs, ys, ws, pad = _head_chunks(x, targets, weights, chunk_tokens, min_rows)

    def body(carry, inp):
        loss, dw = carry
        xc, yc, wc = inp
        lg, e, s, lse, tl = _head_chunk_stats(xc, w, yc)
        d = e * (wc[..., None] / s) - wc[..., None] * jax.nn.one_hot(yc, lg.shape[-1], dtype=e.dtype)
        dxc = _dx_dot(d, w, wt, lowp)
        if weight_grad:
            flat_x, flat_d = xc.reshape(-1, xc.shape[-1]), d.reshape(-1, d.shape[-1]).astype(xc.dtype)
            if lowp:
                # the rounded operands multiplied in float32 (the same products): a bf16 GEMM
                # here failed at run time for a tied head, whose `dW` XLA lays out transposed
                flat_x, flat_d = flat_x.astype(jnp.float32), flat_d.astype(jnp.float32)
            dw = dw + jnp.einsum("nd,nv->dv", flat_x, flat_d, preferred_element_type=jnp.float32)
        return (loss + jnp.sum(wc * (lse - tl)), dw), dxc

    if vocab_block and not weight_grad:
        loss, dx = _head_blocked_dx(xs, ys, ws, w, vocab_block, wt, lowp)
        dw = None
    else:
        dw0 = jnp.zeros(w.shape if weight_grad else (), jnp.float32)
        (loss, dw), dx = jax.lax.scan(body, (jnp.zeros((), jnp.float32), dw0), (xs, ys, ws))
        dw = dw.astype(w_dtype) if weight_grad else None
    # [T/c, B*g, c/g, d] -> [B, T/c, c, d] -> [B, T, d]
    dx = jnp.moveaxis(dx.reshape(dx.shape[0], b, -1, dx.shape[-1]), 0, 1).reshape(b, t + pad, -1)[:, :t].astype(x_dtype)
    return loss, (dx, dw)


def _head_nll_sum_bwd(chunk_tokens, min_rows, weight_grad, vocab_block, operand_dtype, res, ct):
    del chunk_tokens, min_rows, vocab_block, operand_dtype
    dx, dw = res
    return (ct * dx).astype(dx.dtype), (ct * dw).astype(dw.dtype) if weight_grad else None, None, None


_head_nll_sum = jax.custom_vjp(_head_nll_sum, nondiff_argnums=(4, 5, 6, 7, 8))
_head_nll_sum.defvjp(_head_nll_sum_fwd, _head_nll_sum_bwd)


def head_nll_sum(
    x: Float[Array, "b t d"],
    w: Float[Array, "d v"],
    targets: Int[Array, "b t"],
    weights: Float[Array, "b t"],
    *,
    weight_grad: bool = True,
    chunk_tokens: int | None = None,
    chunk_rows: int | None = None,
    vocab_block: int | None = None,
    operand_dtype: str | None = None,
) -> Float[Array, ""]:
    """`sum_{b,t} weights * -log softmax(x W)[target]`: the output head and the weighted
    next-token loss fused, chunked along time.

    Equal to `-sum(token_log_probs(x @ w, targets) * weights)` (pinned against it in
    tests/test_model.py), but the `[B, T, V]` logits are never materialised, and under
    differentiation the forward pass computes the gradients too (`weights` are constants:
    no cotangent flows to them or to `targets`). On the 2-core CPU the 50k-vocabulary head
    was ~90% of a training step at the pythia-14m shape (BUILD_NOTES, issue 13).

    Args:
      x: final hidden states (compute dtype); w: the output matrix `[d, vocab]`.
      targets, weights: next tokens and their (constant) loss weights.
      weight_grad: compute the gradient with respect to `w` (False where `w` is not
        differentiated, e.g. featurisation, where the output embedding is not attributed:
        a zero cotangent is returned and the `[d, V]` GEMM is skipped).
      chunk_tokens: tokens per chunk over the whole batch (None: `head_chunk_tokens(d, blocked)`).
      chunk_rows: a chunk of fewer examples is cut along time into at least this many rows
        (None: `head_chunk_rows()`); the result does not depend on it.
      vocab_block: with `weight_grad=False`, the gradient's chunks take the vocabulary this
        many columns at a time (online softmax; 0: whole; None: `head_vocab_block()`). The result does not depend
        on it beyond rounding.
      operand_dtype: the dtype the head's GEMM operands are rounded to (`LMConfig.matmul_dtype`;
        None: `x`'s); products accumulate in float32. On the CPU a low-precision one
        (`LOWP_MATMUL`) also writes `w^T` out once per call for the `dx` GEMMs.
    """
    block = (head_vocab_block() if vocab_block is None else int(vocab_block)) if not weight_grad else 0
    chunk = head_chunk_tokens(x.shape[-1], blocked=bool(block)) if chunk_tokens is None else int(chunk_tokens)
    rows = head_chunk_rows() if chunk_rows is None else int(chunk_rows)
    od = jnp.dtype(operand_dtype or x.dtype).name
    return _head_nll_sum(x, w, targets, weights.astype(jnp.float32), chunk, rows, weight_grad, block, od)
