"""Greedy decoding with the pure forward pass (no KV cache: prompts here are short).

Used to report completions of fact prompts after pretraining and to get the model's own
prediction as a query target (`eval.query_mode = "prediction"`, paper §4.2).
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
from trackstar_jax.models import lm as model_lib


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "eos_id", "vocab_limit"))
def greedy_step_loop(
    params: Any,
    tokens: Int[Array, "b t"],
    lengths: Int[Array, " b"],
    *,
    graphdef: nnx.GraphDef,
    max_new_tokens: int,
    eos_id: int,
    vocab_limit: int | None = None,
) -> tuple[Int[Array, "b t"], Int[Array, " b"]]:
    """Appends up to `max_new_tokens` argmax tokens after each row's first `lengths[b]` tokens.

    Rows are right-padded; causal attention means padding after position `lengths[b]-1`
    never changes that position's logits. A row stops after emitting `eos_id` or when the
    buffer `[b, t]` is full. Only ids below `vocab_limit` are chosen: the embedding table may
    be larger than the tokenizer (a small corpus trains fewer pieces than `model.vocab_size`),
    and an id the tokenizer does not have cannot be decoded.

    Returns:
      `(tokens [b, t], lengths [b])` with the new tokens written in place.
    """
    t = tokens.shape[1]
    rows = jnp.arange(tokens.shape[0])

    def body(_, carry):
        tokens, lengths, done = carry
        logits = model_lib.apply(graphdef, params, tokens)  # [b, t, v]
        last = logits[rows, jnp.clip(lengths - 1, 0, t - 1)]
        nxt = jnp.argmax(last[:, :vocab_limit], axis=-1).astype(tokens.dtype)
        write = ~done & (lengths < t)
        tokens = tokens.at[rows, jnp.clip(lengths, 0, t - 1)].set(
            jnp.where(write, nxt, tokens[rows, jnp.clip(lengths, 0, t - 1)])
        )
        lengths = lengths + write.astype(lengths.dtype)
        done = done | (write & (nxt == eos_id)) | (lengths >= t)
        return tokens, lengths, done

    tokens, lengths, _ = jax.lax.fori_loop(0, max_new_tokens, body, (tokens, lengths, jnp.zeros_like(lengths, bool)))
    return tokens, lengths


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
    longest = max(len(p) for p in prompts)
    if longest >= max_len:
        raise ValueError(f"a prompt of {longest} tokens leaves no room below max_len={max_len}")
    # Buffer length rounded up to a multiple of 16 so that calls share compilations.
    t = min(-(-(longest + max_new_tokens) // 16) * 16, max_len)
    buf = np.full((len(prompts), t), tokenizer_lib.PAD_ID, np.int32)
    for i, p in enumerate(prompts):
        buf[i, : len(p)] = p
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    out, new_len = jax.device_get(
        greedy_step_loop(
            params,
            jnp.asarray(buf),
            jnp.asarray(lengths),
            graphdef=graphdef,
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
