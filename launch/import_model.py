"""Stage 1 for a released model: `python -m launch.import_model --config=experiments/smollm2.py --workdir=runs/smollm2`.

Reads `config.model.source` (a Hugging Face folder, a .gguf file, a MaxText checkpoint directory
with `config.maxtext`, or "smollm2"), builds the corpus, saves the model's own tokenizer, takes
the optimizer second moments V from the source where it keeps them (MaxText's Adam `nu`, a Hugging
Face Trainer `checkpoint-N/` folder's `optimizer.pt`) or else estimates them
(`config.vectors.estimate_v_*`), and writes a run directory that
`launch.build_index`, `launch.retrieve` and `launch.evaluate` use as they use a trained one.
A finished import only reports. Single process (an import is read on one host).
"""

import json

import jax
from absl import app, flags
from ml_collections import config_flags

from launch import _config

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config (experiments/*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (created; a finished import only reports).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from trackstar_jax import stages  # noqa: PLC0415  (JAX starts after flag parsing)

    summary = stages.import_model(_config.settings(_CONFIG), _WORKDIR.value)
    m, v = summary["model"], summary["second_moment"]
    print(
        f"imported {summary['path']}: {m['arch']}, {summary['num_params']} parameters, "
        f"{m['num_layers']} layers x {m['embed_dim']}, vocab {m['vocab_size']} (tokenizer {summary['tokenizer_vocab_size']})"
    )
    print(f"corpus: {summary['num_examples']} examples; V: {json.dumps(v)}")
    print(f"wall time {summary['wall_seconds']:.1f} s")


if __name__ == "__main__":
    jax.config.config_with_absl()
    _config.run(main)
