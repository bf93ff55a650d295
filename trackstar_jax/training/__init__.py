"""Training: the pure step, the loop with hooks (stage 1, `train`), checkpoints and the run directory.

- `step`: `OptimizerConfig` / Adafactor (§A.3), `TrainState`, `train_step`, `eval_step`, their jit.
- `loop`: the `train` stage (hooks for logging, held-out loss, checkpoints; fact completions).
- `importer`: stage 1 for a released model (`import_model`: HF folder / GGUF -> run directory).
- `second_moment`: the optimizer's V estimated for a released model (it ships no optimizer state).
- `checkpoint`: orbax checkpoints of the full state, `load_run` (what later stages read).
- `logs`: readable stage logs.
"""

from trackstar_jax.training.checkpoint import Run, load_run
from trackstar_jax.training.loop import train
