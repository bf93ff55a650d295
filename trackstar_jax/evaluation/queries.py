"""Fact-tracing queries: facts -> prompts, gold labels, frequency buckets, model correctness.

Paper §4.2 and §A.4. A query is a fact rendered as a left-to-right prompt that ends right
before the object ("Allan Peiper was born in") plus a target " Alexandra" (a space and the
object). Its gold labels are

* **entailing** passages: the fact's own evidence passages and those of duplicate facts
  (same subject, relation and object), the paper's T-REx "ground truth" (§4.2); and
* **mentioning** passages: those that mention at least one surface form of both entities
  (lowercased whole-word matching, aliases shorter than three characters ignored, §A.4), the
  looser label. Their count is the fact's *frequency* (the paper counts C4 examples; we count
  passages of the corpus being attributed, the closest closed-set equivalent).

Templates come from the corpus itself (`Corpus.templates`: the embedded generator's, or the
LAMA corpus's when it holds templated statements) or `data.templates.load`: the paper-style
variant 0 shipped with the package, LAMA `relations.jsonl` / ParaRel as variant 1, the
subject-inside form as variant 2. Sampling follows §A.4: drop facts whose subject contains the object, cap common targets
per bucket and overall, and balance the sample across frequency buckets.

Model correctness (§4.2): a greedy completion is correct when, after lowercasing, punctuation
and stopword removal (the Lucene English stopword list, as BM25 uses), it starts with one of
the object's aliases.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import pathlib
import re
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from trackstar_jax import files
from trackstar_jax.data import answers
from trackstar_jax.data import templates as templates_lib
from trackstar_jax.models import generate as generate_lib
from trackstar_jax.training import logs

# One definition of correctness (§4.2) for training reports and evaluation: data/answers.py.
STOPWORDS, words, normalize_answer, is_correct = (
    answers.STOPWORDS,
    answers.words,
    answers.normalize_answer,
    answers.is_correct,
)
# §A.4: "We exclude entity aliases with less than three characters" (for string matching).
MIN_ALIAS_CHARS = 3
# Frequency bucket lower edges (§A.4 uses 1-10, 10-1e2, ..., 1e5-1e6 occurrences in C4).
DEFAULT_BUCKET_EDGES = (1, 10, 100, 1_000, 10_000, 100_000)


# ---------------------------------------------------------------------------------------
# Data types
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Query:
    """One fact-tracing query (a row of the evaluation set).

    Attributes:
      query_id: row in the query set, 0..Q-1 (the retrieval output's `example_id`).
      fact_id: the fact it was rendered from.
      relation: relation id (e.g. "P19").
      subject, object: entity labels.
      prompt: the rendered template, ending right before the object (no trailing space).
      target: " " + object (gold mode) or " " + the model's greedy prediction (prediction mode).
      aliases: object surface forms used to score correctness (label first).
      subject_aliases: subject surface forms (label first).
      entailing_ids: sorted example ids of passages that entail the fact (gold label).
      mention_ids: sorted example ids of passages mentioning both entities (looser label).
      bucket: frequency bucket name, e.g. "[1,10)" ("0" for facts never mentioned).
      template_variant: which template (Table A.1: 0 original, 1 and 2 variations).
    """

    query_id: int
    fact_id: str
    relation: str
    subject: str
    object: str
    prompt: str
    target: str
    aliases: tuple[str, ...]
    subject_aliases: tuple[str, ...]
    entailing_ids: tuple[int, ...]
    mention_ids: tuple[int, ...]
    bucket: str
    template_variant: int

    @property
    def frequency(self) -> int:
        """Number of corpus passages mentioning both entities (§A.4 fact frequency)."""
        return len(self.mention_ids)

    @property
    def has_evidence(self) -> bool:
        """False for facts with no entailing passage in the corpus (excluded from MRR)."""
        return bool(self.entailing_ids)


@dataclasses.dataclass
class QueryReport:
    """What happened to every fact on the way to the query set (nothing is dropped silently)."""

    num_facts: int = 0
    dropped_relation_filter: int = 0
    dropped_train_split: int = 0
    dropped_subject_contains_object: int = 0
    dropped_target_cap: int = 0
    dropped_bucket_cap: int = 0
    dropped_unmentioned: int = 0
    dropped_incorrect_cap: int = 0
    dropped_max_queries: int = 0
    num_selected: int = 0
    # the wrong-fact cap completes every candidate fact first: the model's accuracy over all of
    # them (the selection's own accuracy is biased upward by the cap)
    num_completed_candidates: int = 0
    num_correct_candidates: int = 0
    no_evidence_fact_ids: list[str] = dataclasses.field(default_factory=list)
    empty_target_fact_ids: list[str] = dataclasses.field(default_factory=list)
    per_bucket: dict[str, int] = dataclasses.field(default_factory=dict)
    per_relation: dict[str, int] = dataclasses.field(default_factory=dict)
    corpus: dict[str, Any] = dataclasses.field(default_factory=dict)  # fact split, counts, seeds (Corpus.info)
    selection_seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["num_no_evidence"] = len(self.no_evidence_fact_ids)
        d["num_empty_target"] = len(self.empty_target_fact_ids)
        return d


@dataclasses.dataclass(frozen=True)
class SelectionConfig:
    """§A.4 sampling knobs (hashable). Caps of 0 mean "no cap".

    Attributes:
      max_per_bucket: facts sampled per frequency bucket (paper: 1000).
      max_per_relation_target_per_bucket: cap on one (relation, target) pair within a bucket
        (paper: 25, e.g. ("country", "USA")).
      max_per_relation_target: the same cap over the whole sample (paper: 100).
      max_incorrect_per_bucket: cap on facts the model predicts incorrectly, per bucket
        (paper: 100, for facts wrong under all three model sizes); needs correctness.
      bucket_edges: lower edges of the frequency buckets; frequency 0 is its own bucket "0".
      include_unmentioned: keep facts whose frequency is 0 (bucket "0"); the paper's buckets
        start at 1.
      seed: sampling seed.
    """

    max_per_bucket: int = 1000
    max_per_relation_target_per_bucket: int = 25
    max_per_relation_target: int = 100
    max_incorrect_per_bucket: int = 0
    bucket_edges: tuple[int, ...] = DEFAULT_BUCKET_EDGES
    include_unmentioned: bool = False
    seed: int = 0


# ---------------------------------------------------------------------------------------
# Text normalisation and entity matching
# ---------------------------------------------------------------------------------------


def matchable_aliases(aliases: Iterable[str]) -> list[str]:
    """Aliases used for string matching: deduped (case-insensitive), >= 3 characters (§A.4)."""
    out, seen = [], set()
    for a in aliases:
        key = " ".join(words(a))
        if len(a.strip()) >= MIN_ALIAS_CHARS and key and key not in seen:
            seen.add(key)
            out.append(a)
    return out


class MentionIndex:
    """Whole-word, lowercased alias lookup over a passage collection (an inverted index).

    `passages_with(alias)` returns the ids of passages in which the alias's words occur as a
    contiguous word sequence. Posting lists of the alias's words are intersected (rarest
    first) before the exact phrase check, so counting mentions for 10^4 facts over 10^5
    passages takes seconds rather than hours of substring scans.
    """

    def __init__(self, texts: Mapping[int, str] | Sequence[str]):
        items = texts.items() if isinstance(texts, Mapping) else enumerate(texts)
        self._words: dict[int, list[str]] = {}
        postings: dict[str, set[int]] = collections.defaultdict(set)
        for pid, text in items:
            ws = words(text)
            self._words[int(pid)] = ws
            for w in set(ws):
                postings[w].add(int(pid))
        self._postings = dict(postings)
        self._cache: dict[tuple[str, ...], frozenset[int]] = {}

    def passages_with(self, alias: str) -> frozenset[int]:
        """Ids of passages containing `alias` as whole words (case-insensitive)."""
        key = tuple(words(alias))
        if not key:
            return frozenset()
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        lists = sorted((self._postings.get(w, set()) for w in set(key)), key=len)
        cand = set(lists[0]).intersection(*lists[1:]) if lists[0] else set()
        if len(key) > 1:
            cand = {pid for pid in cand if _contains_run(self._words[pid], key)}
        hit = frozenset(cand)
        self._cache[key] = hit
        return hit

    def passages_with_any(self, aliases: Iterable[str]) -> frozenset[int]:
        """Union of `passages_with` over `matchable_aliases(aliases)`."""
        out: set[int] = set()
        for a in matchable_aliases(aliases):
            out |= self.passages_with(a)
        return frozenset(out)


def _contains_run(seq: list[str], run: tuple[str, ...]) -> bool:
    n = len(run)
    first = run[0]
    for i, w in enumerate(seq[: len(seq) - n + 1]):
        if w == first and tuple(seq[i : i + n]) == run:
            return True
    return False


def subject_contains_object(fact: Any) -> bool:
    """§A.4 filter: the object's label appears (whole words) inside the subject's label."""
    obj, subj = tuple(words(fact.object)), words(fact.subject)
    return bool(obj) and _contains_run(subj, obj)


# ---------------------------------------------------------------------------------------
# Templates (Table A.1 variants)
# ---------------------------------------------------------------------------------------


# One definition of templates for the corpus's statements and the queries: data/templates.py.
render_prompt, template_for = templates_lib.render, templates_lib.template_for


def load_templates(
    lama_dir: str | pathlib.Path,
    pararel_dir: str | pathlib.Path | None,
    relations: Iterable[str],
    user_file: str | pathlib.Path | None = None,
) -> dict[str, list[str]]:
    """Prompt templates per relation, cut right before the object, in Table A.1's variant order.

    Variant 0 is the paper's style ("[X] was born in the city of:"), variant 1 LAMA's template
    (or a ParaRel paraphrase starting with the subject), variant 2 the subject-inside form;
    further ParaRel paraphrases follow (`data.templates.load`).

    Raises:
      ValueError: a relation lacks a variant 0-2 (names it and where it looked).
    """
    return templates_lib.load(list(relations), lama_dir=lama_dir, pararel_dir=pararel_dir, user_file=user_file)


# ---------------------------------------------------------------------------------------
# Gold labels, frequencies, buckets
# ---------------------------------------------------------------------------------------


def fact_key(fact: Any) -> tuple[str, str, str]:
    """Duplicate-fact key: (subject, relation, object), case- and punctuation-insensitive."""
    return (" ".join(words(fact.subject)), fact.relation, " ".join(words(fact.object)))


def entailing_ids(facts: Sequence[Any]) -> dict[str, tuple[int, ...]]:
    """`{fact_id: sorted ids}`: a fact's evidence plus that of its duplicates (§4.2 gold)."""
    by_key: dict[tuple, set[int]] = collections.defaultdict(set)
    for f in facts:
        by_key[fact_key(f)].update(int(i) for i in f.evidence_ids)
    return {f.fact_id: tuple(sorted(by_key[fact_key(f)])) for f in facts}


def mention_ids(facts: Sequence[Any], index: MentionIndex) -> dict[str, tuple[int, ...]]:
    """`{fact_id: sorted ids}` of passages mentioning an alias of both entities (§A.4)."""
    out = {}
    for f in facts:
        subj = index.passages_with_any((f.subject,) + tuple(f.subject_aliases))
        obj = index.passages_with_any((f.object,) + tuple(f.object_aliases)) if subj else frozenset()
        out[f.fact_id] = tuple(sorted(subj & obj))
    return out


def bucket_name(frequency: int, edges: Sequence[int] = DEFAULT_BUCKET_EDGES) -> str:
    """Log-scale frequency bucket (§A.4): "[1,10)", "[10,100)", ..., "0" below the first edge."""
    if frequency < edges[0]:
        return "0"
    i = int(np.searchsorted(np.asarray(edges), frequency, side="right")) - 1
    hi = edges[i + 1] if i + 1 < len(edges) else math.inf
    return f"[{edges[i]},{hi if hi != math.inf else 'inf'})"


def bucket_order(edges: Sequence[int] = DEFAULT_BUCKET_EDGES) -> list[str]:
    """All bucket names in increasing frequency order (for stable table layout)."""
    return ["0"] + [bucket_name(e, edges) for e in edges]


# ---------------------------------------------------------------------------------------
# Selection (§A.4) and query construction
# ---------------------------------------------------------------------------------------


def select_facts(
    facts: Sequence[Any],
    frequencies: Mapping[str, int],
    cfg: SelectionConfig,
    report: QueryReport,
    correct: Mapping[str, bool] | None = None,
    relations: Iterable[str] | None = None,
) -> list[Any]:
    """§A.4 sampling: filter, cap common targets, balance across frequency buckets.

    Facts are visited in a seeded random order. A fact is dropped when its subject contains
    its object, when its relation is not in `relations` (if given), or when it would exceed a
    cap: facts per bucket, (relation, target) pairs per bucket and overall, and facts the
    model gets wrong per bucket (only when `correct` is given and the cap is > 0). Every drop
    is counted in `report`.

    Args:
      facts: `data.Fact`-like records (fact_id, subject, relation, object, ...).
      frequencies: `{fact_id: number of passages mentioning both entities}`.
      cfg: caps and seed.
      report: updated in place.
      correct: optional `{fact_id: model predicts it correctly}`.
      relations: optional relation allow-list.

    Returns:
      Selected facts, ordered by (bucket, original position) for reproducible output.
    """
    rel_ok = None if relations is None else set(relations)
    order = np.random.default_rng(cfg.seed).permutation(len(facts))
    per_bucket: collections.Counter = collections.Counter()
    per_pair_bucket: collections.Counter = collections.Counter()
    per_pair: collections.Counter = collections.Counter()
    incorrect: collections.Counter = collections.Counter()
    chosen = []
    report.num_facts += len(facts)
    for i in order:
        f = facts[int(i)]
        if rel_ok is not None and f.relation not in rel_ok:
            report.dropped_relation_filter += 1
            continue
        if subject_contains_object(f):
            report.dropped_subject_contains_object += 1
            continue
        freq = int(frequencies[f.fact_id])
        b = bucket_name(freq, cfg.bucket_edges)
        if b == "0" and not cfg.include_unmentioned:
            report.dropped_unmentioned += 1
            continue
        pair = (f.relation, " ".join(words(f.object)))
        if cfg.max_per_bucket and per_bucket[b] >= cfg.max_per_bucket:
            report.dropped_bucket_cap += 1
            continue
        if (
            cfg.max_per_relation_target_per_bucket
            and per_pair_bucket[b, pair] >= cfg.max_per_relation_target_per_bucket
        ) or (cfg.max_per_relation_target and per_pair[pair] >= cfg.max_per_relation_target):
            report.dropped_target_cap += 1
            continue
        wrong = correct is not None and not correct[f.fact_id]
        if wrong and cfg.max_incorrect_per_bucket and incorrect[b] >= cfg.max_incorrect_per_bucket:
            report.dropped_incorrect_cap += 1
            continue
        per_bucket[b] += 1
        per_pair_bucket[b, pair] += 1
        per_pair[pair] += 1
        incorrect[b] += int(wrong)
        chosen.append((int(i), b))
    rank = {b: j for j, b in enumerate(bucket_order(cfg.bucket_edges))}
    chosen.sort(key=lambda t: (rank[t[1]], t[0]))
    report.num_selected = len(chosen)
    report.per_bucket = {b: per_bucket[b] for b in bucket_order(cfg.bucket_edges) if per_bucket[b]}
    return [facts[i] for i, _ in chosen]


def take_balanced(
    facts: Sequence[Any],
    frequencies: Mapping[str, int],
    n: int,
    bucket_edges: Sequence[int] = DEFAULT_BUCKET_EDGES,
    report: QueryReport | None = None,
) -> list[Any]:
    """At most `n` facts taken round-robin over frequency buckets (keeps the §A.4 balance).

    `facts` is `select_facts` output (already shuffled within buckets); the result keeps
    its (bucket, position) order. `n <= 0` keeps everything. With `report`, the cut is
    counted (`dropped_max_queries`) and `num_selected` / `per_bucket` describe the result.
    """
    out = _take_balanced(facts, frequencies, n, bucket_edges)
    if report is not None:
        report.dropped_max_queries += len(facts) - len(out)
        report.num_selected = len(out)
        counts = collections.Counter(bucket_name(int(frequencies[f.fact_id]), bucket_edges) for f in out)
        report.per_bucket = {b: counts[b] for b in bucket_order(bucket_edges) if counts[b]}
    return out


def _take_balanced(facts, frequencies, n, bucket_edges):
    if n <= 0 or len(facts) <= n:
        return list(facts)
    by_bucket: dict[str, list[int]] = collections.defaultdict(list)
    for i, f in enumerate(facts):
        by_bucket[bucket_name(int(frequencies[f.fact_id]), bucket_edges)].append(i)
    queues = [collections.deque(v) for v in by_bucket.values()]
    keep: list[int] = []
    while len(keep) < n:
        for q in queues:
            if q and len(keep) < n:
                keep.append(q.popleft())
    return [facts[i] for i in sorted(keep)]


def build_queries(
    facts: Sequence[Any],
    templates: Mapping[str, Sequence[str]],
    *,
    variant: int,
    entailing: Mapping[str, Sequence[int]],
    mentions: Mapping[str, Sequence[int]],
    bucket_edges: Sequence[int] = DEFAULT_BUCKET_EDGES,
    report: QueryReport | None = None,
    targets: Mapping[str, str] | None = None,
) -> list[Query]:
    """Renders facts into queries (prompt + " " + object) with their gold labels.

    Args:
      facts: facts to render, in output order.
      templates: `{relation: [template, ...]}`; `templates[relation][variant]` is used.
      variant: template variant (Table A.1).
      entailing: `{fact_id: ids}` from `entailing_ids(all_facts)`.
      mentions: `{fact_id: ids}` from `mention_ids(...)`.
      bucket_edges: frequency bucket edges.
      report: facts without evidence are recorded in `report.no_evidence_fact_ids`.
      targets: optional `{fact_id: completion}` replacing the gold object as target text
        (prediction mode); facts missing from it, or with an empty completion, are skipped and
        recorded in `report.empty_target_fact_ids`.

    Returns:
      Queries with consecutive `query_id`s.

    Raises:
      ValueError: a fact's relation has no template / no such variant (names the relation).
    """
    out = []
    for f in facts:
        prompt = render_prompt(template_for(templates, f.relation, variant), f.subject)
        text = f.object if targets is None else targets.get(f.fact_id, "")
        text = " ".join(text.split())
        if not text:
            if report is not None:
                report.empty_target_fact_ids.append(f.fact_id)
            continue
        ent = tuple(sorted(int(i) for i in entailing[f.fact_id]))
        if not ent and report is not None:
            report.no_evidence_fact_ids.append(f.fact_id)
        men = tuple(sorted(int(i) for i in mentions[f.fact_id]))
        out.append(
            Query(
                query_id=len(out),
                fact_id=f.fact_id,
                relation=f.relation,
                subject=f.subject,
                object=f.object,
                prompt=prompt,
                target=" " + text,
                aliases=tuple(dict.fromkeys((f.object,) + tuple(f.object_aliases))),
                subject_aliases=tuple(dict.fromkeys((f.subject,) + tuple(f.subject_aliases))),
                entailing_ids=ent,
                mention_ids=men,
                bucket=bucket_name(len(men), bucket_edges),
                template_variant=variant,
            )
        )
    return out


def with_targets(
    queries: Sequence[Query], completions: Sequence[str], report: QueryReport | None = None
) -> list[Query]:
    """Prediction mode (§5.1 "debugging incorrect predictions"): target = the model's completion.

    Queries whose completion is empty are skipped and counted in `report`; query ids are
    renumbered consecutively.
    """
    out = []
    for q, c in zip(queries, completions, strict=True):
        c = " ".join(c.split())
        if not c:
            if report is not None:
                report.empty_target_fact_ids.append(q.fact_id)
            continue
        out.append(dataclasses.replace(q, query_id=len(out), target=" " + c))
    return out


def encode_queries(
    queries: Sequence[Query], encode: Any, report: QueryReport | None = None
) -> tuple[list[Query], list[tuple[np.ndarray, np.ndarray]]]:
    """Tokenizes queries with `encode(prompt, target) -> dict(tokens, loss_mask)`.

    `encode` is `functools.partial(data.encode_query, tok, max_len=...)`; a ValueError from
    it (the target encodes to nothing, or the query does not fit) skips the query and records
    its fact id in `report.empty_target_fact_ids`. Kept queries are renumbered.

    Returns:
      (kept queries, [(tokens, loss_mask)] aligned with them).
    """
    kept, enc = [], []
    for q in queries:
        try:
            e = encode(q.prompt, q.target)
        except ValueError:
            if report is not None:
                report.empty_target_fact_ids.append(q.fact_id)
            continue
        kept.append(dataclasses.replace(q, query_id=len(kept)))
        enc.append((np.asarray(e["tokens"], np.int32), np.asarray(e["loss_mask"], np.int32)))
    return kept, enc


def save_queries(queries: Sequence[Query], path: str | pathlib.Path) -> None:
    """Writes queries as jsonl (one object per query)."""
    files.atomic_write(path, "".join(json.dumps(dataclasses.asdict(q)) + "\n" for q in queries))


def load_queries(path: str | pathlib.Path) -> list[Query]:
    """Reads `save_queries` output."""
    out = []
    fields = {f.name: f.type for f in dataclasses.fields(Query)}
    for where, row in files.read_jsonl(path):
        try:
            out.append(Query(**{k: tuple(v) if isinstance(v, list) else v for k, v in row.items() if k in fields}))
        except (TypeError, AttributeError) as e:
            raise files.InputError(f"{where}: not a saved query ({e})") from None
    return out


# ---------------------------------------------------------------------------------------
# Greedy completion (model correctness, prediction-mode targets)
# ---------------------------------------------------------------------------------------


def predict(
    graphdef: Any,
    params: Any,
    tokenizer: Any,
    queries: Sequence[Query],
    *,
    max_new_tokens: int,
    max_len: int,
    batch_size: int = 64,
    cache: Any = None,
) -> tuple[list[str], list[bool]]:
    """Greedy completions of the queries' prompts and their §4.2 correctness.

    Completions (`generate.complete`) are cut at the first newline or sentence end so that
    the rest of a generated sentence is not taken as the answer (prediction-mode targets).
    With `cache` (`pair_cache.ResultCache` of `completions_identity` for these weights and
    settings), the uncut completions of the same prompts in the same order, with the same
    token ids, are read back instead of generated, and new ones are added.

    Returns:
      (completions, correct flags), aligned with `queries`.
    """
    # A prompt that leaves no room to generate gets no completion (its query cannot be
    # encoded either and is skipped, counted, by `encode_queries`).
    prompts, completions = [q.prompt for q in queries], []
    key = None
    if cache is not None:
        ids = tokenizer.encode_batch(prompts)
        key = hashlib.sha256(json.dumps([prompts, ids]).encode("utf-8")).hexdigest()[:24]
        completions = list(cache.values.get(key) or [])
        if len(completions) != len(prompts):
            completions = []
    if not completions:
        # batch by batch (one compiled shape, as `complete_batched`) behind a bar: minutes on a CPU
        for lo in logs.progress(
            range(0, len(prompts), batch_size),
            total=-(-len(prompts) // batch_size),
            desc="complete queries",
            unit="batch",
        ):
            completions += generate_lib.complete_batched(
                graphdef, params, tokenizer, prompts[lo : lo + batch_size], max_new_tokens, max_len, batch_size
            )
        if cache is not None and prompts:
            cache.add({key: completions})
    completions = [cut_completion(c) for c in completions]
    return completions, [is_correct(c, q.aliases) for c, q in zip(completions, queries)]


def cut_completion(text: str) -> str:
    """The answer part of a completion: its first non-blank line, up to "; " or a sentence-ending ". ".

    Instruction-tuned models (SmolLM2-Instruct) answer a prompt ending in a colon on a new line
    ("\n\n-   Paris"); cutting at the first newline would score every such answer as empty.
    """
    text = text.lstrip().split("\n", 1)[0]
    m = re.search(r"[.;](\s|$)", text)
    return (text[: m.start()] if m else text).strip()
