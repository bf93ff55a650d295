"""Greedy completions of fact prompts: the cached decoder (`models.generate`) against a full forward
over the whole buffer per new token (what `generate` did before its key/value cache), same
prompts, same batches, one process. One JSON line.

    python -m benchmarks.generate [--model smollm2] [--prompts 256] [--batch 16] [--max_new_tokens 6]

Prompts: the paper-style template 0 of Run A's relations (`experiments/trex_table1.CPU_RELATIONS`)
filled with the subjects of the first facts of each (`--lama_dir`, default ../shared/data/lama),
as §A.4's cap completes them (`queries.predict`: batches of `eval.completion_batch_size`, 6 new
tokens). "tiny_llama" (a random 4-layer Llama, random-token prompts) needs no data or wheel: the
test suite runs it. Each timing is the whole set of prompts after a warm-up batch has compiled
both paths; `same_tokens` counts the prompts whose generated ids are equal.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.imported import _load
from experiments import trex_table1
from trackstar_jax.evaluation import queries
from trackstar_jax.models import generate
from trackstar_jax.models import lm as model_lib

RELATIONS = tuple(trex_table1.CPU_RELATIONS.split(","))  # Run A's


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens"))
def _uncached(params, tokens, lengths, *, graphdef, max_new_tokens):
    """The baseline: each step runs the model over the whole buffer `[b, t]` and takes the logits at
    each row's last position (no EOS stop: Run A's prompts rarely end early, and both paths then
    run all steps)."""
    t, rows = tokens.shape[1], jnp.arange(tokens.shape[0])

    def body(_, carry):
        tokens, lengths = carry
        logits = model_lib.apply(graphdef, params, tokens)
        nxt = jnp.argmax(logits[rows, jnp.clip(lengths - 1, 0, t - 1)], axis=-1).astype(tokens.dtype)
        at = jnp.clip(lengths, 0, t - 1)
        return tokens.at[rows, at].set(nxt), jnp.minimum(lengths + 1, t)

    return jax.lax.fori_loop(0, max_new_tokens, body, (tokens, lengths))


def _fact_prompts(lama_dir: pathlib.Path, tok, n: int) -> list[list[int]]:
    templates = queries.load_templates(lama_dir, lama_dir.parent / "pararel", RELATIONS)
    per = -(-n // len(RELATIONS))
    out = []
    for rel in RELATIONS:
        with gzip.open(lama_dir / "TREx" / f"{rel}.jsonl.gz", "rt") as f:
            for _, line in zip(range(per), f):
                prompt = templates[rel][0].replace("[X]", json.loads(line)["sub_label"])
                out.append([tok.bos_id] + tok.encode(prompt))
    return out[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 or tiny_llama")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max_new_tokens", type=int, default=6)
    ap.add_argument("--lama_dir", default=str(pathlib.Path(__file__).resolve().parents[2] / "shared/data/lama"))
    args = ap.parse_args()

    cfg, params = _load(args.model, max_len=128)
    graphdef, _ = model_lib.abstract_params(cfg)
    if args.model == "smollm2":
        from trackstar_jax.training import importer  # noqa: PLC0415

        tok = importer.load_source(importer.SMOLLM2)[2]
        prompts = _fact_prompts(pathlib.Path(args.lama_dir), tok, args.prompts)
        eos = tok.eos_id
    else:
        rng = np.random.default_rng(0)
        prompts = [
            [2] + rng.integers(4, cfg.vocab_size, int(rng.integers(6, 16))).tolist() for _ in range(args.prompts)
        ]
        eos = -1  # never emitted: every row runs all steps, as the baseline
    batches = [prompts[lo : lo + args.batch] for lo in range(0, len(prompts), args.batch)]
    batches = [b + [b[-1]] * (args.batch - len(b)) for b in batches]  # one batch shape, as complete_batched

    def cached(batch):
        return generate.greedy_generate(graphdef, params, batch, args.max_new_tokens, cfg.max_len, eos)

    def uncached(batch):
        buf, lengths, _ = generate.prompt_buffer(batch, args.max_new_tokens, cfg.max_len)
        out, _ = jax.device_get(
            _uncached(
                params, jnp.asarray(buf), jnp.asarray(lengths), graphdef=graphdef, max_new_tokens=args.max_new_tokens
            )
        )
        return [out[i, len(p) : len(p) + args.max_new_tokens].tolist() for i, p in enumerate(batch)]

    result = {"model": args.model, "prompts": len(prompts), "batch": args.batch, "max_new_tokens": args.max_new_tokens}
    outs = {}
    for name, fn in (("uncached", uncached), ("cached", cached)):
        shapes = {(-(-max(map(len, b)) // 8), -(-(max(map(len, b)) + args.max_new_tokens) // 16)): b for b in batches}
        for b in shapes.values():  # compile every prefill / buffer shape first
            fn(b)
        start = time.perf_counter()
        outs[name] = [o for b in batches for o in fn(b)][: len(prompts)]
        result[f"{name}_s_per_prompt"] = round((time.perf_counter() - start) / len(prompts), 5)
    # EOS cuts a cached row short; compare the tokens up to and including its EOS.
    same = sum(c == u[: len(c)] for c, u in zip(outs["cached"], outs["uncached"]))
    result["same_tokens"] = f"{same}/{len(prompts)}"
    result["cached_speedup"] = round(result["uncached_s_per_prompt"] / result["cached_s_per_prompt"], 2)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
