"""A MaxText llama2-block checkpoint, attributed with the Adam V it was trained with, on the embedded corpus.

    python -m launch.import_model --config=experiments/maxtext.py --workdir=runs/maxtext \
      --config.model.source=/path/to/run/checkpoints \
      --config.maxtext.rope_max_timescale=10000 --config.maxtext.normalization_layer_epsilon=1e-5 \
      --config.maxtext.tokenizer_path=/path/to/hf_tokenizer
    python -m launch.build_index --config=experiments/maxtext.py --workdir=runs/maxtext  (same --config.* flags)

`model.source` is the MaxText run's checkpoint directory (`<dir>/<step>/items`; the latest step
unless `maxtext.step`). The checkpoint records no model config: set the `maxtext.*` keys the run
set (MaxText's own names; models/maxtext.py says which are required). The model section's shape
keys are read from the checkpoint: leave them at base.py's defaults. V is Adam's own (its `nu`,
bias-corrected at the checkpoint's count), kept per element, so Adafactor must not factor it.
"""

from experiments import base


def get_config(arg: str | None = None):
    c = base.get_config(arg)
    c.maxtext.decoder_block = "llama2"  # the one MaxText block mapped
    c.model.max_len = 64  # the embedded corpus' passages are short (at most maxtext.max_target_length)
    c.data.eval_fraction = 0.0  # nothing is trained, so nothing is held out for an eval loss
    c.vectors.num_blocks = 4
    c.vectors.proj_dim = 16
    c.vectors.batch_size = 8
    c.index.chunk_rows = 64
    c.tailpatch.learning_rate = 1e-4  # an import has no schedule to read a final learning rate from
    c.tailpatch.batch_size = 8
    return c
