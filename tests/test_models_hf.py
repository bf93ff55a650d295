"""Hugging Face import (issue 11): logits equal transformers' on tiny random models, refusals.

Parity tests build tiny random models with transformers (torch CPU, float32, eager
attention), randomise every parameter (HF's init leaves logits nearly uniform), save them
with `save_pretrained` (safetensors, optionally sharded) and compare logits. Refusal tests
write folders by hand with the `safetensors` numpy API and need no torch.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from trackstar_jax.models import hf, lm

VOCAB, T = 61, 11


def _transformers():
    pytest.importorskip("torch", reason="HF parity tests need torch (CPU) to run the reference model")
    return pytest.importorskip("transformers", reason="HF parity tests need transformers")


# (model class, config class, config kwargs, save kwargs)
_PARITY = {
    "llama_gqa_biases": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            rope_theta=500.0,
        ),
        {},
    ),
    "llama_mqa_tied_sharded": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
        dict(max_shard_size="3KB"),
    ),
    "qwen2": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
        {},
    ),
    "mistral_window": (
        "MistralForCausalLM",
        "MistralConfig",
        dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=T, tie_word_embeddings=False),
        {},
    ),
    "neox_parallel": (
        "GPTNeoXForCausalLM",
        "GPTNeoXConfig",
        dict(num_attention_heads=2, rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False),
        {},
    ),
    "neox_sequential_tied_sharded": (
        "GPTNeoXForCausalLM",
        "GPTNeoXConfig",
        dict(
            num_attention_heads=4,
            rotary_pct=0.5,
            use_parallel_residual=False,
            tie_word_embeddings=True,
            hidden_act="gelu_new",
        ),
        dict(max_shard_size="3KB"),
    ),
}


def _save_random_hf_model(name, folder):
    transformers = _transformers()
    import torch

    model_cls, config_cls, kwargs, save_kwargs = _PARITY[name]
    config = getattr(transformers, config_cls)(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        max_position_embeddings=32,
        **kwargs,
    )
    config._attn_implementation = "eager"  # the plain softmax(QK^T)V reference
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.normal_(0.0, 0.3)
            if "norm" in pname and pname.endswith("weight"):
                p.add_(1.0)
    model.save_pretrained(folder, **save_kwargs)
    return model, torch


@pytest.mark.parametrize("name", sorted(_PARITY))
def test_logits_equal_transformers(name, tmp_path):
    model, torch = _save_random_hf_model(name, tmp_path)
    if _PARITY[name][3]:
        assert (tmp_path / hf.INDEX_FILE).is_file()  # really sharded
    cfg, params = hf.load_hf(tmp_path)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, T))
    with torch.no_grad():
        want = model(torch.tensor(tokens)).logits.numpy()
    graphdef, _ = lm.abstract_params(cfg)
    with jax.default_matmul_precision("highest"):
        got = np.asarray(jax.jit(lm.apply, static_argnums=0)(graphdef, params, jnp.asarray(tokens, jnp.int32)))
    assert np.abs(want).max() > 1.0  # randomised weights: logits far from uniform
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    if name == "mistral_window":
        assert cfg.max_len == T  # full attention == sliding attention up to the window
    if name.startswith("neox"):
        assert cfg.arch == "gpt_neox" and cfg.rotary_dim == int(cfg.head_dim * _PARITY[name][2]["rotary_pct"])


@pytest.mark.parametrize("name", sorted(_PARITY))
def test_export_inverts_the_import(name, tmp_path):
    """`save_hf(load_hf(folder))`: the same tensors bit for bit, read back as the same model, and
    transformers' own loader runs the export to the original model's logits."""
    transformers = _transformers()
    model, torch = _save_random_hf_model(name, tmp_path / "in")
    cfg, params = hf.load_hf(tmp_path / "in")
    out = hf.save_hf(tmp_path / "out", cfg, params)
    original, _ = hf.open_safetensors(tmp_path / "in")
    exported, _ = hf.open_safetensors(out)
    outputs = set(lm.architecture(cfg.arch).hf_output_names)
    kept = {n for n in original if not hf._BUFFERS.search(n)}
    assert len(exported) == len(kept) and all(n in kept or n in outputs for n in exported)
    for n in exported:
        want = original[n] if n in original else original[next(o for o in outputs if o in original)]
        np.testing.assert_array_equal(exported[n], want, err_msg=n)
    cfg2, params2 = hf.load_hf(out)
    assert cfg2 == cfg
    for p, x in lm.flat_params(params).items():
        np.testing.assert_array_equal(lm.flat_params(params2)[p], x, err_msg=p)
    theirs = getattr(transformers, _PARITY[name][0]).from_pretrained(out, attn_implementation="eager").eval()
    tokens = torch.tensor(np.random.default_rng(1).integers(0, VOCAB, (2, T)))
    with torch.no_grad():
        np.testing.assert_allclose(theirs(tokens).logits.numpy(), model(tokens).logits.numpy(), rtol=1e-6, atol=1e-6)
    with pytest.raises(FileExistsError, match="export into an empty folder"):
        hf.save_hf(out, cfg, params)


@pytest.mark.parametrize(
    "arch,change,match",
    [
        (
            "llama",
            dict(qkv_bias=True, out_bias=False, mlp_bias=True),
            r"model\.qkv_bias=True \(the config\.json says False\)",
        ),
        ("gpt_neox", dict(norm="layer", norm_bias=False, activation="gelu", mlp_bias=True), r"model\.norm_bias=False"),
        (
            "gpt_neox",
            dict(norm="layer", norm_bias=True, activation="gelu", mlp_bias=True, head_dim=4),
            r"model\.head_dim=4",
        ),
        ("palm", {}, "has no Hugging Face export registered"),
    ],
)
def test_export_refuses_what_a_config_json_cannot_describe(arch, change, match):
    base = dict(vocab_size=VOCAB, num_layers=1, embed_dim=16, num_heads=2, head_dim=8, mlp_dim=24, max_len=T)
    cfg = lm.LMConfig(arch=arch, **{**base, **change})
    with pytest.raises(ValueError, match=match):
        hf.to_hf_config(cfg)


def test_bfloat16_params(tmp_path):
    _save_random_hf_model("llama_gqa_biases", tmp_path)
    cfg, params = hf.load_hf(tmp_path, param_dtype="bfloat16", dtype="bfloat16")
    assert cfg.param_dtype == "bfloat16" and all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    graphdef, _ = lm.abstract_params(cfg)
    assert lm.apply(graphdef, params, jnp.zeros((1, 4), jnp.int32)).dtype == jnp.float32


# ---- refusals (no torch needed) ------------------------------------------------------------

_LLAMA_CONFIG = dict(
    model_type="llama",
    vocab_size=VOCAB,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    hidden_act="silu",
)


def _write_folder(folder, config=None, drop=(), extra=None, reshape=None):
    """A hand-written HF llama folder (random float32 tensors), optionally broken."""
    config = dict(_LLAMA_CONFIG if config is None else config)
    cfg = hf.config_from_hf(config)
    rng = np.random.default_rng(0)
    tensors = {n: rng.normal(size=s).astype(np.float32) for n, s in hf.expected_tensor_shapes(cfg).items()}
    for n in drop:
        del tensors[n]
    tensors.update(extra or {})
    if reshape:
        tensors[reshape] = tensors[reshape][..., :-1]
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    safetensors.numpy.save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_hand_written_folder_loads(tmp_path):
    cfg, params = hf.load_hf(_write_folder(tmp_path / "ok"))
    assert cfg.arch == "llama" and cfg.kv_heads == 2
    assert params["layer_1"]["attn"]["key"]["kernel"].shape == (16, 2 * 4)


def test_missing_tensor_is_named_with_its_file(tmp_path):
    folder = _write_folder(tmp_path / "m", drop=["model.layers.1.mlp.up_proj.weight"])
    with pytest.raises(ValueError, match=r"missing tensor.*model\.layers\.1\.mlp\.up_proj\.weight.*model\.safetensors"):
        hf.load_hf(folder)


def test_extra_tensor_is_named(tmp_path):
    folder = _write_folder(tmp_path / "e", extra={"model.layers.0.self_attn.q_norm.weight": np.ones(4, np.float32)})
    with pytest.raises(ValueError, match=r"unknown tensor.*model\.layers\.0\.self_attn\.q_norm\.weight"):
        hf.load_hf(folder)


def test_non_finite_tensor_is_refused_naming_file_and_tensor(tmp_path):
    """A NaN in an imported file is refused at import, naming the shard and the tensor (not
    later as "training diverged")."""
    name = "model.layers.1.mlp.up_proj.weight"
    folder = _write_folder(tmp_path / "n")
    tensors = safetensors.numpy.load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    tensors[name][3, 5] = np.nan
    names = sorted(tensors)
    shard = {n: f"model-0000{1 + (n == name)}-of-00002.safetensors" for n in names}
    for f in set(shard.values()):
        safetensors.numpy.save_file({n: tensors[n] for n in names if shard[n] == f}, str(folder / f))
    (folder / hf.INDEX_FILE).write_text(json.dumps({"weight_map": shard}))
    with pytest.raises(
        ValueError, match=rf"tensor '{name}' in {folder / shard[name]} holds 1 non-finite value\(s\).*index \(3, 5\)"
    ):
        hf.load_hf(folder)


def test_rope_buffers_are_skipped_not_refused(tmp_path):
    folder = _write_folder(
        tmp_path / "b", extra={"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(2, np.float32)}
    )
    hf.load_hf(folder)


def test_shape_mismatch_is_named(tmp_path):
    folder = _write_folder(tmp_path / "s", reshape="model.layers.0.self_attn.o_proj.weight")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight.*shape \(16, 15\)"):
        hf.load_hf(folder)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(model_type="gemma"), "model_type 'gemma' is not supported"),
        (dict(rope_scaling=dict(rope_type="llama3", factor=8.0)), "rope_type 'llama3'"),
        (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4)), "rope_type 'yarn'"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(quantization_config=dict(quant_method="gptq")), "quantization_config"),
    ],
)
def test_unsupported_config_is_refused(tmp_path, change, match):
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**_LLAMA_CONFIG, **change}))
    with pytest.raises(ValueError, match=match):
        hf.load_hf(folder)


def test_missing_files_and_inconsistent_shards(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        hf.load_hf(tmp_path)
    folder = _write_folder(tmp_path / "sh")
    tensors = safetensors.numpy.load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    safetensors.numpy.save_file({n: tensors[n] for n in names[:half]}, str(folder / "model-00001-of-00002.safetensors"))
    safetensors.numpy.save_file(
        {n: tensors[n] for n in names[half:-1]}, str(folder / "model-00002-of-00002.safetensors")
    )
    weight_map = {n: f"model-0000{1 + (i >= half)}-of-00002.safetensors" for i, n in enumerate(names)}
    (folder / hf.INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=rf"missing tensor '{names[-1]}'.*model-00002-of-00002\.safetensors"):
        hf.load_hf(folder)
    del weight_map[names[-1]]  # the index now agrees with the shards: the model itself misses it
    (folder / hf.INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=rf"missing tensor.*{names[-1]}.*expected in the shards"):
        hf.load_hf(folder)


def test_from_hf_state_dict_is_the_shared_entry_point():
    cfg = hf.config_from_hf(_LLAMA_CONFIG)
    rng = np.random.default_rng(1)
    tensors = {n: rng.normal(size=s).astype(np.float32) for n, s in hf.expected_tensor_shapes(cfg).items()}
    cfg2, params = hf.from_hf_state_dict(_LLAMA_CONFIG, tensors, source="a GGUF file")
    assert cfg2 == cfg
    np.testing.assert_array_equal(
        params["layer_0"]["attn"]["out"]["kernel"], tensors["model.layers.0.self_attn.o_proj.weight"].T
    )
    with pytest.raises(ValueError, match="expected in a GGUF file"):
        hf.from_hf_state_dict(
            _LLAMA_CONFIG, {k: v for k, v in tensors.items() if k != "model.norm.weight"}, source="a GGUF file"
        )


def test_pre_transformers_5_gpt_neox_folder(tmp_path):
    # Pythia's config.json style (rotary_pct, rotary_emb_base, no rope_parameters) and tensor
    # names (embed_out, causal-mask buffers), written by hand.
    config = dict(
        model_type="gpt_neox",
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=32,
        rotary_pct=0.5,
        rotary_emb_base=100,
        use_parallel_residual=True,
        layer_norm_eps=1e-5,
        hidden_act="gelu",
        rope_scaling=None,
    )
    cfg = hf.config_from_hf(config)
    assert (cfg.rotary_dim, cfg.rope_base, cfg.tie_embeddings) == (4, 100.0, False)
    rng = np.random.default_rng(2)
    tensors = {n: rng.normal(size=s).astype(np.float32) for n, s in hf.expected_tensor_shapes(cfg).items()}
    tensors["embed_out.weight"] = tensors.pop("lm_head.weight")
    tensors["gpt_neox.layers.0.attention.bias"] = np.tril(np.ones((1, 1, 32, 32), np.float32))
    tensors["gpt_neox.layers.0.attention.masked_bias"] = np.array(-1e9, np.float32)
    _, params = hf.from_hf_state_dict(config, tensors)
    np.testing.assert_array_equal(params["unembed"]["kernel"], tensors["embed_out.weight"].T)
    # fused qkv rows are [head, q|k|v, head_dim]: head 1's key is rows 3*8+8 .. 3*8+16
    qkv = tensors["gpt_neox.layers.0.attention.query_key_value.weight"]
    np.testing.assert_array_equal(params["layer_0"]["attn"]["key"]["kernel"][:, 8:], qkv[32:40].T)
    tensors["lm_head.weight"] = tensors["embed_out.weight"]
    with pytest.raises(ValueError, match="both embed_out.weight and lm_head.weight"):
        hf.from_hf_state_dict(config, tensors)
    with pytest.raises(ValueError, match="rope_interleaved"):
        hf.config_from_hf({**_LLAMA_CONFIG, "rope_interleaved": True})
