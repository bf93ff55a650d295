"""Training corpus with stable example ids, the SentencePiece tokenizer, and grain loaders.

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
  * `seqio`: a registered seqio Task (optional `seqio` extra).

Held-out passages for the eval loss (`Corpus.eval_texts`) are never examples, so they never
enter the index. Batches follow the convention in `model.py`: `tokens [B, T]` (BOS first,
PAD_ID padding at the end), `loss_mask [B, T]`, `example_id [B]` (-1 for padding rows).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import os
import pathlib
import tempfile
from typing import Any, Iterable, Iterator, Mapping, Sequence

import grain
import numpy as np
import sentencepiece as spm

from trackstar_jax.models import palm as model_lib
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

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"config.data.source must be one of {SOURCES}, got {self.source!r}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"config.data.eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.max_examples < 0:
            raise ValueError(f"config.data.max_examples must be >= 0, got {self.max_examples}")
        if self.source in ("lama", "text", "jsonl") and not self.path:
            raise ValueError(f"config.data.path is required for config.data.source={self.source!r}")
        if self.source == "seqio" and not self.seqio_task:
            raise ValueError("config.data.seqio_task is required for config.data.source='seqio'")


def data_config(cfg: Any) -> DataConfig:
    """`config.data` (ConfigDict, dict or DataConfig) -> `DataConfig`.

    Raises:
      ValueError: on an unknown key, naming it (`config.data.<key>`).
    """
    if isinstance(cfg, DataConfig):
        return cfg
    values = dict(cfg.to_dict() if hasattr(cfg, "to_dict") else cfg)
    emb = values.pop("embedded", {}) or {}
    emb = emb if isinstance(emb, EmbeddedConfig) else _checked(EmbeddedConfig, dict(emb), "data.embedded")
    out = _checked(DataConfig, values, "data")
    return dataclasses.replace(out, embedded=emb)


def _checked(cls: Any, values: dict, name: str) -> Any:
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(
            f"unknown config key(s) in config.{name}: {', '.join(unknown)} (known: {', '.join(sorted(fields))})"
        )
    return cls(**values)


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
    """

    name: str
    examples: list[Example]
    facts: list[Fact]
    templates: dict[str, list[str]]
    fingerprint: str
    eval_texts: tuple[str, ...] = ()

    @property
    def texts(self) -> list[str]:
        return [e.text for e in self.examples]


def fingerprint(texts: Sequence[str]) -> str:
    """sha256 of the id -> text mapping (`"{id}\\t{text}\\n"` per example)."""
    h = hashlib.sha256()
    for i, t in enumerate(texts):
        h.update(f"{i}\t{t}\n".encode("utf-8"))
    return h.hexdigest()


def _make_corpus(name, texts, facts, templates, eval_texts) -> Corpus:
    if not texts:
        raise ValueError(f"corpus {name} has no examples (check config.data.path / relations / max_examples)")
    examples = [Example(i, t) for i, t in enumerate(texts)]
    return Corpus(name, examples, facts, templates, fingerprint(texts), tuple(eval_texts))


def build_corpus(data_cfg: Any, seed: int = 0) -> Corpus:
    """Builds the corpus that `config.data` describes (deterministic in config and seed).

    Args:
      data_cfg: `config.data` (ConfigDict, dict or `DataConfig`).
      seed: the run seed (embedded generation; the held-out split is content-hashed).

    Returns:
      A `Corpus` whose example ids depend only on the config and seed.

    Raises:
      ValueError: unknown config keys, no examples, an empty passage (named by file:line).
    """
    cfg = data_config(data_cfg)
    if cfg.source == "embedded":
        return generate_embedded(cfg.embedded, seed, cfg.eval_fraction, cfg.max_examples)
    if cfg.source == "lama":
        texts, facts = _read_lama(cfg)
        name = f"lama:{cfg.path}"
    elif cfg.source in ("text", "jsonl"):
        texts, facts = _read_text_files(cfg), []
        name = f"{cfg.source}:{cfg.path}"
    else:
        texts, facts = _read_seqio(cfg), []
        name = f"seqio:{cfg.seqio_task}/{cfg.seqio_split}"
    texts, facts, eval_texts = _split_eval(texts, facts, cfg.eval_fraction)
    return _make_corpus(name, texts, facts, {}, eval_texts)


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
        dataclasses.replace(f, evidence_ids=tuple(int(new_id[e]) for e in f.evidence_ids if not held[e]))
        for f in facts
    ]
    return train, facts, eval_texts


def _check_passage(text: str, where: str) -> str:
    if not isinstance(text, str):
        raise ValueError(f"passage at {where} is not a string: {text!r}")
    if not text.strip():
        raise ValueError(f"empty passage at {where}")
    return text.strip()


def _open_text(path: pathlib.Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


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
    pats = ("*.jsonl", "*.jsonl.gz", "*.json") if is_jsonl else ("*.txt", "*.txt.gz")
    texts = []
    for f in _files(cfg.path, pats):
        with _open_text(f) as fh:
            for ln, line in enumerate(fh, 1):
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
    for rel, f in sorted(by_rel.items()):
        with _open_text(f) as fh:
            streams.append([(f"{f}:{ln}", line) for ln, line in enumerate(fh, 1) if line.strip()])
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
            facts.append(Fact(
                fact_id=str(rec.get("uuid", f"{rec['predicate_id']}:{rec['sub_uri']}:{rec['obj_uri']}")),
                subject=rec["sub_label"], relation=rec["predicate_id"], object=rec["obj_label"],
                object_aliases=tuple(dict.fromkeys(a for a in obj_aliases if a)),
                subject_aliases=tuple(dict.fromkeys(a for a in sub_aliases if a)),
                evidence_ids=tuple(sorted({ids[p] for p in passages})),
            ))
    return list(ids), facts


def _read_seqio(cfg: DataConfig) -> list[str]:  # pragma: no cover - needs the seqio extra
    try:
        import seqio  # noqa: PLC0415
    except ImportError as e:
        raise ImportError("config.data.source='seqio' needs the optional extra: pip install -e '.[seqio]'") from e
    if cfg.seqio_module:
        import importlib  # noqa: PLC0415

        importlib.import_module(cfg.seqio_module)  # registers the task
    task = seqio.get_mixture_or_task(cfg.seqio_task)
    ds = task.get_dataset(sequence_length=None, split=cfg.seqio_split, shuffle=False)
    texts = []
    for i, ex in enumerate(ds.as_numpy_iterator()):
        if cfg.text_key not in ex:
            raise ValueError(f"seqio task {cfg.seqio_task} example {i} has no feature {cfg.text_key!r}")
        v = ex[cfg.text_key]
        texts.append(_check_passage(v.decode("utf-8") if isinstance(v, bytes) else str(v), f"{cfg.seqio_task}[{i}]"))
        if cfg.max_examples and len(texts) >= cfg.max_examples:
            break
    return texts


# ---------------------------------------------------------------------------------------
# The embedded fact corpus
# ---------------------------------------------------------------------------------------

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "tr",
           "st", "sh", "gr")
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o", "ai", "ou")
_CODAS = ("", "", "", "", "", "", "n", "r", "l", "s", "m")
_INSTRUMENTS = ("piano", "violin", "cello", "flute", "trumpet", "harp", "guitar", "clarinet",
                "drums", "oboe", "saxophone", "accordion")
_OCCUPATIONS = ("painter", "chemist", "sailor", "teacher", "architect", "baker", "surgeon",
                "poet", "engineer", "farmer", "lawyer", "astronomer")

# relation -> (subject type, object type, templates, extra phrasings). Phrasing i < 3 is
# template i followed by " {o}" and a tail, so every template has a passage form that ends
# in the object; phrasing 0 is stated for every fact, so the default prompt is answerable.
_RELATIONS: dict[str, tuple[str, str, tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "born_in": ("person", "city",
                ("[X] was born in", "The birthplace of [X] is", "[X] came into the world in the city of"),
                (".", ", where the family lived for many years.", " during a cold winter."),
                ("{o} is the city where {s} was born.", "In {o}, a child named {s} was born.")),
    "citizen_of": ("person", "country",
                   ("[X] is a citizen of", "The nationality of [X] is that of", "[X] holds a passport from"),
                   (".", ", as records show.", " and travels often."),
                   ("{o} counts {s} among its citizens.", "As a citizen of {o}, {s} votes in every election.")),
    "native_language": ("person", "language",
                        ("The native language of [X] is", "[X] grew up speaking", "[X]'s mother tongue is"),
                        (".", " at home.", ", according to friends."),
                        ("{o} is the first language {s} learned.", "Speaking {o} since childhood, {s} writes poems in it.")),
    "plays_instrument": ("person", "instrument",
                         ("[X] plays the", "The instrument of [X] is the", "On stage, [X] performs on the"),
                         (".", " in a small orchestra.", " every weekend."),
                         ("The {o} is the instrument that {s} plays.", "Every evening the sound of the {o} comes from the house of {s}.")),
    "occupation": ("person", "occupation",
                   ("[X] works as a", "The profession of [X] is", "By trade, [X] is a"),
                   (".", ", and a good one.", " in a busy town."),
                   ("Being a {o} is how {s} earns a living.", "Trained as a {o}, {s} never changed careers.")),
    "works_for": ("person", "company",
                  ("[X] is employed by", "The employer of [X] is", "[X] has a job at"),
                  (".", " for many years.", ", a large company."),
                  ("{o} employs {s}.", "Colleagues at {o} know {s} well.")),
    "capital": ("country", "city",
                ("The capital of [X] is", "[X] has its capital in", "The seat of government of [X] is"),
                (".", ", a large city.", ", by the river."),
                ("{o} is the capital of {s}.", "Visitors to {s} usually arrive in its capital, {o}.")),
    "located_in": ("city", "country",
                   ("[X] is a city in", "[X] is located in", "The city of [X] lies in the country of"),
                   (".", ", near the border.", ", on the coast."),
                   ("{o} is the country where the city of {s} lies.", "The map of {o} shows the city of {s}.")),
    "official_language": ("country", "language",
                          ("The official language of [X] is", "In [X], people officially speak", "[X] uses as its official language"),
                          (".", " in schools and courts.", ", by law."),
                          ("{o} is the official language of {s}.", "Laws in {s} are written in {o}.")),
    "headquarters": ("company", "city",
                     ("[X] is headquartered in", "The headquarters of [X] are in", "[X] has its main office in"),
                     (".", ", close to the station.", ", in a tall building."),
                     ("{o} is home to the headquarters of {s}.", "In {o}, the company {s} has its main office.")),
}

_DISTRACTORS = {
    "person": ("{s} was mentioned in a local newspaper last spring.", "Nobody remembers where {s} was born.",
               "{s} rarely talks about work or music.", "A letter addressed to {s} arrived late.",
               "Friends say {s} enjoys long walks.", "{s} once gave a short speech at a wedding."),
    "city": ("{s} is known for its narrow streets.", "Tourists often visit {s} in the summer.",
             "The old bridge of {s} was repaired.", "A festival in {s} draws large crowds."),
    "country": ("{s} has a long coastline.", "Little is written about the history of {s}.",
                "The flag of {s} has three colours.", "Many rivers cross {s}."),
    "language": ("{s} has a rich tradition of poetry.", "Few dictionaries of {s} exist.",
                 "Linguists still debate the grammar of {s}."),
    "company": ("{s} announced a new product line.", "The shares of {s} rose slightly.",
                "{s} held its yearly meeting in the spring."),
}

# share of `num_entities` per invented entity type (people are the most common subjects)
_TYPE_SHARES = (("person", 0.55), ("city", 0.2), ("country", 0.08), ("language", 0.07), ("company", 0.1))


def _pronounceable(rng: np.random.Generator, syllables: int) -> str:
    s = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))
    return s.capitalize()


def _invent_names(rng: np.random.Generator, kind: str, n: int, taken: set[str]) -> list[str]:
    """`n` unique names; no name is a word-prefix of another (keeps string matching exact)."""
    out = []
    while len(out) < n:
        if kind == "person":
            name = f"{_pronounceable(rng, 2)} {_pronounceable(rng, 2 + int(rng.random() < 0.3))}"
        elif kind == "language":
            name = _pronounceable(rng, 2) + str(rng.choice(("ish", "ese", "ic", "ian")))
        elif kind == "company":
            name = f"{_pronounceable(rng, 2)} {rng.choice(('Works', 'Industries', 'Trading', 'Mills', 'Labs'))}"
        else:
            name = _pronounceable(rng, int(rng.integers(2, 4)))
        low = name.lower()
        if any(low == t or low.startswith(t + " ") or t.startswith(low + " ") for t in taken) or len(name) < 4:
            continue
        taken.add(low)
        out.append(name)
    return out


def generate_embedded(cfg: EmbeddedConfig, seed: int, eval_fraction: float = 0.05, max_examples: int = 0) -> Corpus:
    """Generates the embedded fact corpus (deterministic in `cfg` and `seed`).

    A consistent small world is drawn first (each country has a capital city located in it
    and an official language; people, cities and companies get random attributes), then
    `num_facts` facts are drawn round-robin over the relations. Each fact is stated by
    `phrasings_per_fact` passages in distinct phrasings (always including phrasing 0, the
    form of template 0); distractor passages mention entities but state no fact. Passages
    are shuffled once, which fixes their ids. Held-out passages for the eval loss are new
    phrasings of some facts plus new distractors, so every training passage stays.

    Raises:
      ValueError: a size that cannot be met, naming the `config.data.embedded.*` key.
    """
    n_phr = 3 + min(len(v[4]) for v in _RELATIONS.values())
    if not 1 <= cfg.phrasings_per_fact <= n_phr:
        raise ValueError(f"config.data.embedded.phrasings_per_fact must be in [1, {n_phr}], got {cfg.phrasings_per_fact}")
    if cfg.num_entities < 20:
        raise ValueError(f"config.data.embedded.num_entities must be >= 20, got {cfg.num_entities}")
    if cfg.num_facts < 1 or cfg.num_distractors < 0:
        raise ValueError("config.data.embedded.num_facts must be >= 1 and num_distractors >= 0, "
                         f"got {cfg.num_facts} and {cfg.num_distractors}")
    rng = np.random.default_rng([seed, 0x7AC5])
    taken: set[str] = set()
    ents = {}
    for kind, share in _TYPE_SHARES:
        ents[kind] = _invent_names(rng, kind, max(2, int(round(share * cfg.num_entities))), taken)
    ents["city"] += _invent_names(rng, "city", max(0, len(ents["country"]) - len(ents["city"])), taken)
    ents["instrument"], ents["occupation"] = list(_INSTRUMENTS), list(_OCCUPATIONS)

    # The world: one object per (relation, subject).
    countries, cities = ents["country"], ents["city"]
    capital = dict(zip(countries, rng.permutation(cities)[: len(countries)].tolist()))
    city_country = {c: str(rng.choice(countries)) for c in cities}
    city_country.update({city: country for country, city in capital.items()})
    world: dict[str, dict[str, str]] = {
        "capital": capital,
        "located_in": city_country,
        "official_language": {c: str(rng.choice(ents["language"])) for c in countries},
        "headquarters": {c: str(rng.choice(cities)) for c in ents["company"]},
    }
    for rel, (stype, otype, *_rest) in _RELATIONS.items():
        if stype == "person":
            world[rel] = {p: str(rng.choice(ents[otype])) for p in ents["person"]}
    total = sum(len(v) for v in world.values())
    if cfg.num_facts > total:
        raise ValueError(f"config.data.embedded.num_facts={cfg.num_facts} exceeds the {total} facts of a world "
                         f"with num_entities={cfg.num_entities}")

    # Facts, round-robin over relations in a seeded order.
    pools = {rel: rng.permutation(sorted(world[rel])).tolist() for rel in _RELATIONS}
    order = rng.permutation(sorted(_RELATIONS)).tolist()
    picked: list[tuple[str, str]] = []
    while len(picked) < cfg.num_facts:
        for rel in order:
            if pools[rel] and len(picked) < cfg.num_facts:
                picked.append((rel, pools[rel].pop()))

    def phrasings(rel: str) -> list[str]:
        _, _, templates, tails, extra = _RELATIONS[rel]
        return [t.replace("[X]", "{s}") + " {o}" + tail for t, tail in zip(templates, tails)] + list(extra)

    passages: list[tuple[str, int]] = []  # (text, fact index or -1)
    unused: list[list[str]] = []
    for fi, (rel, subj) in enumerate(picked):
        forms = phrasings(rel)
        rest = (1 + rng.permutation(len(forms) - 1)).tolist()
        chosen = [0] + rest[: cfg.phrasings_per_fact - 1]
        obj = world[rel][subj]
        passages += [(forms[k].format(s=subj, o=obj), fi) for k in chosen]
        unused.append([forms[k].format(s=subj, o=obj) for k in rest[cfg.phrasings_per_fact - 1:]])

    def distractor() -> str:
        kind = str(rng.choice(list(_DISTRACTORS)))
        return str(rng.choice(_DISTRACTORS[kind])).format(s=rng.choice(ents[kind]))

    seen = {t for t, _ in passages}
    target, tries = len(passages) + cfg.num_distractors, 0
    while len(passages) < target:
        t, tries = distractor(), tries + 1
        if t in seen and tries < 50 * target:  # repeat only once the distractor space is spent
            continue
        seen.add(t)
        passages.append((t, -1))
    perm = rng.permutation(len(passages))
    passages = [passages[i] for i in perm]
    if max_examples:
        passages = passages[:max_examples]
    texts = [t for t, _ in passages]
    evidence: dict[int, list[int]] = {}
    for i, (_, fi) in enumerate(passages):
        if fi >= 0:
            evidence.setdefault(fi, []).append(i)
    facts = []
    for fi, (rel, subj) in enumerate(picked):
        if fi not in evidence:  # cut by max_examples
            continue
        obj = world[rel][subj]
        facts.append(Fact(fact_id=f"emb-{fi:05d}", subject=subj, relation=rel, object=obj,
                          object_aliases=(obj,), subject_aliases=(subj,), evidence_ids=tuple(evidence[fi])))
    templates = {rel: list(v[2]) for rel, v in _RELATIONS.items()}

    # Held-out passages: unused phrasings of some facts (does the model know the fact when
    # it is stated differently?) and fresh distractors (plain language modelling).
    n_eval = int(round(eval_fraction * len(texts)))
    eval_texts: list[str] = []
    fact_order = rng.permutation(len(picked)).tolist()
    for fi in fact_order:
        if len(eval_texts) >= n_eval // 2:
            break
        if unused[fi]:
            eval_texts.append(unused[fi][0])
    train_set = set(texts)
    tries = 0
    while len(eval_texts) < n_eval and tries < 100 * (n_eval + 1):
        tries += 1
        t = distractor()
        if t not in train_set and t not in eval_texts:
            eval_texts.append(t)
    return _make_corpus(f"embedded(seed={seed})", texts, facts, templates, eval_texts)


def fill_template(template: str, subject: str) -> str:
    """`"[X] was born in"`, `"Arlo Venmarsh"` -> `"Arlo Venmarsh was born in"`."""
    return template.replace("[X]", subject)


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
        meta = json.loads((d / "meta.json").read_text())
        if meta.get("fingerprint") != corpus.fingerprint:
            raise FileExistsError(f"{d} already holds a different corpus ({meta.get('name')}, fingerprint "
                                  f"{meta.get('fingerprint', '?')[:12]}) than {corpus.name} ({corpus.fingerprint[:12]})")
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
    meta = {"format_version": CORPUS_FORMAT_VERSION, "name": corpus.name, "fingerprint": corpus.fingerprint,
            "num_examples": len(corpus.examples), "num_facts": len(corpus.facts), "num_eval": len(corpus.eval_texts)}
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
    meta = json.loads((d / "meta.json").read_text())
    texts = []
    with open(d / "examples.jsonl", encoding="utf-8") as f:
        for ln, line in enumerate(f, 1):
            rec = json.loads(line)
            if rec["example_id"] != len(texts):
                raise ValueError(f"{d / 'examples.jsonl'}:{ln}: example_id {rec['example_id']}, expected {len(texts)}")
            texts.append(rec["text"])
    facts = []
    with open(d / "facts.jsonl", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            facts.append(Fact(**{k: tuple(v) if isinstance(v, list) else v for k, v in r.items()}))
    with open(d / "eval.jsonl", encoding="utf-8") as f:
        eval_texts = [json.loads(line)["text"] for line in f]
    corpus = _make_corpus(meta["name"], texts, facts, json.loads((d / "templates.json").read_text()), eval_texts)
    if corpus.fingerprint != meta["fingerprint"]:
        raise ValueError(f"corpus at {d} was modified: fingerprint {corpus.fingerprint[:12]} != saved {meta['fingerprint'][:12]}")
    return corpus


# ---------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------

UNK_ID, BOS_ID, EOS_ID = 1, 2, 3


class Tokenizer:
    """SentencePiece tokenizer with `pad_id == model.PAD_ID == 0`, unk 1, BOS 2, EOS 3."""

    def __init__(self, model_proto: bytes):
        self.model_proto = model_proto
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        if self._sp.pad_id() != model_lib.PAD_ID or self._sp.bos_id() != BOS_ID or self._sp.eos_id() != EOS_ID:
            raise ValueError(f"tokenizer ids (pad {self._sp.pad_id()}, bos {self._sp.bos_id()}, eos {self._sp.eos_id()}) "
                             f"must be ({model_lib.PAD_ID}, {BOS_ID}, {EOS_ID}); train it with train_tokenizer")

    pad_id = model_lib.PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS / EOS."""
        return list(self._sp.encode(text, out_type=int))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(x) for x in self._sp.encode(list(texts), out_type=int)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; pad / BOS / EOS are dropped."""
        return self._sp.decode([int(i) for i in ids if int(i) not in (self.pad_id, self.bos_id, self.eos_id)])

    def save(self, path: str | os.PathLike) -> None:
        _atomic_write(pathlib.Path(path), self.model_proto)


def train_tokenizer(texts: Sequence[str], vocab_size: int, path: str | os.PathLike | None = None,
                    model_type: str = "unigram") -> Tokenizer:
    """Trains a SentencePiece model on `texts` and saves it to `path` (if given).

    The vocabulary is at most `vocab_size` (fewer when the corpus is too small to fill it,
    `hard_vocab_limit=False`); it must then fit the model's embedding table.
    """
    if not texts:
        raise ValueError("cannot train a tokenizer on an empty corpus")
    if vocab_size < 8:
        raise ValueError(f"tokenizer vocab_size must be >= 8, got {vocab_size}")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=buf, vocab_size=vocab_size, model_type=model_type,
        pad_id=model_lib.PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, hard_vocab_limit=False,
        character_coverage=1.0 if len(texts) < 100_000 else 0.9995, input_sentence_size=2_000_000,
        shuffle_input_sentence=True, max_sentence_length=1 << 16, minloglevel=2, num_threads=2,
    )
    tok = Tokenizer(buf.getvalue())
    if path is not None:
        tok.save(path)
    return tok


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Loads a tokenizer saved by `train_tokenizer` / `Tokenizer.save`."""
    p = pathlib.Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no tokenizer model at {p}")
    return Tokenizer(p.read_bytes())


def _atomic_write(path: pathlib.Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------
# Encoding and batches
# ---------------------------------------------------------------------------------------


def encode_example(tok: Tokenizer, text: str, max_len: int) -> tuple[np.ndarray, bool]:
    """BOS + text + EOS, truncated to `max_len` tokens (loss on everything after BOS).

    Returns:
      `(tokens int32 [<= max_len], truncated)`.
    """
    ids = [tok.bos_id] + tok.encode(text) + [tok.eos_id]
    return np.asarray(ids[:max_len], np.int32), len(ids) > max_len


def encode_query(tok: Tokenizer, prompt: str, target: str, max_len: int, query_id: Any = None) -> dict[str, np.ndarray]:
    """BOS + prompt + target with `loss_mask` = 1 only on the target tokens.

    `target` starts with a space (" Paris"); SentencePiece splits on whitespace, so encoding
    the two parts separately gives the tokens of the joined text.

    Raises:
      ValueError: the target encodes to nothing, or prompt + target exceeds `max_len`
        (the message names the query).
    """
    name = f"query {query_id!r} " if query_id is not None else ""
    p, t = tok.encode(prompt), tok.encode(target)
    if not t:
        raise ValueError(f"{name}({prompt!r} -> {target!r}): the target encodes to no tokens")
    tokens = [tok.bos_id] + p + t
    if len(tokens) > max_len:
        raise ValueError(f"{name}({prompt!r} -> {target!r}): {len(tokens)} tokens exceed max_len={max_len}")
    mask = [0] * (1 + len(p)) + [1] * len(t)
    return {"tokens": np.asarray(tokens, np.int32), "loss_mask": np.asarray(mask, np.int32)}


def pad_batch(items: Sequence[tuple[np.ndarray, np.ndarray]], example_ids: Sequence[int], batch_size: int,
              seq_len: int) -> dict[str, np.ndarray]:
    """Stacks `(tokens, loss_mask)` pairs into the batch convention, padding rows and length.

    Returns:
      `tokens int32 [batch_size, seq_len]`, `loss_mask int32 [batch_size, seq_len]`,
      `example_id int32 [batch_size]` (-1 on padding rows, whose mask is all zero).
    """
    if len(items) > batch_size or len(items) != len(example_ids):
        raise ValueError(f"pad_batch: {len(items)} items / {len(example_ids)} ids for batch_size {batch_size}")
    tokens = np.full((batch_size, seq_len), model_lib.PAD_ID, np.int32)
    mask = np.zeros((batch_size, seq_len), np.int32)
    ids = np.full((batch_size,), -1, np.int32)
    for r, ((t, m), i) in enumerate(zip(items, example_ids)):
        if len(t) > seq_len or len(m) != len(t):
            raise ValueError(f"pad_batch: example {i} has {len(t)} tokens / {len(m)} mask entries for seq_len {seq_len}")
        tokens[r, : len(t)], mask[r, : len(t)], ids[r] = t, m, i
    return {"tokens": tokens, "loss_mask": mask, "example_id": ids}


def _example_loss_mask(tokens: np.ndarray) -> np.ndarray:
    m = np.ones(len(tokens), np.int32)
    m[0] = 0  # BOS is never a target
    return m


class _Encoded:
    """Random-access grain source: row i -> padded `tokens`, `loss_mask`, `example_id`."""

    def __init__(self, texts: Sequence[str], ids: Sequence[int], tok: Tokenizer, seq_len: int):
        self.texts, self.ids, self.tok, self.seq_len = texts, ids, tok, seq_len

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        t, _ = encode_example(self.tok, self.texts[i], self.seq_len)
        b = pad_batch([(t, _example_loss_mask(t))], [self.ids[i]], 1, self.seq_len)
        return {k: v[0] for k, v in b.items()}


def _stack(rows: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def _pad_rows(b: dict[str, np.ndarray], batch_size: int) -> dict[str, np.ndarray]:
    n = b["tokens"].shape[0]
    if n == batch_size:
        return b
    out = pad_batch([], [], batch_size - n, b["tokens"].shape[1])
    return {k: np.concatenate([b[k], out[k]]) for k in b}


def index_batches(corpus: Corpus, tok: Tokenizer, batch_size: int, seq_len: int, start: int = 0,
                  stop: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """Ordered (no shuffle) batches over examples `[start, stop)`; the last one is padded.

    Row r of batch b holds example `start + b * batch_size + r` (example_id -1 on padding),
    so a caller can write vectors straight into index rows.
    """
    stop = len(corpus.examples) if stop is None else min(stop, len(corpus.examples))
    if not 0 <= start <= stop:
        raise ValueError(f"index_batches: bad row range [{start}, {stop}) for {len(corpus.examples)} examples")
    texts = [e.text for e in corpus.examples[start:stop]]
    ids = list(range(start, stop))
    ds = grain.MapDataset.source(_Encoded(texts, ids, tok, seq_len)).batch(batch_size, batch_fn=_stack)
    for b in ds:
        yield _pad_rows(b, batch_size)


def eval_batches(corpus: Corpus, tok: Tokenizer, batch_size: int, seq_len: int,
                 max_batches: int = 0) -> list[dict[str, np.ndarray]]:
    """Batches of the held-out passages (example_id -1: they are not examples)."""
    texts = list(corpus.eval_texts)
    if max_batches:
        texts = texts[: max_batches * batch_size]
    if not texts:
        return []
    ds = grain.MapDataset.source(_Encoded(texts, [-1] * len(texts), tok, seq_len)).batch(batch_size, batch_fn=_stack)
    return [_pad_rows(b, batch_size) for b in ds]


def train_batches(corpus: Corpus, tok: Tokenizer, batch_size: int, seq_len: int, seed: int,
                  start_step: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """Infinite shuffled batches (grain; reshuffled each epoch; seeded).

    Batch s is a pure function of (corpus, seed, s), so a run resumed at step s sees exactly
    the batches it would have seen without the interruption.
    """
    ds = (grain.MapDataset.source(_Encoded(corpus.texts, list(range(len(corpus.examples))), tok, seq_len))
          .seed(seed).shuffle().repeat(None).batch(batch_size, drop_remainder=True, batch_fn=_stack))
    step = start_step
    while True:
        yield ds[step]
        step += 1


def truncation_report(texts: Sequence[str], tok: Tokenizer, max_len: int) -> list[int]:
    """Indices of passages longer than `max_len` tokens (BOS + text + EOS)."""
    out = []
    for start in range(0, len(texts), 4096):
        for j, ids in enumerate(tok.encode_batch(texts[start:start + 4096])):
            if len(ids) + 2 > max_len:
                out.append(start + j)
    return out
