"""The per-device kernel of exact top-k retrieval: a row block scored against the queries under a
`Plan`, the stable selection and merge of candidates (ties to the lower id), and the sharded
program (`sharded_fn`: every device's top-k / bottom-k all-gathered and merged).

The exactness argument (stable `lax.top_k`, ascending-id concatenation, `SENTINEL` rows, -0
canonicalised) is in `topk.py`'s docstring.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from trackstar_jax.retrieval import native
from trackstar_jax.retrieval.score_plan import Plan

# Id of a row that does not exist (padding); larger than any real id, so it also loses ties.
SENTINEL = int(np.iinfo(np.int32).max)
# bfloat16 terms the query is split into against bfloat16 rows ("bf16_split3"), by precision:
# 3 terms carry float32's 24 significand bits, 2 carry 16 (more than TF32's 11), 1 is bf16.
_SPLIT_TERMS = {"float32": 3, "tf32": 2, "bf16": 1}
_DOT_PRECISION = {"float32": lax.Precision.HIGHEST, "tf32": lax.Precision.HIGH}
# Up to this many scores per device (64 MB) a shard is scored whole and selected once.
_SCORE_ALL = 1 << 24


def _widen(blk: Array, upcast: str) -> tuple[Array, ...]:
    """Float32 operands of a row block: `(rows,)`, or `(even, odd)` columns for bf16 pairs."""
    if upcast == "none":
        return (blk,)
    if upcast == "convert":
        return (blk.astype(jnp.float32),)
    # blk is uint32 [b, d/2]: the low half-word is bf16 column 2j, the high one column 2j+1
    # (little-endian). A bf16 is the top 16 bits of the float32 with the same value.
    even = lax.bitcast_convert_type(blk << 16, jnp.float32)
    odd = lax.bitcast_convert_type(blk & jnp.uint32(0xFFFF0000), jnp.float32)
    return even, odd


def split3(q: Float[Array, "q d"], terms: int = 3) -> Array:
    """`[Q, d]` float32 -> `[d, terms * Q]` bfloat16 with columns (query j, term t):
    q = q1 + q2 + q3 for 3 terms (fewer terms: the leading ones).

    Each term is the bfloat16 rounding of what the previous ones left (8 significand bits
    each, 24 in all = float32); the remainder is below float32 rounding of q.
    """
    qt = q.T
    parts, r = [], qt
    for _ in range(terms):
        t = r.astype(jnp.bfloat16)
        parts.append(t)
        r = r - t.astype(jnp.float32)
    return jnp.stack(parts, axis=-1).reshape(qt.shape[0], -1)


def _block_scores(q_parts: tuple[Array, ...], blk: Array, plan: Plan) -> Float[Array, "q b"]:
    """Scores `[Q, b]` of a row block against the queries, accumulated in float32."""
    if plan.upcast == "native":
        (q,) = q_parts
        return native.scores(blk, q)
    if plan.upcast == "bf16_split3":
        # q_parts = (w,) with w [d, 3Q] bfloat16: the query split into three bfloat16 terms per
        # column (q = q1 + q2 + q3 to float32 precision). bf16 x bf16 products are exact in
        # float32 and accumulate in float32, so this equals a float32 dot, and XLA:CPU runs it
        # natively on the bf16 rows (no widened copy; bf16 dot instructions where available).
        (w,) = q_parts
        terms = _SPLIT_TERMS[plan.precision]
        if plan.query_major:  # scores come out [terms * Q, b]: no transpose of the score tile
            s = lax.dot_general(w, blk, (((0,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            return s.reshape(-1, terms, blk.shape[0]).sum(axis=1)
        s = jnp.dot(blk, w, preferred_element_type=jnp.float32)  # [b, terms * Q]
        return s.reshape(blk.shape[0], -1, terms).sum(axis=-1).T
    if plan.contract == "reduce":
        # One fused multiply-reduce (XLA:CPU hands it, widening included, to its YNNPACK path).
        (qp,) = q_parts
        return jnp.sum(blk[None, :, :].astype(jnp.float32) * qp[:, None, :], axis=-1)
    out = None
    prec = _DOT_PRECISION.get(plan.precision)  # None: "bf16", both operands rounded to bfloat16
    for qp, rp in zip(q_parts, _widen(blk, plan.upcast)):
        if prec is None:
            qp, rp = qp.astype(jnp.bfloat16), rp.astype(jnp.bfloat16)
        if plan.query_major:
            s = jnp.dot(qp, rp.T, precision=prec, preferred_element_type=jnp.float32)
        else:
            s = jnp.dot(rp, qp.T, precision=prec, preferred_element_type=jnp.float32).T
        out = s if out is None else out + s
    return out


def select(s: Float[Array, "q n"], k: int, segment: int | None) -> tuple[Array, Array]:
    """`lax.top_k(s, k)`: values and positions, ties to the lower position; with `segment`, in
    two stages (the top-k of each segment, then of the candidates), the same result."""
    nq, n = s.shape
    if segment is None or n <= segment:
        return lax.top_k(s, k)
    pad = -n % segment
    # -inf padding sits after every real position, so a real entry wins any tie with it
    xs = jnp.pad(s, ((0, 0), (0, pad)), constant_values=-jnp.inf).reshape(nq, -1, segment)
    v, p = lax.top_k(xs, min(k, segment))  # [Q, n / segment, k1]
    p = p + (jnp.arange(xs.shape[1], dtype=p.dtype) * segment)[None, :, None]
    v2, q2 = lax.top_k(v.reshape(nq, -1), k)
    return v2, jnp.take_along_axis(p.reshape(nq, -1), q2, axis=1)


def _merge(carry: tuple[Array, ...], cand: tuple[Array, ...], k: int, segment: int | None = None) -> tuple[Array, ...]:
    """Stable merge of two candidate lists; `carry` must hold the lower ids.

    Both lists are `(top_scores, top_ids, neg_bottom_scores, bottom_ids)`, each `[Q, *]` and
    sorted by (value desc, id asc); bottoms are kept negated so one rule serves both.
    `segment`: `_select`'s two-stage selection.
    """
    out = []
    for (cs, ci), (ns, ni) in ((carry[0:2], cand[0:2]), (carry[2:4], cand[2:4])):
        s = jnp.concatenate([cs, ns], axis=1)
        i = jnp.concatenate([ci, ni], axis=1)
        v, p = select(s, min(k, s.shape[1]), segment)
        out += [v, jnp.take_along_axis(i, p, axis=1)]
    return tuple(out)


def _device_topk(
    q: Float[Array, "q d"],
    rows: Array,
    scale: Float[Array, " m"] | None,
    base: Int[Array, ""],
    n_valid: Int[Array, ""],
    *,
    k: int,
    plan: Plan,
) -> tuple[Array, ...]:
    """Running top-k / bottom-k of one device's rows `[m, d]` (ids `base + local index`).

    Returns `(top_s, top_i, neg_bot_s, bot_i)`, each `[Q, min(k, m)]`, sorted (value desc, id asc).
    """
    m = rows.shape[0]
    nq = q.shape[0]
    if plan.upcast == "bf16_pairs":
        # Rows as [m, d/2] uint32 words, each holding bf16 columns (2j, 2j+1). Host arrays arrive
        # already viewed that way (`_put_rows`, free); a device bf16 array is repacked here
        # (XLA emits a full pass for this bitcast). The query splits into even / odd columns.
        if rows.dtype != jnp.uint32:
            rows = lax.bitcast_convert_type(rows.reshape(m, rows.shape[1] // 2, 2), jnp.uint32)
        q_parts = (q[:, 0::2], q[:, 1::2])
    elif plan.upcast == "bf16_split3":
        q_parts = (split3(q, _SPLIT_TERMS[plan.precision]),)
    else:
        q_parts = (q,)
    bs = min(plan.block_rows, m)
    num_blocks = -(-m // bs)
    kk = min(k, m)

    score_all = _SCORE_ALL if plan.score_all is None else plan.score_all
    if num_blocks == 1 or (nq * m <= score_all and plan.upcast in ("none", "bf16_split3", "native")):
        # Few queries and no widened copy of the rows: the whole shard is one dot whose scores
        # fit one buffer; select once. (Looping over blocks would add a dynamic-slice copy of
        # every row block, and a per-block selection, for no gain. Widening upcasts keep
        # blocks: filling a score buffer block by block measured slower than merging.)
        s = _block_scores(q_parts, rows, plan)
        if scale is not None:
            s = s * scale[None, :]
        ids = base + jnp.arange(m, dtype=jnp.int32)
        valid = ids < n_valid
        s = jnp.where(s == 0, jnp.float32(0), s)
        ids = jnp.broadcast_to(jnp.where(valid, ids, SENTINEL)[None, :], (nq, m))
        empty = (jnp.zeros((nq, 0), jnp.float32), jnp.zeros((nq, 0), jnp.int32)) * 2
        return _merge(
            empty,
            (jnp.where(valid[None, :], s, -jnp.inf), ids, jnp.where(valid[None, :], -s, -jnp.inf), ids),
            kk,
            plan.segment,
        )

    def block(i, carry):
        # The last block is clamped to end at m; rows it shares with the previous block are masked.
        start = jnp.minimum(i * bs, m - bs)
        blk = lax.dynamic_slice_in_dim(rows, start, bs) if num_blocks > 1 else rows
        s = _block_scores(q_parts, blk, plan)
        if scale is not None:
            s = s * (lax.dynamic_slice_in_dim(scale, start, bs) if num_blocks > 1 else scale)[None, :]
        local = start + jnp.arange(bs, dtype=jnp.int32)
        ids = base + local
        valid = (local >= i * bs) & (ids < n_valid)
        s = jnp.where(s == 0, jnp.float32(0), s)  # -0.0 -> +0.0 (ties must not depend on the sign of zero)
        top = jnp.where(valid[None, :], s, -jnp.inf)
        bot = jnp.where(valid[None, :], -s, -jnp.inf)
        ids = jnp.broadcast_to(jnp.where(valid, ids, SENTINEL)[None, :], (nq, bs))
        return _merge(carry, (top, ids, bot, ids), kk, plan.segment)

    neg_inf = jnp.full((nq, kk), -jnp.inf, jnp.float32)
    none = jnp.full((nq, kk), SENTINEL, jnp.int32)
    # Block 0 outside the loop: its output is device-varying, as the loop carry must be.
    carry = block(0, (neg_inf, none, neg_inf, none))
    return carry if num_blocks == 1 else lax.fori_loop(1, num_blocks, block, carry)


@functools.lru_cache(maxsize=128)
def sharded_fn(mesh: Mesh, k: int, plan: Plan, has_scale: bool):
    """jit(shard_map(...)) computing the global top-k of one row array over `mesh`."""
    axes = tuple(mesh.axis_names)

    def per_device(q, rows, *rest):
        scale = rest[0] if has_scale else None
        offset, n_valid = rest[-2:]
        base = offset + lax.axis_index(axes) * rows.shape[0]
        local = _device_topk(q, rows, scale, base, n_valid, k=k, plan=plan)
        # [D, Q, kk] -> [Q, D*kk] in device order, i.e. ascending-id order of the lists.
        gathered = [
            jnp.moveaxis(lax.all_gather(x, axes, axis=0, to="invarying"), 0, 1).reshape(x.shape[0], -1) for x in local
        ]
        kk = local[0].shape[1]
        heads = tuple(g[:, :kk] for g in gathered)
        tails = tuple(g[:, kk:] for g in gathered)
        return _merge(heads, tails, k) if gathered[0].shape[1] > kk else heads

    in_specs = (P(), P(axes, None)) + ((P(axes),) if has_scale else ()) + (P(), P())
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=P()))


@functools.lru_cache(maxsize=16)
def merge_fn(k: int):
    return jax.jit(functools.partial(_merge, k=k))
