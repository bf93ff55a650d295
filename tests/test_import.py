"""training.importer end to end: a tiny random Llama saved by transformers -> import_model ->
build_index -> retrieve_queries, on experiments/tiny.py's embedded corpus; and the refusals.

The Llama has tiny.py's shapes (so tiny.py's model section agrees with it) and a byte-level
BPE tokenizer trained with `tokenizers` on the same corpus (400 ids, fits the 512 rows).
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

pytest.importorskip("torch", reason="the end-to-end import test saves a random Llama with torch + transformers")
transformers = pytest.importorskip("transformers", reason="the end-to-end import test needs transformers")
tokenizers = pytest.importorskip("tokenizers", reason="the imported tokenizer needs the `tokenizers` package")

from trackstar_jax import config as config_lib  # noqa: E402
from trackstar_jax import data as data_lib  # noqa: E402
from trackstar_jax import (
    stages,  # noqa: E402
)
from trackstar_jax.data import hf_tokenizer  # noqa: E402
from trackstar_jax.index import build, store  # noqa: E402
from trackstar_jax.models import hf as hf_lib  # noqa: E402
from trackstar_jax.models import lm  # noqa: E402
from trackstar_jax.retrieval import stage as retrieval_stage  # noqa: E402
from trackstar_jax.training import checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_compile")


def _save_tokenizer(texts, folder, vocab_size=400):
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tk = tokenizers.Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(texts, trainer)
    os.makedirs(folder, exist_ok=True)
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"})
    )


def _save_llama(folder, m, vocab_size):
    import torch

    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=m.embed_dim,
        intermediate_size=m.mlp_dim,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=1,
        head_dim=m.head_dim,
        max_position_embeddings=m.max_len,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from experiments import tiny

    c = tiny.get_config()
    s = config_lib.from_configdict(c)
    folder = tmp_path_factory.mktemp("tiny_llama")
    _save_tokenizer(data_lib.build_corpus(s.data, s.seed).texts, folder)
    _save_llama(folder, s.model, s.model.vocab_size)
    return folder


def _config(folder):
    from experiments import tiny

    c = tiny.get_config()
    c.model.source = str(folder)
    c.vectors.estimate_v_batch_sequences = 6  # minibatch (the default): V from 3 steps of 6 held-out passages
    c.vectors.estimate_v_steps = 3
    c.vectors.estimate_v_seed = 5
    c.vectors.batch_size = 8
    return c


def test_import_build_index_retrieve(hf_folder, tmp_path):
    c = _config(hf_folder)
    workdir = tmp_path / "run"
    summary = stages.import_model(config_lib.from_configdict(c), workdir)
    m = summary["model"]
    assert (m["arch"], m["num_kv_heads"], m["tie_embeddings"], m["norm_eps"], m["source"]) == (
        "llama",
        1,
        False,
        1e-5,
        str(hf_folder),
    )
    rec = summary["second_moment"]
    assert (
        rec["kind"],
        rec["estimate_v_method"],
        rec["estimate_v_source"],
        rec["num_steps"],
        rec["num_sequences"],
    ) == (
        "estimated",
        "minibatch",
        "heldout",
        3,
        18,
    )
    assert rec["num_dropped_candidates"] == 0 and rec["decay_rate"] == c.train.decay_rate

    run = stages.load_run(workdir)
    assert isinstance(run.tokenizer, hf_tokenizer.HFTokenizer) and run.step == 0
    assert run.opt_state_info["estimate_v_batch_sequences"] == 6 and run.opt_state_info["estimate_v_seed"] == 5
    _, want = hf_lib.load_hf(hf_folder, max_len=c.model.max_len)
    for p, x in lm.flat_params(want).items():
        np.testing.assert_array_equal(np.asarray(lm.flat_params(run.params)[p]), x, err_msg=p)
    assert run.model_cfg.arch == "llama" and not (workdir / checkpoint.TOKENIZER_FILE).exists()

    # Exported back (`stages.export_hf`): the folder's tensors bit for bit, and a tokenizer that
    # encodes as the run's does.
    out = stages.export_hf(workdir, tmp_path / "hf_out")
    original, _ = hf_lib.open_safetensors(hf_folder)
    exported, _ = hf_lib.open_safetensors(out)
    assert set(exported) == {n for n in original if not hf_lib._BUFFERS.search(n)}
    for n in exported:
        np.testing.assert_array_equal(exported[n], original[n], err_msg=n)
    text = "Paris is the capital of France."
    assert hf_tokenizer.HFTokenizer.from_pretrained_dir(out).encode(text) == run.tokenizer.encode(text)
    assert hf_lib.config_from_hf(json.loads((out / "config.json").read_text()), max_len=c.model.max_len) == (
        dataclasses.replace(run.model_cfg, source="")
    )

    # A rerun only reports: same summary, checkpoint untouched.
    ckpt = workdir / checkpoint.CHECKPOINT_DIR
    before = sorted((p.name, p.stat().st_mtime_ns) for p in ckpt.rglob("*"))
    assert stages.import_model(config_lib.from_configdict(c), workdir) == summary
    assert sorted((p.name, p.stat().st_mtime_ns) for p in ckpt.rglob("*")) == before

    # Later stages take the same (unresolved) experiment config.
    settings = config_lib.from_configdict(c)
    stages.build_index(settings, workdir)
    man = store.read_manifest(build.index_dir(settings.index, workdir))
    sm = man["model"]["second_moment"]
    assert (sm["kind"], sm["estimate_v_steps"], sm["estimate_v_batch_sequences"], sm["num_sequences"]) == (
        "estimated",
        3,
        6,
        18,
    )  # B, N, the source and the counts are part of the index identity
    assert man["storage"]["num_rows"] == len(run.corpus.examples)
    queries = [retrieval_stage.TextQuery("q0", "The capital of", " Paris"), retrieval_stage.TextQuery("q1", "A", " b")]
    recs, _ = retrieval_stage.retrieve_queries(run, settings, workdir, queries, k=5)
    n = len(run.corpus.examples)
    for r, q in zip(recs, queries):
        assert r["example_id"] == q.example_id and len(r["proponent_ids"]) == 5
        assert all(0 <= i < n for i in r["proponent_ids"]) and len(set(r["proponent_ids"])) == 5
        assert r["proponent_scores"] == sorted(r["proponent_scores"], reverse=True)

    # A config that disagrees with the imported shapes is refused, naming the field.
    c.model.num_layers = 3
    with pytest.raises(config_lib.ConfigError, match=r"model.num_layers=3 but the imported model has 2"):
        stages.build_index(config_lib.from_configdict(c), workdir)


def test_refusals(hf_folder, tmp_path):
    c = _config(hf_folder)
    c.model.mlp_dim = 128
    with pytest.raises(config_lib.ConfigError, match=r"model.mlp_dim=128 but the imported model has 256"):
        stages.import_model(config_lib.from_configdict(c), tmp_path / "a")
    c = _config(hf_folder)
    c.model.max_len = 128
    with pytest.raises(config_lib.ConfigError, match=r"model.max_len=128 exceeds the imported model's 64"):
        stages.import_model(config_lib.from_configdict(c), tmp_path / "b")
    with pytest.raises(config_lib.ConfigError, match="launch.import_model"):
        stages.train(config_lib.from_configdict(_config(hf_folder)), tmp_path / "c")
    c.model.source = ""
    with pytest.raises(config_lib.ConfigError, match="model.source is empty"):
        stages.import_model(config_lib.from_configdict(c), tmp_path / "d")
    c.model.source = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        stages.import_model(config_lib.from_configdict(c), tmp_path / "e")

    # A tokenizer with more ids (400) than the embedding has rows (300): both sizes named.
    small = tmp_path / "small_vocab"
    _save_llama(
        small,
        config_lib.from_configdict(c).model.__class__(
            vocab_size=300, num_layers=1, embed_dim=64, num_heads=2, head_dim=32, mlp_dim=256, max_len=64
        ),
        300,
    )
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (small / f).write_bytes((hf_folder / f).read_bytes())
    c = _config(small)
    c.model.vocab_size, c.model.num_layers = 300, 1
    with pytest.raises(ValueError, match=r"has 400 ids but the model's embedding has 300 rows"):
        stages.import_model(config_lib.from_configdict(c), tmp_path / "f")
    assert not (tmp_path / "f" / "config.json").exists()  # refused before writing anything


def test_no_estimate_refuses_the_correction(hf_folder, tmp_path):
    c = _config(hf_folder)
    c.vectors.estimate_v_steps = 0
    workdir = tmp_path / "run"
    stages.import_model(config_lib.from_configdict(c), workdir)
    run = stages.load_run(workdir)
    assert run.opt_state is None and run.opt_state_info["kind"] == "none"
    with pytest.raises(ValueError, match="vectors.correction=False"):
        stages.build_index(config_lib.from_configdict(c), workdir)
    c.vectors.estimate_v_steps = 8  # a different estimate on a finished import is refused, not redone
    with pytest.raises(config_lib.ConfigError, match="estimate_v_steps=8"):
        stages.import_model(config_lib.from_configdict(c), workdir)
    c.vectors.estimate_v_steps = 0
    c.vectors.estimate_v_source = "candidates"  # so is another source
    with pytest.raises(config_lib.ConfigError, match="estimate_v_source=candidates"):
        stages.import_model(config_lib.from_configdict(c), workdir)


def test_per_example_estimate_from_a_file_source(hf_folder, tmp_path):
    """The per-example method stays an option; a file source is read and never holds candidates."""
    c = _config(hf_folder)
    src = tmp_path / "v_text.txt"
    cands = data_lib.build_corpus(config_lib.from_configdict(c).data, 0).texts
    src.write_text("\n".join(["The cat sat on the mat.", "Paris is a city.", cands[0]]) + "\n")
    c.vectors.estimate_v_method = "per_example"
    c.vectors.estimate_v_source = f"file:{src}"
    c.vectors.estimate_v_examples = 8
    rec = stages.import_model(config_lib.from_configdict(c), tmp_path / "run")["second_moment"]
    assert (rec["estimate_v_method"], rec["num_examples"], rec["num_source_texts"], rec["num_dropped_candidates"]) == (
        "per_example",
        2,
        2,
        1,
    )


@pytest.mark.slow  # ~140 s on the shared 2-core CPU (train + completions + index compiles)
def test_continued_pretraining_of_an_import(hf_folder, tmp_path):
    """`stages.train` on an import: starts from the imported parameters with a fresh Adafactor,
    trains on the run's corpus, and the run then has a measured optimizer state."""
    import jax

    from trackstar_jax.training import step as step_lib

    c = _config(hf_folder)
    workdir = tmp_path / "run"
    stages.import_model(config_lib.from_configdict(c), workdir)
    c.train.num_steps, c.train.checkpoint_every_steps, c.train.max_checkpoints_to_keep = 2, 1, 5
    summary = stages.train(config_lib.from_configdict(c), workdir)
    assert summary["step"] == 2 and np.isfinite(summary["train_loss"])

    # Step 1 is one train step from the imported parameters with optax's initial state.
    imported = stages.load_run(workdir, step=0)
    run1 = stages.load_run(workdir, step=1)
    settings = config_lib.load_run_settings(workdir)
    opt = step_lib.make_optimizer(settings.train.optimizer)
    state0 = step_lib.TrainState(
        step=jax.numpy.zeros((), jax.numpy.int32), params=imported.params, opt_state=opt.init(imported.params)
    )
    batch = next(
        data_lib.train_batches(
            run1.corpus,
            run1.tokenizer,
            settings.train.global_batch_size,
            settings.model.max_len,
            settings.seed,
            start_step=0,
        )
    )
    want, _ = step_lib.train_step(state0, batch, graphdef=run1.graphdef, opt=opt)
    for p, x in lm.flat_params(want.params).items():
        np.testing.assert_allclose(np.asarray(lm.flat_params(run1.params)[p]), x, rtol=1e-5, atol=1e-6, err_msg=p)

    run = stages.load_run(workdir)
    assert run.step == 2 and run.opt_state is not None
    assert run.opt_state_info["kind"] == "measured" and run.opt_state_info["steps"] == 2
    assert run.opt_state_info["imported"]["kind"] == "estimated"
    counts = [int(x) for p, x in jax.tree_util.tree_leaves_with_path(run.opt_state) if "count" in str(p)]
    assert counts and all(n == 2 for n in counts)  # the optimizer's own count, not the estimate's

    settings = config_lib.from_configdict(c)
    stages.build_index(settings, workdir)
    man = store.read_manifest(build.index_dir(settings.index, workdir))
    assert man["model"]["second_moment"]["kind"] == "measured"
