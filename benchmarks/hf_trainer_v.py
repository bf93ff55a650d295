"""A real `transformers.Trainer` checkpoint of a tiny Llama, and how far an estimated V moves
TrackStar's top-10 from the optimizer's real V.

    python -m benchmarks.hf_trainer_v --out /tmp/hf_trainer_v [--optims adamw_torch,adafactor] [--steps 40]

For each optimizer (`TrainingArguments.optim`): trains a Llama with experiments/tiny.py's shapes
(2 layers x 64, vocab 512) for `--steps` steps of 8 passages on tiny.py's embedded corpus with
`transformers.Trainer` (torch CPU), and saves `checkpoint-<steps>/` with the model, its
tokenizer and `optimizer.pt`. Then imports it twice with `launch.import_model`'s stage: with the
checkpoint's real V (`training.optimizer_state`), and without `optimizer.pt` (V estimated from
`vectors.estimate_v_examples` per-example gradients, `training.second_moment`); builds tiny.py's
TrackStar index on each and retrieves the top-10 of `--queries` queries (a corpus passage's last
word as the completion of the rest). Prints one JSON object per optimizer: the mean top-10 overlap
|A ∩ B| / 10 between the two and the share of queries with the same top-1.

`make_checkpoint` is what tests/test_hf_trainer.py runs to get its fixture. torch and
transformers are test-only dependencies (launch/_venv.sh), never the package's.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil


def tiny_settings():
    """experiments/tiny.py's settings (the model the checkpoint has, the corpus it trains on)."""
    from experiments import tiny
    from trackstar_jax import config as config_lib

    return config_lib.from_configdict(tiny.get_config())


def make_checkpoint(out: str | os.PathLike, optim: str, *, steps: int = 3, seed: int = 0) -> pathlib.Path:
    """Trains tiny.py's Llama with `transformers.Trainer(optim=optim)` for `steps` steps (batch 8,
    weight decay 0.1, so both parameter groups are used) and returns `out/checkpoint-<steps>`."""
    import tokenizers
    import torch
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from trackstar_jax import data as data_lib

    out = pathlib.Path(out)
    s = tiny_settings()
    m = s.model
    texts = data_lib.build_corpus(s.data, s.seed).texts
    tk = tokenizers.Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    config = transformers.LlamaConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.embed_dim,
        intermediate_size=m.mlp_dim,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=1,
        head_dim=m.head_dim,
        max_position_embeddings=m.max_len,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    eos = tokenizer.eos_token_id
    rows = []
    for t in texts:
        ids = [eos] + tk.encode(t).ids[: m.max_len - 1]
        pad = m.max_len - len(ids)
        rows.append(
            {
                "input_ids": torch.tensor(ids + [eos] * pad),
                "attention_mask": torch.tensor([1] * len(ids) + [0] * pad),
                "labels": torch.tensor(ids + [-100] * pad),
            }
        )
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        weight_decay=0.1,
        optim=optim,
        save_strategy="steps",
        save_steps=steps,
        logging_steps=steps,
        report_to="none",
        use_cpu=True,
        seed=seed,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)
    trainer.train()
    return out / f"checkpoint-{steps}"


def without_optimizer(checkpoint: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """A copy of the checkpoint's model folder without `optimizer.pt` (so V is estimated)."""
    from trackstar_jax.models import hf_trainer

    out.mkdir(parents=True, exist_ok=True)
    for f in checkpoint.iterdir():
        if f.is_file() and f.name != hf_trainer.OPTIMIZER_FILE:
            shutil.copy(f, out / f.name)
    return out


def text_queries(corpus_texts: list[str], n: int) -> list:
    """`n` queries: passage i's last word (its fact's object) as the completion of the rest."""
    from trackstar_jax.retrieval import stage as retrieval_stage

    out = []
    for i, t in enumerate(corpus_texts):
        head, _, last = t.rstrip(".").rpartition(" ")
        if head:
            out.append(retrieval_stage.TextQuery(f"q{i}", head, " " + last))
        if len(out) == n:
            break
    return out


def top10(source: pathlib.Path, workdir: pathlib.Path, queries: list, estimate_examples: int) -> list[list[int]]:
    """Imports `source` into `workdir`, builds tiny.py's index and retrieves each query's top-10."""
    from experiments import tiny
    from trackstar_jax import config as config_lib
    from trackstar_jax import stages
    from trackstar_jax.retrieval import stage as retrieval_stage

    c = tiny.get_config()
    c.model.source = str(source)
    c.vectors.estimate_v_examples = estimate_examples
    settings = config_lib.from_configdict(c)
    stages.import_model(settings, workdir)
    stages.build_index(settings, workdir)
    run = stages.load_run(workdir)
    recs, _ = retrieval_stage.retrieve_queries(run, settings, workdir, queries, k=10)
    return [list(r["proponent_ids"]) for r in recs]


def compare(a: list[list[int]], b: list[list[int]]) -> dict:
    """Mean |A ∩ B| / 10 and the share of equal top-1s over paired lists."""
    return {
        "top10_overlap": round(sum(len(set(x) & set(y)) / 10 for x, y in zip(a, b)) / len(a), 4),
        "same_top1": round(sum(x[:1] == y[:1] for x, y in zip(a, b)) / len(a), 4),
        "queries": len(a),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="working folder (checkpoints and runs are written here)")
    p.add_argument("--optims", default="adamw_torch,adafactor", help="TrainingArguments.optim values")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--queries", type=int, default=40)
    p.add_argument("--estimate_v_examples", type=int, default=64)
    a = p.parse_args()
    out = pathlib.Path(a.out)
    from trackstar_jax import data as data_lib

    s = tiny_settings()
    queries = text_queries(data_lib.build_corpus(s.data, s.seed).texts, a.queries)
    for optim in a.optims.split(","):
        ckpt = make_checkpoint(out / optim / "trainer", optim, steps=a.steps)
        real = top10(ckpt, out / optim / "run_real", queries, a.estimate_v_examples)
        folder = without_optimizer(ckpt, out / optim / "model_only")
        est = top10(folder, out / optim / "run_estimated", queries, a.estimate_v_examples)
        print(
            json.dumps(
                {
                    "optim": optim,
                    "trainer_steps": a.steps,
                    "estimate": f"per-example, {a.estimate_v_examples} corpus passages (training.second_moment)",
                    "real_vs_estimated": compare(real, est),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
