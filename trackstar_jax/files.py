"""How the pipeline writes files: atomically, durably, and never over a finished one.

Every file the stages write goes through here: a reader sees the old content or the new,
never half a file, and `create_once` lets several writers (processes or hosts sharing a
filesystem) race for a file that must be written exactly once. A failed write (a full disk)
removes its temporary and names the file; `workdir_lock` keeps two stages from writing one
run directory at once.

No write follows a symbolic link (`check_writable`, the one rule): below the run directory a
stage holds (`workdir_lock`), no folder on a written file's path and not the file itself may be
a symlink, so a tampered workdir (a linked lock file, a linked `retrieval/`) cannot make a stage
write, truncate or create anything outside it. Outside a held run directory only the file
itself is checked. Files are opened with O_NOFOLLOW; folders a library writes into (tensorstore's
arrays, orbax's checkpoints) are checked whole first (`check_tree`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gzip
import hashlib
import html
import io
import json
import os
import pathlib
import re
import socket
import stat
import zlib
from typing import Any, Callable, Iterator

import numpy as np

_TMP_TAG = ".tmp-"


def _tmp_path(path: pathlib.Path) -> pathlib.Path:
    # Host and pid: writers on several hosts may share the filesystem (and a pid).
    return path.with_name(f".{path.name}{_TMP_TAG}{socket.gethostname()}-{os.getpid()}")


class WriteError(OSError):
    """A file could not be written (e.g. the disk is full); the message names it. Nothing was
    replaced and the temporary is gone."""


def write_error(path: str | os.PathLike, e: OSError) -> WriteError:
    """`e` (from writing `path`) as a `WriteError` naming the file and, for a full disk, saying so."""
    if isinstance(e, WriteError):
        return e
    full = e.errno in (errno.ENOSPC, errno.EDQUOT)
    why = "the disk is full" if full else (e.strerror or str(e))
    return WriteError(e.errno, f"cannot write {path}: {why} ({e}); the previous file (if any) is unchanged")


def write_tmp(path: pathlib.Path, data: bytes) -> pathlib.Path:
    """Writes `data` durably (fsync) to a temporary sibling of `path`; returns its path.

    Raises:
      SymlinkError: `path` or a folder on it is a symlink (`check_writable`).
      WriteError: naming `path` (the temporary is removed).
    """
    path = check_writable(path)
    tmp = _tmp_path(path)
    try:
        make_dirs(path.parent)
        with os.fdopen(open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except SymlinkError:
        raise
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise write_error(path, e) from e
    return tmp


def atomic_write(path: str | os.PathLike, data: bytes | str) -> None:
    """Writes `data` to `path` via a temporary file, fsync and rename (readers see old or new).

    Raises:
      SymlinkError: `path` or a folder on it is a symlink (`check_writable`).
      WriteError: naming `path` (nothing replaced, no temporary left).
    """
    path = check_writable(path)
    tmp = write_tmp(path, data.encode() if isinstance(data, str) else data)
    try:
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise write_error(path, e) from e


def atomic_write_json(path: str | os.PathLike, obj: Any, **kwargs: Any) -> None:
    """`atomic_write` of `json.dumps(obj, indent=1, **kwargs)`."""
    atomic_write(path, json.dumps(obj, indent=1, **kwargs))


def atomic_write_with(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Runs `write(tmp_path)` (e.g. a compiler writing its output), then renames it to `path`."""
    path = check_writable(path)
    make_dirs(path.parent)
    tmp = check_writable(_tmp_path(path))
    try:
        write(str(tmp))
        os.replace(tmp, path)
    except OSError as e:
        raise write_error(path, e) from e
    finally:
        tmp.unlink(missing_ok=True)


def create_once(path: str | os.PathLike, data: bytes | str) -> bool:
    """Atomically creates `path` with `data` unless it exists; True if this call created it.

    Raises:
      SymlinkError: `path` or a folder on it is a symlink (`check_writable`): a link is not
        "the file exists", it is refused.
    """
    path = check_writable(path)
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


class ConfigError(ValueError):
    """A config value or key is wrong; the message names `config.<section>.<key>` (and the file the
    config came from). Re-exported as `config.ConfigError`; here so that every role can raise it."""


class InputError(ValueError):
    """An input or run file cannot be read as what it should be; the message names file[:line]."""


def read_lines(path: str | os.PathLike, data: bytes | None = None) -> Iterator[tuple[int, str]]:
    """Yields `(line_no, text)` (1-based, newline stripped) of a UTF-8 text file (`.gz` too).

    Every jsonl / text reader goes through here, so bad bytes are reported the same way.
    `data`: the file's bytes, already read (by a reader that bounds and checks what it opens);
    `path` then only names it.

    Raises:
      InputError: a line is not valid UTF-8 (names `file:line` and the byte offset in it).
    """
    path = pathlib.Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        fh = io.BytesIO(data) if data is not None else opener(path, "rb")
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


def read_jsonl(path: str | os.PathLike, data: bytes | None = None) -> Iterator[tuple[str, Any]]:
    """Yields `("file:line", record)` for every non-blank line of a jsonl file (`data`: its
    bytes, already read, as in `read_lines`).

    Raises:
      InputError: bad UTF-8 or a line that is not JSON (names `file:line`).
    """
    for n, line in read_lines(path, data):
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


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: str, where: str, what: str) -> str:
    """`text` (a passage, a prompt) unless it holds a NUL character, which no tokenizer input
    should (a NUL from a damaged file changes what is featurized without any other sign), or a
    lone surrogate (a JSON `\\ud800` escape of half a character pair), which is not text: no
    tokenizer can encode it.

    Raises:
      InputError: naming `where` (file:line), `what` and the character's position.
    """
    i = text.find("\x00")
    if i >= 0:
        raise InputError(f"{where}: the {what} holds a NUL character (U+0000) at position {i}; remove it")
    m = _SURROGATE.search(text)
    if m:
        raise InputError(
            f"{where}: the {what} holds a lone surrogate (U+{ord(m.group()):04X}) at position {m.start()}, "
            "half of a UTF-16 pair that is not a character; fix its \\u escape"
        )
    return text


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def html_text(value: Any) -> str:
    """`value` as text inside HTML, the one escaping rule of every HTML this project writes (the
    notebook's tables, table.md; the explorer builds its page from DOM text nodes instead): any
    value, of any type, from any file, goes through here, so `& < > " '` become entities and a
    tampered field shows as text in an element or a quoted attribute and runs nothing."""
    return html.escape(str(value), quote=True)


def markdown_text(value: Any) -> str:
    """`value` as text in a Markdown line or table cell: Markdown renders inline HTML, so the
    same rule as `html_text` but for quotes (Markdown text holds no attribute, and table.md
    stays readable as plain text); a `|` would split the cell and a newline the row."""
    return html.escape(str(value), quote=False).replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read in blocks (a checkpoint's arrays need not fit in memory)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def shorten(text: str, limit: int = 80) -> str:
    """`repr`-style short form of user text for error messages (long prompts are cut)."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


# ---------------------------------------------------------------------------------------
# No write follows a symlink
# ---------------------------------------------------------------------------------------


class SymlinkError(WriteError):
    """A write refused because the file, or a folder on its path below the run directory, is a
    symbolic link (the message names the link and where it points); nothing was written."""


_roots: list[pathlib.Path] = []  # run directories held by `workdir_lock` in this process


def symlink_below(root: str | os.PathLike, path: str | os.PathLike) -> pathlib.Path | None:
    """The first existing component of `path` below `root` (each folder, then `path` itself)
    that is a symbolic link, or None. Both are taken lexically (`os.path.abspath`: `..` folded,
    no link resolved); `root` itself may be a link (the user's choice of run directory).

    The one test behind every symlink rule of the project: writes (`check_writable`) and what
    the explorer serves (`serving.browse.servable`).

    Raises:
      ValueError: `path` does not lie under `root`.
    """
    root, path = pathlib.Path(os.path.abspath(root)), pathlib.Path(os.path.abspath(path))
    cur = root
    for part in path.relative_to(root).parts:
        cur = cur / part
        try:
            if stat.S_ISLNK(os.lstat(cur).st_mode):
                return cur
        except FileNotFoundError:
            return None
    return None


def _held_root(path: pathlib.Path) -> pathlib.Path | None:
    """The held run directory `path` lies in (the innermost; as given or resolved), or None."""
    roots = [r for root in _roots for r in (root, pathlib.Path(os.path.realpath(root))) if path.is_relative_to(r)]
    return max(roots, key=lambda r: len(r.parts)) if roots else None


def check_writable(path: str | os.PathLike) -> pathlib.Path:
    """`path`, absolute with `..` folded, after checking that writing it follows no symlink: no
    folder between the held run directory (`workdir_lock`) and `path`, nor `path` itself, is a
    symbolic link (outside a held run directory: `path` itself). Callers write the returned path
    (the folded one: `link/..` is not the folder the OS would reach).

    Raises:
      SymlinkError: names `path`, the link and its target.
    """
    path = pathlib.Path(os.path.abspath(path))
    link = symlink_below(_held_root(path) or path.parent, path)
    if link is not None:
        raise SymlinkError(
            errno.ELOOP,
            f"refusing to write {path}: {link} is a symbolic link (to {os.readlink(link)}); a run directory's "
            "files and folders must be real ones so that nothing is written outside it: replace the link by "
            "the file or folder itself",
        )
    return path


def open_nofollow(path: str | os.PathLike, flags: int, mode: int = 0o644) -> int:
    """`os.open(path, flags | O_NOFOLLOW)` after `check_writable` (a link swapped in between is
    refused by the kernel, not followed); returns the fd.

    Raises:
      SymlinkError: the file or a folder on its path is a symlink.
    """
    path = check_writable(path)
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SymlinkError(errno.ELOOP, f"refusing to write {path}: it is a symbolic link") from None
        raise


def open_append(path: str | os.PathLike) -> io.TextIOWrapper:
    """`path` opened for appending UTF-8 text (created if absent), never through a symlink
    (`open_nofollow`); its folder is made (`make_dirs`)."""
    path = check_writable(path)
    make_dirs(path.parent)
    return os.fdopen(open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a", encoding="utf-8")


def make_dirs(path: str | os.PathLike) -> pathlib.Path:
    """`mkdir -p path`, inside a held run directory after `check_writable(path)` (no folder on it
    is a symlink); outside one (a folder the user named) unchecked. Returns it, absolute."""
    path = pathlib.Path(os.path.abspath(path))
    if _held_root(path) is not None:
        check_writable(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def check_tree(folder: str | os.PathLike) -> pathlib.Path:
    """`folder` (`check_writable`) after checking that nothing below it is a symbolic link: for
    folders a library writes into by its own paths (tensorstore's index arrays, orbax's
    checkpoints), which this module cannot open for it. One `scandir` pass (no file is read).

    Raises:
      SymlinkError: names the first link found.
    """
    folder = check_writable(folder)
    stack = [folder] if folder.is_dir() else []
    while stack:
        with os.scandir(stack.pop()) as it:
            for entry in it:
                if entry.is_symlink():
                    check_writable(entry.path)  # raises, naming it
                if entry.is_dir(follow_symlinks=False):
                    stack.append(pathlib.Path(entry.path))
    return folder


# ---------------------------------------------------------------------------------------
# One writer per run directory
# ---------------------------------------------------------------------------------------


class WorkdirBusyError(RuntimeError):
    """Another process is writing the same run directory (the message names its pid and stage)."""


_held: dict[str, int] = {}  # lock file -> depth: a stage that runs another stage re-enters


def _lock_path(workdir: pathlib.Path, process_index: int) -> pathlib.Path:
    return workdir / f".writer-{process_index:04d}.lock"


@contextlib.contextmanager
def exclusive_lock(lock: pathlib.Path, holder: str, busy: Callable[[str], Exception]) -> Iterator[None]:
    """Holds `fcntl.flock(lock)` without waiting, writing `holder` into the file while held.

    The kernel drops the lock when its holder exits (a crash or `kill -9` included), so the
    next writer never waits on a dead one; the file is emptied on release.

    Raises:
      busy(what the live holder wrote): another process holds it.
      SymlinkError: the lock file (or a folder on its path) is a symlink: never followed, the
        file it points to is not touched.
    """
    fd = open_nofollow(lock, os.O_RDWR | os.O_CREAT)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy(os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a process that did not say") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{holder}, pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # an idle lock file is empty: a finished run's files stay byte-identical
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def workdir_lock(workdir: str | os.PathLike, stage: str, process_index: int = 0) -> Iterator[None]:
    """Holds the run directory's writer lock (`exclusive_lock` on `<workdir>/.writer-<i>.lock`)
    while a stage writes it; every writing stage takes it, re-entrantly within one process.

    Process `i` of a multi-process job (or of `launch.validate --process_index=i`, or of
    independent `build_index` writers) takes lock `i`, so a job's own processes do not exclude
    each other. On first taking it, temporaries left by dead writers of this host are removed.

    A stage that refuses its input (raises) in a workdir this call created, having written no
    file but the lock, leaves nothing behind: the lock and the (empty) folders are removed (a
    mistyped `--workdir`).

    Raises:
      WorkdirBusyError: another live process holds it (names its stage, pid and host).
    """
    workdir = pathlib.Path(workdir)
    created = [p for p in (workdir, *workdir.parents) if not p.exists()]  # deepest first
    workdir.mkdir(parents=True, exist_ok=True)
    with _workdir_lock(workdir, _lock_path(workdir, process_index), stage, created):
        yield


def _remove_if_only_lock(workdir: pathlib.Path, lock: pathlib.Path, created: list[pathlib.Path]) -> None:
    """Removes `lock`, the empty folders under `workdir` and the `created` folders (deepest
    first) when `workdir` holds no file but the lock (a refusal wrote nothing)."""
    try:
        tree = list(os.walk(workdir, topdown=False))
        if any(pathlib.Path(root, f) != lock for root, _, names in tree for f in names):
            return
        lock.unlink(missing_ok=True)
        for root, dirs, _ in tree:
            for d in dirs:
                pathlib.Path(root, d).rmdir()
        for d in created:
            d.rmdir()  # only empty folders: another writer's file keeps its folder
    except OSError:
        pass


@contextlib.contextmanager
def _workdir_lock(workdir: pathlib.Path, lock: pathlib.Path, stage: str, created: list[pathlib.Path]) -> Iterator[None]:
    key = str(lock.resolve())
    if key in _held:  # a stage running another stage (evaluate -> build_index, retrieve)
        _held[key] += 1
        try:
            yield
        finally:
            _held[key] -= 1
        return

    def busy(holder: str) -> Exception:
        return WorkdirBusyError(
            f"{workdir} is being written by another process ({holder}); two stages writing one run "
            f"directory at once would interleave its files: wait for it to finish or stop it, or use "
            f"another --workdir (lock {lock})"
        )

    with exclusive_lock(lock, stage, busy):
        _held[key] = 1
        _roots.append(workdir.absolute())
        try:
            remove_stale_temporaries(workdir)
            yield
        except BaseException:
            if created:  # still holding the lock: no other writer can have started in it
                _remove_if_only_lock(workdir, lock, created)
            raise
        finally:
            _roots.remove(workdir.absolute())
            del _held[key]


# Folders of bulk data that this module never writes into (tensorstore chunks, orbax checkpoints).
_NO_TEMPORARIES = frozenset({"vectors", "row_scale", "checkpoints"})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(workdir: str | os.PathLike) -> list[pathlib.Path]:
    """Removes `.<name>.tmp-<this host>-<pid>` files under `workdir` whose writer is dead (killed
    mid-write); returns them. Temporaries of live processes and of other hosts are kept."""
    prefix = f"{_TMP_TAG}{socket.gethostname()}-"
    removed = []
    for root, dirs, names in os.walk(workdir):
        dirs[:] = [d for d in dirs if d not in _NO_TEMPORARIES]
        for n in names:
            i = n.rfind(prefix)
            if not n.startswith(".") or i < 0 or not n[i + len(prefix) :].isdigit():
                continue
            if not _alive(int(n[i + len(prefix) :])):
                f = pathlib.Path(root) / n
                f.unlink(missing_ok=True)
                removed.append(f)
    return removed
