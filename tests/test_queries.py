"""queries: templates, gold labels, frequency, sampling caps, correctness, bad input; real LAMA lines."""

import dataclasses
import functools
import re

import pytest

from trackstar_jax import config as config_lib
from trackstar_jax import data as data
from trackstar_jax.evaluation import queries


def _fact(fid, subj, rel, obj, ev=(), oal=(), sal=()):
    return data.Fact(
        fact_id=fid,
        subject=subj,
        relation=rel,
        object=obj,
        object_aliases=tuple(oal) or (obj,),
        subject_aliases=tuple(sal) or (subj,),
        evidence_ids=tuple(ev),
    )


# ---------------------------------------------------------------------------------------
# correctness (§4.2)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pred, aliases, want",
    [
        ("Paris, France", ("Paris",), True),
        ("the Netherlands and Belgium", ("Netherlands",), True),  # stopword "the" removed
        ("PARIS.", ("paris",), True),  # case and punctuation
        ("Parisian food", ("Paris",), False),  # whole words only
        ("London", ("Paris", "London"), True),  # any alias
        ("a painter", ("painter",), True),
        ("in the city of Lyon", ("Lyon",), False),  # must start with the answer
        ("", ("Paris",), False),
        ("the", ("the",), False),  # an alias that normalises to nothing never matches
    ],
)
def test_is_correct(pred, aliases, want):
    assert queries.is_correct(pred, aliases) is want


def test_cut_completion():
    assert queries.cut_completion(" Paris. He later moved") == "Paris"
    assert queries.cut_completion(" Alexandra, Victoria\nmore") == "Alexandra, Victoria"
    assert queries.cut_completion(" 3.5 metres") == "3.5 metres"
    # an instruction-tuned model answers on a new line: the first non-blank line is the answer
    assert queries.cut_completion("\n\n-   Paris\n-  ") == "-   Paris"
    assert queries.is_correct(queries.cut_completion("\n\n-   Paris\n-  "), ["Paris"])
    assert queries.cut_completion("\n\n") == ""


# ---------------------------------------------------------------------------------------
# mention counting (frequency, looser label)
# ---------------------------------------------------------------------------------------

TEXTS = [
    "Paris is in France.",
    "The Paris Hilton hotel.",
    "Parisian cafes in France",
    "new york and paris",
    "York is old.",
    "New York, New York",
    "France",
]


def _reference_passages_with(texts, alias):
    pat = re.compile(r"(?<!\w)" + r"\W+".join(re.escape(w) for w in queries.words(alias)) + r"(?!\w)")
    return {i for i, t in enumerate(texts) if pat.search(t.lower())}


@pytest.mark.parametrize("alias", ["Paris", "paris hilton", "New York", "york", "France", "cafes in france", "zzz"])
def test_mention_index_matches_regex_scan(alias):
    idx = queries.MentionIndex(TEXTS)
    assert idx.passages_with(alias) == _reference_passages_with(TEXTS, alias)


def test_mention_ids_need_both_entities_and_skip_short_aliases():
    idx = queries.MentionIndex(TEXTS)
    f = _fact("f", "Paris", "P1", "France", sal=("Paris", "NY"))  # "NY" < 3 chars: ignored
    assert queries.mention_ids([f], idx) == {"f": (0,)}
    g = _fact("g", "New York", "P1", "York")
    assert queries.mention_ids([g], idx) == {"g": (3, 5)}


def test_entailing_ids_merge_duplicate_facts():
    facts = [
        _fact("a", "Ann Lee", "P19", "Paris", ev=(4, 1)),
        _fact("b", "ann lee", "P19", "Paris.", ev=(7,)),
        _fact("c", "Ann Lee", "P20", "Paris", ev=(9,)),
    ]
    got = queries.entailing_ids(facts)
    assert got == {"a": (1, 4, 7), "b": (1, 4, 7), "c": (9,)}


def test_bucket_names():
    assert queries.bucket_name(0) == "0"
    assert queries.bucket_name(1) == "[1,10)"
    assert queries.bucket_name(9) == "[1,10)"
    assert queries.bucket_name(10) == "[10,100)"
    assert queries.bucket_name(10**6) == "[100000,inf)"
    assert queries.bucket_order((1, 3)) == ["0", "[1,3)", "[3,inf)"]


# ---------------------------------------------------------------------------------------
# sampling (§A.4)
# ---------------------------------------------------------------------------------------


def test_select_facts_filters_and_caps():
    facts = [_fact(f"usa{i}", f"Town{i}", "P17", "USA") for i in range(30)]
    facts += [_fact(f"fr{i}", f"Ville{i}", "P17", "France") for i in range(5)]
    facts += [_fact("self", "Paris Saint-Germain", "P17", "Paris")]  # subject contains object
    facts += [_fact("zero", "Nowhere", "P17", "Chad")]  # never mentioned
    freq = {f.fact_id: 3 for f in facts}
    freq["zero"] = 0
    freq.update({f"usa{i}": 30 for i in range(15)})  # half the USA facts in the [10,100) bucket
    rep = queries.QueryReport()
    cfg = queries.SelectionConfig(
        max_per_bucket=100,
        max_per_relation_target_per_bucket=5,
        max_per_relation_target=8,
        bucket_edges=(1, 10, 100),
        seed=0,
    )
    got = queries.select_facts(facts, freq, cfg, rep)
    ids = [f.fact_id for f in got]
    assert "self" not in ids and "zero" not in ids
    assert rep.dropped_subject_contains_object == 1 and rep.dropped_unmentioned == 1
    usa = [f for f in got if f.object == "USA"]
    assert len(usa) == 8  # overall (relation, target) cap
    assert sum(freq[f.fact_id] == 30 for f in usa) <= 5 and sum(freq[f.fact_id] == 3 for f in usa) <= 5
    assert len([f for f in got if f.object == "France"]) == 5
    assert rep.num_selected == len(got) == 13 and rep.dropped_target_cap == 30 - 8
    assert rep.per_bucket == {"[1,10)": sum(freq[i] == 3 for i in ids), "[10,100)": sum(freq[i] == 30 for i in ids)}
    # the output is ordered by bucket, and the same seed gives the same sample
    assert [queries.bucket_name(freq[i], (1, 10, 100)) for i in ids] == sorted(
        [queries.bucket_name(freq[i], (1, 10, 100)) for i in ids], key=queries.bucket_order((1, 10, 100)).index
    )
    assert [f.fact_id for f in queries.select_facts(facts, freq, cfg, queries.QueryReport())] == ids


def test_select_facts_bucket_and_incorrect_caps():
    facts = [_fact(f"f{i}", f"S{i}", "P1", f"O{i}") for i in range(20)]
    freq = {f.fact_id: 2 for f in facts}
    correct = {f.fact_id: i % 2 == 0 for i, f in enumerate(facts)}
    rep = queries.QueryReport()
    cfg = queries.SelectionConfig(max_per_bucket=8, max_incorrect_per_bucket=2, bucket_edges=(1, 10))
    got = queries.select_facts(facts, freq, cfg, rep, correct=correct)
    assert len(got) == 8 and sum(not correct[f.fact_id] for f in got) == 2
    assert rep.dropped_incorrect_cap > 0 and rep.dropped_bucket_cap > 0
    assert rep.num_facts == 20 == rep.num_selected + rep.dropped_incorrect_cap + rep.dropped_bucket_cap


def test_the_default_incorrect_cap_is_the_papers_ratio():
    """§A.4: up to 1000 facts per bucket, at most 100 of them wrong; the default keeps that ratio."""
    from trackstar_jax import config as config_lib
    from trackstar_jax.evaluation import query_set

    assert config_lib.EvalSettings().incorrect_cap == 100
    assert config_lib.EvalSettings(max_per_bucket=200).incorrect_cap == 20
    assert config_lib.EvalSettings(max_incorrect_per_bucket=0).incorrect_cap == 0  # explicitly no cap
    assert config_lib.EvalSettings(max_per_bucket=3).incorrect_cap == 1
    from experiments import base

    s = config_lib.from_configdict(base.get_config())
    assert query_set.selection_config(s).max_incorrect_per_bucket == 100
    with pytest.raises(ValueError, match="max_incorrect_per_bucket"):
        config_lib.EvalSettings(max_incorrect_per_bucket=-2)


# ---------------------------------------------------------------------------------------
# templates, query building, bad input
# ---------------------------------------------------------------------------------------


def test_render_prompt_and_missing_template_errors():
    assert queries.render_prompt("the mother tongue of [X] is [Y] .", "Ann Lee") == "The mother tongue of Ann Lee is"
    assert queries.render_prompt("[X] was born in", "Ann") == "Ann was born in"
    with pytest.raises(ValueError, match=r"no \[X\] slot"):
        queries.render_prompt("born in [Y]", "Ann")
    with pytest.raises(ValueError, match="'P999' has no prompt template"):
        queries.template_for({"P19": ["[X] was born in"]}, "P999", 0)
    with pytest.raises(ValueError, match="'P19' has no template variant 2"):
        queries.template_for({"P19": ["[X] was born in"]}, "P19", 2)
    facts = [_fact("a", "Ann", "P999", "Paris", ev=(0,))]
    with pytest.raises(ValueError, match="P999"):
        queries.build_queries(
            facts, {"P19": ["[X] was born in"]}, variant=0, entailing={"a": (0,)}, mentions={"a": (0,)}
        )


def test_build_queries_reports_no_evidence_and_empty_targets():
    facts = [
        _fact("a", "Ann", "P19", "Paris", ev=(0,)),
        _fact("b", "Bob", "P19", "Lyon"),
        _fact("c", "Cy", "P19", "Rome", ev=(2,)),
    ]
    tmpl = {"P19": ["[X] was born in"]}
    rep = queries.QueryReport()
    ent = queries.entailing_ids(facts)
    men = {"a": (0, 5), "b": (), "c": (2,)}
    qs = queries.build_queries(facts, tmpl, variant=0, entailing=ent, mentions=men, report=rep, bucket_edges=(1, 10))
    assert [q.prompt for q in qs] == ["Ann was born in", "Bob was born in", "Cy was born in"]
    assert [q.target for q in qs] == [" Paris", " Lyon", " Rome"]
    assert rep.no_evidence_fact_ids == ["b"] and not qs[1].has_evidence
    assert qs[0].frequency == 2 and qs[0].bucket == "[1,10)" and qs[1].bucket == "0"
    # prediction mode: empty completions are skipped and counted, ids renumbered
    pred = queries.with_targets(qs, ["Paris, France", "  ", "Milan"], report=rep)
    assert [(q.query_id, q.target) for q in pred] == [(0, " Paris, France"), (1, " Milan")]
    assert rep.empty_target_fact_ids == ["b"]
    # a target that tokenizes to nothing (data.encode_query raises) is skipped and counted
    tok = data.train_tokenizer(["Ann was born in Paris.", "Cy was born in Rome."] * 20, vocab_size=40)
    encode = functools.partial(data.encode_query, tok, max_len=32)
    odd = [qs[0], dataclasses.replace(qs[2], target=" ")]
    rep2 = queries.QueryReport()
    kept, enc = queries.encode_queries(odd, encode, rep2)
    assert [q.fact_id for q in kept] == ["a"] and rep2.empty_target_fact_ids == ["c"]
    tokens, mask = enc[0]
    assert tok.decode(tokens[mask == 1]).strip() == "Paris"
    assert rep2.to_dict()["num_empty_target"] == 1


def test_save_load_roundtrip(tmp_path):
    facts = [_fact("a", "Ann", "P19", "Paris", ev=(3, 0))]
    qs = queries.build_queries(
        facts, {"P19": ["[X] was born in"]}, variant=0, entailing=queries.entailing_ids(facts), mentions={"a": (0, 3)}
    )
    queries.save_queries(qs, tmp_path / "q.jsonl")
    assert queries.load_queries(tmp_path / "q.jsonl") == qs


# ---------------------------------------------------------------------------------------
# real LAMA T-REx lines (../shared/data)
# ---------------------------------------------------------------------------------------


def test_load_templates_real_lama_and_pararel(shared_data):
    t = queries.load_templates(shared_data / "lama", shared_data / "pararel", ["P19", "P103", "P31"])
    # variant 0 the paper's style, 1 LAMA's template, 2 the subject inside; ParaRel paraphrases follow
    assert t["P19"][:4] == [
        "[X] was born in the city of:",
        "[X] was born in",
        "The birthplace of [X] is",
        "[X] is originally from",
    ]
    assert t["P103"] == [
        "The native language of [X] is the following language:",
        "The native language of [X] is",
        "The first language learned by [X] is",
        "The mother tongue of [X] is",
    ]
    assert t["P31"] == [
        "[X] is an instance of the following class:",
        "[X] is a",
        "The class of which [X] is an instance is",
    ]
    with pytest.raises(ValueError, match="'P31' has no template variant 3"):
        queries.template_for(t, "P31", 3)
    with pytest.raises(ValueError, match=r"'P9999' has no prompt template variant\(s\) \[0, 1, 2\]"):
        queries.load_templates(shared_data / "lama", shared_data / "pararel", ["P9999"])


def test_queries_from_real_lama_lines(shared_data):
    cfg = data.DataConfig(
        source="lama", path=str(shared_data / "lama"), relations="P19,P103", max_examples=80, eval_fraction=0.0
    )
    corpus = data.build_corpus(config_lib.section("data", cfg))
    tmpl = queries.load_templates(shared_data / "lama", shared_data / "pararel", ["P19", "P103"])
    idx = queries.MentionIndex(corpus.texts)
    ent = queries.entailing_ids(corpus.facts)
    men = queries.mention_ids(corpus.facts, idx)
    rep = queries.QueryReport()
    sel = queries.select_facts(corpus.facts, {k: len(v) for k, v in men.items()}, queries.SelectionConfig(), rep)
    qs = queries.build_queries(sel, tmpl, variant=0, entailing=ent, mentions=men, report=rep)
    assert len(qs) == rep.num_selected > 10
    by_fact = {q.fact_id: q for q in qs}
    # the first P19 line of LAMA: Allan Peiper, born in Alexandra ("Alexandra, Victoria" in the text)
    q = by_fact["6a9d91c1-eb9b-4142-8371-3c063ec40700"]
    assert q.prompt == "Allan Peiper was born in the city of:" and q.target == " Alexandra"
    assert "Alexandra, Victoria" in q.aliases
    texts = [corpus.texts[i] for i in q.entailing_ids]
    assert any(t.startswith("Allan Peiper (born 26 April 1960 in Alexandra, Victoria, Australia)") for t in texts)
    for q in qs:
        # gold passages are the fact's own evidence; every query's prompt ends before the object
        fact = next(f for f in corpus.facts if f.fact_id == q.fact_id)
        assert set(fact.evidence_ids) <= set(q.entailing_ids)
        assert not q.prompt.endswith(" ") and q.target == " " + q.object
        assert q.frequency == len(q.mention_ids) and q.bucket == queries.bucket_name(q.frequency)
        assert q.relation in ("P19", "P103")
        assert not queries.subject_contains_object(fact)
        # the looser label: every mention passage contains an alias of both entities
        for i in q.mention_ids:
            low = corpus.texts[i].lower()
            assert any(a.lower() in low for a in q.aliases) and any(a.lower() in low for a in q.subject_aliases)
    P103 = [q for q in qs if q.relation == "P103"]
    assert P103 and all(q.prompt.startswith("The native language of ") for q in P103)


def test_take_balanced_round_robins_buckets():
    facts = [_fact(f"a{i}", f"A{i}", "P1", "X") for i in range(6)] + [
        _fact(f"b{i}", f"B{i}", "P1", "Y") for i in range(2)
    ]
    freq = {**{f"a{i}": 3 for i in range(6)}, **{f"b{i}": 50 for i in range(2)}}
    rep = queries.QueryReport()
    got = [f.fact_id for f in queries.take_balanced(facts, freq, 4, (1, 10), rep)]
    assert got == ["a0", "a1", "b0", "b1"]  # 2 + 2, not the first 4 of the big bucket
    assert rep.dropped_max_queries == 4 and rep.num_selected == 4 and rep.per_bucket == {"[1,10)": 2, "[10,inf)": 2}
    assert len(queries.take_balanced(facts, freq, 0, (1, 10))) == 8


def test_predict_pads_batches_and_skips_prompts_without_room():
    from trackstar_jax.models import lm as model_lib

    tok = data.train_tokenizer(["Ann was born in Paris.", "Cy was born in Rome."] * 20, vocab_size=40)
    cfg = model_lib.LMConfig(vocab_size=40, num_layers=1, embed_dim=16, num_heads=2, head_dim=8, mlp_dim=32, max_len=12)
    graphdef, params = model_lib.split_model(model_lib.make_model(cfg, 0))
    facts = [_fact("a", "Ann", "P19", "Paris"), _fact("b", "Ann " * 20, "P19", "Rome"), _fact("c", "Cy", "P19", "Rome")]
    qs = queries.build_queries(
        facts,
        {"P19": ["[X] was born in"]},
        variant=0,
        entailing=queries.entailing_ids(facts),
        mentions={"a": (), "b": (), "c": ()},
    )
    comps, ok = queries.predict(graphdef, params, tok, qs, max_new_tokens=3, max_len=cfg.max_len, batch_size=2)
    assert len(comps) == len(ok) == 3
    assert comps[1] == "" and ok[1] is False  # 20-word subject: no room below max_len
    assert ok == [queries.is_correct(c, q.aliases) for c, q in zip(comps, qs)]


def test_predict_reads_a_calls_completions_back_from_its_cache(tmp_path, monkeypatch):
    """`predict` with a `pair_cache.ResultCache`: the same prompts in the same order are read back
    (the generator is not called, the completions are equal), prompts in another order are
    generated again, and another model or generation setting starts another file."""
    import types

    import jax

    from trackstar_jax.evaluation import pair_cache
    from trackstar_jax.models import generate as generate_lib
    from trackstar_jax.models import lm as model_lib

    tok = data.train_tokenizer(["Ann was born in Paris.", "Cy was born in Rome."] * 20, vocab_size=40)
    cfg = model_lib.LMConfig(vocab_size=40, num_layers=1, embed_dim=16, num_heads=2, head_dim=8, mlp_dim=32, max_len=12)
    graphdef, params = model_lib.split_model(model_lib.make_model(cfg, 0))
    facts = [_fact("a", "Ann", "P19", "Paris"), _fact("c", "Cy", "P19", "Rome")]
    qs = queries.build_queries(
        facts,
        {"P19": ["[X] was born in"]},
        variant=0,
        entailing=queries.entailing_ids(facts),
        mentions={"a": (), "c": ()},
    )
    gen = dict(max_new_tokens=3, max_len=cfg.max_len, batch_size=2)
    run = types.SimpleNamespace(params=params, model_cfg=cfg, step=5)

    def cache(run=run, **over):
        ident = pair_cache.completions_identity(run, **{**gen, **over})
        return pair_cache.ResultCache(
            tmp_path, ident, folder=pair_cache.COMPLETIONS_DIR, parse=pair_cache.strings
        )  # fmt: skip

    want = queries.predict(graphdef, params, tok, qs, **gen)
    assert queries.predict(graphdef, params, tok, qs, cache=cache(), **gen) == want  # generated, then kept
    calls = []
    real = generate_lib.complete_batched
    monkeypatch.setattr(generate_lib, "complete_batched", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert queries.predict(graphdef, params, tok, qs, cache=cache(), **gen) == want and not calls  # read back
    rev = queries.predict(graphdef, params, tok, qs[::-1], cache=cache(), **gen)
    assert calls and rev == tuple(x[::-1] for x in want)  # another call: generated
    other = types.SimpleNamespace(params=jax.tree.map(lambda x: x + 1, params), model_cfg=cfg, step=5)
    assert len({cache().path, cache(run=other).path, cache(max_new_tokens=4).path, cache(batch_size=4).path}) == 4
    with cache().path.open("a") as f:
        f.write('{"k": "x", "d": [1, 2]}\n{"k": "trunc')  # a value of another type, a killed write
    calls.clear()
    assert queries.predict(graphdef, params, tok, qs, cache=cache(), **gen) == want and not calls
