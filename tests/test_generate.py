"""Incremental decoding (`DecoderLM.decode`, `layers.cached_attention`) and cached greedy generation,
against the full forward pass of every architecture: the reference is the model's own `hidden` /
`apply` over whole sequences, with no cache."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import arch_config
from flax import nnx

from trackstar_jax.models import generate
from trackstar_jax.models import lm as model_lib

pytestmark = pytest.mark.usefixtures("fast_compile")  # conftest.py: cheaper compiles, restored on exit

VOCAB = 64
# Each architecture's attention path: GQA with biases and an untied head (llama), multi-head with
# partial rotary, parallel and sequential residual (gpt_neox), multi-query with the scaled tied
# head (palm).
CONFIGS = {
    "llama": arch_config("llama", vocab_size=VOCAB, qkv_bias=True, tie_embeddings=False),
    "gpt_neox_parallel": arch_config("gpt_neox", vocab_size=VOCAB, parallel_residual=True),
    "gpt_neox_sequential": arch_config("gpt_neox", vocab_size=VOCAB, parallel_residual=False),
    "palm": model_lib.LMConfig(
        arch="palm", vocab_size=VOCAB, num_layers=2, embed_dim=32, num_heads=4, head_dim=8, mlp_dim=64, max_len=16
    ),
}
# bfloat16 operands: both paths round the same GEMM operands; they differ in summation order, so
# the agreement is bf16's, not float32's.
TOLERANCE = {"": 2e-5, "bfloat16": 3e-2}


def _model(name, matmul_dtype):
    cfg = dataclasses.replace(CONFIGS[name], matmul_dtype=matmul_dtype)
    return model_lib.split_model(model_lib.make_model(cfg, seed=3))


@pytest.mark.parametrize("matmul_dtype", sorted(TOLERANCE))
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_decode_equals_the_full_forward(name, matmul_dtype):
    """Right-padded prompts of different lengths fill the cache in one call; then each row's
    next tokens are decoded one at a time at its own position. Every hidden state equals the
    full forward's at that position of the row's true sequence (the padding the prefill cached
    is overwritten before it is read)."""
    graphdef, params = _model(name, matmul_dtype)
    t = CONFIGS[name].max_len
    rng = np.random.default_rng(0)
    seq = rng.integers(4, VOCAB, size=(3, t)).astype(np.int32)
    lengths = np.asarray([3, 5, 8], np.int32)
    buf = np.where(np.arange(t)[None] < lengths[:, None], seq, 0).astype(np.int32)
    rows = np.arange(3)

    full = jax.jit(lambda p, toks: nnx.merge(graphdef, p).hidden(toks))
    step = jax.jit(lambda p, toks, cache, pos: nnx.merge(graphdef, p).decode(toks, cache, pos))

    want = np.asarray(full(params, jnp.asarray(seq)))
    tol = TOLERANCE[matmul_dtype]
    model = nnx.merge(graphdef, params)
    h, cache = step(params, jnp.asarray(buf[:, :8]), model.init_cache(3, t), jnp.zeros(3, jnp.int32))
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(h)[i, :n], want[i, :n], rtol=tol, atol=tol)
    for s in range(t - int(lengths.max())):
        pos = lengths + s
        h, cache = step(params, jnp.asarray(seq[rows, pos][:, None]), cache, jnp.asarray(pos))
        np.testing.assert_allclose(np.asarray(h)[:, 0], want[rows, pos], rtol=tol, atol=tol, err_msg=f"step {s}")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cached_greedy_equals_the_uncached_argmax(name):
    """`greedy_generate` (prefill + one position per step) against the argmax of a full forward
    over the whole sequence so far, token by token: EOS stops a row, `vocab_limit` bounds the
    ids, and no tokens are asked for none."""
    graphdef, params = _model(name, "")
    max_len = CONFIGS[name].max_len
    forward = jax.jit(lambda p, toks: model_lib.apply(graphdef, p, toks))
    prompts = [[2, 10, 11, 12], [2, 40], [2, 7, 7, 7, 7, 7, 7, 7, 7]]

    # The EOS id is a token the model really emits for one of the prompts, so that stopping is exercised.
    def last_logits(seq):  # one buffer shape, one compile; causal, so the padding cannot matter
        buf = np.zeros((1, max_len), np.int32)
        buf[0, : len(seq)] = seq
        return np.asarray(forward(params, jnp.asarray(buf)))[0, len(seq) - 1]

    first = [int(np.argmax(last_logits(p))) for p in prompts]
    eos = first[1]
    for limit in (None, 37):
        got = generate.greedy_generate(graphdef, params, prompts, 6, max_len, eos_id=eos, vocab_limit=limit)
        for p, g in zip(prompts, got):
            seq = list(p)
            while len(seq) < min(len(p) + 6, max_len):
                nxt = int(np.argmax(last_logits(seq)[:limit]))
                seq.append(nxt)
                if nxt == eos:
                    break
            assert g == seq[len(p) :], (name, limit, p)
            assert limit is None or max(g) < limit
    assert generate.greedy_generate(graphdef, params, prompts, 0, max_len, eos_id=eos) == [[], [], []]


def test_generate_benchmark_runs(capsys, monkeypatch):
    """`benchmarks.generate` at toy size: both paths run and generate the same ids."""
    from benchmarks import generate as bench

    monkeypatch.setattr("sys.argv", ["generate", "--model=tiny_llama", "--prompts=6", "--batch=4"])
    bench.main()
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["same_tokens"] == "6/6" and row["cached_s_per_prompt"] > 0 and row["uncached_s_per_prompt"] > 0
