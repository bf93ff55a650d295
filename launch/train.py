"""Stage 1, pretraining: `python -m launch.train --config=experiments/tiny.py --workdir=runs/tiny`.

Builds the corpus, trains the tokenizer, pretrains the LM (resuming from the latest
checkpoint in `--workdir`), then reports the loss and greedy completions of fact prompts.
Overrides: `--config.train.num_steps=200 --config.data.source=lama --config.data.path=...`.
"""

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from trackstar_jax import pipeline

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config (experiments/*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (created; an existing one is resumed).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if jax.process_count() > 1:
        jax.distributed.initialize()
    logging.info("process %d/%d, devices: %s", jax.process_index(), jax.process_count(), jax.devices())
    summary = pipeline.train(_CONFIG.value, _WORKDIR.value)
    print(f"step {summary['step']}: train loss {summary['train_loss']}, eval loss {summary['eval_loss']}, "
          f"fact accuracy {summary['fact_accuracy']} over {summary['num_fact_prompts']} prompts")
    for r in summary["completions"]:
        print(f"  {'OK' if r['correct'] else '--'}  {r['prompt']!r} -> {r['completion']!r}  (target {r['target']!r})")


if __name__ == "__main__":
    jax.config.config_with_absl()
    app.run(main)
