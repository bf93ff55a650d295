"""The proponent explorer, a local web app: `python -m launch.serve --config=experiments/tiny.py --workdir=runs/tiny`.

Loads the run and every gradient index in the workdir once, then serves the page and the
JSON API (`trackstar_jax.serving.app`) at http://127.0.0.1:8765 until interrupted. Needs
the `serve` extra (`pip install -e '.[serve]'`). The server has no authentication: it binds
127.0.0.1 unless told otherwise (`--host=0.0.0.0` logs a warning), and answers only requests
whose Host is loopback, the bound address or a name in `--allowed_hosts` (a web page cannot
reach it by DNS rebinding), from its own page (`trackstar_jax.serving.guard`).
"""

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from launch import _config
from trackstar_jax.distributed import multihost

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config (experiments/*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run directory (trained by launch.train, indexed by launch.build_index)."
)
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to bind (anything but loopback exposes the run).")
_PORT = flags.DEFINE_integer("port", 8765, "Port to bind.")
_ALLOWED_HOSTS = flags.DEFINE_list(
    "allowed_hosts",
    [],
    "Further host names / addresses the server answers to (Host header) besides loopback and --host: "
    "the machine's names when bound to another interface, e.g. --host=0.0.0.0 --allowed_hosts=gpu7.lan,10.0.0.7.",
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    import uvicorn  # noqa: PLC0415 -- the `serve` extra

    from trackstar_jax import stages  # noqa: PLC0415
    from trackstar_jax.serving import app as app_lib  # noqa: PLC0415
    from trackstar_jax.serving import guard  # noqa: PLC0415

    multihost.require_single_process("launch.serve")
    try:
        hosts = guard.allowed_hosts(_HOST.value, _ALLOWED_HOSTS.value)
    except ValueError as e:
        raise app.UsageError(f"--allowed_hosts: {e}") from None
    if _HOST.value not in guard.LOOPBACK_HOSTS:
        logging.warning(
            "serve: binding %s: the explorer has no authentication; anyone who can reach this "
            "address can query the model and read the workdir's retrieval files",
            _HOST.value,
        )
    engine = stages.open_engine(_config.settings(_CONFIG), _WORKDIR.value)
    logging.info("serve: methods %s (not offered: %s); answering Host %s", engine.methods, engine.skipped, hosts)
    print(f"proponent explorer: http://{_HOST.value}:{_PORT.value}/", flush=True)
    uvicorn.run(app_lib.make_app(engine, hosts=hosts), host=_HOST.value, port=_PORT.value, log_level="info")


if __name__ == "__main__":
    jax.config.config_with_absl()
    _config.run(main)
