"""The launchers' one conversion: the `--config` flag's ConfigDict -> typed `Settings`."""

import sys

from absl import flags
from ml_collections import config_flags

from trackstar_jax import config as config_lib
from trackstar_jax.distributed import runtime


def settings(holder: flags.FlagHolder) -> config_lib.Settings:
    """Typed settings of `--config` (errors name the key and the config file, or the
    `--config.<key>=` flag when the value came from the command line)."""
    return config_lib.from_configdict(
        holder.value,
        source=config_flags.get_config_filename(flags.FLAGS[holder.name]),
        flags=config_lib.command_line_overrides(sys.argv),
    )


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with a config-override typo (`--config.vectors.proj_sed=5`) reported
    in one line instead of three chained tracebacks (`app.run(main, flags_parser=parse_flags)`).
    Every launcher parses with it, so it also turns on the persistent compilation cache
    (`distributed.runtime`; `TRACKSTAR_COMPILATION_CACHE=off` disables it) and filters library
    chatter out of the log (`runtime.quiet_library_logs`)."""
    runtime.enable_compilation_cache()
    runtime.quiet_library_logs()
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        sys.exit(f"FATAL Flags parsing error: {e}\nPass --helpshort or --helpfull to see help on flags.")
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        msg = str(e).strip("'\"").replace("\\'", "'").replace("\\n", " ").replace("\n", " ")
        overrides = " ".join(a for a in argv[1:] if a.startswith("--config."))
        sys.exit(
            f"FATAL config flag error: {msg} (in {overrides or 'the --config flags'}); see experiments/base.py "
            "for every key"
        )
