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
from trackstar_jax.data import embedded, seqio_source
from trackstar_jax.data.corpus_types import (
    Corpus,
    DataConfig,
    Fact,
    check_passage,
    make_corpus,
)

CORPUS_FORMAT_VERSION = 1


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
        return embedded.generate_embedded(cfg.embedded, seed, cfg.eval_fraction, cfg.max_examples)
    templates, info = {}, {}
    if cfg.source == "lama":
        texts, facts, lama_info = _read_lama(cfg)
        name = f"lama:{cfg.path}"
        if cfg.statements_per_fact or cfg.eval_fact_fraction or cfg.templates_file:
            texts, facts, templates, info = _with_statements(cfg, texts, facts)
        info = {**info, "lama": lama_info}
    elif cfg.source in ("text", "jsonl"):
        texts, facts = _read_text_files(cfg), []
        name = f"{cfg.source}:{cfg.path}"
    else:
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
                texts.append(check_passage(rec[cfg.text_key], where))
            else:
                texts.append(check_passage(line, where))
            if cfg.max_examples and len(texts) >= cfg.max_examples:
                return texts
    return texts


def _keep_evidence(passages: list[str], fact_id: str, cap: int, seed: int) -> list[str]:
    """The distinct `passages` of one fact, at most `cap` (0: all) of them: those with the
    smallest `_unit_hash(seed, fact_id, passage)`, in their first-seen order. The choice
    depends on the fact and its sentences only, not on the file's order or other facts."""
    distinct = list(dict.fromkeys(passages))
    if not cap or len(distinct) <= cap:
        return distinct
    keep = set(sorted(distinct, key=lambda p: _unit_hash(seed, fact_id, p))[:cap])
    return [p for p in distinct if p in keep]


def evidence_report(counts: Sequence[int]) -> dict:
    """`{"facts", "mean", "median", "max", "histogram"}` of evidence passages per fact
    (histogram: `{"1": facts with one, ..., "8+": ...}`)."""
    c = np.asarray(counts, np.int64)
    if c.size == 0:
        return {"facts": 0}
    hist = {str(k): int(np.sum(c == k)) for k in range(0, 8) if np.any(c == k)}
    hist["8+"] = int(np.sum(c >= 8))
    return {
        "facts": int(c.size),
        "mean": float(c.mean()),
        "median": float(np.median(c)),
        "max": int(c.max()),
        "histogram": hist,
    }


def _read_lama(cfg: DataConfig) -> tuple[list[str], list[Fact], dict]:
    """LAMA T-REx: passages (deduplicated, first-seen order), facts with gold evidence, and a
    report of what was kept.

    Each fact keeps at most `max_evidence_per_fact` of its distinct evidence sentences (a
    seeded choice, `_keep_evidence`): one fact can carry hundreds (up to ~1,800 in the shared
    files), which would otherwise crowd out every other fact. Facts are visited round-robin
    over the selected relation files, so that a `max_examples` cap keeps every relation; a
    fact whose new passages would exceed it is skipped (counted), and reading stops once the
    cap is reached exactly or the files end. Every kept fact keeps all of its kept evidence.

    Returns:
      `(texts, facts, info)`; `info`: `max_evidence_per_fact`, `evidence_seed`,
      `evidence_dropped` (sentences the cap left out), `facts_skipped` (over `max_examples`),
      `evidence_per_fact` (`evidence_report` of the kept facts).
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
    dropped = skipped = 0

    def report() -> dict:
        return {
            "max_evidence_per_fact": cfg.max_evidence_per_fact,
            "evidence_seed": cfg.evidence_seed,
            "evidence_dropped": dropped,
            "facts_skipped": skipped,
            "evidence_per_fact": evidence_report([len(f.evidence_ids) for f in facts]),
        }

    for row in range(max((len(s) for s in streams), default=0)):
        for stream in streams:
            if row >= len(stream):
                continue
            if cfg.max_examples and len(ids) >= cfg.max_examples:
                return list(ids), facts, report()
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
                passages.append(check_passage(ms.replace("[MASK]", ev["obj_surface"]), f"{where} evidence {j}"))
                obj_aliases.append(ev["obj_surface"])
                sub_aliases.append(ev.get("sub_surface", rec["sub_label"]))
            fact_id = str(rec.get("uuid", f"{rec['predicate_id']}:{rec['sub_uri']}:{rec['obj_uri']}"))
            kept = _keep_evidence(passages, fact_id, cfg.max_evidence_per_fact, cfg.evidence_seed)
            new = [p for p in kept if p not in ids]
            if cfg.max_examples and len(ids) + len(new) > cfg.max_examples:
                skipped += 1
                continue
            dropped += len(dict.fromkeys(passages)) - len(kept)
            for p in new:
                ids[p] = len(ids)
            facts.append(
                Fact(
                    fact_id=fact_id,
                    subject=rec["sub_label"],
                    relation=rec["predicate_id"],
                    object=rec["obj_label"],
                    object_aliases=tuple(dict.fromkeys(a for a in obj_aliases if a)),
                    subject_aliases=tuple(dict.fromkeys(a for a in sub_aliases if a)),
                    evidence_ids=tuple(sorted({ids[p] for p in kept})),
                )
            )
    return list(ids), facts, report()


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
    d = files_lib.check_writable(d)  # `corpus/` and the folders above it in the run: no symlinks
    files_lib.make_dirs(d.parent)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=d.name + ".tmp", dir=d.parent))  # new, mode 0700: no link in it
    with open(tmp / "examples.jsonl", "x", encoding="utf-8") as f:
        for e in corpus.examples:
            f.write(json.dumps({"example_id": e.example_id, "text": e.text}, ensure_ascii=False) + "\n")
    with open(tmp / "facts.jsonl", "x", encoding="utf-8") as f:
        for fact in corpus.facts:
            f.write(json.dumps(dataclasses.asdict(fact), ensure_ascii=False) + "\n")
    with open(tmp / "eval.jsonl", "x", encoding="utf-8") as f:
        for t in corpus.eval_texts:
            f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
    with open(tmp / "templates.json", "x", encoding="utf-8") as f:
        f.write(json.dumps(corpus.templates, indent=1, ensure_ascii=False))
    meta = {
        "format_version": CORPUS_FORMAT_VERSION,
        "name": corpus.name,
        "fingerprint": corpus.fingerprint,
        "num_examples": len(corpus.examples),
        "num_facts": len(corpus.facts),
        "num_eval": len(corpus.eval_texts),
        "info": corpus.info,
    }
    with open(tmp / "meta.json", "x", encoding="utf-8") as f:
        f.write(json.dumps(meta, indent=1))
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
