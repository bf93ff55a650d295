"""Export: a run's model as a Hugging Face folder (`launch.export_hf`).

The inverse of `import_model` for the architectures that register an export (`to_hf`: Llama,
Mistral, Qwen2, SmolLM2; GPT-NeoX / Pythia): e.g. an imported model after `launch.train`
continued its pretraining. `models.hf.save_hf` writes `config.json`, `model.safetensors` and the
run's `tokenizer.json`; transformers' `from_pretrained` and `launch.import_model` read it.
"""

from __future__ import annotations

import os
import pathlib

import jax
from absl import logging

from trackstar_jax.models import hf
from trackstar_jax.stages import run as run_lib
from trackstar_jax.training import checkpoint as checkpoint_lib
from trackstar_jax.training import logs


def export_hf(workdir: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None) -> pathlib.Path:
    """Writes the model of the run in `workdir` (checkpoint `step`, default the latest) to `out`.

    A run pretrained by `launch.train` has a SentencePiece tokenizer, which an HF folder cannot
    hold as `tokenizer.json`: its weights and config are written, with a warning.

    Raises:
      ValueError: the architecture has no export, or a model an HF config.json cannot describe
        (`models.hf.to_hf_config` names the fields). FileExistsError: `out` holds a model.
    """
    logs.quiet_library_logs()
    run = run_lib.load_run(workdir, step=step)
    hf_tok = (pathlib.Path(workdir) / checkpoint_lib.HF_TOKENIZER_DIR / "tokenizer.json").is_file()
    tok = run.tokenizer if hf_tok else None  # imported runs keep the model's own; pretrained ones SentencePiece
    if tok is None:
        logging.warning("export: the run's tokenizer is SentencePiece (launch.train): %s gets no tokenizer.json", out)
    path = hf.save_hf(out, run.model_cfg, jax.device_get(run.params), tokenizer=tok)
    logging.info("export: %s at step %d -> %s", workdir, run.step, path)
    return path
