"""Hugging Face checkpoints -> (`lm.LMConfig`, parameters in our layout).

Supported `model_type`s: `llama` (also SmolLM2), `mistral`, `qwen2` -> `arch="llama"`;
`gpt_neox` (Pythia) -> `arch="gpt_neox"`. A folder holds `config.json` and either
`model.safetensors` or shards `model-0000x-of-0000y.safetensors` with
`model.safetensors.index.json`; tensors are read with the `safetensors` numpy API (bfloat16
through ml_dtypes), one at a time, and cast to `param_dtype`.

Everything is checked, and refused with a ValueError that names the culprit: an unsupported
model_type or config feature (rope scaling, a non-SiLU Llama activation, quantisation, ...),
a missing tensor (with the file it was expected in), an unknown tensor, a shape mismatch.
The result is compared with `lm.abstract_params(cfg)` path by path, so no parameter is left
at a random initialisation.

Two config details that we translate rather than refuse:

* Sliding-window attention (Mistral, Qwen2 with `use_sliding_window`) is the same as full
  causal attention for sequences no longer than the window, so `max_len` is capped at the
  window (a longer input then raises in the model instead of being attended wrongly).
* Both config styles are read: transformers 5 (`rope_parameters` with `rope_theta`,
  `rope_type`, `partial_rotary_factor`) and older files (`rope_theta` / `rotary_emb_base`,
  `rope_scaling`, `rotary_pct`).

`from_hf_state_dict` is the loader's core, shared with other formats (a GGUF reader that
produces HF-named tensors and an HF-style config dict).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Any, Callable, Iterator, Mapping

import jax.numpy as jnp
import numpy as np
import safetensors

from trackstar_jax import files as files_lib
from trackstar_jax.models import lm

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "gpt_neox")
DTYPES = ("float32", "bfloat16")
CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Non-parameter buffers that older checkpoints carry (causal-mask and RoPE caches, which we
# recompute): skipped, not refused.
_BUFFERS = re.compile(r"(\.rotary_emb\.inv_freq|\.attention\.bias|\.attention\.masked_bias)$")
_NEOX_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
_KNOWN_UNSUPPORTED = ("quantization_config", "attn_logit_softcapping", "final_logit_softcapping")


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One HF tensor: its name, its HF shape and how it becomes our parameter(s)."""

    name: str
    shape: tuple[int, ...]
    convert: Callable[[np.ndarray], dict[str, np.ndarray]]


def _rope(hf: Mapping[str, Any]) -> tuple[float, float]:
    """`(theta, partial_rotary_factor)` from either config style; refuses rope scaling."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    for what, d in (("rope_parameters", params), ("rope_scaling", scaling or {})):
        kind = d.get("rope_type", d.get("type", "default"))
        if kind != "default":
            raise ValueError(
                f"config.json {what} has rope_type {kind!r}: only the default (unscaled) RoPE is implemented"
            )
    theta = params.get("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10_000.0)))
    default_pct = 0.25 if hf["model_type"] == "gpt_neox" else 1.0  # GPTNeoXConfig's default rotary_pct
    pct = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", hf.get("rotary_pct", default_pct)))
    return float(theta), float(pct)


def config_from_hf(
    hf: Mapping[str, Any], *, dtype: str = "float32", param_dtype: str = "float32", max_len: int | None = None
) -> lm.LMConfig:
    """Translates an HF `config.json` dict into an `LMConfig`.

    Args:
      hf: the parsed config.json.
      dtype: compute dtype, "float32" or "bfloat16".
      param_dtype: parameter dtype, "float32" or "bfloat16".
      max_len: override of the maximum sequence length (default: `max_position_embeddings`,
        capped at a sliding window).

    Returns:
      The config.

    Raises:
      ValueError: unsupported model_type, dtype or config feature (the message names it).
    """
    for name, value in (("dtype", dtype), ("param_dtype", param_dtype)):
        if value not in DTYPES:
            raise ValueError(f"model.{name} must be one of {DTYPES} for an imported model, got {value!r}")
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"config.json model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    for key in _KNOWN_UNSUPPORTED:
        if hf.get(key) is not None:
            raise ValueError(f"config.json sets {key!r}, which the {model_type} import does not implement")
    if hf.get("rope_interleaved"):  # SmolLM2's configs say false; true would pair features (2i, 2i+1)
        raise ValueError("config.json sets rope_interleaved=true: only the rotate-half RoPE layout is implemented")
    theta, pct = _rope(hf)
    d, h = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or d // h)
    window = hf.get("sliding_window")
    if model_type == "qwen2" and not hf.get("use_sliding_window", False):
        window = None
    if model_type == "llama":
        window = None
    length = int(hf.get("max_position_embeddings", 2048))
    if window is not None:
        length = min(length, int(window))  # full attention == sliding attention up to the window
    common = dict(
        vocab_size=int(hf["vocab_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        embed_dim=d,
        num_heads=h,
        head_dim=head_dim,
        mlp_dim=int(hf["intermediate_size"]),
        max_len=int(max_len or length),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_base=theta,
        dtype=dtype,
        param_dtype=param_dtype,
    )
    if model_type == "gpt_neox":
        act = hf.get("hidden_act", "gelu")
        if act not in _NEOX_ACTIVATIONS:
            raise ValueError(
                f"config.json hidden_act {act!r} is not supported for gpt_neox "
                f"(supported: {', '.join(_NEOX_ACTIVATIONS)})"
            )
        attn_bias = bool(hf.get("attention_bias", True))
        return lm.LMConfig(
            arch="gpt_neox",
            norm="layer",
            norm_bias=True,
            norm_eps=float(hf.get("layer_norm_eps", 1e-5)),
            rotary_pct=pct,
            qkv_bias=attn_bias,
            out_bias=attn_bias,
            mlp_bias=True,
            parallel_residual=bool(hf.get("use_parallel_residual", True)),
            activation=_NEOX_ACTIVATIONS[act],
            **common,
        )
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json hidden_act {act!r} is not supported for {model_type} (only 'silu', SwiGLU)")
    if pct != 1.0:
        raise ValueError(f"config.json partial_rotary_factor {pct} is not supported for {model_type}")
    if model_type == "qwen2":
        qkv_bias, out_bias, mlp_bias = True, False, False
    elif model_type == "llama":
        qkv_bias = out_bias = bool(hf.get("attention_bias", False))
        mlp_bias = bool(hf.get("mlp_bias", False))
    else:  # mistral: no biases
        qkv_bias = out_bias = mlp_bias = False
    return lm.LMConfig(
        arch="llama",
        norm="rms",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        num_kv_heads=int(hf.get("num_key_value_heads") or h),
        qkv_bias=qkv_bias,
        out_bias=out_bias,
        mlp_bias=mlp_bias,
        **common,
    )


def _t(path: str) -> Callable[[np.ndarray], dict[str, np.ndarray]]:
    """HF `nn.Linear.weight [out, in]` -> our `kernel [in, out]`."""
    return lambda w: {path: w.T}


def _same(path: str) -> Callable[[np.ndarray], dict[str, np.ndarray]]:
    return lambda w: {path: w}


def _linear(hf_name: str, path: str, n_in: int, n_out: int, bias: bool) -> list[_Tensor]:
    out = [_Tensor(f"{hf_name}.weight", (n_out, n_in), _t(f"{path}/kernel"))]
    if bias:
        out.append(_Tensor(f"{hf_name}.bias", (n_out,), _same(f"{path}/bias")))
    return out


def _llama_spec(cfg: lm.LMConfig) -> list[_Tensor]:
    d, h, g, hd, m = cfg.embed_dim, cfg.num_heads, cfg.kv_heads, cfg.head_dim, cfg.mlp_dim
    spec = [
        _Tensor("model.embed_tokens.weight", (cfg.vocab_size, d), _same("embed")),
        _Tensor("model.norm.weight", (d,), _same("final_norm/scale")),
    ]
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}", f"layer_{i}"
        spec += _linear(f"{hf}.self_attn.q_proj", f"{ours}/attn/query", d, h * hd, cfg.qkv_bias)
        spec += _linear(f"{hf}.self_attn.k_proj", f"{ours}/attn/key", d, g * hd, cfg.qkv_bias)
        spec += _linear(f"{hf}.self_attn.v_proj", f"{ours}/attn/value", d, g * hd, cfg.qkv_bias)
        spec += _linear(f"{hf}.self_attn.o_proj", f"{ours}/attn/out", h * hd, d, cfg.out_bias)
        spec += _linear(f"{hf}.mlp.gate_proj", f"{ours}/mlp/gate", d, m, cfg.mlp_bias)
        spec += _linear(f"{hf}.mlp.up_proj", f"{ours}/mlp/up", d, m, cfg.mlp_bias)
        spec += _linear(f"{hf}.mlp.down_proj", f"{ours}/mlp/down", m, d, cfg.mlp_bias)
        spec += [
            _Tensor(f"{hf}.input_layernorm.weight", (d,), _same(f"{ours}/attn_norm/scale")),
            _Tensor(f"{hf}.post_attention_layernorm.weight", (d,), _same(f"{ours}/mlp_norm/scale")),
        ]
    return spec


def _neox_qkv(path: str, h: int, hd: int, what: str) -> Callable[[np.ndarray], dict[str, np.ndarray]]:
    """Splits HF's fused `query_key_value` (rows ordered `[head, q|k|v, head_dim]`) into
    our `query`, `key`, `value` (kernels `[in, h * hd]`, biases `[h * hd]`)."""

    def convert(w):
        parts = w.reshape((h, 3, hd) + w.shape[1:])
        out = {}
        for j, name in enumerate(("query", "key", "value")):
            x = parts[:, j].reshape((h * hd,) + w.shape[1:])
            out[f"{path}/{name}/{what}"] = x.T if what == "kernel" else x
        return out

    return convert


def _neox_spec(cfg: lm.LMConfig) -> list[_Tensor]:
    d, h, hd, m = cfg.embed_dim, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
    spec = [
        _Tensor("gpt_neox.embed_in.weight", (cfg.vocab_size, d), _same("embed")),
        _Tensor("gpt_neox.final_layer_norm.weight", (d,), _same("final_norm/scale")),
        _Tensor("gpt_neox.final_layer_norm.bias", (d,), _same("final_norm/bias")),
    ]
    for i in range(cfg.num_layers):
        hf, ours = f"gpt_neox.layers.{i}", f"layer_{i}"
        qkv = f"{hf}.attention.query_key_value"
        spec.append(_Tensor(f"{qkv}.weight", (3 * h * hd, d), _neox_qkv(f"{ours}/attn", h, hd, "kernel")))
        if cfg.qkv_bias:
            spec.append(_Tensor(f"{qkv}.bias", (3 * h * hd,), _neox_qkv(f"{ours}/attn", h, hd, "bias")))
        spec += _linear(f"{hf}.attention.dense", f"{ours}/attn/out", h * hd, d, cfg.out_bias)
        spec += _linear(f"{hf}.mlp.dense_h_to_4h", f"{ours}/mlp/up", d, m, cfg.mlp_bias)
        spec += _linear(f"{hf}.mlp.dense_4h_to_h", f"{ours}/mlp/down", m, d, cfg.mlp_bias)
        for norm, ln in (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm")):
            spec += [
                _Tensor(f"{hf}.{ln}.weight", (d,), _same(f"{ours}/{norm}/scale")),
                _Tensor(f"{hf}.{ln}.bias", (d,), _same(f"{ours}/{norm}/bias")),
            ]
    return spec


def _output_names(cfg: lm.LMConfig) -> tuple[str, ...]:
    """Accepted names of the untied output embedding (GPT-NeoX: `embed_out` before transformers 5)."""
    return ("embed_out.weight", "lm_head.weight") if cfg.arch == "gpt_neox" else ("lm_head.weight",)


def expected_tensor_shapes(cfg: lm.LMConfig) -> dict[str, tuple[int, ...]]:
    """`{HF tensor name: HF shape}` of a checkpoint of `cfg` (untied output embedding as `lm_head.weight`)."""
    spec = _llama_spec(cfg) if cfg.arch == "llama" else _neox_spec(cfg)
    if not cfg.tie_embeddings:
        spec.append(_Tensor("lm_head.weight", (cfg.vocab_size, cfg.embed_dim), _t("unembed/kernel")))
    return {t.name: t.shape for t in spec}


def _float_array(x: Any, name: str, source: str) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
        raise ValueError(f"tensor {name!r} in {source} has dtype {x.dtype}: expected a floating-point tensor")
    return x


def from_hf_state_dict(
    hf_config: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray],
    *,
    dtype: str = "float32",
    param_dtype: str = "float32",
    max_len: int | None = None,
    source: str = "the state dict",
) -> tuple[lm.LMConfig, dict]:
    """HF-named tensors + an HF config dict -> `(LMConfig, params)` in our layout.

    Args:
      hf_config: the parsed `config.json` (or an equivalent dict).
      tensors: `{hf_name: array [HF shape]}` (any Mapping; read once per name).
      dtype, param_dtype, max_len: see `config_from_hf`.
      source: where the tensors came from, for error messages (e.g. a file path).

    Returns:
      `(cfg, params)`: params is a pure nested dict of host numpy arrays in `param_dtype`
      with exactly the paths and shapes of `lm.abstract_params(cfg)` (put them on devices
      with the shardings you want).

    Raises:
      ValueError: unsupported config (see `config_from_hf`), a missing, unknown or misshapen
        tensor (named, with `source`), or a non-float tensor.
    """
    cfg = config_from_hf(hf_config, dtype=dtype, param_dtype=param_dtype, max_len=max_len)
    spec = _llama_spec(cfg) if cfg.arch == "llama" else _neox_spec(cfg)
    names = set(tensors)
    out_names = [n for n in _output_names(cfg) if n in names]
    if cfg.tie_embeddings:
        for n in out_names:  # some tied checkpoints still store the output embedding: it must be the input one
            embed_name = spec[0].name
            if embed_name in names and not np.array_equal(np.asarray(tensors[n]), np.asarray(tensors[embed_name])):
                raise ValueError(
                    f"tie_word_embeddings is true but tensor {n!r} in {source} differs from {embed_name!r}"
                )
    else:
        if len(out_names) > 1:
            raise ValueError(f"{source} holds both {' and '.join(out_names)}: which is the output embedding?")
        name = out_names[0] if out_names else _output_names(cfg)[-1]
        spec.append(_Tensor(name, (cfg.vocab_size, cfg.embed_dim), _t("unembed/kernel")))
    used = {t.name for t in spec} | set(out_names)
    missing = [t.name for t in spec if t.name not in names]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"missing tensor(s) {', '.join(missing[:5])}{more}: expected in {source}")
    unknown = sorted(n for n in names - used if not _BUFFERS.search(n))
    if unknown:
        more = f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else ""
        raise ValueError(
            f"unknown tensor(s) in {source} for {hf_config['model_type']} with this config.json: "
            f"{', '.join(unknown[:5])}{more}"
        )
    pdt = np.dtype(jnp.dtype(param_dtype))
    flat: dict[str, np.ndarray] = {}
    for t in spec:
        x = _float_array(tensors[t.name], t.name, source)
        if tuple(x.shape) != t.shape:
            raise ValueError(f"tensor {t.name!r} in {source} has shape {tuple(x.shape)}; config.json implies {t.shape}")
        for path, y in t.convert(x).items():
            flat[path] = np.ascontiguousarray(y, dtype=pdt)  # one copy at most (a transposed kernel)
    _, abstract = lm.abstract_params(cfg)
    want = {p: tuple(x.shape) for p, x in lm.flat_params(abstract).items()}
    got = {p: tuple(x.shape) for p, x in flat.items()}
    if want != got:  # a mapping bug, not a user error: say exactly what differs
        diff = sorted(set(want) ^ set(got)) + sorted(p for p in set(want) & set(got) if want[p] != got[p])
        raise ValueError(f"internal: imported parameters do not match the {cfg.arch} model at {', '.join(diff)}")
    return cfg, _unflatten(flat)


def _unflatten(flat: Mapping[str, Any]) -> dict:
    out: dict = {}
    for path, x in flat.items():
        node = out
        *head, last = path.split("/")
        for part in head:
            node = node.setdefault(part, {})
        node[last] = x
    return out


def _safe_open(path: pathlib.Path) -> Any:
    """`safetensors.safe_open`, with a damaged file named (not a bare `SafetensorError`)."""
    try:
        return safetensors.safe_open(str(path), framework="numpy")
    except (safetensors.SafetensorError, OSError) as e:
        raise files_lib.InputError(
            f"{path} is not a readable safetensors file ({e}): it is truncated or damaged; download it again"
        ) from None


class _SafetensorsFolder(Mapping):
    """Lazy `{tensor name: np.ndarray}` over one or several safetensors files (read on access)."""

    def __init__(self, files: Mapping[str, pathlib.Path]):
        self._files = dict(files)  # tensor name -> file
        self._handles: dict[pathlib.Path, Any] = {}

    def file_of(self, name: str) -> pathlib.Path:
        return self._files[name]

    def __getitem__(self, name: str) -> np.ndarray:
        path = self._files[name]
        if path not in self._handles:
            self._handles[path] = _safe_open(path)
        try:
            return self._handles[path].get_tensor(name)
        except (safetensors.SafetensorError, OSError) as e:
            raise files_lib.InputError(
                f"{path}: tensor {name!r} cannot be read ({e}); download the file again"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def open_safetensors(folder: str | pathlib.Path) -> tuple[_SafetensorsFolder, str]:
    """The tensors of an HF folder (single file or index + shards), lazily, and a description
    of where they are (for error messages).

    Raises:
      ValueError: no safetensors weights in the folder, a shard the index names is absent,
        a tensor the index places in a shard is not there, or a shard holds a tensor the
        index does not list.
    """
    folder = pathlib.Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = files_lib.read_json(index, "safetensors index", "download it again")
        if not isinstance(weight_map, dict) or not isinstance(weight_map.get("weight_map"), dict):
            raise files_lib.InputError(f'{index} has no "weight_map" object; download it again')
        weight_map = weight_map["weight_map"]
        files = {}
        for shard in sorted(set(weight_map.values())):
            path = folder / shard
            if not path.is_file():
                raise ValueError(f"{INDEX_FILE} lists shard {shard!r}, which is not in {folder}")
            with _safe_open(path) as f:
                stored = set(f.keys())
            listed = {n for n, s in weight_map.items() if s == shard}
            for n in sorted(listed - stored):
                raise ValueError(f"missing tensor {n!r}: {INDEX_FILE} places it in {path}, which does not hold it")
            for n in sorted(stored - listed):
                raise ValueError(f"tensor {n!r} in {path} is not listed in {INDEX_FILE}")
            files.update({n: path for n in stored})
        return _SafetensorsFolder(files), f"the shards of {index}"
    single = folder / SINGLE_FILE
    if single.is_file():
        with _safe_open(single) as f:
            names = list(f.keys())
        return _SafetensorsFolder({n: single for n in names}), str(single)
    present = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    raise ValueError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {folder} (found: {', '.join(present) or 'nothing'}); "
        "only safetensors checkpoints are read"
    )


def load_hf(
    folder: str | pathlib.Path, *, dtype: str = "float32", param_dtype: str = "float32", max_len: int | None = None
) -> tuple[lm.LMConfig, dict]:
    """Loads an HF model folder as `(LMConfig, params)` (see `from_hf_state_dict`).

    Usage:

        cfg, params = hf.load_hf("SmolLM2-135M", param_dtype="bfloat16")
        graphdef, _ = lm.abstract_params(cfg)
        logits = lm.apply(graphdef, params, tokens)

    Raises:
      ValueError: a missing config.json or weights, an unsupported model_type or config
        feature, a missing / unknown / misshapen tensor (each named).
    """
    folder = pathlib.Path(folder)
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"no {CONFIG_FILE} in {folder}")
    hf_config = files_lib.read_json(config_path, "HF model config", "download it again")
    config_from_hf(hf_config, dtype=dtype, param_dtype=param_dtype, max_len=max_len)  # refuse before reading weights
    tensors, source = open_safetensors(folder)
    return from_hf_state_dict(hf_config, tensors, dtype=dtype, param_dtype=param_dtype, max_len=max_len, source=source)
