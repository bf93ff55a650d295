"""Readable absl logs for the stages: orbax's per-save INFO chatter is dropped."""

from __future__ import annotations

import logging as std_logging

from absl import logging


class _DropLibraryInfo(std_logging.Filter):
    """Drops INFO/DEBUG records of orbax (dozens of lines per checkpoint); warnings pass."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        return record.levelno >= std_logging.WARNING or "/orbax/" not in record.pathname


def quiet_library_logs() -> None:
    """Installs the orbax filter on absl's handler and logger, once per process.

    Called at the start of every stage (a library user may call a stage without a launcher);
    it changes process-global logging state, so it is idempotent: a filter already present
    is not added again.
    """
    for target in (logging.get_absl_handler(), logging.get_absl_logger()):
        if not any(isinstance(f, _DropLibraryInfo) for f in target.filters):
            target.addFilter(_DropLibraryInfo())
