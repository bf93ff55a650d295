"""Stage 4, the fact-tracing table: `python -m launch.evaluate --config=experiments/trex_table1.py --workdir=runs/t1`.

One command from nothing to the table: pretrains the model (or resumes / reuses the
checkpoint in `--workdir`) -- or, when `config.model.source` names a released model, imports it
(a finished import is reused) --, builds (or reuses) every gradient index the chosen rows need, then
evaluates every row of `config.eval.methods` and writes `workdir/eval/table.{json,md}`.
The table and the top proponents of a few queries are printed at the end.
Overrides: `--config.eval.methods='("bm25","trackstar")' --config.eval.query_mode=prediction`.
"""

import time

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from launch import _config, _distributed
from trackstar_jax import stages
from trackstar_jax.evaluation import report

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config (experiments/*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (created; an existing run is reused).")
_TRAIN = flags.DEFINE_bool("train", True, "Pretrain / resume first (a finished run is only reloaded).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    _distributed.initialize()  # before anything starts JAX's backends
    logging.info("process %d/%d, devices: %s", jax.process_index(), jax.process_count(), jax.devices())
    settings = _config.settings(_CONFIG)

    def stage():
        if settings.model.source:  # a released model: import it (a finished import only reports)
            t0 = time.perf_counter()
            summary = stages.import_model(settings, _WORKDIR.value)
            logging.info(
                "stage import: %.1fs (%s, %d examples)",
                time.perf_counter() - t0,
                summary.get("path"),
                summary.get("num_examples", 0),
            )
        elif _TRAIN.value:
            summary = stages.train(settings, _WORKDIR.value)
            print(
                f"model at step {summary['step']}: train loss {summary['train_loss']}, eval loss {summary['eval_loss']}"
            )
        return stages.evaluate(settings, _WORKDIR.value)

    table = _distributed.run(stage)  # under --distributed: rows, index ranges and tail-patch pairs split over hosts
    out = report.eval_dir(settings, _WORKDIR.value)
    print((out / "table.md").read_text())
    print(
        f"wrote {out / 'table.json'} ({len(table['rows'])} rows, "
        f"{table['num_queries']} queries, {table['seconds']:.0f}s)"
    )


if __name__ == "__main__":
    jax.config.config_with_absl()
    _config.run(main)
