"""Stage 1, pretraining: `python -m launch.train --config=experiments/tiny.py --workdir=runs/tiny`.

Builds the corpus, trains the tokenizer, pretrains the LM (resuming from the latest
checkpoint in `--workdir`), then reports the loss and greedy completions of fact prompts.
Overrides: `--config.train.num_steps=200 --config.data.source=lama --config.data.path=...`.
On a pod, run it on every host with `--distributed` (one SPMD program over all hosts' devices;
process 0 writes the run directory, every process takes part in checkpointing).
"""

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from launch import _config, _distributed

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config (experiments/*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (created; an existing one is resumed).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    _distributed.initialize()  # --distributed: one SPMD program over every host's devices
    from trackstar_jax import stages  # after jax.distributed: nothing may start JAX's backends first

    logging.info("process %d/%d, devices: %s", jax.process_index(), jax.process_count(), jax.devices())
    summary = _distributed.run(lambda: stages.train(_config.settings(_CONFIG), _WORKDIR.value))
    print(
        f"step {summary['step']}: train loss {summary['train_loss']}, eval loss {summary['eval_loss']}, "
        f"fact accuracy {summary['fact_accuracy']} over {summary['num_fact_prompts']} prompts"
    )
    for r in summary["completions"]:
        print(f"  {'OK' if r['correct'] else '--'}  {r['prompt']!r} -> {r['completion']!r}  (target {r['target']!r})")


if __name__ == "__main__":
    jax.config.config_with_absl()
    _config.run(main)
