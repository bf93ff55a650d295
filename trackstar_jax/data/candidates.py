"""The candidate set: the passages that are indexed and retrieved, apart from the training text.

A run's corpus (`config.data`) is what the model was trained on, or, for an imported model
(trained elsewhere), simply the passages read. The *candidates* (`config.candidates`) are the
passages attributed over: the index rows, BM25's and the dense row's documents, the gold
passages of a fact and the tail-patch proponents. They are a view of the corpus chosen by a
named rule, so they need no reader of their own and their ids are stable:

* `"all"`: every corpus passage (the default; e.g. the quickstart's embedded corpus).
* `"natural"`: only passages read from the source (for LAMA T-REx, the evidence sentences);
  templated statements the pipeline adds to the training text (`data.statements_per_fact`)
  are never candidates. This is the paper's closed set (§5: the candidates are the T-REx
  Wikipedia abstract sentences; the model was trained on another corpus, C4).

Why a section of its own and not a `config.data` key: `data` defines the run (a checkpoint is
refused when it differs), while the candidate set belongs to the later stages like the index
does: one trained run can be attributed over several candidate sets without retraining. The
view gets its own fingerprint, which the index manifest records, so an index of other
candidates is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from trackstar_jax.data import corpus_types as corpus_lib


@dataclasses.dataclass(frozen=True)
class CandidateConfig:
    """`config.candidates`: which corpus passages are indexed and retrieved (module docstring)."""

    passages: str = "all"

    def __post_init__(self):
        if self.passages not in PASSAGE_SETS:
            raise ValueError(f"candidates.passages must be one of {tuple(PASSAGE_SETS)}, got {self.passages!r}")


def _all(corpus: corpus_lib.Corpus) -> list[int]:
    return list(range(len(corpus.examples)))


def _natural(corpus: corpus_lib.Corpus) -> list[int]:
    from trackstar_jax.data import templates as templates_lib  # noqa: PLC0415  (templates build on answers)

    statements = templates_lib.statement_ids(corpus)
    return [i for i in range(len(corpus.examples)) if i not in statements]


# name -> the corpus ids it keeps (in corpus order)
PASSAGE_SETS: dict[str, Callable[[corpus_lib.Corpus], list[int]]] = {"all": _all, "natural": _natural}


def select(corpus: corpus_lib.Corpus, cfg: CandidateConfig) -> corpus_lib.Corpus:
    """The candidate view of `corpus`: kept passages renumbered 0..M-1 in corpus order, facts'
    evidence ids mapped into them (evidence that is not a candidate is dropped), templates and
    held-out passages unchanged, its own fingerprint; `info["candidates"]` says what was kept.

    Raises:
      ValueError: the rule keeps no passage (names it and the corpus).
    """
    if cfg.passages == "all":
        return corpus
    keep = PASSAGE_SETS[cfg.passages](corpus)
    if not keep:
        raise ValueError(f"config.candidates.passages={cfg.passages!r} keeps no passage of corpus {corpus.name}")
    new_id = {old: new for new, old in enumerate(keep)}
    texts = [corpus.examples[i].text for i in keep]
    facts = [
        dataclasses.replace(f, evidence_ids=tuple(new_id[e] for e in f.evidence_ids if e in new_id))
        for f in corpus.facts
    ]
    info = {
        **corpus.info,
        "candidates": {
            "passages": cfg.passages,
            "num_candidates": len(keep),
            "num_corpus_passages": len(corpus.examples),
            "corpus_fingerprint": corpus.fingerprint,
        },
    }
    return corpus_lib.make_corpus(
        f"{corpus.name} [candidates: {cfg.passages}]", texts, facts, corpus.templates, corpus.eval_texts, info
    )
