"""The evaluation's query set: the run's facts -> sampled, labelled, encoded queries (§4.2, §A.4)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import pathlib

import numpy as np

from trackstar_jax import data as data_lib
from trackstar_jax import files
from trackstar_jax.distributed import multihost
from trackstar_jax.evaluation import pair_cache
from trackstar_jax.evaluation import queries as queries_lib
from trackstar_jax.evaluation import settings as settings_lib
from trackstar_jax.retrieval import stage as retrieval_stage
from trackstar_jax.training import checkpoint as checkpoint_lib


@dataclasses.dataclass
class EvalQueries:
    """The query set of an evaluation run.

    Attributes:
      queries: encoded queries (query_id = row).
      encoded: `(tokens, loss_mask)` per query.
      completions, correct: the model's greedy completion of each prompt and its §4.2 correctness.
      report: what happened to every fact (drops, no evidence, empty targets).
      templates: the templates used.
      r_eval_prompts: prompts whose gradients define R_eval (hessian.r_eval_source =
        "task_prompts"): the queries, then prompts of other facts of the same relations and
        template; empty when R_eval comes from the queries.
    """

    queries: list[queries_lib.Query]
    encoded: list[tuple[np.ndarray, np.ndarray]]
    completions: list[str]
    correct: list[bool]
    report: queries_lib.QueryReport
    templates: dict[str, list[str]]
    r_eval_prompts: list[retrieval_stage.TextQuery] = dataclasses.field(default_factory=list)

    def r_eval_queries(self) -> list[retrieval_stage.TextQuery]:
        """The examples whose gradients define R_eval of a mixed R (§3, §A.1.3): the task
        prompts (hessian.r_eval_source = "task_prompts"), else the queries themselves. The
        evaluation, `launch.retrieve` of the fact queries and the explorer all take R_eval here."""
        return list(self.r_eval_prompts) or self.text_queries()

    def text_queries(self, with_fact_fields: bool = False) -> list[retrieval_stage.TextQuery]:
        """The queries as retrieval's `TextQuery` (with fact fields and gold ids for output files)."""
        if not with_fact_fields:
            return [retrieval_stage.TextQuery(q.query_id, q.prompt, q.target) for q in self.queries]
        return [
            retrieval_stage.TextQuery(
                q.query_id,
                q.prompt,
                q.target,
                (
                    ("fact_id", q.fact_id),
                    ("relation", q.relation),
                    ("model_completion", c),
                    ("model_correct", ok),
                    ("entailing_ids", list(q.entailing_ids)),
                ),
                gold=tuple(q.entailing_ids),
            )
            for q, c, ok in zip(self.queries, self.completions, self.correct)
        ]


def selection_config(settings: settings_lib.TableSettings) -> queries_lib.SelectionConfig:
    """§A.4 sampling settings from `config.eval`."""
    e = settings.eval
    return queries_lib.SelectionConfig(
        max_per_bucket=e.max_per_bucket,
        max_per_relation_target_per_bucket=e.max_per_relation_target_per_bucket,
        max_per_relation_target=e.max_per_relation_target,
        max_incorrect_per_bucket=e.incorrect_cap,
        bucket_edges=e.bucket_edges,
        include_unmentioned=e.include_unmentioned,
        seed=settings.seed,
    )


def eval_templates(
    run: checkpoint_lib.Run, ev: settings_lib.EvalSettings, relations: list[str]
) -> dict[str, list[str]]:
    """The corpus's own templates (embedded source; LAMA with templated statements) or, for a
    LAMA corpus without them, `data.templates.load` (paper style, LAMA / ParaRel, subject inside)."""
    if run.corpus.templates:
        missing = [r for r in relations if r not in run.corpus.templates]
        if missing:
            raise ValueError(f"relations {missing} have no prompt template in the run's corpus ({run.corpus.name})")
        return {k: list(v) for k, v in run.corpus.templates.items()}
    lama = ev.lama_dir or run.data.path
    if not lama:
        raise files.ConfigError(
            "the corpus has no prompt templates: set config.eval.lama_dir to a folder with LAMA relations.jsonl"
        )
    root = pathlib.Path(lama)
    root = root if (root / "relations.jsonl").is_file() else root.parent  # data.path may point at TREx/
    data = run.data
    return queries_lib.load_templates(
        root, ev.pararel_dir or data.pararel_dir or None, relations, user_file=data.templates_file or None
    )


def make_eval_queries(run: checkpoint_lib.Run, settings: settings_lib.TableSettings) -> EvalQueries:
    """Facts -> sampled, labelled, encoded queries with the model's greedy completions (§4.2, §A.4).

    Raises:
      ValueError: the corpus has no facts; a queried relation has no template (names it);
        no query survives.
    """
    ev, corpus = settings.eval, run.corpus
    sel = selection_config(settings)
    if not corpus.facts:
        raise ValueError(f"corpus {corpus.name} has no facts to query (fact tracing needs source 'embedded' or 'lama')")
    have = sorted({f.relation for f in corpus.facts})
    missing = [r for r in ev.relation_list if r not in have]
    if missing:
        raise files.ConfigError(
            f"config.eval.relations {missing} have no facts in corpus {corpus.name} (it has {have})"
        )
    relations = list(ev.relation_list) or have
    templates = eval_templates(run, ev, relations)
    for r in relations:
        queries_lib.template_for(templates, r, ev.template_variant)  # a relation with no template: error naming it
    mention_index = queries_lib.MentionIndex(corpus.texts)
    facts = [f for f in corpus.facts if f.relation in set(relations)]
    # Fact split (data.eval_fact_fraction): only eval facts are queried; train facts have
    # templated statements in the corpus, so their answer is in the prompt's own form.
    in_train = [f for f in facts if f.split == "train"]
    facts = [f for f in facts if f.split != "train"]
    mentions = queries_lib.mention_ids(facts, mention_index)
    entailing = queries_lib.entailing_ids(corpus.facts)
    freq = {k: len(v) for k, v in mentions.items()}
    max_len, bs = run.model_cfg.max_len, ev.completion_batch_size
    gen = dict(max_new_tokens=ev.max_new_tokens, max_len=max_len, batch_size=bs)
    cache = None  # a resumed or reopened evaluation reads its completions back (`pair_cache`)
    if run.workdir is not None:
        cache = pair_cache.ResultCache(
            run.workdir,
            pair_cache.completions_identity(run, **gen),
            write=multihost.is_primary() and os.access(run.workdir, os.W_OK),  # the explorer may serve a read-only run
            folder=pair_cache.COMPLETIONS_DIR,
            parse=pair_cache.strings,
        )
    predict = functools.partial(queries_lib.predict, run.graphdef, run.params, run.tokenizer, cache=cache, **gen)
    correct_all = None
    if sel.max_incorrect_per_bucket > 0:  # §A.4 caps wrong predictions: needs them for every candidate
        cand = queries_lib.build_queries(
            facts,
            templates,
            variant=ev.template_variant,
            entailing=entailing,
            mentions=mentions,
            bucket_edges=sel.bucket_edges,
        )
        done = dict(zip(((q.fact_id, q.prompt) for q in cand), zip(*predict(cand))))
        correct_all = {fid: ok for (fid, _), (_, ok) in done.items()}
    report = queries_lib.QueryReport(corpus=dict(corpus.info), selection_seed=sel.seed)
    if correct_all is not None:
        report.num_completed_candidates, report.num_correct_candidates = len(correct_all), sum(correct_all.values())
    report.dropped_relation_filter = len(corpus.facts) - len(facts) - len(in_train)
    report.dropped_train_split = len(in_train)
    report.num_facts = len(corpus.facts) - len(facts)  # select_facts adds len(facts): the total is the corpus's
    selected = queries_lib.select_facts(facts, freq, sel, report, correct=correct_all)
    selected = queries_lib.take_balanced(selected, freq, ev.max_queries, sel.bucket_edges, report)
    qs = queries_lib.build_queries(
        selected,
        templates,
        variant=ev.template_variant,
        entailing=entailing,
        mentions=mentions,
        bucket_edges=sel.bucket_edges,
        report=report,
    )
    # The cap already completed every candidate: the selected prompts are among them, so the
    # flags that selected a fact are the ones reported (no second pass over the selection).
    if correct_all is not None and all((q.fact_id, q.prompt) in done for q in qs):
        completions, correct = [done[q.fact_id, q.prompt][0] for q in qs], [done[q.fact_id, q.prompt][1] for q in qs]
    else:
        completions, correct = predict(qs)
    by_fact = {q.fact_id: (c, ok) for q, c, ok in zip(qs, completions, correct)}
    if ev.query_mode == "prediction":
        qs = queries_lib.with_targets(qs, completions, report)
    encode = functools.partial(data_lib.encode_query, run.tokenizer, max_len=max_len)
    qs, enc = queries_lib.encode_queries(qs, encode, report)
    report.per_relation = dict(sorted(collections.Counter(q.relation for q in qs).items()))
    if not qs:
        raise ValueError(f"no query left after selection and encoding: {json.dumps(report.to_dict())}")
    eq = EvalQueries(
        qs, enc, [by_fact[q.fact_id][0] for q in qs], [by_fact[q.fact_id][1] for q in qs], report, templates
    )
    if settings.hessian.r_eval_source == "task_prompts":
        pool = [f for f in corpus.facts if f.relation in set(relations)]
        eq.r_eval_prompts = task_prompts(
            eq, pool, templates, ev.template_variant, settings.hessian.r_eval_prompts, encode, settings.seed
        )
    return eq


def task_prompts(
    eq: EvalQueries,
    facts: list,
    templates: dict[str, list[str]],
    variant: int,
    num: int,
    encode: functools.partial,
    seed: int,
) -> list[retrieval_stage.TextQuery]:
    """R_eval's examples when they are "task prompts" (§A.1.3): the queries, then facts of the
    same relations (either split; not the queried ones; seeded order) rendered with the same
    template and gold target, `num` in all. Prompts that cannot be encoded are skipped."""
    out = [retrieval_stage.TextQuery(i, q.prompt, q.target) for i, q in enumerate(eq.queries)][:num]
    queried = {q.fact_id for q in eq.queries}
    seen = {(q.prompt, q.target) for q in eq.queries}
    for i in np.random.default_rng(seed + 1).permutation(len(facts)):
        if len(out) >= num:
            break
        f = facts[int(i)]
        prompt = queries_lib.render_prompt(queries_lib.template_for(templates, f.relation, variant), f.subject)
        target = " " + " ".join(f.object.split())
        if f.fact_id in queried or (prompt, target) in seen or target == " ":
            continue
        try:
            encode(prompt, target)
        except ValueError:
            continue
        seen.add((prompt, target))
        out.append(retrieval_stage.TextQuery(len(out), prompt, target))
    return out
