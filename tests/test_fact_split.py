"""Prompt templates (paper style / LAMA / subject inside), the train / eval fact split with
templated statements, and a query set drawn from the eval split only (issue 12)."""

import collections
import json
import pathlib

import pytest

from trackstar_jax import config as config_lib
from trackstar_jax import data, stages
from trackstar_jax.data import templates
from trackstar_jax.evaluation import queries

CITIES = ["Paris", "Rome", "Oslo", "Lima", "Quito", "Cairo", "Delhi", "Hanoi", "Dakar", "Sofia", "Riga", "Baku"]
LANGS = ["French", "Italian", "Norwegian", "Spanish"]


def _fact(rel, i, subj, obj, sentences):
    return {
        "uuid": f"{rel}-{i}",
        "sub_uri": f"Q{i}",
        "sub_label": subj,
        "predicate_id": rel,
        "obj_uri": f"Q{1000 + i}",
        "obj_label": obj,
        "evidences": [{"sub_surface": subj, "obj_surface": obj, "masked_sentence": s} for s in sentences],
    }


@pytest.fixture
def lama_dir(tmp_path) -> pathlib.Path:
    """A hand-made LAMA-format folder: 24 P19 facts, 12 P103 facts, relations.jsonl, no ParaRel."""
    trex = tmp_path / "lama" / "TREx"
    trex.mkdir(parents=True)
    rows = []
    for i in range(24):
        name = f"Person{i} Surname{i}"
        rows.append(
            _fact("P19", i, name, CITIES[i % 12], [f"{name} (born 19{i:02d} in [MASK]) was a painter number {i}."])
        )
    (trex / "P19.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows = [
        _fact("P103", i, f"Writer{i} Name{i}", LANGS[i % 4], [f"Writer{i} Name{i} wrote poems in [MASK] from {i}."])
        for i in range(12)
    ]
    (trex / "P103.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rel = [
        {"relation": "P19", "template": "[X] was born in [Y] ."},
        {"relation": "P103", "template": "The native language of [X] is [Y] ."},
    ]
    (tmp_path / "lama" / "relations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rel))
    return tmp_path / "lama"


def _cfg(lama_dir, **kw):
    base = dict(
        source="lama",
        path=str(lama_dir),
        eval_fraction=0.0,
        statements_per_fact=2,
        eval_fact_fraction=0.4,
        fact_split_seed=0,
    )
    return data.DataConfig(**{**base, **kw})


# ---------------------------------------------------------------------------------------
# templates
# ---------------------------------------------------------------------------------------


def test_packaged_templates_cover_every_lama_relation_in_three_variants(shared_data):
    rels = [
        json.loads(line)["relation"] for line in (shared_data / "lama" / "relations.jsonl").read_text().splitlines()
    ]
    assert len(rels) >= 41
    t = templates.load(rels, lama_dir=shared_data / "lama", pararel_dir=shared_data / "pararel")
    for r in rels:
        v = t[r]
        assert len(v) >= 3, r
        for h in v:
            assert h.count("[X]") == 1 and "[Y]" not in h, (r, h)
        assert v[0].endswith(":"), (r, v[0])  # paper style: names the answer type, ends with a colon
        assert not v[1].endswith(":"), (r, v[1])  # LAMA / ParaRel: no constraining colon
        assert not v[2].startswith("[X]"), (r, v[2])  # subject not first (Table A.1 variation 2)
    assert t["P19"][:3] == ["[X] was born in the city of:", "[X] was born in", "The birthplace of [X] is"]
    assert t["P17"][0] == "[X] is located in the following country:"  # the paper's own example (§A.4)
    # LAMA's "[Y] participated in the [X]" does not end with the object and ParaRel has no P1923:
    # variant 1 is the shipped one.
    assert t["P1923"][1] == "[X] was contested by"


def test_templates_variant1_from_lama_and_user_file_overrides(lama_dir, tmp_path):
    t = templates.load(["P19", "P103"], lama_dir=lama_dir)
    assert t["P19"] == ["[X] was born in the city of:", "[X] was born in", "The birthplace of [X] is"]
    user = tmp_path / "mine.jsonl"
    user.write_text(
        json.dumps({"relation": "P19", "templates": {"0": "[X] came into the world in the town of:"}})
        + "\n"
        + json.dumps(
            {"relation": "P9999", "templates": {"0": "[X] likes:", "1": "[X] likes", "2": "What [X] likes is"}}
        )
        + "\n"
    )
    t = templates.load(["P19", "P9999"], lama_dir=lama_dir, user_file=user)
    assert t["P19"][0] == "[X] came into the world in the town of:" and t["P19"][1] == "[X] was born in"
    assert t["P9999"] == ["[X] likes:", "[X] likes", "What [X] likes is"]


def test_templates_errors_name_the_relation_and_line(lama_dir, tmp_path):
    with pytest.raises(ValueError, match=r"relation 'P9999' has no prompt template variant\(s\) \[0, 1, 2\]"):
        templates.load(["P9999"], lama_dir=lama_dir)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"relation": "P19", "templates": {"0": "[X] and [X] were born in:"}}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1 \(P19 variant 0\).*exactly one \[X\]"):
        templates.load(["P19"], lama_dir=lama_dir, user_file=bad)
    bad.write_text(json.dumps({"relation": "P19", "templates": "[X] was born in"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: expected"):
        templates.load(["P19"], lama_dir=lama_dir, user_file=bad)


# ---------------------------------------------------------------------------------------
# corpus: fact split + templated statements
# ---------------------------------------------------------------------------------------


def test_fact_split_and_templated_statements(lama_dir):
    corpus = data.build_corpus(_cfg(lama_dir))
    split = {f.fact_id: f.split for f in corpus.facts}
    n_eval = sum(s == "eval" for s in split.values())
    assert 0 < n_eval < len(split) and set(split.values()) == {"train", "eval"}
    info = corpus.info
    assert info["fact_split"] == {
        "seed": 0,
        "eval_fact_fraction": 0.4,
        "num_train_facts": len(split) - n_eval,
        "num_eval_facts": n_eval,
    }
    n_evidence = info["num_evidence_passages"]
    assert n_evidence == 36 and info["num_templated_statements"] == 2 * (len(split) - n_eval)
    assert len(corpus.examples) == n_evidence + info["num_templated_statements"]
    statements = set(range(n_evidence, len(corpus.examples)))
    assert templates.statement_ids(corpus) == frozenset(statements)  # found again by text
    owner = {}
    for f in corpus.facts:
        mine = set(f.evidence_ids) & statements
        if f.split == "eval":
            assert not mine  # an eval fact's knowledge is only in its evidence sentence
            assert set(f.evidence_ids) < set(range(n_evidence))
        else:
            assert len(mine) == 2
            texts = [corpus.texts[i] for i in sorted(mine)]
            # template 0 always, rendered with the subject and ending with the object
            first = templates.render(corpus.templates[f.relation][0], f.subject)
            assert f"{first} {f.object}." in texts
            assert all(t.startswith(f.subject) or f.subject in t for t in texts)
        for i in mine:
            assert i not in owner  # a statement entails its own fact only
            owner[i] = f.fact_id
    # deterministic in the seed, different for another seed
    again = data.build_corpus(_cfg(lama_dir))
    assert again.fingerprint == corpus.fingerprint
    other = data.build_corpus(_cfg(lama_dir, fact_split_seed=1))
    assert {f.fact_id: f.split for f in other.facts} != split


def test_duplicate_facts_share_a_split(lama_dir):
    p = lama_dir / "TREx" / "P19.jsonl"
    lines = p.read_text().splitlines()
    dup = json.loads(lines[0])
    dup["uuid"] = "dup-of-0"
    dup["evidences"][0]["masked_sentence"] = "Another sentence says Person0 Surname0 was from [MASK]."
    p.write_text("\n".join(lines + [json.dumps(dup)]) + "\n")
    corpus = data.build_corpus(_cfg(lama_dir, eval_fact_fraction=0.5))
    by_id = {f.fact_id: f for f in corpus.facts}
    assert by_id["dup-of-0"].split == by_id["P19-0"].split


def test_corpus_info_and_split_survive_save_and_load(lama_dir, tmp_path):
    corpus = data.build_corpus(_cfg(lama_dir))
    data.save_corpus(corpus, tmp_path / "corpus")
    back = data.load_corpus(tmp_path / "corpus")
    assert back.info == corpus.info and back.facts == corpus.facts and back.templates == corpus.templates


def test_split_config_errors(lama_dir):
    with pytest.raises(ValueError, match="need config.data.source='lama'"):
        data.DataConfig(source="embedded", statements_per_fact=2)
    with pytest.raises(ValueError, match="eval_fact_fraction must be in"):
        data.DataConfig(source="lama", path=str(lama_dir), eval_fact_fraction=1.0)
    with pytest.raises(ValueError, match=r"relation 'P19' has no prompt template"):
        (lama_dir / "relations.jsonl").unlink()
        bad = lama_dir.parent / "t.jsonl"
        bad.write_text(json.dumps({"relation": "P7", "templates": {"0": "[X] x:"}}) + "\n")
        data.build_corpus(_cfg(lama_dir, relations="P19"))  # shipped file has P19 v0/v2, no LAMA v1


# ---------------------------------------------------------------------------------------
# the query set: eval facts only, split and counts in the report
# ---------------------------------------------------------------------------------------


class _Run:
    """What `query_set.make_eval_queries` reads from a run, with a model that answers "Paris"."""

    workdir = None  # no run folder: nothing cached (`pair_cache.ResultCache`)

    def __init__(self, corpus, settings):
        self.corpus, self.data = corpus, settings.data


def test_queries_come_from_the_eval_split_only(lama_dir, monkeypatch):
    from trackstar_jax.evaluation import query_set

    corpus = data.build_corpus(_cfg(lama_dir))
    settings = config_lib.from_dict(
        {
            "data": {"source": "lama", "path": str(lama_dir)},
            "eval": {"max_per_relation_target": 0, "max_per_relation_target_per_bucket": 0},
            "hessian": {"r_eval_source": "task_prompts", "r_eval_prompts": 30},
        }
    )
    run = _Run(corpus, settings)
    run.model_cfg = type("M", (), {"max_len": 64})()
    run.graphdef = run.params = None

    class Tok:
        def encode(self, text):
            return list(range(len(text.split())))

    run.tokenizer = Tok()
    monkeypatch.setattr(queries, "predict", lambda *a, **k: (["Paris"] * len(a[-1]), [False] * len(a[-1])))
    monkeypatch.setattr(
        query_set.data_lib,
        "encode_query",
        lambda tok, p, t, max_len, query_id=None: {"tokens": [1, 2, 3], "loss_mask": [0, 0, 1]},
    )
    eq = query_set.make_eval_queries(run, settings)
    split = {f.fact_id: f.split for f in corpus.facts}
    assert eq.queries and all(split[q.fact_id] == "eval" for q in eq.queries)
    rep = eq.report.to_dict()
    assert rep["dropped_train_split"] == sum(s == "train" for s in split.values())
    assert rep["corpus"]["fact_split"]["num_eval_facts"] == sum(s == "eval" for s in split.values())
    assert sum(rep["per_relation"].values()) == len(eq.queries)
    # template 0 (paper style) from the corpus
    q = eq.queries[0]
    assert q.prompt.endswith(":") and q.target == " " + q.object
    # R_eval task prompts: the queries first, then other facts of the same relations and template
    assert len(eq.r_eval_prompts) == 30
    assert [(t.prompt, t.target) for t in eq.r_eval_prompts[: len(eq.queries)]] == [
        (q.prompt, q.target) for q in eq.queries
    ]
    assert all(t.prompt.endswith(":") for t in eq.r_eval_prompts)
    assert len({(t.prompt, t.target) for t in eq.r_eval_prompts}) == 30
    # R_eval's examples (what evaluate, launch.retrieve and the explorer use): the task prompts
    # here, the queries themselves without them
    assert eq.r_eval_queries() == eq.r_eval_prompts
    eq.r_eval_prompts = []
    assert eq.r_eval_queries() == eq.text_queries() and len(eq.r_eval_queries()) == len(eq.queries)


def test_the_wrong_fact_cap_completes_each_fact_once(lama_dir, monkeypatch):
    """With §A.4's cap every candidate is completed once; the selection reports those flags."""
    from trackstar_jax.evaluation import query_set

    corpus = data.build_corpus(_cfg(lama_dir))
    settings = config_lib.from_dict(
        {
            "data": {"source": "lama", "path": str(lama_dir)},
            "eval": {"max_per_relation_target": 0, "max_per_relation_target_per_bucket": 0, "max_per_bucket": 10},
        }
    )
    run = _Run(corpus, settings)
    run.model_cfg = type("M", (), {"max_len": 64})()
    run.graphdef = run.params = None
    run.tokenizer = type("T", (), {"encode": lambda self, t: list(range(len(t.split())))})()
    calls = []

    def predict(*a, **k):  # right on every other fact, by position in this call
        calls.append([q.fact_id for q in a[-1]])
        return [f"c{i}" for i in range(len(a[-1]))], [i % 2 == 0 for i in range(len(a[-1]))]

    monkeypatch.setattr(queries, "predict", predict)
    monkeypatch.setattr(
        query_set.data_lib,
        "encode_query",
        lambda tok, p, t, max_len, query_id=None: {"tokens": [1, 2, 3], "loss_mask": [0, 0, 1]},
    )
    eq = query_set.make_eval_queries(run, settings)
    assert settings.eval.max_incorrect_per_bucket == -1 and len(calls) == 1  # the cap's pass only
    rep = eq.report.to_dict()
    assert (
        rep["num_completed_candidates"] == len(calls[0]) and rep["num_correct_candidates"] == (len(calls[0]) + 1) // 2
    )
    first = dict(zip(calls[0], range(len(calls[0]))))
    want = [(f"c{first[q.fact_id]}", first[q.fact_id] % 2 == 0) for q in eq.queries]
    assert eq.queries and list(zip(eq.completions, eq.correct)) == want
    # the cap held: at most max(1, round(10 / 10)) = 1 wrong fact per bucket
    wrong = collections.Counter(q.bucket for q, ok in zip(eq.queries, eq.correct) if not ok)
    assert wrong and max(wrong.values()) == 1


# ---------------------------------------------------------------------------------------
# the documented command on another relation set (launch.evaluate = train + evaluate)
# ---------------------------------------------------------------------------------------


def _any_relations_config(lama_dir, relations):
    from experiments import trex_table1

    c = trex_table1.get_config()
    c.data.path = str(lama_dir)
    c.data.relations = relations
    c.data.pararel_dir = c.eval.pararel_dir = ""
    c.data.max_examples = 0
    c.data.eval_fraction = 0.0
    c.model.vocab_size = 128
    c.model.num_layers, c.model.embed_dim, c.model.num_heads, c.model.head_dim, c.model.mlp_dim = 1, 32, 2, 16, 64
    c.train.num_steps = 4
    c.train.log_every_steps = c.train.eval_every_steps = c.train.checkpoint_every_steps = 4
    c.train.global_batch_size = 8
    c.train.num_completions = 0
    c.train.max_new_tokens = 2
    c.train.min_dim_size_to_factor = 16
    c.vectors.num_blocks, c.vectors.proj_dim, c.vectors.batch_size = 1, 4, 8  # d = 32
    c.hessian.lambda_component_fraction = 1 / 32
    c.hessian.r_eval_prompts = 30
    c.index.chunk_rows = 16
    c.retrieval.read_chunk_rows = 64
    c.eval.methods = ("trex_gold", "bm25", "exp1", "exp2", "trackstar", "trackstar_l090")
    c.eval.optional_methods = ()
    c.eval.max_new_tokens = 2
    c.eval.max_per_relation_target = c.eval.max_per_relation_target_per_bucket = 0
    c.eval.num_examples_shown = 1
    c.tailpatch.top_ks = (1, 10)
    c.tailpatch.batch_size = 8
    return c


@pytest.mark.slow
def test_trex_table1_runs_on_another_relation_set(lama_dir, tmp_path, compile_cache):

    settings = config_lib.from_configdict(_any_relations_config(lama_dir, "P19,P103"))
    stages.train(settings, tmp_path / "run")
    table = stages.evaluate(settings, tmp_path / "run")
    split = table["query_report"]["corpus"]["fact_split"]
    assert table["num_queries"] == split["num_eval_facts"] > 0  # every eval fact, no train fact
    assert set(table["model_accuracy_by_relation"]) == {"P19", "P103"}
    rows = {r["method"]: r for r in table["rows"]}
    ts, fixed = rows["trackstar"]["scoring"]["whitening"], rows["trackstar_l090"]["scoring"]["whitening"]
    assert fixed["mix_lambda"] == 0.9 and 0 < ts["mix_lambda"] < 1
    assert ts["r_eval"]["source"] == "task_prompts" and ts["r_eval"]["num_vectors"] == 30
    assert len(ts["r_eval"]["r_eval_rank_per_block"]) == 2 and 0 <= ts["r_eval"]["num_downweighted_2x"] <= 32
    groups = {c["group"] for c in table["comparisons"]}
    assert groups == {"a", "b", "c"}  # no TRAK row here: (d) is left out
    assert 0 <= rows["trackstar"]["statement_at_10"] <= 1 and set(rows["bm25"]["by_relation"]) == {"P19", "P103"}
    md = (tmp_path / "run" / "eval" / "table.md").read_text()
    assert "paired bootstrap over queries of the difference" in md and "Accuracy per relation: P103" in md


def test_a_relation_without_templates_is_named(lama_dir, tmp_path):

    (lama_dir / "TREx" / "P7777.jsonl").write_text(
        (lama_dir / "TREx" / "P103.jsonl").read_text().replace("P103", "P7777")
    )
    settings = config_lib.from_configdict(_any_relations_config(lama_dir, "P19,P7777"))
    with pytest.raises(ValueError, match=r"relation 'P7777' has no prompt template.*config.data.templates_file"):
        stages.train(settings, tmp_path / "run")
    user = tmp_path / "mine.jsonl"
    user.write_text(
        json.dumps(
            {"relation": "P7777", "templates": {"0": "[X] speaks:", "1": "[X] speaks", "2": "The tongue of [X] is"}}
        )
        + "\n"
    )
    corpus = data.build_corpus(settings.data.__class__(**{**settings.data.__dict__, "templates_file": str(user)}))
    assert corpus.templates["P7777"][0] == "[X] speaks:"


def test_smollm2_variant_resolves_to_the_same_table():
    from experiments import smollm2_table1, trex_table1

    s = config_lib.from_configdict(smollm2_table1.get_config())
    t = config_lib.from_configdict(trex_table1.get_config())
    assert s.model.source == "smollm2" and s.vectors.estimate_v_examples > 0  # estimated optimizer correction
    for key in ("source", "relations", "fact_split_seed"):
        assert getattr(s.data, key) == getattr(t.data, key), key
    # Nothing is trained on the corpus (issue 35): no templated statements, every fact may be a
    # query, and the candidates are the natural sentences, as in trex_table1.
    assert s.data.statements_per_fact == 0 and s.data.eval_fact_fraction == 0.0
    assert s.candidates.passages == t.candidates.passages == "natural"
    assert s.eval.methods == t.eval.methods and s.eval.template_variant == t.eval.template_variant == 0
    assert s.hessian.r_eval_source == "task_prompts"


def test_query_budget_counts_what_the_wrong_fact_cap_admits(lama_dir):
    """benchmarks/query_budget: every fact right = every cap but the wrong-fact one; every fact
    wrong = at most max(1, round(max_per_bucket / 10)) per bucket."""
    from benchmarks import query_budget

    settings = config_lib.from_dict(
        {
            "data": {"source": "lama", "path": str(lama_dir), "eval_fact_fraction": 0.0},
            "eval": {"max_per_relation_target": 0, "max_per_relation_target_per_bucket": 0, "max_per_bucket": 20},
        }
    )
    right = query_budget.budget(settings, 0, accuracy=1.0, draws=2)
    buckets = right["per_bucket_before_wrong_cap"]
    assert right["facts"] == 36 and right["queries_min"] == right["queries_max"] == sum(buckets.values()) > 0
    wrong = query_budget.budget(settings, 0, accuracy=0.0, draws=1)
    assert wrong["max_incorrect_per_bucket"] == 2 and wrong["queries_mean"] == sum(min(n, 2) for n in buckets.values())
    assert query_budget.budget(settings, 20, accuracy=1.0, draws=1)["sentences"] <= 20
