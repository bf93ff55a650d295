"""Greedy decoding with a key/value cache.

Used to report completions of fact prompts after pretraining, to get the model's own
prediction as a query target (`eval.query_mode = "prediction"`, paper §4.2) and for §A.4's
cap on facts the model gets wrong (one completion per candidate fact: minutes on a CPU).
One forward over the prompts fills the cache (`DecoderLM.decode`), then each new token costs
one position per row instead of a forward over the whole buffer.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Int

from trackstar_jax.data import tokenizer as tokenizer_lib


@functools.partial(jax.jit, static_argnames=("graphdef", "prefill", "max_new_tokens", "eos_id", "vocab_limit"))
def greedy_step_loop(
    params: Any,
    tokens: Int[Array, "b t"],
    lengths: Int[Array, " b"],
    *,
    graphdef: nnx.GraphDef,
    prefill: int,
    max_new_tokens: int,
    eos_id: int,
    vocab_limit: int | None = None,
) -> tuple[Int[Array, "b t"], Int[Array, " b"]]:
    """Appends up to `max_new_tokens` argmax tokens after each row's first `lengths[b]` tokens.

    Rows are right-padded, every `lengths[b] <= prefill`: one forward over `tokens[:, :prefill]`
    fills the cache (causal attention: padding after a row's prompt never changes its last
    prompt position, and a padded position's cache entry is overwritten before that row reads
    it), then each step decodes the token just written at the row's own position. A row stops
    after emitting `eos_id` or when the buffer `[b, t]` is full. Only ids below `vocab_limit`
    are chosen: the embedding table may be larger than the tokenizer (a small corpus trains
    fewer pieces than `model.vocab_size`), and an id the tokenizer does not have cannot be decoded.

    Returns:
      `(tokens [b, t], lengths [b])` with the new tokens written in place.
    """
    if max_new_tokens <= 0:
        return tokens, lengths
    b, t = tokens.shape
    rows = jnp.arange(b)
    model = nnx.merge(graphdef, params)

    def emit(carry, logits):
        """Writes the argmax of `logits [b, v]` at each unfinished row's next position."""
        tokens, lengths, done = carry
        nxt = jnp.argmax(logits[:, :vocab_limit], axis=-1).astype(tokens.dtype)
        at = jnp.clip(lengths, 0, t - 1)
        write = ~done & (lengths < t)
        tokens = tokens.at[rows, at].set(jnp.where(write, nxt, tokens[rows, at]))
        lengths = lengths + write.astype(lengths.dtype)
        done = done | (write & (nxt == eos_id)) | (lengths >= t)
        return (tokens, lengths, done), nxt, at

    h, cache = model.decode(tokens[:, :prefill], model.init_cache(b, t), jnp.zeros_like(lengths))
    carry, nxt, at = emit(
        (tokens, lengths, jnp.zeros_like(lengths, bool)), model.logits(h[rows, jnp.clip(lengths - 1, 0, prefill - 1)])
    )

    def body(_, state):
        carry, nxt, at, cache = state
        # A finished row decodes its last token again at a position nobody reads: harmless.
        h, cache = model.decode(nxt[:, None], cache, at)
        carry, nxt, at = emit(carry, model.logits(h[:, 0]))
        return carry, nxt, at, cache

    (tokens, lengths, _), *_ = jax.lax.fori_loop(0, max_new_tokens - 1, body, (carry, nxt, at, cache))
    return tokens, lengths


def prompt_buffer(
    prompts: Sequence[Sequence[int]], max_new_tokens: int, max_len: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Right-padded prompts with room for `max_new_tokens`: `(tokens [b, t] int32, lengths [b],
    prefill)`. `t` is rounded up to a multiple of 16 and `prefill` (covers every prompt) to one of
    8, both capped at `max_len`, so that calls share compilations.

    Raises:
      ValueError: a prompt leaves no room to generate below `max_len`.
    """
    longest = max(len(p) for p in prompts)
    if longest >= max_len:
        raise ValueError(f"a prompt of {longest} tokens leaves no room below max_len={max_len}")
    t = min(-(-(longest + max_new_tokens) // 16) * 16, max_len)
    buf = np.full((len(prompts), t), tokenizer_lib.PAD_ID, np.int32)
    for i, p in enumerate(prompts):
        buf[i, : len(p)] = p
    return buf, np.asarray([len(p) for p in prompts], np.int32), min(-(-longest // 8) * 8, t)


def greedy_generate(
    graphdef: nnx.GraphDef,
    params: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    max_len: int,
    eos_id: int,
    vocab_limit: int | None = None,
) -> list[list[int]]:
    """Greedy continuations (token ids, without the prompt; EOS kept if emitted).

    Args:
      prompts: token ids per prompt (BOS included).
      max_new_tokens: tokens to generate at most.
      max_len: the model's maximum sequence length (the buffer is at most this long).
      eos_id: stop token.
      vocab_limit: only ids below it are generated (the tokenizer's size).
    """
    if not prompts:
        return []
    buf, lengths, prefill = prompt_buffer(prompts, max_new_tokens, max_len)
    out, new_len = jax.device_get(
        greedy_step_loop(
            params,
            jnp.asarray(buf),
            jnp.asarray(lengths),
            graphdef=graphdef,
            prefill=prefill,
            max_new_tokens=max_new_tokens,
            eos_id=eos_id,
            vocab_limit=vocab_limit,
        )
    )
    return [out[i, len(p) : new_len[i]].tolist() for i, p in enumerate(prompts)]


def complete(
    graphdef: nnx.GraphDef, params: Any, tok: Any, prompts: Sequence[str], max_new_tokens: int, max_len: int
) -> list[str]:
    """Greedy text completions of `prompts` (decoded up to the first EOS)."""
    ids = [[tok.bos_id] + tok.encode(p) for p in prompts]
    outs = greedy_generate(graphdef, params, ids, max_new_tokens, max_len, tok.eos_id, vocab_limit=tok.vocab_size)
    texts = []
    for p, o in zip(ids, outs):
        if tok.eos_id in o:
            o = o[: o.index(tok.eos_id)]
        # Decode with the prompt so that the leading space of the first new word survives.
        head = tok.decode(p)
        full = tok.decode(p + o)
        texts.append(full[len(head) :] if full.startswith(head) else tok.decode(o))
    return texts


def complete_batched(
    graphdef: nnx.GraphDef,
    params: Any,
    tok: Any,
    prompts: Sequence[str],
    max_new_tokens: int,
    max_len: int,
    batch_size: int = 64,
) -> list[str]:
    """`complete` over any number of prompts in batches of exactly `batch_size` (one compiled shape).

    A prompt that leaves no room to generate below `max_len` gets the completion "".
    """
    fits = [len(tok.encode(p)) + 1 < max_len for p in prompts]
    out: list[str] = []
    for start in range(0, len(prompts), batch_size):
        chunk = [
            p if ok else "" for p, ok in zip(prompts[start : start + batch_size], fits[start : start + batch_size])
        ]
        padded = chunk + [""] * (batch_size - len(chunk))  # one batch shape: one compilation
        out += complete(graphdef, params, tok, padded, max_new_tokens, max_len)[: len(chunk)]
    return [c if ok else "" for c, ok in zip(out, fits)]
