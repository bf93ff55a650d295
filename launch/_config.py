"""What every launcher shares: the `--config` flag's ConfigDict -> typed `Settings`, the flag
parser, and `run` (a refusal as one line on stderr, its traceback under `--verbose_errors`)."""

import sys
from typing import Any, Callable

from absl import app, flags
from ml_collections import config_flags

from trackstar_jax import config as config_lib
from trackstar_jax import files
from trackstar_jax.distributed import memory, runtime
from trackstar_jax.index import manifest

_VERBOSE_ERRORS = flags.DEFINE_bool(
    "verbose_errors",
    False,
    "On a refusal (bad input, a damaged, busy or mismatched run, a step that does not fit), print "
    "the full traceback as well as the one-line message.",
)

# The errors a stage refuses with, each naming what is wrong (file, line, key, step) in its
# message: the one line is the report, the traceback only says where in the code it was raised.
# ValueError covers files.InputError / ConfigError (and UnicodeError); OSError covers
# files.WriteError, FileNotFoundError and FileExistsError.
KNOWN_ERRORS = (
    ValueError,
    OSError,
    FloatingPointError,
    ImportError,
    files.WorkdirBusyError,
    memory.DoesNotFitError,
    manifest.IndexStoreError,
)


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
    in one line instead of three chained tracebacks (`run(main)` parses with it).
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


def is_known(e: BaseException) -> bool:
    """Whether `e` is a refusal reported as one line (`KNOWN_ERRORS`), not a bug to trace."""
    return isinstance(e, KNOWN_ERRORS)


def error_line(e: BaseException) -> str:
    """`e` as the one line a launcher prints for it."""
    msg = " ".join(str(e).split("\n")).strip() or repr(e)
    return f"FATAL {type(e).__name__}: {msg}"


def verbose_errors() -> bool:
    """Whether `--verbose_errors` was given (False before the flags are parsed)."""
    return flags.FLAGS.is_parsed() and _VERBOSE_ERRORS.value


def guarded(main: Callable[[list[str]], Any]) -> Callable[[list[str]], Any]:
    """`main` with a known error (`KNOWN_ERRORS`) ended as one line on stderr and exit status 1;
    with `--verbose_errors`, or for any other error, it propagates with its traceback."""

    def wrapped(argv: list[str]) -> Any:
        try:
            return main(argv)
        except KNOWN_ERRORS as e:
            if verbose_errors():
                raise
            sys.exit(error_line(e) + " (--verbose_errors shows the traceback)")

    return wrapped


def run(main: Callable[[list[str]], Any], flags_parser: Callable[[list[str]], Any] | None = None) -> None:
    """Every launcher's `app.run`: `guarded(main)`, with `parse_flags` unless told otherwise."""
    app.run(guarded(main), flags_parser=flags_parser or parse_flags)
