"""Read a `torch.save` file (the zip format) as numpy, without torch and without arbitrary unpickling.

A `torch.save` file (torch >= 1.6) is a zip archive: `<prefix>/data.pkl`, a pickle whose
tensors are `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)` calls on
storages named by persistent ids `("storage", torch.FloatStorage, key, location, numel)`,
and `<prefix>/data/<key>`, each storage's raw little-endian bytes. `load` unpickles
`data.pkl` with an `Unpickler` whose `find_class` allows only the tensor-rebuild functions,
the storage types and `collections.OrderedDict` (what an optimizer state dict needs); any
other global (e.g. `os.system` in a hostile file) is refused before anything runs, naming it.
Tensors come back as numpy arrays (bfloat16 through ml_dtypes) with their sizes and strides.
"""

from __future__ import annotations

import collections
import os
import pathlib
import pickle
import zipfile
from typing import Any

import ml_dtypes
import numpy as np

# torch storage type name -> numpy dtype of its elements.
STORAGE_DTYPES = {
    "DoubleStorage": np.float64,
    "FloatStorage": np.float32,
    "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


class UnsafePickleError(pickle.UnpicklingError):
    """A torch file's pickle names a global that tensor data does not need (nothing was run)."""


class _StorageType:
    """Stands in for `torch.<X>Storage` inside the pickle (only its dtype is used)."""

    def __init__(self, name: str):
        self.name, self.dtype = name, np.dtype(STORAGE_DTYPES[name])


def _rebuild_tensor(storage: np.ndarray, offset: int, size: tuple, stride: tuple, *_: Any) -> np.ndarray:
    """`torch._utils._rebuild_tensor_v2`'s view `storage[offset:]` with `size` / `stride`
    (in elements), copied so it owns its memory. Extra arguments (requires_grad, hooks,
    metadata) do not change the values."""
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    need = offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1 if all(size) else offset
    if offset < 0 or need > storage.size:
        raise pickle.UnpicklingError(
            f"a tensor of size {size}, stride {stride} at offset {offset} overruns its storage of {storage.size} elements"
        )
    item = storage.itemsize
    view = np.lib.stride_tricks.as_strided(
        storage[offset:], shape=size, strides=tuple(s * item for s in stride), writeable=False
    )
    return np.array(view)


def _rebuild_parameter(data: np.ndarray, *_: Any) -> np.ndarray:
    """`torch._utils._rebuild_parameter`: an `nn.Parameter` is its data."""
    return data


# (module, name) -> what the restricted unpickler returns for it.
_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): collections.OrderedDict,
    **{("torch", name): _StorageType(name) for name in STORAGE_DTYPES},
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: Any, archive: zipfile.ZipFile, prefix: str, where: str):
        super().__init__(file)
        self._archive, self._prefix, self._where = archive, prefix, where
        self._storages: dict[str, np.ndarray] = {}

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise UnsafePickleError(
                f"{self._where}: its pickle calls {module}.{name}, which tensor data does not need; "
                "refused without running it (only torch tensors, storages and OrderedDict are read)"
            ) from None

    def persistent_load(self, pid: Any) -> np.ndarray:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"{self._where}: unknown persistent id {pid!r:.80} (not a torch storage)")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError(f"{self._where}: storage {key!r} has type {storage_type!r:.60}")
        if key not in self._storages:
            member = f"{self._prefix}data/{key}"
            try:
                raw = self._archive.read(member)
            except KeyError:
                raise pickle.UnpicklingError(f"{self._where}: storage {member} is missing from the archive") from None
            if len(raw) != int(numel) * storage_type.dtype.itemsize:
                raise pickle.UnpicklingError(
                    f"{self._where}: storage {member} holds {len(raw)} bytes, expected {numel} x {storage_type.name}"
                )
            self._storages[key] = np.frombuffer(raw, dtype=storage_type.dtype.newbyteorder("<"))
        return self._storages[key]


def load(path: str | os.PathLike) -> Any:
    """The object a `torch.save` zip file holds, with tensors as numpy arrays.

    Raises:
      ValueError: not a zip (an old, pre-1.6 torch file, or damaged), no
        `data.pkl`, a big-endian file, a missing or short storage (each names the file).
      UnsafePickleError: the pickle names any global besides tensor rebuilding (named; nothing ran).
    """
    path = pathlib.Path(path)
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise ValueError(
            f"{path} is not a torch zip file (saved by torch < 1.6 in the legacy format, or damaged): "
            "re-save it with a current torch"
        ) from None
    with archive:
        pkls = [n for n in archive.namelist() if n.endswith("data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            raise ValueError(f"{path} holds {len(pkls)} top-level data.pkl files: not a torch.save archive")
        prefix = pkls[0][: -len("data.pkl")]
        if f"{prefix}byteorder" in archive.namelist():
            order = archive.read(f"{prefix}byteorder").decode("ascii", "replace").strip()
            if order != "little":
                raise ValueError(f"{path} was saved on a {order}-endian machine; only little-endian files are read")
        with archive.open(pkls[0]) as f:
            try:
                return _Unpickler(f, archive, prefix, str(path)).load()
            except UnsafePickleError:
                raise
            except (pickle.UnpicklingError, EOFError, TypeError, ValueError) as e:
                raise ValueError(f"{path}: its data.pkl cannot be read as torch tensor data ({e})") from None
