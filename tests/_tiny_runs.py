"""What a test's tiny run is made of (`conftest.tiny_run` keeps what `make` writes, across
sessions). The run cache's fingerprint hashes this file, not conftest: editing conftest keeps
the made runs, editing this file makes them again."""

import pathlib

from trackstar_jax import config as config_lib
from trackstar_jax import stages


def make(settings: config_lib.Settings, folder: pathlib.Path, *, evaluate: bool, index: bool) -> None:
    """Trains the run into `folder`; then builds its default index (`index`) and evaluates it
    (`evaluate`)."""
    stages.train(settings, folder)
    if index:
        stages.build_index(settings, folder)
    if evaluate:
        stages.evaluate(settings, folder)
