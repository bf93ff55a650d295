"""Writes the files behind the demo seqio Tasks of `tasks.py` (no seqio needed).

`python -m experiments.seqio_demo.make_data DATA_DIR` writes, from the embedded fact corpus
(seed 0, small): the passages that state a fact in `facts-0000{0,1}-of-00002.txt` and the
distractor passages in `other-00000-of-00001.txt` (one passage per line, the layout of a
text-line corpus a T5X user keeps), a SentencePiece model `spm.model` trained on the same text
(T5's ids: pad 0, eos 1, unk 2, no bos) and `queries.jsonl`, one `{"prompt", "target"}` per
fact (template 0), for `launch.retrieve`.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import sentencepiece as spm

from trackstar_jax.data import corpus_types as corpus_lib
from trackstar_jax.data import embedded

FACT_SHARDS = 2
VOCAB_SIZE = 256


def write_demo_data(data_dir: str | pathlib.Path, num_facts: int = 40, num_distractors: int = 40) -> pathlib.Path:
    """Writes the demo corpus, vocabulary and queries into `data_dir` (created); returns it."""
    d = pathlib.Path(data_dir)
    d.mkdir(parents=True, exist_ok=True)
    cfg = corpus_lib.EmbeddedConfig(num_entities=60, num_facts=num_facts, num_distractors=num_distractors)
    c = embedded.generate_embedded(cfg, seed=0, eval_fraction=0.0)
    evidence = {i for f in c.facts for i in f.evidence_ids}
    facts = [t for i, t in enumerate(c.texts) if i in evidence]
    other = [t for i, t in enumerate(c.texts) if i not in evidence]
    for k in range(FACT_SHARDS):
        _write_lines(d / f"facts-{k:05d}-of-{FACT_SHARDS:05d}.txt", facts[k::FACT_SHARDS])
    _write_lines(d / "other-00000-of-00001.txt", other)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(c.texts),
        model_prefix=str(d / "spm"),
        vocab_size=VOCAB_SIZE,
        model_type="unigram",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        minloglevel=2,
    )
    queries = [
        {"prompt": embedded.fill_template(c.templates[f.relation][0], f.subject), "target": " " + f.object}
        for f in c.facts
    ]
    _write_lines(d / "queries.jsonl", [json.dumps(q) for q in queries])
    return d


def _write_lines(path: pathlib.Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data_dir")
    print(write_demo_data(p.parse_args().data_dir))
