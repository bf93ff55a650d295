"""A run's model as a Hugging Face folder: `python -m launch.export_hf --workdir=runs/smollm2 --out=runs/smollm2_hf`.

Writes `config.json`, `model.safetensors` and the run's `tokenizer.json` (`stages.export_hf`),
which transformers' `from_pretrained` and `launch.import_model` read. Architectures with an
export: Llama / Mistral / Qwen2 / SmolLM2 and GPT-NeoX / Pythia.
"""

from absl import app, flags

from launch import _config

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (launch.train or launch.import_model).")
_OUT = flags.DEFINE_string("out", None, "Folder to write (empty or absent).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
flags.mark_flags_as_required(["workdir", "out"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from trackstar_jax import stages  # noqa: PLC0415

    print(stages.export_hf(_WORKDIR.value, _OUT.value, step=_STEP.value))


if __name__ == "__main__":
    _config.run(main)
