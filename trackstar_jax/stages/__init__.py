"""The pipeline's stages, in one place above the role packages.

A stage takes typed `Settings` and a workdir (what a launcher parses), opens the run once
(`open_run`: the mesh, `config.check_matches_run`, `load_run`) and hands the
`LoadedRun` to the role packages' work, which take loaded objects only; a stage that runs
another's work (evaluate -> its rows' indices and retrievals) passes the loaded run on
instead of calling that stage's front door again.

| stage | function | the work |
| --- | --- | --- |
| 1 train | `train` | `training.loop` |
| 1 import | `import_model` | `training.importer` |
| (any) | `open_run`, `load_run`, `save_run_config` | `training.checkpoint` |
| 2 index | `build_index` | `index.build_from_run` |
| 3 retrieve | `retrieve`, `retrieve_fact_queries` | `retrieval.write_retrieval` |
| 4 evaluate | `evaluate`; `reopen` (a finished evaluation, for tools that re-measure it) | `evaluation.evaluate_run` |
| validate | `validate` | `evaluation.lds` |
| serve | `open_engine` | `serving.engine.Engine` |
| export | `export_hf` | `models.hf.save_hf` |
"""

from trackstar_jax.stages.build import build_index
from trackstar_jax.stages.evaluate import Reopened, evaluate, reopen, validate
from trackstar_jax.stages.export import export_hf
from trackstar_jax.stages.import_model import import_model
from trackstar_jax.stages.retrieve import retrieve, retrieve_fact_queries
from trackstar_jax.stages.run import LoadedRun, load_run, open_run, save_run_config
from trackstar_jax.stages.serve import open_engine
from trackstar_jax.stages.train import train

__all__ = [
    "LoadedRun",
    "Reopened",
    "build_index",
    "evaluate",
    "export_hf",
    "import_model",
    "load_run",
    "open_engine",
    "open_run",
    "reopen",
    "retrieve",
    "retrieve_fact_queries",
    "save_run_config",
    "train",
    "validate",
]
