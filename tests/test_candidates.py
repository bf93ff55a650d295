"""config.candidates: the passages indexed and retrieved, apart from the training text (data/candidates.py)."""

import pytest
from _lama_util import write_lama

from trackstar_jax import config as config_lib
from trackstar_jax.data import candidates, corpus, corpus_types, templates


def test_natural_candidates_drop_templated_statements_and_remap_gold(tmp_path):
    cfg = corpus_types.DataConfig(
        source="lama",
        path=str(write_lama(tmp_path / "lama")),
        statements_per_fact=1,
        eval_fact_fraction=0.5,
        eval_fraction=0.0,
    )
    full = corpus.build_corpus(cfg)
    stmts = templates.statement_ids(full)
    assert stmts and len(full.examples) == 12 + len(stmts)  # the training text holds the statements
    view = candidates.select(full, candidates.CandidateConfig("natural"))
    assert len(view.examples) == 12 and not set(view.texts) & {full.texts[i] for i in stmts}
    assert [e.example_id for e in view.examples] == list(range(12))
    assert view.fingerprint != full.fingerprint and view.info["candidates"]["num_corpus_passages"] == len(full.examples)
    for f_full, f_view in zip(full.facts, view.facts):
        natural = [full.texts[e] for e in f_full.evidence_ids if e not in stmts]
        assert [view.texts[e] for e in f_view.evidence_ids] == natural  # gold = the natural sentences only
        if f_full.split == "train":
            assert len(f_full.evidence_ids) == len(f_view.evidence_ids) + 1
    assert candidates.select(full, candidates.CandidateConfig("all")) is full


def test_candidates_is_a_typed_section_outside_the_run_sections():
    from experiments import base

    s = config_lib.from_configdict(base.get_config())
    assert s.candidates.passages == "all"
    c = base.get_config()
    c.candidates.passages = "natrual"
    with pytest.raises(config_lib.ConfigError, match="candidates.passages must be one of"):
        config_lib.from_configdict(c)
    # a trained run can be attributed over other candidates: not a run-defining section
    assert "candidates" not in config_lib.RUN_SECTIONS
    assert config_lib.mismatches(s, s.replace({"candidates.passages": "natural"})) == []
