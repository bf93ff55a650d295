"""MaxText import (`models.maxtext`, `training.importer`'s MaxText source) against real MaxText.

tests/fixtures/maxtext holds a tiny llama2-block model trained 4 steps by MaxText 0.2.5 on CPU
(tools/maxtext_fixture.sh), scanned and unscanned, with MaxText's own logits on three
sequences. Default suite (no MaxText needed): our forward on the import matches those logits,
the imported V is Adam's exact step denominator of the checkpoint's `nu` mapped by hand,
build_index -> retrieve run on the imported run, and what is not mapped is refused by name.
`-m slow`: the fixture is regenerated with real MaxText (a Python 3.12 side venv) and compared.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess

import jax
import numpy as np
import pytest

from trackstar_jax import config as config_lib
from trackstar_jax.models import lm
from trackstar_jax.models import maxtext as maxtext_lib
from trackstar_jax.training import importer

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "maxtext"
REPO = pathlib.Path(__file__).resolve().parents[1]
VARIANTS = ("scanned", "unscanned", "interleaved_rope")


def _ckpt_dir(variant: str, root: pathlib.Path = FIXTURE) -> pathlib.Path:
    return root / variant / "checkpoints"


def _settings(variant: str, root: pathlib.Path = FIXTURE, **kw) -> maxtext_lib.MaxTextSettings:
    """`config.maxtext` as a user copies it from the MaxText run's keys (maxtext_args.json)."""
    args = json.loads((root / variant / "maxtext_args.json").read_text())
    return maxtext_lib.MaxTextSettings(
        decoder_block=args["decoder_block"],
        rope_max_timescale=float(args["rope_max_timescale"]),
        normalization_layer_epsilon=float(args["normalization_layer_epsilon"]),
        max_target_length=int(args["max_target_length"]),
        tokenizer_path=kw.pop("tokenizer_path", "unused"),
        **{k: args[k] for k in ("rope_type", "rope_use_scale") if k in args},
        **kw,
    )


def _second_moment(s):
    return importer._maxtext_second_moment(s)


def _load(variant: str, root: pathlib.Path = FIXTURE, **kw) -> maxtext_lib.Imported:
    s = _settings(variant, root, **kw)
    return maxtext_lib.load_maxtext(_ckpt_dir(variant, root), s, _second_moment(s))


def _check_logits(variant: str, root: pathlib.Path = FIXTURE) -> None:
    got = _load(variant, root)
    ref = np.load(root / variant / "reference.npz")
    graphdef, _ = lm.abstract_params(got.cfg)
    with jax.default_matmul_precision("highest"):
        logits = np.asarray(lm.apply(graphdef, got.params, ref["tokens"]))
    assert logits.shape == ref["logits"].shape
    np.testing.assert_allclose(logits, ref["logits"], rtol=0, atol=1e-5, err_msg=variant)


@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_matches_maxtext_logits(variant):
    """Our llama forward on the imported params equals MaxText's own logits (float32, <= 1e-5)."""
    _check_logits(variant)


def test_config_read_from_the_shapes():
    got = _load("scanned")
    c = got.cfg
    assert (c.arch, c.vocab_size, c.num_layers, c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim, c.mlp_dim) == (
        "llama",
        128,
        2,
        32,
        4,
        2,
        8,
        64,
    )
    assert (c.norm_eps, c.rope_base, c.max_len, c.tie_embeddings) == (1e-5, 10_000.0, 16, False)
    assert got.record["count"] == got.record["step"] + 1 == 4 and got.record["scanned_layers"]
    # The header alone (orbax metadata, no array read) gives the same config, for the planner.
    s = _settings("scanned")
    items, _ = maxtext_lib.items_dir(_ckpt_dir("scanned"), -1)
    assert maxtext_lib.config_from_shapes(maxtext_lib.read_shapes(items), s, "x")[0] == c


def _raw_orbax(variant: str) -> dict:
    """The whole checkpoint read by orbax alone (not through models.maxtext), as numpy."""
    import orbax.checkpoint as ocp

    items, _ = maxtext_lib.items_dir(_ckpt_dir(variant), -1)
    ckptr = ocp.PyTreeCheckpointer()
    meta = ckptr.metadata(items)
    meta = getattr(meta, "item_metadata", None) or getattr(meta, "tree", None) or meta
    # nnx_aux holds PRNG keys (not numpy-convertible): skipped; everything else is read.
    item = {k: (jax.tree.map(lambda _: ocp.PLACEHOLDER, v) if k == "nnx_aux" else v) for k, v in meta.items()}
    args = jax.tree.map(lambda x: x if x is ocp.PLACEHOLDER else ocp.RestoreArgs(restore_type=np.ndarray), item)
    got = ckptr.restore(items, args=ocp.args.PyTreeRestore(item=item, restore_args=args))
    return {k: v for k, v in got.items() if k != "nnx_aux"}


@pytest.mark.parametrize("variant", VARIANTS)
def test_nu_mapping_matches_hand_mapped_values(variant):
    """V of each kind of tensor, mapped by hand from the orbax tree: Adam's denominator
    `sqrt(nu / (1 - b2^count)) + eps`, squared, divided by head_dim for the query kernel
    (whose weight we multiply by sqrt(head_dim)); weights likewise by hand."""
    raw = _raw_orbax(variant)
    adam = raw["opt_state"][0] if isinstance(raw["opt_state"], list) else raw["opt_state"]["0"]
    count, b2, eps = int(adam["count"]), 0.95, 1e-8
    assert count == 4
    nu, w = adam["nu"]["params"], raw["params"]["params"]
    got = _load(variant)
    v, p = lm.flat_params(got.v), lm.flat_params(got.params)
    hd = 8

    def den2(x):  # float64 reference of Adam's step denominator, squared
        return (np.sqrt(x.astype(np.float64) / (1 - b2**count)) + eps) ** 2

    def layer(tree, i, *names):
        if "layers" in tree["decoder"]:  # scanned: stacked on axis 1
            x = tree["decoder"]["layers"]
            for n in names:
                x = x[n]
            return np.take(x, i, axis=1)
        x = tree["decoder"][f"layers_{i}"]
        for n in names:
            x = x[n]
        return x

    # interleaved RoPE pairs (2i, 2i+1) -> rotate-half (i, i + 4) within each head
    perm = np.array([0, 2, 4, 6, 1, 3, 5, 7]) if variant == "interleaved_rope" else np.arange(8)
    for i in range(2):
        q_nu = layer(nu, i, "self_attention", "query", "kernel")[..., perm]  # [32, 4, 8]
        np.testing.assert_allclose(v[f"layer_{i}/attn/query/kernel"], den2(q_nu).reshape(32, 32) / hd, rtol=1e-6)
        q_w = layer(w, i, "self_attention", "query", "kernel")[..., perm]
        np.testing.assert_allclose(p[f"layer_{i}/attn/query/kernel"], q_w.reshape(32, 32) * np.sqrt(hd), rtol=1e-6)
        k_nu = layer(nu, i, "self_attention", "key", "kernel")[..., perm]  # [32, 2, 8]
        np.testing.assert_allclose(v[f"layer_{i}/attn/key/kernel"], den2(k_nu).reshape(32, 16), rtol=1e-6)
        o_nu = layer(nu, i, "self_attention", "out", "kernel")  # [4, 8, 32]
        np.testing.assert_allclose(v[f"layer_{i}/attn/out/kernel"], den2(o_nu).reshape(32, 32), rtol=1e-6)
        np.testing.assert_allclose(
            v[f"layer_{i}/mlp/up/kernel"], den2(layer(nu, i, "mlp", "wi_1", "kernel")), rtol=1e-6
        )
        np.testing.assert_allclose(
            v[f"layer_{i}/mlp_norm/scale"], den2(layer(nu, i, "post_self_attention_layer_norm", "scale")), rtol=1e-6
        )
    np.testing.assert_allclose(v["embed"], den2(nu["token_embedder"]["embedding"]), rtol=1e-6)
    np.testing.assert_allclose(v["unembed/kernel"], den2(nu["decoder"]["logits_dense"]["kernel"]), rtol=1e-6)
    np.testing.assert_array_equal(p["unembed/kernel"], w["decoder"]["logits_dense"]["kernel"])


def test_adam_v_per_optimizer():
    """adamw: optax's bias correction 1/(1 - b2^count); adam_pax: MaxText's nu is already
    bias-corrected by its decay; both add eps outside the square root and eps_root inside."""
    from trackstar_jax.features import preconditioner

    nu = np.array([0.0, 1e-6, 4.0], np.float32)
    s = _settings("scanned", adam_b2=0.5, adam_eps=1e-3, adam_eps_root=1e-4)
    want = (np.sqrt(nu / (1 - 0.5**2) + 1e-4) + 1e-3) ** 2
    np.testing.assert_allclose(importer._maxtext_second_moment(s)(nu, 2), want, rtol=1e-6)
    pax = dataclasses.replace(s, opt_type="adam_pax")
    np.testing.assert_allclose(importer._maxtext_second_moment(pax)(nu, 2), (np.sqrt(nu + 1e-4) + 1e-3) ** 2, rtol=1e-6)
    with pytest.raises(ValueError, match="count 0: no update has been made"):
        preconditioner.adam_bias_correction(0, 0.95)


def test_interleaved_rope_layout_is_permuted_alike_in_weights_and_v():
    """rope_type='llama3.1' (rope_use_scale=False) stores RoPE pairs (2i, 2i+1): the query and key
    columns are reordered within each head to rotate-half, V in the same order."""
    base, inter = _load("scanned"), _load("scanned", rope_type="llama3.1", rope_use_scale=False)
    perm = np.concatenate([np.arange(0, 8, 2), np.arange(1, 8, 2)])
    for tree in ("params", "v"):
        a, b = lm.flat_params(getattr(base, tree)), lm.flat_params(getattr(inter, tree))
        for name in ("query", "key"):
            x = np.asarray(a[f"layer_1/attn/{name}/kernel"]).reshape(32, -1, 8)
            np.testing.assert_array_equal(np.asarray(b[f"layer_1/attn/{name}/kernel"]), x[..., perm].reshape(32, -1))
        np.testing.assert_array_equal(b["layer_1/attn/value/kernel"], a["layer_1/attn/value/kernel"])
    # q . k is unchanged by a permutation applied to both: RoPE in rotate-half on the permuted
    # columns equals interleaved RoPE on the stored ones.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8,))
    pos, theta = 3.0, 10_000.0
    freqs = pos / theta ** (np.arange(0, 8, 2) / 8)
    cos, sin = np.cos(freqs), np.sin(freqs)
    inter_out = np.empty(8)
    inter_out[0::2] = x[0::2] * cos - x[1::2] * sin
    inter_out[1::2] = x[1::2] * cos + x[0::2] * sin
    y = x[perm]
    half = np.concatenate([y[:4] * cos - y[4:] * sin, y[4:] * cos + y[:4] * sin])
    np.testing.assert_allclose(half, inter_out[perm], rtol=1e-12)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"decoder_block": "gemma2"}, r"config.maxtext.decoder_block='gemma2' is not mapped"),
        ({"decoder_block": ""}, r"set config.maxtext.decoder_block"),
        ({"rope_max_timescale": 0.0}, r"set config.maxtext.rope_max_timescale"),
        ({"opt_type": "sgd"}, r"opt_type='sgd' is refused: no optimizer state"),
        ({"opt_type": "muon"}, r"opt_type='muon' is refused: orthogonalised momentum"),
        ({"opt_type": "adafactor"}, r"opt_type='adafactor' is not mapped"),
        ({"rope_type": "yarn"}, r"rope_type='yarn' is not mapped"),
        ({"rope_type": "llama3.1"}, r"llama3.1's RoPE frequency scaling is not mapped"),
        ({"rope_linear_scaling_factor": 2.0}, r"rope_linear_scaling_factor=2.0 is not mapped"),
        ({"num_query_heads": 8}, r"config.maxtext.num_query_heads=8 but the checkpoint's kernels have 4"),
        ({"num_kv_heads": 4}, r"config.maxtext.num_kv_heads=4 but the checkpoint's kernels have 2"),
        ({"step": 7}, r"maxtext.step=7: .* holds steps \[3\]"),
    ],
)
def test_refusals_are_named(change, match):
    s = dataclasses.replace(_settings("scanned"), **change)
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        maxtext_lib.load_maxtext(_ckpt_dir("scanned"), s, _second_moment(s))


def test_refuses_an_optimizer_state_without_nu_and_unmapped_tensors(tmp_path):
    import orbax.checkpoint as ocp

    raw = _raw_orbax("scanned")
    # An SGD run saves no per-element second moment: refused naming what the state holds.
    ocp.PyTreeCheckpointer().save(
        tmp_path / "sgd" / "3" / "items", {"params": raw["params"], "opt_state": {"trace": 0}, "step": 3}
    )
    s = _settings("scanned")
    with pytest.raises(ValueError, match=r"has no Adam 'nu'"):
        maxtext_lib.load_maxtext(tmp_path / "sgd", s, _second_moment(s))
    # A fused q/k/v checkpoint (or any tensor the llama2 mapping does not place) is refused by name.
    params = raw["params"]["params"]
    layers = params["decoder"]["layers"]["self_attention"]
    layers["qkv_proj"] = {"kernel": np.zeros((32, 2, 3, 4, 8), np.float32)}
    tree = {"params": raw["params"], "opt_state": [{"count": 4, "mu": {}, "nu": raw["params"]}], "step": 3}
    ocp.PyTreeCheckpointer().save(tmp_path / "fused" / "3" / "items", tree)
    with pytest.raises(ValueError, match=r"does not place .*decoder/layers/self_attention/qkv_proj/kernel"):
        maxtext_lib.load_maxtext(tmp_path / "fused", s, _second_moment(s))
    # A tied output (no logits_dense) is refused: MaxText scales it by 1/sqrt(emb_dim).
    del params["decoder"]["logits_dense"], layers["qkv_proj"]
    ocp.PyTreeCheckpointer().save(tmp_path / "tied" / "3" / "items", tree)
    with pytest.raises(ValueError, match=r"tied output \(logits_via_embedding=true"):
        maxtext_lib.load_maxtext(tmp_path / "tied", s, _second_moment(s))


# ---------------------------------------------------------------------------------------
# The import stage: a run that indexes and retrieves
# ---------------------------------------------------------------------------------------


def _tokenizer(folder: pathlib.Path, texts) -> None:
    """A word-level tokenizer of at most 128 ids (the fixture's vocabulary size)."""
    tokenizers = pytest.importorskip("tokenizers", reason="the imported tokenizer needs the `tokenizers` package")
    from tokenizers import models, pre_tokenizers, trainers

    tk = tokenizers.Tokenizer(models.WordLevel(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator(texts, trainers.WordLevelTrainer(vocab_size=128, special_tokens=["<unk>", "<bos>", "<eos>"]))
    folder.mkdir(parents=True, exist_ok=True)
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"})
    )


def _stage_config(tmp_path: pathlib.Path):
    from experiments import base, tiny
    from trackstar_jax import data as data_lib

    c = tiny.get_config()
    s = config_lib.from_configdict(c)
    tok = tmp_path / "tok"
    _tokenizer(tok, data_lib.build_corpus(s.data, s.seed).texts)
    c.model = base.get_config().model  # shape keys at their defaults: filled from the checkpoint
    c.model.source = str(_ckpt_dir("scanned"))
    c.model.max_len = 16
    c.maxtext.decoder_block = "llama2"
    c.maxtext.rope_max_timescale = 10_000.0
    c.maxtext.normalization_layer_epsilon = 1e-5
    c.maxtext.max_target_length = 16
    c.maxtext.tokenizer_path = str(tok)
    c.train.min_dim_size_to_factor = 1 << 30  # Adafactor keeps the per-element V unfactored
    c.vectors.batch_size = 8
    return c


@pytest.mark.usefixtures("fast_compile")
def test_import_build_index_retrieve(tmp_path):
    from trackstar_jax import stages
    from trackstar_jax.features import preconditioner
    from trackstar_jax.index import build, store
    from trackstar_jax.retrieval import stage as retrieval_stage

    c = _stage_config(tmp_path)
    workdir = tmp_path / "run"
    summary = stages.import_model(config_lib.from_configdict(c), workdir)
    assert summary["second_moment"]["kind"] == "checkpoint" and summary["second_moment"]["count"] == 4
    run = stages.load_run(workdir)
    want = _load("scanned")
    for path, x in lm.flat_params(want.params).items():
        np.testing.assert_array_equal(np.asarray(lm.flat_params(run.params)[path]), x, err_msg=path)
    # The correction the index uses is 1/sqrt(V) of the imported V, element-wise and exact.
    paths = ("layer_0/attn/query/kernel", "layer_1/mlp/down/kernel")
    corr = preconditioner.from_opt_state(run.params, run.opt_state, paths, exact=True)
    for path in paths:
        np.testing.assert_allclose(
            corr.elementwise(path, lm.flat_params(want.v)[path].shape),
            lm.flat_params(want.v)[path] ** -0.5,
            rtol=1e-6,
        )

    settings = config_lib.from_configdict(c)
    stages.build_index(settings, workdir)
    man = store.read_manifest(build.index_dir(settings.index, workdir))
    assert man["model"]["second_moment"]["source"] == "maxtext"
    queries = [retrieval_stage.TextQuery("q0", "The capital of", " Paris"), retrieval_stage.TextQuery("q1", "A", " b")]
    recs, _ = retrieval_stage.retrieve_queries(run, settings, workdir, queries, k=5)
    n = len(run.corpus.examples)
    for r in recs:
        assert len(set(r["proponent_ids"])) == 5 and all(0 <= i < n for i in r["proponent_ids"])
        assert r["proponent_scores"] == sorted(r["proponent_scores"], reverse=True)


def test_stage_keeps_v_unfactored_and_refuses_missing_keys(tmp_path):
    from trackstar_jax import stages

    c = _stage_config(tmp_path)
    c.train.min_dim_size_to_factor = 16
    summary = stages.import_model(config_lib.from_configdict(c), tmp_path / "a")
    # 33: one above the largest second-largest dimension (32) of the model's matrices, so
    # Adafactor keeps Adam's per-element V whole (as for a Trainer's AdamW V)
    assert stages.load_run(tmp_path / "a").optimizer.min_dim_size_to_factor == 33
    assert summary["second_moment"]["min_dim_size_to_factor"] == 33
    c = _stage_config(tmp_path)
    c.maxtext.tokenizer_path = ""
    with pytest.raises(ValueError, match=r"set config.maxtext.tokenizer_path"):
        stages.import_model(config_lib.from_configdict(c), tmp_path / "b")
    assert not (tmp_path / "b" / "config.json").exists()
    # The planner reads the same config from the checkpoint's metadata.
    got = importer.read_source_config(c.model.source, maxtext=_settings("scanned"))
    assert (got.num_layers, got.num_kv_heads, got.vocab_size) == (2, 2, 128)


# ---------------------------------------------------------------------------------------
# -m slow: regenerate the fixture with real MaxText and compare
# ---------------------------------------------------------------------------------------


@pytest.mark.slow  # builds / reuses the ~1.4 GB .venv-maxtext; 504 s on the loaded 2-core VM (3 MaxText trainings)
def test_regenerated_fixture_matches(tmp_path):
    venv_py = REPO / ".venv-maxtext" / "bin" / "python"
    py312 = os.environ.get("PYTHON312") or next(
        (
            str(p)
            for root in ("/root/.pyenv/versions", str(pathlib.Path.home() / ".pyenv/versions"))
            for p in sorted(pathlib.Path(root).glob("3.12*/bin/python3"))
        ),
        None,
    )
    if not venv_py.exists() and py312 is None:
        pytest.skip("no .venv-maxtext and no Python 3.12 interpreter (pyenv 3.12 or $PYTHON312) to build it")
    if shutil.which("bash") is None:
        pytest.skip("tools/maxtext_fixture.sh needs bash")
    out = tmp_path / "maxtext"
    subprocess.run(["bash", str(REPO / "tools" / "maxtext_fixture.sh"), str(out)], check=True, cwd=REPO)
    for variant in VARIANTS:
        _check_logits(variant, out)
        assert _load(variant, out).cfg == _load(variant).cfg
