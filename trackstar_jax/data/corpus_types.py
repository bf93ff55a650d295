"""The corpus's types: the `config.data` section (`DataConfig`), its records (`Example`, `Fact`,
`Corpus`) and what every source builds them with (`make_corpus`, `fingerprint`, `check_passage`).

Below `corpus.py` (which reads the sources and saves a corpus) and the sources in their own
modules (`embedded.py`, `seqio_source.py`), which build on these types: `corpus.py` imports them,
never the other way round.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Sequence

from trackstar_jax import files as files_lib

SOURCES = ("embedded", "lama", "text", "jsonl", "seqio")

# ---------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EmbeddedConfig:
    """Size of the embedded fact corpus (`config.data.embedded`)."""

    num_entities: int = 200  # invented entities: people, cities, countries, languages, companies
    num_facts: int = 120  # facts stated in the corpus (spread evenly over the relations)
    phrasings_per_fact: int = 3  # passages per fact, each in a distinct phrasing
    num_distractors: int = 200  # passages that mention entities but state no fact


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Typed view of `config.data` (see experiments/base.py for each key)."""

    source: str = "embedded"
    path: str = ""
    text_key: str = "text"
    seqio_task: str = ""
    seqio_split: str = "train"
    seqio_module: str = ""
    relations: str = ""
    max_examples: int = 0
    max_evidence_per_fact: int = 8
    evidence_seed: int = 0
    embedded: EmbeddedConfig = EmbeddedConfig()
    tokenizer_model_type: str = "unigram"
    eval_fraction: float = 0.05
    statements_per_fact: int = 0
    eval_fact_fraction: float = 0.0
    fact_split_seed: int = 0
    templates_file: str = ""
    pararel_dir: str = ""

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"config.data.source must be one of {SOURCES}, got {self.source!r}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"config.data.eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.max_examples < 0:
            raise ValueError(f"config.data.max_examples must be >= 0, got {self.max_examples}")
        if self.max_evidence_per_fact < 0:
            raise ValueError(f"config.data.max_evidence_per_fact must be >= 0, got {self.max_evidence_per_fact}")
        if self.source in ("lama", "text", "jsonl") and not self.path:
            raise ValueError(f"config.data.path is required for config.data.source={self.source!r}")
        if self.statements_per_fact < 0:
            raise ValueError(f"config.data.statements_per_fact must be >= 0, got {self.statements_per_fact}")
        if not 0.0 <= self.eval_fact_fraction < 1.0:
            raise ValueError(f"config.data.eval_fact_fraction must be in [0, 1), got {self.eval_fact_fraction}")
        if (self.statements_per_fact or self.eval_fact_fraction) and self.source != "lama":
            raise ValueError(
                "config.data.statements_per_fact / eval_fact_fraction (templated statements, fact split) "
                f"need config.data.source='lama', got {self.source!r}"
            )
        if self.source == "seqio" and not self.seqio_task:
            raise ValueError("config.data.seqio_task is required for config.data.source='seqio'")


# ---------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Example:
    """One training passage; `example_id` is its row in the attribution index (0..N-1)."""

    example_id: int
    text: str


@dataclasses.dataclass(frozen=True)
class Fact:
    """A (subject, relation, object) fact with the ids of every passage that states it."""

    fact_id: str
    subject: str
    relation: str
    object: str
    object_aliases: tuple[str, ...]
    subject_aliases: tuple[str, ...]
    evidence_ids: tuple[int, ...]
    split: str = ""  # "train" (its templated statements are in the corpus) | "eval" (queried) | "" (no split)


@dataclasses.dataclass
class Corpus:
    """Training examples (ids 0..N-1), facts with gold evidence, prompt templates.

    Attributes:
      name: source description (e.g. `embedded(seed=0)`, `lama:../shared/data/lama`).
      examples: `examples[i].example_id == i`.
      facts: facts with `evidence_ids` into `examples` (empty for text / jsonl / seqio).
      templates: `templates[relation]` = prompts like "[X] was born in" (end before [Y]);
        filled by the embedded source, empty for LAMA.
      fingerprint: sha256 of the id -> text mapping (index manifests store it).
      eval_texts: held-out passages for the eval loss (never examples, never indexed).
      info: how the corpus was made (fact split, counts, seeds), saved in meta.json.
    """

    name: str
    examples: list[Example]
    facts: list[Fact]
    templates: dict[str, list[str]]
    fingerprint: str
    eval_texts: tuple[str, ...] = ()
    info: dict = dataclasses.field(default_factory=dict)

    @property
    def texts(self) -> list[str]:
        return [e.text for e in self.examples]


def fingerprint(texts: Sequence[str]) -> str:
    """sha256 of the id -> text mapping (`"{id}\\t{text}\\n"` per example)."""
    h = hashlib.sha256()
    for i, t in enumerate(texts):
        h.update(f"{i}\t{t}\n".encode("utf-8"))
    return h.hexdigest()


def make_corpus(name, texts, facts, templates, eval_texts, info=None) -> Corpus:
    if not texts:
        raise ValueError(f"corpus {name} has no examples (check config.data.path / relations / max_examples)")
    examples = [Example(i, t) for i, t in enumerate(texts)]
    return Corpus(name, examples, facts, templates, fingerprint(texts), tuple(eval_texts), dict(info or {}))


def check_passage(text: str, where: str) -> str:
    """`text` stripped, or a ValueError naming `where` (not a string, blank, or not valid text)."""
    if not isinstance(text, str):
        raise ValueError(f"passage at {where} is not a string: {text!r}")
    if not text.strip():
        raise ValueError(f"empty passage at {where}")
    return files_lib.check_text(text, where, "passage").strip()
