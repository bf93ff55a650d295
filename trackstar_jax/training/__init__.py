"""Training: the pure step, the loop with hooks, checkpoints, and loading a released model.

The stages that use them (`train`, `import_model`) are in `stages/`.

- `step`: `OptimizerConfig` / Adafactor (§A.3), `TrainState`, `train_step`, `eval_step`, their jit.
- `loop`: the training loop's pieces (data, compiled step, hooks for logging, held-out loss and
  checkpoints; fact completions).
- `importer`: a released model's config, parameters and tokenizer (HF folder / GGUF).
- `second_moment`: the optimizer's V estimated for a released model (it ships no optimizer state).
- `checkpoint`: orbax checkpoints of the full state; `Run` (what later stages read), `reload`.
- `logs`: readable stage logs.
"""

from trackstar_jax.training.checkpoint import Run, reload
