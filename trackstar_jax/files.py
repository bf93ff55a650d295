"""How the pipeline writes files: atomically, durably, and never over a finished one.

Every file the stages write goes through here: a reader sees the old content or the new,
never half a file, and `create_once` lets several writers (processes or hosts sharing a
filesystem) race for a file that must be written exactly once.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import pathlib
import socket
import zlib
from typing import Any, Callable, Iterator

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


# ---------------------------------------------------------------------------------------
# Reading: one decoding path, every error names the file (and line)
# ---------------------------------------------------------------------------------------


class InputError(ValueError):
    """An input or run file cannot be read as what it should be; the message names file[:line]."""


def read_lines(path: str | os.PathLike) -> Iterator[tuple[int, str]]:
    """Yields `(line_no, text)` (1-based, newline stripped) of a UTF-8 text file (`.gz` too).

    Every jsonl / text reader goes through here, so bad bytes are reported the same way.

    Raises:
      InputError: a line is not valid UTF-8 (names `file:line` and the byte offset in it).
    """
    path = pathlib.Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        fh = opener(path, "rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"no such file: {path}") from None
    with fh:
        try:
            for n, raw in enumerate(fh, 1):
                try:
                    yield n, raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError as e:
                    raise InputError(
                        f"{path}:{n}: not valid UTF-8 (byte {e.start} of the line: "
                        f"{raw[e.start : e.start + 1]!r}); fix or re-encode the file"
                    ) from None
        except (OSError, EOFError, zlib.error) as e:  # a damaged .gz
            raise InputError(f"{path}: cannot be read ({e})") from None


def read_jsonl(path: str | os.PathLike) -> Iterator[tuple[str, Any]]:
    """Yields `("file:line", record)` for every non-blank line of a jsonl file.

    Raises:
      InputError: bad UTF-8 or a line that is not JSON (names `file:line`).
    """
    for n, line in read_lines(path):
        if not line.strip():
            continue
        try:
            yield f"{path}:{n}", json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{n}: not valid JSON ({e})") from None


def read_json(path: str | os.PathLike, what: str = "file", fix: str = "restore it or re-create it") -> Any:
    """A whole JSON file, with an error naming the file for a truncated or damaged one.

    Raises:
      FileNotFoundError: no file. InputError: not UTF-8 JSON (names the file and `fix`).
    """
    path = pathlib.Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"no {what} at {path}") from None
    try:
        return json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{what} {path} is damaged (not valid JSON: {e}); {fix}") from None


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def shorten(text: str, limit: int = 80) -> str:
    """`repr`-style short form of user text for error messages (long prompts are cut)."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"
