"""Training corpus with stable example ids: sources, the typed `config.data`, saving beside the run.

Every training example is one passage (truncated to the model's max length, never packed
with others) with a stable integer `example_id` = its row in the attribution index. The same
data config gives the same id -> text mapping (`Corpus.fingerprint` is its sha256), which is
saved beside the run (`workdir/corpus/`) so that proponents can be shown as text.

Sources (`config.data.source`):
  * `embedded`: a seeded generator of a small fact corpus (invented entities with
    pronounceable names, 10 relations, several phrasings per fact as separate passages,
    distractor passages that state no fact) with exact gold `evidence_ids` and >= 3 prompt
    templates per relation that end right before the object (paper §A.4 / Table A.1 style).
  * `lama`: LAMA T-REx `TREx/P*.jsonl.gz` files (each evidence's `masked_sentence` with
    `[MASK]` -> `obj_surface` is one passage; passages are deduplicated; a fact's gold
    evidence is every passage made from its evidences).
  * `text` (one passage per non-blank line) and `jsonl` (one passage per record, field
    `config.data.text_key`), from a file or a folder of such files.
  * `seqio`: a registered seqio Task or Mixture (optional `seqio` extra; `seqio_source.py`).

Held-out passages for the eval loss (`Corpus.eval_texts`) are never examples, so they never
enter the index. Batches follow the convention in `model.py`: `tokens [B, T]` (BOS first,
PAD_ID padding at the end), `loss_mask [B, T]`, `example_id [B]` (-1 for padding rows).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import tempfile
from typing import Sequence

import numpy as np

from trackstar_jax import files as files_lib

SOURCES = ("embedded", "lama", "text", "jsonl", "seqio")
CORPUS_FORMAT_VERSION = 1

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


def build_corpus(cfg: DataConfig, seed: int = 0) -> Corpus:
    """Builds the corpus that `config.data` describes (deterministic in config and seed).

    Args:
      cfg: the typed `config.data` (`config.from_configdict(...).data`).
      seed: the run seed (embedded generation, a seqio Task's stochastic preprocessors; the
        held-out split is content-hashed).

    Returns:
      A `Corpus` whose example ids depend only on the config and seed.

    Raises:
      ValueError: no examples, an empty passage (named by file:line).
    """
    if cfg.source == "embedded":
        from trackstar_jax.data import embedded  # noqa: PLC0415  (embedded builds on this module's types)

        return embedded.generate_embedded(cfg.embedded, seed, cfg.eval_fraction, cfg.max_examples)
    templates, info = {}, {}
    if cfg.source == "lama":
        texts, facts = _read_lama(cfg)
        name = f"lama:{cfg.path}"
        if cfg.statements_per_fact or cfg.eval_fact_fraction or cfg.templates_file:
            texts, facts, templates, info = _with_statements(cfg, texts, facts)
    elif cfg.source in ("text", "jsonl"):
        texts, facts = _read_text_files(cfg), []
        name = f"{cfg.source}:{cfg.path}"
    else:
        from trackstar_jax.data import seqio_source  # noqa: PLC0415  (optional extra; builds on this module)

        (texts, info), facts = seqio_source.read(cfg, seed), []
        name = f"seqio:{cfg.seqio_task}/{cfg.seqio_split}"
    texts, facts, eval_texts = _split_eval(texts, facts, cfg.eval_fraction)
    return make_corpus(name, texts, facts, templates, eval_texts, info)


def _unit_hash(*parts: object) -> float:
    """A number in [0, 1) from the sha256 of `parts` (stable across runs and machines)."""
    key = "\0".join(str(p) for p in parts).encode("utf-8")
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / 2.0**64


def fact_split(fact: Fact, eval_fraction: float, seed: int) -> str:
    """ "eval" for ~`eval_fraction` of facts, else "train", by a seeded hash of the fact's key.

    The key is (subject, relation, object), lowercased, so duplicate facts (several LAMA lines of
    one triple) land in the same split and an eval fact never shares gold with a train fact.
    """
    key = (fact.subject.lower().strip(), fact.relation, fact.object.lower().strip())
    return "eval" if _unit_hash("fact-split", seed, *key) < eval_fraction else "train"


def _with_statements(cfg: DataConfig, texts: list[str], facts: list[Fact]) -> tuple[list, list, dict, dict]:
    """Splits facts into train / eval and adds templated statements of the train facts (§A.4 templates).

    Each train fact gets `statements_per_fact` statements ("Allan Peiper was born in the city
    of: Alexandra."): template 0 (the queried form) first, then others drawn by a seeded hash
    from the LAMA / ParaRel / subject-inside templates. A statement is appended after the
    evidence passages and is an entailing passage of its own fact only; eval facts never get
    one, so their knowledge is only in their evidence sentences.

    Returns:
      (texts, facts with `split` set, templates `{relation: heads}`, info for meta.json).
    """
    from trackstar_jax.data import templates as templates_lib  # noqa: PLC0415  (templates build on answers)

    relations = sorted({f.relation for f in facts})
    root = pathlib.Path(cfg.path)
    templates = templates_lib.load(
        relations,
        lama_dir=root,
        pararel_dir=cfg.pararel_dir or None,
        user_file=cfg.templates_file or None,
    )
    ids = {t: i for i, t in enumerate(texts)}
    texts = list(texts)
    out, counts = [], {"train": 0, "eval": 0}
    num_statements = 0
    for f in facts:
        split = fact_split(f, cfg.eval_fact_fraction, cfg.fact_split_seed)
        counts[split] += 1
        ev = list(f.evidence_ids)
        if split == "train" and cfg.statements_per_fact:
            heads = templates[f.relation]
            rest = sorted(
                range(1, len(heads)), key=lambda j: _unit_hash("statement", cfg.fact_split_seed, f.fact_id, j)
            )
            for j in [0, *rest][: cfg.statements_per_fact]:
                s = templates_lib.statement(heads[j], f.subject, f.object)
                if s not in ids:
                    ids[s] = len(texts)
                    texts.append(s)
                    num_statements += 1
                ev.append(ids[s])
        out.append(dataclasses.replace(f, evidence_ids=tuple(sorted(set(ev))), split=split))
    info = {
        "fact_split": {
            "seed": cfg.fact_split_seed,
            "eval_fact_fraction": cfg.eval_fact_fraction,
            "num_train_facts": counts["train"],
            "num_eval_facts": counts["eval"],
        },
        "statements_per_fact": cfg.statements_per_fact,
        "num_evidence_passages": len(ids) - num_statements,
        "num_templated_statements": num_statements,
        "templates_file": cfg.templates_file,
        "pararel_dir": cfg.pararel_dir,
    }
    return texts, out, templates, info


def _split_eval(texts: list[str], facts: list[Fact], fraction: float) -> tuple[list[str], list[Fact], list[str]]:
    """Holds out ~`fraction` of passages by a hash of their text (stable, order-free).

    A passage that is the last remaining evidence of a fact stays in training, so every fact
    keeps at least one gold passage. Ids are renumbered densely; evidence ids follow.
    """
    if fraction <= 0 or not texts:
        return texts, facts, []
    facts_of: dict[int, list[int]] = {}
    for fi, f in enumerate(facts):
        for e in f.evidence_ids:
            facts_of.setdefault(e, []).append(fi)
    remaining = [len(f.evidence_ids) for f in facts]
    held = np.zeros(len(texts), bool)
    for i, t in enumerate(texts):
        u = int.from_bytes(hashlib.sha256(("eval\0" + t).encode("utf-8")).digest()[:8], "big") / 2.0**64
        if u < fraction and all(remaining[fi] > 1 for fi in facts_of.get(i, ())):
            held[i] = True
            for fi in facts_of.get(i, ()):
                remaining[fi] -= 1
    if held.all():  # a corpus of one or two passages: keep them for training
        held[:] = False
    new_id = np.cumsum(~held) - 1
    train = [t for t, h in zip(texts, held) if not h]
    eval_texts = [t for t, h in zip(texts, held) if h]
    facts = [
        dataclasses.replace(f, evidence_ids=tuple(int(new_id[e]) for e in f.evidence_ids if not held[e])) for f in facts
    ]
    return train, facts, eval_texts


def _check_passage(text: str, where: str) -> str:
    if not isinstance(text, str):
        raise ValueError(f"passage at {where} is not a string: {text!r}")
    if not text.strip():
        raise ValueError(f"empty passage at {where}")
    return files_lib.check_text(text, where, "passage").strip()


# Sources read from `config.data.path`, and the file patterns a folder there must hold.
_PATH_PATTERNS = {"text": ("*.txt", "*.txt.gz"), "jsonl": ("*.jsonl", "*.jsonl.gz", "*.json"), "lama": ("*",)}


def check_source(cfg: DataConfig) -> None:
    """Refuses a `config.data.path` that `build_corpus` could not read (missing, or a folder
    without files of its source), naming it as `build_corpus` would: a stage calls this before
    it writes anything, so a mistyped path leaves nothing on disk.

    Raises:
      FileNotFoundError: the path does not exist or holds no file of the source.
    """
    if cfg.source in _PATH_PATTERNS:
        _files(cfg.path, _PATH_PATTERNS[cfg.source])


def _files(path: str, patterns: Sequence[str]) -> list[pathlib.Path]:
    p = pathlib.Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise FileNotFoundError(f"config.data.path {path!r} does not exist")
    files = sorted({f for pat in patterns for f in p.glob(pat)})
    if not files:
        raise FileNotFoundError(f"no files matching {list(patterns)} under config.data.path {path!r}")
    return files


def _read_text_files(cfg: DataConfig) -> list[str]:
    """Plain text: one passage per non-blank line. jsonl: one passage per record."""
    is_jsonl = cfg.source == "jsonl"
    pats = _PATH_PATTERNS[cfg.source]
    texts = []
    for f in _files(cfg.path, pats):
        for ln, line in files_lib.read_lines(f):
            if not line.strip():
                continue  # blank lines separate passages / records
            where = f"{f}:{ln}"
            if is_jsonl:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"invalid JSON at {where}: {e}") from None
                if not isinstance(rec, dict) or cfg.text_key not in rec:
                    raise ValueError(f"record at {where} has no field config.data.text_key={cfg.text_key!r}")
                texts.append(_check_passage(rec[cfg.text_key], where))
            else:
                texts.append(_check_passage(line, where))
            if cfg.max_examples and len(texts) >= cfg.max_examples:
                return texts
    return texts


def _read_lama(cfg: DataConfig) -> tuple[list[str], list[Fact]]:
    """LAMA T-REx: passages (deduplicated, first-seen order) and facts with gold evidence.

    Facts are visited round-robin over the selected relation files, so that a
    `max_examples` cap keeps every relation; the cap stops before the fact that would
    exceed it (so every kept fact keeps all of its evidence).
    """
    root = pathlib.Path(cfg.path)
    trex = root / "TREx" if (root / "TREx").is_dir() else root
    files = _files(str(trex), ("P*.jsonl.gz", "P*.jsonl"))
    wanted = [r.strip() for r in cfg.relations.split(",") if r.strip()]
    by_rel = {f.name.split(".")[0]: f for f in files}
    if wanted:
        missing = [r for r in wanted if r not in by_rel]
        if missing:
            raise ValueError(f"config.data.relations: no file for {missing} under {trex} (have {sorted(by_rel)})")
        by_rel = {r: by_rel[r] for r in wanted}
    streams = []
    for _rel, f in sorted(by_rel.items()):
        streams.append([(f"{f}:{ln}", line) for ln, line in files_lib.read_lines(f) if line.strip()])
    ids: dict[str, int] = {}
    facts: list[Fact] = []
    for row in range(max((len(s) for s in streams), default=0)):
        for stream in streams:
            if row >= len(stream):
                continue
            where, line = stream[row]
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"invalid JSON at {where}: {e}") from None
            passages, obj_aliases, sub_aliases = [], [rec["obj_label"]], [rec["sub_label"]]
            for j, ev in enumerate(rec.get("evidences", [])):
                ms = ev.get("masked_sentence", "")
                if "[MASK]" not in ms:
                    raise ValueError(f"evidence {j} of fact {rec.get('uuid')} at {where} has no [MASK]")
                passages.append(_check_passage(ms.replace("[MASK]", ev["obj_surface"]), f"{where} evidence {j}"))
                obj_aliases.append(ev["obj_surface"])
                sub_aliases.append(ev.get("sub_surface", rec["sub_label"]))
            new = [p for p in dict.fromkeys(passages) if p not in ids]
            if cfg.max_examples and len(ids) + len(new) > cfg.max_examples:
                return list(ids), facts
            for p in new:
                ids[p] = len(ids)
            facts.append(
                Fact(
                    fact_id=str(rec.get("uuid", f"{rec['predicate_id']}:{rec['sub_uri']}:{rec['obj_uri']}")),
                    subject=rec["sub_label"],
                    relation=rec["predicate_id"],
                    object=rec["obj_label"],
                    object_aliases=tuple(dict.fromkeys(a for a in obj_aliases if a)),
                    subject_aliases=tuple(dict.fromkeys(a for a in sub_aliases if a)),
                    evidence_ids=tuple(sorted({ids[p] for p in passages})),
                )
            )
    return list(ids), facts


# ---------------------------------------------------------------------------------------
# Saving / loading beside the run
# ---------------------------------------------------------------------------------------


def save_corpus(corpus: Corpus, directory: str | os.PathLike) -> None:
    """Writes the corpus to `directory` (examples.jsonl, facts.jsonl, templates.json, ...).

    Raises:
      FileExistsError: `directory` already holds a different corpus (never overwritten).
    """
    d = pathlib.Path(directory)
    if (d / "meta.json").exists():
        meta = files_lib.read_json(
            d / "meta.json", "corpus metadata", "delete the run directory's corpus/ to rebuild it"
        )
        if meta.get("fingerprint") != corpus.fingerprint:
            raise FileExistsError(
                f"{d} already holds a different corpus ({meta.get('name')}, fingerprint "
                f"{meta.get('fingerprint', '?')[:12]}) than {corpus.name} ({corpus.fingerprint[:12]})"
            )
        return
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=d.name + ".tmp", dir=d.parent))
    with open(tmp / "examples.jsonl", "w", encoding="utf-8") as f:
        for e in corpus.examples:
            f.write(json.dumps({"example_id": e.example_id, "text": e.text}, ensure_ascii=False) + "\n")
    with open(tmp / "facts.jsonl", "w", encoding="utf-8") as f:
        for fact in corpus.facts:
            f.write(json.dumps(dataclasses.asdict(fact), ensure_ascii=False) + "\n")
    with open(tmp / "eval.jsonl", "w", encoding="utf-8") as f:
        for t in corpus.eval_texts:
            f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
    (tmp / "templates.json").write_text(json.dumps(corpus.templates, indent=1, ensure_ascii=False))
    meta = {
        "format_version": CORPUS_FORMAT_VERSION,
        "name": corpus.name,
        "fingerprint": corpus.fingerprint,
        "num_examples": len(corpus.examples),
        "num_facts": len(corpus.facts),
        "num_eval": len(corpus.eval_texts),
        "info": corpus.info,
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    os.replace(tmp, d)


def load_corpus(directory: str | os.PathLike) -> Corpus:
    """Reads a corpus written by `save_corpus`, checking its fingerprint.

    Raises:
      FileNotFoundError: no corpus there. ValueError: ids not dense or fingerprint mismatch.
    """
    d = pathlib.Path(directory)
    if not (d / "meta.json").exists():
        raise FileNotFoundError(f"no corpus at {d} (expected {d / 'meta.json'})")
    fix = f"the run's corpus is damaged: restore {d} from a backup or re-create the run"
    meta = files_lib.read_json(d / "meta.json", "corpus metadata", fix)
    texts = []
    for where, rec in files_lib.read_jsonl(d / "examples.jsonl"):
        if not isinstance(rec, dict) or rec.get("example_id") != len(texts) or not isinstance(rec.get("text"), str):
            raise files_lib.InputError(f'{where}: expected {{"example_id": {len(texts)}, "text": ...}}; {fix}')
        texts.append(rec["text"])
    facts, where = [], str(d / "facts.jsonl")
    try:
        for where, r in files_lib.read_jsonl(d / "facts.jsonl"):  # noqa: B007  (named in the error below)
            facts.append(Fact(**{k: tuple(v) if isinstance(v, list) else v for k, v in r.items()}))
        eval_texts = [rec["text"] for where, rec in files_lib.read_jsonl(d / "eval.jsonl")]
    except (TypeError, KeyError, AttributeError) as e:
        raise files_lib.InputError(f"{where}: not a corpus record ({e}); {fix}") from None
    corpus = make_corpus(
        meta["name"],
        texts,
        facts,
        files_lib.read_json(d / "templates.json", "corpus templates", fix),
        eval_texts,
        meta.get("info", {}),
    )
    if corpus.fingerprint != meta.get("fingerprint"):
        raise files_lib.InputError(
            f"corpus at {d} was modified: fingerprint {corpus.fingerprint[:12]} != saved "
            f"{str(meta.get('fingerprint'))[:12]} (in meta.json); {fix}"
        )
    return corpus
