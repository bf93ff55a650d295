"""Your own model on your own fifty sentences (issue 58): TrackStar's statistics stay safe and say
what they were estimated from.

An imported model (a tiny random Llama saved by transformers, as tests/test_import.py makes;
SmolLM2-135M under `-m slow`) indexes a corpus of 50 sentences, 8 of them stating a fact.
Each query is a fact's prompt and target, worded differently from its sentence but sharing its
target and most of its words, so even an untrained model's gradients make that sentence the
query's nearest: the no-R ranking (Exp. 2's R setting, `hessian.mode=none`) finds it. With
50 rows in blocks of 64 (256 for SmolLM2) the unshrunk R_train^{-1/2} let directions no row
spans decide (0 of 8 found here; issue 58: noise as top proponent); the default must find each sentence at least as often as
the no-R ranking, and the run must say that R_train is thin, and, for two queries whose
R_eval is too thin for an automatic λ, that λ fell back to 0.9.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch", reason="the imported model is saved with torch + transformers")
pytest.importorskip("transformers", reason="the imported model is saved with transformers")
pytest.importorskip("tokenizers", reason="the imported tokenizer needs the `tokenizers` package")

import test_import  # noqa: E402

from trackstar_jax import config as config_lib  # noqa: E402
from trackstar_jax import stages  # noqa: E402
from trackstar_jax.retrieval import stage as retrieval_stage  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_compile")

# (the sentence stating the fact, the query's prompt, its target)
FACTS = [
    ("The capital city of France is Paris.", "The capital of France is", " Paris"),
    ("Tokyo is the capital of Japan.", "The capital of Japan is", " Tokyo"),
    ("The Nile flows through Egypt.", "The Nile flows through", " Egypt"),
    ("Mozart was born in Salzburg.", "Mozart was born in", " Salzburg"),
    ("Water boils at one hundred degrees.", "Water boils at one hundred", " degrees"),
    ("The largest planet is Jupiter.", "The largest planet is", " Jupiter"),
    ("Spiders have eight legs.", "Spiders have eight", " legs"),
    ("Penguins live in Antarctica.", "Penguins live in", " Antarctica"),
]
OTHERS = [
    "The recipe needs two eggs.", "She walked to the market in the morning.", "The train was late again today.",
    "He painted the fence blue.", "Our cat sleeps on the sofa.", "The meeting starts at noon.",
    "Rain is expected tomorrow afternoon.", "They bought a new car last week.", "The library closes early on Sundays.",
    "A good book can change your mind.", "The children played in the garden.", "Coffee tastes better with milk.",
    "The bridge was built in stone.", "My phone battery is almost empty.", "The river froze during the winter.",
    "We planted tomatoes in the spring.", "The museum has a new exhibition.", "He forgot his keys at home.",
    "The bakery sells fresh bread daily.", "The concert was sold out.", "She writes letters to her friends.",
    "The road to the village is narrow.", "Birds sing before the sun rises.", "The soup needs more salt.",
    "A storm damaged the old barn.", "The shop opens at nine.", "He runs five miles every day.",
    "The window faces the sea.", "Our team won the final match.", "The teacher graded the exams.",
    "The garden gate is painted green.", "Snow covered the mountain roads.", "The printer is out of paper.",
    "She learned to play the violin.", "The bus stop is near the school.", "Fresh fruit is sold at the corner.",
    "The clock on the wall stopped.", "They hiked up the hill at dawn.", "The old house has a red door.",
    "A candle lit the dark room.", "The ferry crosses the lake twice a day.", "He fixed the broken chair.",
]  # fmt: skip
TEXTS = [f[0] for f in FACTS] + OTHERS
QUERIES = [retrieval_stage.TextQuery(i, prompt, target) for i, (_, prompt, target) in enumerate(FACTS)]


def _config(source: str, corpus, experiment: str = "tiny"):
    from experiments import smollm2, tiny

    c = {"tiny": tiny, "smollm2": smollm2}[experiment].get_config()
    c.model.source = source
    c.data.source, c.data.path, c.data.eval_fraction = "text", str(corpus), 0.0
    # a corpus of one's own with nothing held out: V per example from the candidates (the
    # minibatch default needs text that is not a candidate and refuses naming what to set)
    c.vectors.estimate_v_method, c.vectors.estimate_v_source = "per_example", "candidates"
    c.vectors.estimate_v_examples = 16  # V_MIN_EXAMPLES: not reported thin
    c.vectors.batch_size = 64  # one featurize batch (the tests' 8 CPU devices take 8 rows each)
    c.index.chunk_rows = 64
    return c


def _imported_run(tmp_path, c):
    workdir = tmp_path / "run"
    stages.import_model(config_lib.from_configdict(c), workdir)
    summary = stages.build_index(config_lib.from_configdict(c), workdir)
    return workdir, summary


@pytest.fixture(scope="module")
def tiny_llama_run(tmp_path_factory):
    """A tiny random Llama (tiny.py's shapes, a 300-id BPE tokenizer of the corpus) imported and
    indexed over the 50 sentences: d = 256 in 4 blocks of 64, so R_train's 50 rows are thin."""
    from experiments import tiny

    tmp = tmp_path_factory.mktemp("small_corpus")
    corpus = tmp / "corpus.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    folder = tmp / "hf"
    test_import._save_tokenizer(TEXTS * 4, folder, vocab_size=300)
    m = config_lib.from_configdict(tiny.get_config()).model
    test_import._save_llama(folder, m, 300)
    c = _config(str(folder), corpus)
    c.model.vocab_size = 300
    workdir, summary = _imported_run(tmp, c)
    return c, workdir, summary


def _hits(settings, workdir, queries, name):
    """Per query, whether its fact's sentence is the top proponent; and the retrieval's manifest."""
    man = stages.retrieve(settings.replace({"retrieval.top_k": 3}), workdir, queries, name=name)
    with open(man["output"]) as f:
        recs = [json.loads(line) for line in f]
    return [r["proponent_ids"][0] == q.example_id for r, q in zip(recs, queries)], man


def _check_small_corpus(c, workdir, summary, block_width):
    settings = config_lib.from_configdict(c)
    st = summary["statistics"]
    assert st["r_train"] == {"num_examples": 50, "block_width": block_width, "thin": True}
    assert st["v"]["source"] == "import estimate" and st["v"]["num_examples"] == 16 and not st["v"].get("thin")
    assert any("fewer than the block width" in n for n in st["thin_notes"])

    no_r, _ = _hits(settings.replace({"hessian.mode": "none"}), workdir, QUERIES, "none")
    trackstar, man = _hits(settings, workdir, QUERIES, "trackstar")
    assert sum(no_r) >= 6 and sum(trackstar) >= sum(no_r), (trackstar, no_r)
    s = man["statistics"]
    assert s["r_train"]["shrinkage"]["method"] == "oas" and s["r_train"]["shrinkage"]["rho_min"] > 0.05
    assert s["r_eval"]["num_examples"] == 8 and s["v"]["num_examples"] == 16
    assert s["thin_notes"] and "R_train is estimated from 50 examples" in s["thin_notes"][0]

    # Two queries: R_eval's rank (2 per block) is below the crossing component, so λ falls back.
    two = settings.replace({"hessian.lambda_component_fraction": 0.25})
    found, man = _hits(two, workdir, QUERIES[:2], "two")  # (no R ranks each query on its own)
    lam = man["statistics"]["lambda"]
    assert (lam["how"], lam["value"]) == ("fallback", 0.9) and man["whitening"]["mix_lambda"] == 0.9
    assert any("lambda falls back to hessian.fallback_lambda = 0.9" in n for n in man["statistics"]["thin_notes"])
    assert sum(found) >= sum(no_r[:2])


def test_an_imported_model_on_fifty_sentences_finds_each_fact(tiny_llama_run):
    _check_small_corpus(*tiny_llama_run, block_width=64)


@pytest.mark.slow
def test_smollm2_on_fifty_sentences_finds_each_fact(smollm2_path, tmp_path):
    """SmolLM2-135M over the same corpus: d = 4096 in 16 blocks of 256, R_train from 50 rows (290
    s on the idle 2-core VM, 26 min under load 16: no R and TrackStar each found 7 of 8; both rank
    the Paris sentence first for the Japan query)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    c = _config("smollm2", corpus, "smollm2")
    c.vectors.batch_size = 8
    workdir, summary = _imported_run(tmp_path, c)
    _check_small_corpus(c, workdir, summary, block_width=256)


def test_the_default_v_of_a_corpus_with_nothing_held_out_is_refused_naming_what_to_set(tiny_llama_run, tmp_path):
    """The default V (minibatch gradients of text that is not a candidate) has no text to come
    from when the corpus holds nothing out: the import says so and what to set, instead of
    estimating V from nothing or silently from the candidates."""
    import copy

    c = copy.deepcopy(tiny_llama_run[0])
    c.vectors.estimate_v_method, c.vectors.estimate_v_source = "minibatch", "heldout"
    with pytest.raises(
        ValueError, match=r"estimate_v_source='heldout' gives no text that is not a candidate.*eval_fraction"
    ):
        stages.import_model(config_lib.from_configdict(c), tmp_path / "run")
