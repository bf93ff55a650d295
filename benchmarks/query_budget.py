"""How many queries §A.4's sampling admits as the candidate set grows (no model is run).

Run A (`experiments/smollm2_table1.py`) queries the facts whose evidence is in the candidate set,
sampled as §A.4 says: frequency buckets (passages of the candidate set naming both entities),
caps on common targets and at most `max_per_bucket / 10` facts the model gets wrong per bucket.
Whether a fact is wrong needs the model, so this draws it at a stated accuracy (`--accuracy`,
seeded; Run A's `query_report.json` gives the measured one, `num_correct_candidates /
num_completed_candidates`) and runs the library's own corpus reader, frequency count and
`queries.select_facts` on the config's data section with `data.max_examples` set to each of
`--max_examples`. One JSON line per size: sentences, facts, facts per bucket before the
wrong-fact cap, and the queries selected (mean and range over `--draws` seeded draws).

    python -m benchmarks.query_budget --config=experiments/smollm2_table1.py \\
        --max_examples=3200,6400,9600,12800 --accuracy=0.028
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json

import numpy as np

from trackstar_jax import config as config_lib
from trackstar_jax.data import corpus as data_lib
from trackstar_jax.evaluation import queries, query_set


def _settings(path: str) -> config_lib.Settings:
    file, _, arg = path.partition(":")
    spec = importlib.util.spec_from_file_location("budget_config", file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return config_lib.from_configdict(mod.get_config(arg or None), source=file)


def budget(settings: config_lib.Settings, max_examples: int, accuracy: float, draws: int) -> dict:
    """Queries §A.4 admits over `max_examples` candidate sentences, correctness drawn at `accuracy`."""
    data = config_lib.section("data", {**config_lib.to_dict(settings.data), "max_examples": max_examples})
    corpus = data_lib.build_corpus(data, settings.seed)
    rel = set(settings.eval.relation_list) or {f.relation for f in corpus.facts}
    facts = [f for f in corpus.facts if f.relation in rel and f.split != "train"]
    mentions = queries.mention_ids(facts, queries.MentionIndex(corpus.texts))
    freq = {k: len(v) for k, v in mentions.items()}
    sel = query_set.selection_config(settings)
    no_cap = queries.select_facts(facts, freq, sel, queries.QueryReport())  # every cap but the wrong-fact one
    counts = []
    for d in range(draws):
        rng = np.random.default_rng(d)
        correct = {f.fact_id: bool(rng.random() < accuracy) for f in facts}
        counts.append(len(queries.select_facts(facts, freq, sel, queries.QueryReport(), correct=correct)))
    return {
        "max_examples": max_examples,
        "sentences": len(corpus.texts),
        "facts": len(facts),
        "per_bucket_before_wrong_cap": dict(
            sorted(collections.Counter(queries.bucket_name(freq[f.fact_id], sel.bucket_edges) for f in no_cap).items())
        ),
        "max_incorrect_per_bucket": sel.max_incorrect_per_bucket,
        "accuracy": accuracy,
        "queries_mean": float(np.mean(counts)),
        "queries_min": int(min(counts)),
        "queries_max": int(max(counts)),
        "draws": draws,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="an experiments file, optionally with :variant")
    ap.add_argument("--max_examples", default="3200,6400,9600,12800")
    ap.add_argument("--accuracy", type=float, required=True, help="share of facts the model completes correctly")
    ap.add_argument("--draws", type=int, default=5)
    a = ap.parse_args(argv)
    if not 0.0 <= a.accuracy <= 1.0:
        ap.error(f"--accuracy must be in [0, 1], got {a.accuracy}")
    settings = _settings(a.config)
    for n in (int(x) for x in a.max_examples.split(",")):
        print(json.dumps(budget(settings, n, a.accuracy, a.draws)), flush=True)


if __name__ == "__main__":
    main()
