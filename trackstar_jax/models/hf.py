"""Hugging Face checkpoints -> (`lm.LMConfig`, parameters in our layout), and back (`save_hf`).

Supported `model_type`s are those the registered architectures name (`lm.Architecture`):
`llama` (also SmolLM2), `mistral`, `qwen2` -> `arch="llama"` (llama.py); `gpt_neox` (Pythia) ->
`arch="gpt_neox"` (gpt_neox.py). Each architecture module holds its config translation and its
tensor names (`Tensor`, `linear`, `transposed`, `same` here are their vocabulary). A folder holds `config.json` and either
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
produces HF-named tensors and an HF-style config dict). The export (`to_hf_config`,
`to_hf_state_dict`, `save_hf`) inverts the same tensor mapping and the architecture's `to_hf`.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Any, Callable, Iterator, Mapping

import jax.numpy as jnp
import numpy as np

from trackstar_jax import files as files_lib
from trackstar_jax.models import lm

DTYPES = ("float32", "bfloat16")
CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Non-parameter buffers that older checkpoints carry (causal-mask and RoPE caches, which we
# recompute): skipped, not refused.
_BUFFERS = re.compile(r"(\.rotary_emb\.inv_freq|\.attention\.bias|\.attention\.masked_bias)$")
_KNOWN_UNSUPPORTED = ("quantization_config", "attn_logit_softcapping", "final_logit_softcapping")


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One HF tensor: its name, its HF shape and how it becomes our parameter(s)."""

    name: str
    shape: tuple[int, ...]
    convert: Callable[[np.ndarray], dict[str, np.ndarray]]


def supported_model_types() -> dict[str, str]:
    """`{HF model_type: arch}` over the registered architectures."""
    return {t: a.name for a in lm.ARCHITECTURES.values() if a.from_hf for t in a.hf_model_types}


def architecture_of(hf: Mapping[str, Any]) -> lm.Architecture:
    """The registered architecture that imports a config.json's `model_type`.

    Raises:
      ValueError: no architecture registers it (names the supported ones).
    """
    model_type = hf.get("model_type")
    types = supported_model_types()
    if model_type not in types:
        raise ValueError(f"config.json model_type {model_type!r} is not supported (supported: {', '.join(types)})")
    return lm.architecture(types[model_type])


def rope(hf: Mapping[str, Any], default_pct: float = 1.0) -> tuple[float, float]:
    """`(theta, partial_rotary_factor)` from either config style; refuses rope scaling.

    `default_pct` is the architecture's rotary fraction when the file names none."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    for what, d in (("rope_parameters", params), ("rope_scaling", scaling or {})):
        kind = d.get("rope_type", d.get("type", "default"))
        if kind != "default":
            raise ValueError(
                f"config.json {what} has rope_type {kind!r}: only the default (unscaled) RoPE is implemented"
            )
    theta = params.get("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10_000.0)))
    pct = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", hf.get("rotary_pct", default_pct)))
    return float(theta), float(pct)


def config_from_hf(
    hf: Mapping[str, Any], *, dtype: str = "float32", param_dtype: str = "float32", max_len: int | None = None
) -> lm.LMConfig:
    """Translates an HF `config.json` dict into an `LMConfig` (the registered architecture's `from_hf`).

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
    arch = architecture_of(hf)
    for key in _KNOWN_UNSUPPORTED:
        if hf.get(key) is not None:
            raise ValueError(f"config.json sets {key!r}, which the {hf['model_type']} import does not implement")
    if hf.get("rope_interleaved"):  # SmolLM2's configs say false; true would pair features (2i, 2i+1)
        raise ValueError("config.json sets rope_interleaved=true: only the rotate-half RoPE layout is implemented")
    return arch.from_hf(hf, dtype=dtype, param_dtype=param_dtype, max_len=max_len)


def common_fields(
    hf: Mapping[str, Any],
    *,
    theta: float,
    dtype: str,
    param_dtype: str,
    max_len: int | None,
    window: int | None = None,
) -> dict[str, Any]:
    """The `LMConfig` fields every architecture reads the same way from a config.json.

    `max_len` (if given) wins; else `max_position_embeddings`, capped at a sliding `window`
    (full attention equals sliding attention up to the window)."""
    d, h = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    length = int(hf.get("max_position_embeddings", 2048))
    if window is not None:
        length = min(length, int(window))
    return dict(
        vocab_size=int(hf["vocab_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        embed_dim=d,
        num_heads=h,
        head_dim=int(hf.get("head_dim") or d // h),
        mlp_dim=int(hf["intermediate_size"]),
        max_len=int(max_len or length),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_base=theta,
        dtype=dtype,
        param_dtype=param_dtype,
    )


def transposed(path: str) -> Callable[[np.ndarray], dict[str, np.ndarray]]:
    """HF `nn.Linear.weight [out, in]` -> our `kernel [in, out]`."""
    return lambda w: {path: w.T}


def same(path: str) -> Callable[[np.ndarray], dict[str, np.ndarray]]:
    """An HF tensor stored as is at our `path` (embeddings, norms, biases)."""
    return lambda w: {path: w}


def linear(hf_name: str, path: str, n_in: int, n_out: int, bias: bool) -> list[Tensor]:
    """An HF `nn.Linear` (`weight [out, in]`, optional `bias`) as our `path/kernel` (and `path/bias`)."""
    out = [Tensor(f"{hf_name}.weight", (n_out, n_in), transposed(f"{path}/kernel"))]
    if bias:
        out.append(Tensor(f"{hf_name}.bias", (n_out,), same(f"{path}/bias")))
    return out


def _output_names(cfg: lm.LMConfig) -> tuple[str, ...]:
    """Accepted names of the untied output embedding (e.g. GPT-NeoX: `embed_out` before transformers 5)."""
    return lm.architecture(cfg.arch).hf_output_names


def _hf_tensors(cfg: lm.LMConfig) -> list[Tensor]:
    """The HF tensors of `cfg`'s architecture (untied output embedding aside)."""
    arch = lm.architecture(cfg.arch)
    if arch.hf_tensors is None:
        raise ValueError(f"model.arch={cfg.arch!r} has no Hugging Face tensor names registered")
    return arch.hf_tensors(cfg)


def expected_tensor_shapes(cfg: lm.LMConfig) -> dict[str, tuple[int, ...]]:
    """`{HF tensor name: HF shape}` of a checkpoint of `cfg` (untied output embedding as `lm_head.weight`)."""
    spec = _hf_tensors(cfg)
    if not cfg.tie_embeddings:
        spec.append(Tensor("lm_head.weight", (cfg.vocab_size, cfg.embed_dim), transposed("unembed/kernel")))
    return {t.name: t.shape for t in spec}


def _float_array(x: Any, name: str, source: str) -> np.ndarray:
    """`x` as a numpy array, refused (naming tensor and file) unless it is floating point and finite."""
    x = np.asarray(x)
    if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
        raise ValueError(f"tensor {name!r} in {source} has dtype {x.dtype}: expected a floating-point tensor")
    bad = ~np.isfinite(x)
    if bad.any():  # a damaged file or a diverged model: refused here, not as a training divergence later
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise files_lib.InputError(
            f"tensor {name!r} in {source} holds {int(bad.sum())} non-finite value(s) (NaN or inf; the first at "
            f"index {at}): the file is damaged or the model diverged; download it again"
        )
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
    return cfg, params_from_state_dict(cfg, tensors, source=source, model_type=hf_config["model_type"])


def params_from_state_dict(
    cfg: lm.LMConfig, tensors: Mapping[str, np.ndarray], *, source: str = "the state dict", model_type: str = ""
) -> dict:
    """HF-named tensors of a `cfg` model -> params in our layout (`from_hf_state_dict` after the config).

    Raises:
      ValueError: a missing, unknown or misshapen tensor (named, with `source`), or a non-float tensor.
    """
    param_dtype = cfg.param_dtype
    spec = _hf_tensors(cfg)
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
        spec.append(Tensor(name, (cfg.vocab_size, cfg.embed_dim), transposed("unembed/kernel")))
    used = {t.name for t in spec} | set(out_names)
    missing = [t.name for t in spec if t.name not in names]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"missing tensor(s) {', '.join(missing[:5])}{more}: expected in {source}")
    unknown = sorted(n for n in names - used if not _BUFFERS.search(n))
    if unknown:
        more = f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else ""
        raise ValueError(
            f"unknown tensor(s) in {source} for {model_type or cfg.arch} with this config.json: "
            f"{', '.join(unknown[:5])}{more}"
        )
    pdt = np.dtype(jnp.dtype(param_dtype))
    flat: dict[str, np.ndarray] = {}
    for t in spec:
        where = tensors.file_of(t.name) if isinstance(tensors, _SafetensorsFolder) else source
        x = _float_array(tensors[t.name], t.name, str(where))
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
    return _unflatten(flat)


def _unflatten(flat: Mapping[str, Any]) -> dict:
    out: dict = {}
    for path, x in flat.items():
        node = out
        *head, last = path.split("/")
        for part in head:
            node = node.setdefault(part, {})
        node[last] = x
    return out


def _safetensors() -> Any:
    """The optional `safetensors` package, imported only when an HF folder is read: the package
    (every architecture module registers its HF mapping from here) must import without it."""
    try:
        import safetensors  # noqa: PLC0415  (optional dependency: the `hf` extra)
    except ImportError as e:
        raise ImportError(
            f"reading a Hugging Face model folder needs the optional `safetensors` package ({e}): "
            "pip install 'trackstar_jax[hf]'"
        ) from None
    return safetensors


def _safe_open(path: pathlib.Path) -> Any:
    """`safetensors.safe_open`, with a damaged file named (not a bare `SafetensorError`)."""
    safetensors = _safetensors()
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
        except (_safetensors().SafetensorError, OSError) as e:
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


# ---------------------------------------------------------------------------------------
# Export: our (cfg, params) -> a Hugging Face folder (the import's inverse)
# ---------------------------------------------------------------------------------------

# `LMConfig` fields an HF config.json does not carry: the run's choices, not the model's.
_NOT_IN_HF_CONFIG = ("source", "remat", "matmul_dtype", "dtype")


def common_to_hf(cfg: lm.LMConfig) -> dict[str, Any]:
    """The config.json keys every architecture writes the same way (`common_fields`' inverse)."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.embed_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.mlp_dim,
        "max_position_embeddings": cfg.max_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": cfg.rope_base,
        "torch_dtype": cfg.param_dtype,
    }


def to_hf_config(cfg: lm.LMConfig) -> dict[str, Any]:
    """The HF `config.json` dict of a `cfg` model (the registered architecture's `to_hf`).

    The dict is read back with `config_from_hf`, and every model field must come back equal, so
    a model that an HF config cannot describe (e.g. a Llama with attention biases on q/k/v but
    not on the output) is refused here, not exported wrong.

    Raises:
      ValueError: the architecture registers no export, or fields the config.json cannot
        carry (each named with both values).
    """
    arch = lm.architecture(cfg.arch)
    if arch.to_hf is None:
        raise ValueError(f"model.arch={cfg.arch!r} has no Hugging Face export registered")
    out = arch.to_hf(cfg)
    back = config_from_hf(out, dtype=cfg.dtype, param_dtype=cfg.param_dtype, max_len=cfg.max_len)
    # num_kv_heads None means num_heads: compare the heads each config actually has
    want, got = (dataclasses.replace(c, num_kv_heads=c.kv_heads) for c in (cfg, back))
    bad = [
        f"model.{f.name}={getattr(want, f.name)!r} (the config.json says {getattr(got, f.name)!r})"
        for f in dataclasses.fields(lm.LMConfig)
        if f.name not in _NOT_IN_HF_CONFIG and getattr(want, f.name) != getattr(got, f.name)
    ]
    if bad:
        raise ValueError(f"a {out['model_type']} config.json cannot describe this model: " + "; ".join(bad))
    return out


def to_hf_state_dict(cfg: lm.LMConfig, params: Any) -> dict[str, np.ndarray]:
    """Our params -> `{HF tensor name: array [HF shape]}`, the exact inverse of the import.

    Each HF tensor's import conversion (`Tensor.convert`: a transpose, a split, a reshape) only
    moves entries, so it is inverted by running it on the tensor's entry indices: every entry of
    our parameters goes back to the HF position it came from (bit-exact; dtypes kept).

    Raises:
      ValueError: a conversion that is not a rearrangement, or a parameter no HF tensor holds.
    """
    flat = {p: np.asarray(x) for p, x in lm.flat_params(params).items()}
    spec = _hf_tensors(cfg)
    if not cfg.tie_embeddings:
        spec.append(Tensor(_output_names(cfg)[-1], (cfg.vocab_size, cfg.embed_dim), transposed("unembed/kernel")))
    out, used = {}, set()
    for t in spec:
        size = int(np.prod(t.shape))
        where = t.convert(np.arange(size, dtype=np.int64).reshape(t.shape))
        dtypes = {flat[p].dtype for p in where}
        x, filled = np.empty(size, next(iter(dtypes))), np.zeros(size, bool)
        for path, idx in where.items():
            idx = np.asarray(idx)
            if idx.dtype != np.int64 or idx.shape != flat[path].shape or len(dtypes) != 1:
                raise ValueError(f"tensor {t.name!r}: its conversion to {path} is not a rearrangement of entries")
            x[idx.ravel()], filled[idx.ravel()] = flat[path].ravel(), True
            used.add(path)
        if not filled.all():
            raise ValueError(f"tensor {t.name!r}: {int((~filled).sum())} entries come from no parameter")
        out[t.name] = x.reshape(t.shape)
    left = sorted(set(flat) - used)
    if left:
        raise ValueError(f"parameters no {cfg.arch} HF tensor holds: {', '.join(left[:5])}")
    return out


def save_hf(folder: str | pathlib.Path, cfg: lm.LMConfig, params: Any, *, tokenizer: Any = None) -> pathlib.Path:
    """Writes `cfg` / `params` as a Hugging Face folder: `config.json` and `model.safetensors`
    (and `tokenizer.json` when `tokenizer` is a `data.hf_tokenizer.HFTokenizer`), which
    `load_hf` and transformers' `from_pretrained` read. Nothing in `folder` is overwritten.

    Raises:
      ValueError: see `to_hf_config` / `to_hf_state_dict`. FileExistsError: the folder holds a model.
    """
    folder = pathlib.Path(folder)
    hf_config = to_hf_config(cfg)
    tensors = to_hf_state_dict(cfg, params)
    for name in (CONFIG_FILE, SINGLE_FILE, INDEX_FILE):
        if (folder / name).exists():
            raise FileExistsError(f"{folder / name} exists: export into an empty folder")
    files_lib.make_dirs(folder)
    _safetensors()  # the optional package, with the install hint
    from safetensors import numpy as st_numpy  # noqa: PLC0415

    files_lib.atomic_write_with(
        folder / SINGLE_FILE, lambda tmp: st_numpy.save_file(tensors, tmp, metadata={"format": "pt"})
    )
    if tokenizer is not None:
        tokenizer.save(folder)
    files_lib.atomic_write_json(folder / CONFIG_FILE, hf_config, sort_keys=True)
    return folder
