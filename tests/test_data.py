"""Corpus sources, stable example ids, tokenizer, encoding and grain batches."""

import gzip
import json

import numpy as np
import pytest

from trackstar_jax import config as config_lib
from trackstar_jax import data as data
from trackstar_jax.data import batching, corpus_types


@pytest.fixture(scope="module")
def embedded():
    from experiments import tiny

    return data.build_corpus(config_lib.section("data", tiny.get_config().data), seed=0)


@pytest.fixture(scope="module")
def tok(embedded, tmp_path_factory):
    return data.train_tokenizer(embedded.texts, 512, tmp_path_factory.mktemp("tok") / "t.model")


# --- embedded corpus -------------------------------------------------------------------


def test_embedded_ids_are_stable_across_builds(tiny_config):
    a = data.build_corpus(config_lib.section("data", tiny_config.data), seed=0)
    b = data.build_corpus(config_lib.section("data", tiny_config.data.to_dict()), seed=0)  # a plain dict works too
    assert [(e.example_id, e.text) for e in a.examples] == [(e.example_id, e.text) for e in b.examples]
    assert a.fingerprint == b.fingerprint == data.fingerprint(b.texts)
    assert a.facts == b.facts and a.eval_texts == b.eval_texts
    assert [e.example_id for e in a.examples] == list(range(len(a.examples)))
    c = data.build_corpus(config_lib.section("data", tiny_config.data), seed=1)
    assert c.fingerprint != a.fingerprint


def test_embedded_sizes_follow_config(tiny_config):
    tiny_config.data.embedded.num_facts = 30
    tiny_config.data.embedded.phrasings_per_fact = 2
    tiny_config.data.embedded.num_distractors = 17
    c = data.build_corpus(config_lib.section("data", tiny_config.data), seed=0)
    assert len(c.facts) == 30 and len(c.examples) == 30 * 2 + 17
    assert all(len(f.evidence_ids) == 2 for f in c.facts)
    assert len({f.relation for f in c.facts}) == 10  # round-robin over the relations


def test_embedded_gold_evidence_is_exact(embedded):
    texts = embedded.texts
    evidence = {i for f in embedded.facts for i in f.evidence_ids}
    for f in embedded.facts:
        assert len(f.evidence_ids) == 3 and len(set(f.evidence_ids)) == 3
        assert len({texts[i] for i in f.evidence_ids}) == 3  # distinct phrasings
        for i in f.evidence_ids:
            assert f.subject in texts[i] and f.object in texts[i], (f, texts[i])
        # Template 0 + " object" is always stated (so the default prompt is answerable).
        stated = data.fill_template(embedded.templates[f.relation][0], f.subject) + " " + f.object
        assert any(texts[i].startswith(stated) for i in f.evidence_ids)
        # No passage outside the evidence completes any of the fact's prompts with the object.
        for i, t in enumerate(texts):
            if i in f.evidence_ids:
                continue
            for tpl in embedded.templates[f.relation]:
                assert (data.fill_template(tpl, f.subject) + " " + f.object) not in t
    # Distractors exist and state no fact: they complete no fact's prompt at all.
    distractors = [t for i, t in enumerate(texts) if i not in evidence]
    assert len(distractors) == 200
    prompts = [
        data.fill_template(tpl, f.subject) + " " for f in embedded.facts for tpl in embedded.templates[f.relation]
    ]
    assert not any(p in t for p in prompts for t in distractors)
    # Facts are functional: one object per (subject, relation).
    assert len({(f.subject, f.relation) for f in embedded.facts}) == len(embedded.facts)


def test_embedded_templates_end_before_the_object(embedded):
    assert len(embedded.templates) >= 6
    for _rel, tpls in embedded.templates.items():
        assert len(tpls) >= 3 and len(set(tpls)) == len(tpls)
        for t in tpls:
            assert "[X]" in t and "[Y]" not in t and not t.endswith(" ")


def test_embedded_eval_texts_are_held_out(embedded):
    assert len(embedded.eval_texts) == round(0.05 * len(embedded.examples))
    assert not set(embedded.eval_texts) & set(embedded.texts)


def test_embedded_names_are_pronounceable_and_unique(embedded):
    subjects = {f.subject for f in embedded.facts}
    for s in subjects:
        assert s.replace(" ", "").isalpha() and s[0].isupper()
    objs = {f.object.lower() for f in embedded.facts}
    for a in objs:  # exact-match scoring: no object is a word-prefix of another
        assert not any(b != a and b.startswith(a + " ") for b in objs)


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("phrasings_per_fact", 9, "phrasings_per_fact"),
        ("num_facts", 100_000, "num_facts"),
        ("num_entities", 3, "num_entities"),
    ],
)
def test_embedded_bad_sizes_name_the_key(tiny_config, key, value, match):
    setattr(tiny_config.data.embedded, key, value)
    with pytest.raises(ValueError, match=match):
        data.build_corpus(config_lib.section("data", tiny_config.data), seed=0)


# --- config errors -------------------------------------------------------------------------


def test_unknown_data_keys_are_named(tiny_config):
    d = tiny_config.data.to_dict()
    d["max_exampels"] = 3
    with pytest.raises(ValueError, match=r"config\.data: max_exampels"):
        config_lib.from_dict({"data": d})
    d = tiny_config.data.to_dict()
    d["embedded"]["num_fact"] = 3
    with pytest.raises(ValueError, match=r"config\.data\.embedded: num_fact"):
        config_lib.from_dict({"data": d})
    with pytest.raises(ValueError, match="config.data.source"):
        config_lib.from_dict({"data": {"source": "c4"}})
    with pytest.raises(ValueError, match="config.data.path"):
        config_lib.from_dict({"data": {"source": "lama"}})


# --- text / jsonl ---------------------------------------------------------------------------


def test_text_and_jsonl_sources(tmp_path):
    (tmp_path / "a.txt").write_text("first passage\n\n  second passage  \nthird\n")
    c = data.build_corpus(
        config_lib.section("data", {"source": "text", "path": str(tmp_path / "a.txt"), "eval_fraction": 0.0}), 0
    )
    assert c.texts == ["first passage", "second passage", "third"] and c.facts == []
    d = tmp_path / "j"
    d.mkdir()
    (d / "0.jsonl").write_text("\n".join(json.dumps({"body": f"doc {i}"}) for i in range(5)) + "\n")
    with gzip.open(d / "1.jsonl.gz", "wt") as f:
        f.write(json.dumps({"body": "zipped doc"}) + "\n")
    c = data.build_corpus(
        config_lib.section(
            "data", {"source": "jsonl", "path": str(d), "text_key": "body", "eval_fraction": 0.0, "max_examples": 4}
        ),
        0,
    )
    assert c.texts == ["doc 0", "doc 1", "doc 2", "doc 3"]
    c = data.build_corpus(
        config_lib.section("data", {"source": "jsonl", "path": str(d), "text_key": "body", "eval_fraction": 0.0}), 0
    )
    assert c.texts[-1] == "zipped doc" and len(c.examples) == 6


def test_bad_passages_are_named(tmp_path):
    (tmp_path / "e.jsonl").write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"text": "  "}) + "\n")
    with pytest.raises(ValueError, match=r"empty passage at .*e\.jsonl:2"):
        data.build_corpus(config_lib.section("data", {"source": "jsonl", "path": str(tmp_path / "e.jsonl")}), 0)
    (tmp_path / "k.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"k\.jsonl:1 has no field"):
        data.build_corpus(config_lib.section("data", {"source": "jsonl", "path": str(tmp_path / "k.jsonl")}), 0)
    (tmp_path / "blank.txt").write_text("\n  \n")
    with pytest.raises(ValueError, match="has no examples"):
        data.build_corpus(config_lib.section("data", {"source": "text", "path": str(tmp_path / "blank.txt")}), 0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.build_corpus(config_lib.section("data", {"source": "text", "path": str(tmp_path / "nope")}), 0)


def test_eval_split_is_by_content_and_keeps_every_fact(tmp_path):
    texts = [f"passage number {i}" for i in range(400)]
    (tmp_path / "t.txt").write_text("\n".join(texts))
    c = data.build_corpus(
        config_lib.section("data", {"source": "text", "path": str(tmp_path / "t.txt"), "eval_fraction": 0.2}), 0
    )
    assert 40 < len(c.eval_texts) < 120 and sorted(c.texts + list(c.eval_texts)) == sorted(texts)
    # Same held-out set whatever the file order (hash of content).
    (tmp_path / "r.txt").write_text("\n".join(texts[::-1]))
    r = data.build_corpus(
        config_lib.section("data", {"source": "text", "path": str(tmp_path / "r.txt"), "eval_fraction": 0.2}), 0
    )
    assert set(r.eval_texts) == set(c.eval_texts)
    # A fact's last evidence passage is never held out; evidence ids are renumbered.
    facts = [data.Fact(f"f{i}", "s", "r", "o", ("o",), ("s",), (i,)) for i in range(400)]
    kept, facts2, held = data.corpus._split_eval(texts, facts, 0.5)
    assert held == [] and kept == texts and facts2 == facts
    facts = [data.Fact("f", "s", "r", "o", ("o",), ("s",), tuple(range(400)))]
    kept, (f2,), held = data.corpus._split_eval(texts, facts, 0.5)
    assert len(held) > 100 and [kept[i] for i in f2.evidence_ids] == kept


# --- LAMA -------------------------------------------------------------------------------


def _write_lama(root, rows_by_rel):
    (root / "TREx").mkdir(parents=True)
    for rel, rows in rows_by_rel.items():
        with gzip.open(root / "TREx" / f"{rel}.jsonl.gz", "wt") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


def _fact(uuid, sub, obj, rel, sentences):
    return {
        "uuid": uuid,
        "sub_label": sub,
        "obj_label": obj,
        "predicate_id": rel,
        "sub_uri": "Q1",
        "obj_uri": "Q2",
        "evidences": [{"sub_surface": sub, "obj_surface": surf, "masked_sentence": s} for surf, s in sentences],
    }


def test_lama_reader_on_a_small_copy(tmp_path):
    _write_lama(
        tmp_path,
        {
            "P19": [
                _fact(
                    "a",
                    "Ann Lee",
                    "Paris",
                    "P19",
                    [
                        ("Paris", "Ann Lee was born in [MASK]."),
                        ("Paris, France", "Born in [MASK], Ann Lee sang."),
                        ("Paris", "Ann Lee was born in [MASK]."),
                    ],
                ),
                _fact("b", "Bo Wu", "Rome", "P19", [("Rome", "Bo Wu (born in [MASK]) ran.")]),
            ],
            "P20": [
                _fact(
                    "c",
                    "Ann Lee",
                    "Oslo",
                    "P20",
                    [("Oslo", "Ann Lee died in [MASK]."), ("Paris", "Born in [MASK], Ann Lee sang.")],
                )
            ],
        },
    )
    cfg = {"source": "lama", "path": str(tmp_path), "eval_fraction": 0.0}
    c = data.build_corpus(config_lib.section("data", cfg), 0)
    # round-robin over relations: P19 fact a, P20 fact c, P19 fact b; duplicates removed
    assert c.texts == [
        "Ann Lee was born in Paris.",
        "Born in Paris, France, Ann Lee sang.",
        "Ann Lee died in Oslo.",
        "Born in Paris, Ann Lee sang.",
        "Bo Wu (born in Rome) ran.",
    ]
    a, cc, b = c.facts
    assert (a.fact_id, a.evidence_ids, a.object_aliases) == ("a", (0, 1), ("Paris", "Paris, France"))
    assert (cc.relation, cc.evidence_ids) == ("P20", (2, 3))
    assert b.evidence_ids == (4,) and c.templates == {}
    only = data.build_corpus(config_lib.section("data", dict(cfg, relations="P20")), 0)
    assert [f.fact_id for f in only.facts] == ["c"]
    capped = data.build_corpus(
        config_lib.section("data", dict(cfg, max_examples=4)), 0
    )  # stops before the fact that overflows
    assert len(capped.examples) == 4 and [f.fact_id for f in capped.facts] == ["a", "c"]
    with pytest.raises(ValueError, match="P99"):
        data.build_corpus(config_lib.section("data", dict(cfg, relations="P99")), 0)


def test_lama_evidence_cap_is_seeded_and_skips_an_oversized_fact(tmp_path):
    """At most `data.max_evidence_per_fact` sentences per fact, chosen by a seeded hash of the
    fact and sentence (not by file order); a fact over `data.max_examples` is skipped, not the
    end of reading; the corpus' info reports evidence per fact."""
    many = [("Oslo", f"Ann Lee lived in [MASK] in {1900 + i}.") for i in range(40)]
    rows = {
        "P19": [
            _fact("a", "Ann Lee", "Oslo", "P19", many),
            _fact("b", "Bo Wu", "Rome", "P19", [("Rome", f"Bo Wu left [MASK] in {2000 + i}.") for i in range(6)]),
            _fact("c", "Cy Ng", "Pisa", "P19", [("Pisa", "Cy Ng was born in [MASK].")]),
        ]
    }
    _write_lama(tmp_path / "fwd", rows)
    rev = {"P19": [dict(rows["P19"][0], evidences=rows["P19"][0]["evidences"][::-1]), *rows["P19"][1:]]}
    _write_lama(tmp_path / "rev", rev)
    cfg = {"source": "lama", "eval_fraction": 0.0, "max_evidence_per_fact": 3}
    fwd = data.build_corpus(config_lib.section("data", dict(cfg, path=str(tmp_path / "fwd"))), 0)
    back = data.build_corpus(config_lib.section("data", dict(cfg, path=str(tmp_path / "rev"))), 0)
    kept = {fwd.texts[i] for i in fwd.facts[0].evidence_ids}
    assert len(kept) == 3 and kept == {back.texts[i] for i in back.facts[0].evidence_ids}  # order-free
    other = data.build_corpus(config_lib.section("data", dict(cfg, path=str(tmp_path / "fwd"), evidence_seed=1)), 0)
    assert {other.texts[i] for i in other.facts[0].evidence_ids} != kept  # the seed chooses
    info = fwd.info["lama"]
    assert (info["evidence_dropped"], info["facts_skipped"]) == (37 + 3, 0)
    assert info["evidence_per_fact"]["histogram"] == {"1": 1, "3": 2, "8+": 0}
    # max_examples = 5: a (3) fits, b (3 more) would overflow and is skipped, c (1) still fits
    capped = data.build_corpus(config_lib.section("data", dict(cfg, path=str(tmp_path / "fwd"), max_examples=5)), 0)
    assert [f.fact_id for f in capped.facts] == ["a", "c"] and capped.info["lama"]["facts_skipped"] == 1
    assert len(capped.texts) == 4
    # no cap: every sentence, as before
    whole = data.build_corpus(
        config_lib.section("data", dict(cfg, path=str(tmp_path / "fwd"), max_evidence_per_fact=0)), 0
    )
    assert len(whole.facts[0].evidence_ids) == 40 and whole.info["lama"]["evidence_dropped"] == 0


def test_lama_reader_names_bad_evidence(tmp_path):
    _write_lama(tmp_path, {"P19": [_fact("a", "A", "B", "P19", [("B", "no mask here")])]})
    with pytest.raises(ValueError, match=r"evidence 0 of fact a at .*P19\.jsonl\.gz:1 has no \[MASK\]"):
        data.build_corpus(config_lib.section("data", {"source": "lama", "path": str(tmp_path)}), 0)


def test_lama_reader_on_shared_data(shared_data):
    lama = shared_data / "lama"
    cfg = {"source": "lama", "path": str(lama), "relations": "P19,P1303", "eval_fraction": 0.05}
    c = data.build_corpus(config_lib.section("data", cfg), 0)
    assert c.fingerprint == data.build_corpus(config_lib.section("data", cfg), 0).fingerprint
    assert len(set(c.texts)) == len(c.texts) > 1000
    assert {f.relation for f in c.facts} == {"P19", "P1303"}
    # Reference: rebuild every fact's passages straight from the file.
    by_uuid = {f.fact_id: f for f in c.facts}
    held = set(c.eval_texts)
    with gzip.open(lama / "TREx" / "P19.jsonl.gz", "rt") as f:
        for line in list(f)[:200]:
            r = json.loads(line)
            every = {e["masked_sentence"].replace("[MASK]", e["obj_surface"]).strip() for e in r["evidences"]}
            got = {c.texts[i] for i in by_uuid[r["uuid"]].evidence_ids}
            if len(every) <= 8:  # data.max_evidence_per_fact's default: all of them
                assert got == every - held
            else:  # 8 of them, chosen by the seeded hash
                assert got <= every and len(got | (every & held)) >= 8 - len(every & held)
            assert by_uuid[r["uuid"]].evidence_ids  # a fact never loses all of its gold passages


# --- save / load ----------------------------------------------------------------------------


def test_save_load_roundtrip_and_refusals(embedded, tmp_path):
    d = tmp_path / "corpus"
    data.save_corpus(embedded, d)
    back = data.load_corpus(d)
    assert back.examples == embedded.examples and back.facts == embedded.facts
    assert back.templates == embedded.templates and back.eval_texts == embedded.eval_texts
    assert back.fingerprint == embedded.fingerprint
    data.save_corpus(embedded, d)  # the same corpus again: no-op
    other = data.build_corpus(config_lib.section("data", {"source": "embedded", "embedded": {"num_facts": 20}}), 0)
    with pytest.raises(FileExistsError, match="different corpus"):
        data.save_corpus(other, d)
    lines = (d / "examples.jsonl").read_text().splitlines()
    lines[3] = json.dumps({"example_id": 3, "text": "tampered"})
    (d / "examples.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="modified"):
        data.load_corpus(d)


# --- tokenizer and encoding -------------------------------------------------------------------


def test_tokenizer_ids_and_roundtrip(tok, embedded, tmp_path):
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (data.PAD_ID, 2, 3)
    assert 8 < tok.vocab_size <= 512
    for t in embedded.texts[:50]:
        ids = tok.encode(t)
        assert ids and min(ids) > tok.eos_id and tok.decode(ids) == t
    tok.save(tmp_path / "x.model")
    again = data.load_tokenizer(tmp_path / "x.model")
    assert again.encode(embedded.texts[0]) == tok.encode(embedded.texts[0])
    with pytest.raises(FileNotFoundError):
        data.load_tokenizer(tmp_path / "missing.model")


def test_encode_example_and_truncation(tok):
    t, cut = data.encode_example(tok, "Some short words.", 64)
    assert not cut and t[0] == tok.bos_id and t[-1] == tok.eos_id and t.dtype == np.int32
    long_text = " ".join(["word"] * 200)
    t, cut = data.encode_example(tok, long_text, 16)
    assert cut and len(t) == 16 and t[0] == tok.bos_id and tok.eos_id not in t[1:]
    assert data.truncation_report(["a b", long_text, "c"], tok, 16) == [1]


def test_encode_query_masks_only_the_target(tok, embedded):
    f = embedded.facts[0]
    prompt = data.fill_template(embedded.templates[f.relation][0], f.subject)
    q = data.encode_query(tok, prompt, " " + f.object, 64)
    n_target = len(tok.encode(" " + f.object))
    assert q["loss_mask"].sum() == n_target and q["loss_mask"][-n_target:].all()
    assert q["tokens"][0] == tok.bos_id and len(q["tokens"]) == len(q["loss_mask"])
    # Same tokens as the passage that states the fact (SentencePiece splits on spaces).
    joined = tok.encode(prompt + " " + f.object)
    assert q["tokens"][1:].tolist() == joined
    with pytest.raises(ValueError, match="q7.*no tokens"):
        data.encode_query(tok, prompt, "", 64, query_id="q7")
    with pytest.raises(ValueError, match="exceed max_len=4"):
        data.encode_query(tok, prompt, " " + f.object, 4)


def test_pad_batch_convention():
    b = data.pad_batch([(np.array([2, 5, 6, 3]), np.array([0, 1, 1, 1]))], [7], 3, 6)
    assert b["tokens"].tolist() == [[2, 5, 6, 3, 0, 0], [0] * 6, [0] * 6]
    assert b["loss_mask"].tolist() == [[0, 1, 1, 1, 0, 0], [0] * 6, [0] * 6]
    assert b["example_id"].tolist() == [7, -1, -1]
    assert all(v.dtype == np.int32 for v in b.values())
    with pytest.raises(ValueError):
        data.pad_batch([(np.arange(9), np.ones(9))], [0], 1, 6)


@pytest.mark.parametrize("per", [1, 2, 4])
def test_bucket_len_is_the_least_ladder_step_at_or_above_the_longest_row(monkeypatch, per):
    """`bucket_len` against a brute-force ladder: per doubling (n, 2n], `per` equal steps."""
    monkeypatch.setattr(data.batching, "BUCKETS_PER_OCTAVE", per)
    ladder = [16] + [n + (n // per) * j for n in (16, 32, 64, 128) for j in range(1, per + 1)]
    for longest in range(1, 257):
        want = min(x for x in ladder if x >= longest)
        assert data.bucket_len(longest, 256) == want
        assert data.bucket_len(longest, 40) == min(want, 40)
    assert len({data.bucket_len(n, 256) for n in range(1, 257)}) == 4 * per + 1  # the compile bound
    ladder8 = [8] + [n + (n // per) * j for n in (8, 16, 32, 64, 128) for j in range(1, per + 1)]
    for longest in range(1, 257):  # another ladder, given (the tail-patch step's: 1 per doubling from 8)
        assert data.bucket_len(longest, 256, per_octave=per, min_len=8) == min(x for x in ladder8 if x >= longest)


def test_length_groups_batch_rows_of_like_length():
    lengths = [5, 3, 9, 3, 1, 7, 9]
    groups = data.length_groups(lengths, 3)
    assert [g.tolist() for g in groups] == [[4, 1, 3], [0, 5, 2], [6]]  # stable: ties keep their order
    assert sorted(np.concatenate(groups).tolist()) == list(range(7))
    assert data.length_groups([], 4) == []


def test_index_batches_are_ordered_and_padded(embedded, tok):
    batches = list(data.index_batches(embedded, tok, 64, 48))
    ids = np.concatenate([b["example_id"] for b in batches])
    n = len(embedded.examples)
    assert len(batches) == -(-n // 64) and ids[:n].tolist() == list(range(n)) and (ids[n:] == -1).all()
    last = batches[-1]
    assert (last["tokens"][ids[-64:] == -1] == 0).all() and (last["loss_mask"][ids[-64:] == -1] == 0).all()
    row = batches[1]
    t, _ = data.encode_example(tok, embedded.examples[64 + 5].text, 48)
    assert row["tokens"][5, : len(t)].tolist() == t.tolist() and row["loss_mask"][5, 0] == 0
    assert row["loss_mask"][5].sum() == len(t) - 1
    part = list(data.index_batches(embedded, tok, 64, 48, start=100, stop=230))
    assert np.concatenate([b["example_id"] for b in part])[:130].tolist() == list(range(100, 230))


def test_train_batches_are_seeded_shuffled_and_resumable(embedded, tok):
    n = len(embedded.examples)
    it = data.train_batches(embedded, tok, 40, 48, seed=3)
    first = [next(it) for _ in range(2 * n // 40 + 2)]
    ids = np.concatenate([b["example_id"] for b in first])
    assert sorted(ids[:n].tolist()) == list(range(n))  # an epoch visits every example once
    assert ids[:n].tolist() != list(range(n))  # shuffled
    assert ids[:n].tolist() != ids[n : 2 * n].tolist()  # reshuffled per epoch
    again = data.train_batches(embedded, tok, 40, 48, seed=3, start_step=5)
    resumed = [next(again) for _ in range(3)]
    assert all(np.array_equal(resumed[i][k], first[5 + i][k]) for i in range(3) for k in ("tokens", "example_id"))
    other = next(data.train_batches(embedded, tok, 40, 48, seed=4))
    assert not np.array_equal(other["example_id"], first[0]["example_id"])


@pytest.mark.parametrize("n", [3, 40, batching.SMALL_EPOCH + 3])  # kept epochs, and element by element
def test_train_batches_follow_grains_seeded_shuffle_position_for_position(embedded, tok, n):
    """The reference is grain's own pipeline (`seed(s).shuffle().repeat(None)`) over the same
    rows, read across several epochs, from a resumed step and for a subset of example ids."""
    import grain

    texts = [embedded.texts[i % len(embedded.texts)] for i in range(n)]
    corpus = corpus_types.make_corpus("shuffle test", texts, [], {}, ())
    batch = 7
    for seed, start in [(0, 0), (2**32 - 2, 1)]:  # the per-epoch seed wraps at 2**32
        ours = data.train_batches(corpus, tok, batch, 48, seed=seed, start_step=start)
        ref = grain.MapDataset.source(list(range(n))).seed(seed).shuffle().repeat(None)
        steps = 2 if n > 100 else 3 * n // batch + 2
        for s in range(start, start + steps):
            want = [ref[i] for i in range(s * batch, (s + 1) * batch)]
            assert next(ours)["example_id"].tolist() == want, (n, seed, s)
    sub = np.arange(0, n, 2)[:20]
    got = next(data.train_batches(corpus, tok, batch, 48, seed=5, example_ids=sub))["example_id"].tolist()
    ref = grain.MapDataset.source(sub.tolist()).seed(5).shuffle().repeat(None)
    assert got == [ref[i] for i in range(batch)]
    with pytest.raises(ValueError, match="seed"):
        next(data.train_batches(corpus, tok, batch, 48, seed=-1))


def test_eval_batches_use_held_out_passages(embedded, tok):
    bs = data.eval_batches(embedded, tok, 16, 48)
    assert sum(int((b["loss_mask"].sum(1) > 0).sum()) for b in bs) == len(embedded.eval_texts)
    assert all((b["example_id"] == -1).all() for b in bs)
    assert len(data.eval_batches(embedded, tok, 16, 48, max_batches=1)) == 1
