"""How the pipeline writes files: atomically, durably, and never over a finished one.

Every file the stages write goes through here: a reader sees the old content or the new,
never half a file, and `create_once` lets several writers (processes or hosts sharing a
filesystem) race for a file that must be written exactly once.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import socket
from typing import Any, Callable

import numpy as np


def _tmp_path(path: pathlib.Path) -> pathlib.Path:
    # Host and pid: writers on several hosts may share the filesystem (and a pid).
    return path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")


def write_tmp(path: pathlib.Path, data: bytes) -> pathlib.Path:
    """Writes `data` durably (fsync) to a temporary sibling of `path`; returns its path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_path(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def atomic_write(path: str | os.PathLike, data: bytes | str) -> None:
    """Writes `data` to `path` via a temporary file, fsync and rename (readers see old or new)."""
    path = pathlib.Path(path)
    os.replace(write_tmp(path, data.encode() if isinstance(data, str) else data), path)


def atomic_write_json(path: str | os.PathLike, obj: Any, **kwargs: Any) -> None:
    """`atomic_write` of `json.dumps(obj, indent=1, **kwargs)`."""
    atomic_write(path, json.dumps(obj, indent=1, **kwargs))


def atomic_write_with(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Runs `write(tmp_path)` (e.g. a compiler writing its output), then renames it to `path`."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_path(path)
    try:
        write(str(tmp))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def create_once(path: str | os.PathLike, data: bytes | str) -> bool:
    """Atomically creates `path` with `data` unless it exists; True if this call created it."""
    path = pathlib.Path(path)
    tmp = write_tmp(path, data.encode() if isinstance(data, str) else data)
    try:
        os.link(tmp, path)  # fails if another writer got there first
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink()


def npy_bytes(a: np.ndarray) -> bytes:
    """`a` as .npy file bytes (no pickle)."""
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()
