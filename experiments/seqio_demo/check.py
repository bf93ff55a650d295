"""Checks a seqio run against seqio itself: `python -m experiments.seqio_demo.check RUN_A RUN_B`.

Both run directories were trained (`launch.train`) from the same config on a seqio Task or
Mixture, RUN_A also indexed and retrieved. Checked, exiting non-zero on the first failure:

  1. ids are stable: RUN_A and RUN_B saved the same corpus (fingerprint, every id -> text), and
     rebuilding it here, in a third process, gives it again;
  2. the passages are what seqio yields: each Task's `task.get_dataset(split, shuffle=False)`
     (for a Mixture every Task with a rate > 0, in `Mixture.tasks` order), feature
     `<text_key>_pretokenized`, is, in order, the run's examples with its held-out passages
     (`data.eval_fraction`) taken out;
  3. retrieval names passages by id: every proponent / opponent text in RUN_A/retrieval/*.jsonl
     is the corpus text of its id, and every id is an index row.

Prints one JSON line of counts. Needs the `seqio` extra (docs/seqio.md).
"""

from __future__ import annotations

import argparse
import json
import pathlib

from trackstar_jax import config as config_lib
from trackstar_jax import data
from trackstar_jax.data import seqio_source


def seqio_passages(data_cfg: data.DataConfig, seed: int) -> list[str]:
    """The passages straight from seqio (strings, stripped), independently of `seqio_source`."""
    seqio = seqio_source.import_seqio()
    __import__(data_cfg.seqio_module)
    provider = seqio.get_mixture_or_task(data_cfg.seqio_task)
    tasks = [provider] if isinstance(provider, seqio.Task) else [t for t in provider.tasks if provider.get_rate(t) > 0]
    out = []
    for task in tasks:
        ds = task.get_dataset(sequence_length=None, split=data_cfg.seqio_split, shuffle=False, seed=seed)
        out += [ex[data_cfg.text_key + "_pretokenized"].decode("utf-8").strip() for ex in ds.as_numpy_iterator()]
    return out


def check(run_a: pathlib.Path, run_b: pathlib.Path) -> dict:
    settings = config_lib.load_run_settings(run_a)
    a, b = data.load_corpus(run_a / "corpus"), data.load_corpus(run_b / "corpus")
    assert a.fingerprint == b.fingerprint and a.examples == b.examples, f"{run_a} and {run_b} saved different corpora"
    again = data.build_corpus(settings.data, settings.seed)
    assert again.fingerprint == a.fingerprint and again.examples == a.examples, "rebuilding the corpus changed it"

    stream = seqio_passages(settings.data, settings.seed)
    held = set(a.eval_texts)
    assert len(set(stream)) == len(stream), "the demo Tasks yield distinct passages"
    assert held <= set(stream), "a held-out passage seqio never yielded"
    assert [t for t in stream if t not in held] == a.texts, "the run's examples are not seqio's passages in order"

    num_records = 0
    for path in sorted((run_a / "retrieval").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            for side in ("proponent", "opponent"):
                ids, texts = r[f"{side}_ids"], r[f"{side}s"]
                assert all(0 <= i < len(a.texts) for i in ids), f"{path}: {side} id outside the index"
                assert texts == [a.texts[i] for i in ids], f"{path}: {side} text is not its id's passage"
            num_records += 1
    assert num_records, f"no retrieval output under {run_a / 'retrieval'}"
    return {
        "fingerprint": a.fingerprint,
        "num_examples": len(a.texts),
        "num_held_out": len(a.eval_texts),
        "num_seqio_passages": len(stream),
        "num_retrieval_records": num_records,
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_a", type=pathlib.Path)
    p.add_argument("run_b", type=pathlib.Path)
    args = p.parse_args()
    print(json.dumps(check(args.run_a, args.run_b)))
