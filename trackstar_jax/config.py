"""The one typed config: every section of an experiment's ConfigDict as a frozen dataclass.

`experiments/*.py` files (ml_collections, absl `--config.x.y=` overrides) stay the user
interface. This module is the only place that reads a ConfigDict (or a run's saved
`config.json`): `from_configdict` turns it into `Settings`, checking every key once, and the
stages take `Settings` (or one of its sections). Errors name the dotted key and the file the
config came from:

    settings = config.from_configdict(get_config(), source="experiments/tiny.py")
    settings.model          # models.lm.LMConfig (hashable: a jit static argument)
    settings.train.optimizer  # training.step.OptimizerConfig

The roles below config own the type of their section and validate it: `LMConfig` (models),
`DataConfig` and `CandidateConfig` (data), `VectorConfig` (features), `OptimizerConfig` and
`TrainSettings` (training), `HessianConfig`, `StorageConfig` and `IndexSettings` (index),
`RetrievalSettings` (retrieval), `EvalSettings`, `TailpatchSettings` and `ValidateSettings`
(evaluation), `MeshSettings` (distributed); they are re-exported here under the same names (one
type each). Config is the composition root: it imports the roles' section types, no role imports
it. The roles that read several sections of one object type it by a `Protocol` of what they
read (`retrieval.stage.RowSettings`, `evaluation.settings.TableSettings`), which `Settings`
satisfies. A section that extends a role's type (`TrainSettings` the optimizer's,
`IndexSettings` the storage's) inherits its fields: one list of keys. `to_dict(settings)` gives
back the nested dict a ConfigDict would, so run directories written before the typed config
still load.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import re
import sys
import types
import typing
from typing import Any, Mapping, Sequence

from trackstar_jax import files
from trackstar_jax import methods as methods_lib
from trackstar_jax.data import candidates as candidates_lib
from trackstar_jax.data import corpus as data_lib
from trackstar_jax.distributed import sharding as sharding_lib
from trackstar_jax.evaluation import settings as eval_lib
from trackstar_jax.features import vectors as vectors_lib
from trackstar_jax.index import hessian as hessian_lib
from trackstar_jax.index import manifest as manifest_lib
from trackstar_jax.models import lm as model_lib
from trackstar_jax.models import maxtext as maxtext_lib
from trackstar_jax.retrieval import stage as retrieval_lib
from trackstar_jax.training import step as step_lib

CONFIG_FILE = "config.json"  # the run directory's resolved config

# Sections a run is defined by: a checkpoint (or an existing workdir) is refused when any of
# these differ. Other sections (vectors, index, retrieval, eval, ...) belong to later stages.
RUN_SECTIONS = ("seed", "model", "data")
RESUMABLE_TRAIN_KEYS = step_lib.RESUMABLE_TRAIN_KEYS  # train keys that may change on resume (training/step.py)
# Keys of the run sections that change how a step is computed, not what it computes: never
# compared with a run's config.json (e.g. rematerialise to fit a larger batch when featurizing).
RUNTIME_KEYS = ("model.remat", "model.matmul_dtype")


# Sections whose keys never enter an index's manifest, and why (the `model` / `vectors` keys are
# classified by `index.build.INDEX_KEYS`; tests/test_index_identity.py checks every key is).
INDEX_SECTIONS = {
    "seed": "the run's: reaches an index through the checkpoint's fingerprint",
    "data": "the corpus's fingerprint is recorded instead",
    "candidates": "the candidate set's fingerprint is recorded instead (an index over other passages is refused)",
    "train": "the run's: reaches an index through the checkpoint's fingerprint",
    "mesh": "how the work is split, not what it computes",
    "hessian": "applied at scoring time (one index serves every R and unit-norm setting)",
    "index": "storage: checked against the stored dtype, not part of the identity",
    "retrieval": "after the index",
    "eval": "after the index",
    "tailpatch": "after the index",
    "validate": "after the index",
    "maxtext": "the import's: reaches an index through the checkpoint's fingerprint",
}


ConfigError = files.ConfigError  # raised by the roles too (files.py, the bottom layer)


# ---------------------------------------------------------------------------------------
# Section types the role packages own (re-exported: one type each)
# ---------------------------------------------------------------------------------------

OptimizerConfig, TrainSettings = step_lib.OptimizerConfig, step_lib.TrainSettings  # `config.train` (training/)
HessianConfig, HESSIAN_MODES, R_EVAL_SOURCES = (
    hessian_lib.HessianConfig,
    hessian_lib.HESSIAN_MODES,
    hessian_lib.R_EVAL_SOURCES,
)
StorageConfig, STORAGE_DTYPES, IndexSettings = (
    manifest_lib.StorageConfig,
    manifest_lib.STORAGE_DTYPES,
    manifest_lib.IndexSettings,
)
flatten = manifest_lib.flatten
MeshSettings, RetrievalSettings = sharding_lib.MeshSettings, retrieval_lib.RetrievalSettings
EvalSettings, TailpatchSettings, ValidateSettings = (
    eval_lib.EvalSettings,
    eval_lib.TailpatchSettings,
    eval_lib.ValidateSettings,
)
QUERY_MODES, PAPER_INCORRECT_PER_BUCKET = eval_lib.QUERY_MODES, eval_lib.PAPER_INCORRECT_PER_BUCKET
MaxTextSettings = maxtext_lib.MaxTextSettings  # `config.maxtext` (models/maxtext.py)


# ---------------------------------------------------------------------------------------
# Sections read only by the stages
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Settings:
    """A whole experiment config, typed. Built by `from_configdict` / `load_run_settings`."""

    seed: int = 0
    model: model_lib.LMConfig = model_lib.LMConfig()
    data: data_lib.DataConfig = data_lib.DataConfig()
    candidates: candidates_lib.CandidateConfig = candidates_lib.CandidateConfig()  # what is indexed / retrieved
    mesh: MeshSettings = MeshSettings()
    train: TrainSettings = TrainSettings()
    vectors: vectors_lib.VectorConfig = vectors_lib.VectorConfig()
    hessian: HessianConfig = HessianConfig()
    index: IndexSettings = IndexSettings()
    retrieval: RetrievalSettings = RetrievalSettings()
    eval: EvalSettings = EvalSettings()
    tailpatch: TailpatchSettings = TailpatchSettings()
    validate: ValidateSettings = ValidateSettings()
    maxtext: MaxTextSettings = MaxTextSettings()  # read only when model.source is a MaxText checkpoint
    source: str = dataclasses.field(default="", compare=False)  # where it came from (for messages)

    def __post_init__(self):
        if self.eval.num_proponents < max(self.tailpatch.top_ks):
            raise ValueError(
                f"eval.num_proponents={self.eval.num_proponents} must be >= "
                f"max(tailpatch.top_ks)={max(self.tailpatch.top_ks)}"
            )

    def replace(self, overrides: Mapping[str, Any]) -> Settings:
        """A copy with dotted-key overrides, e.g. `{"vectors.correction": False, "index.dir": "x"}`."""
        d = to_dict(self)
        for key, value in overrides.items():
            node = d
            *parents, leaf = key.split(".")
            for p in parents:
                node = node[p]
            if leaf not in node:
                raise ConfigError(f"unknown config key config.{key}")
            node[leaf] = value
        return from_dict(d, source=self.source)

    def to_dict(self) -> dict:
        """`to_dict(self)`: the nested dict a ConfigDict would give (what a run records)."""
        return to_dict(self)

    def differences(self, saved: Mapping[str, Any], sections: Sequence[str], ignore: Sequence[str] = ()) -> list[str]:
        """`mismatches(saved, self, sections, ignore)`: the keys of `sections` where a recorded
        config differs from these settings."""
        return mismatches(saved, self, sections=sections, ignore=ignore)


# ---------------------------------------------------------------------------------------
# Building and comparing
# ---------------------------------------------------------------------------------------


def _where(source: str, flags: Mapping[str, str], key: str) -> str:
    """Where the value of `key` ("index.chunk_rows") came from, for an error message: its
    command-line flag when one set it, else the config file."""
    if key in flags:
        return f" (from {flags[key]} on the command line)"
    return f" (in {source})" if source else ""


def _build(cls: type, values: Mapping[str, Any], name: str, source: str, flags: Mapping[str, str] = {}) -> Any:  # noqa: B006
    """Dataclass `cls` from `values`: unknown keys and bad values raise, naming the key and
    where it was set (`flags`: `{"index.chunk_rows": "--config.index.chunk_rows=0"}`, else the file)."""
    where = f" (in {source})" if source else ""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and not (cls is Settings and f.name == "source")}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown config key(s) in config{'.' + name if name else ''}: {', '.join(unknown)}{where} "
            f"(known: {', '.join(sorted(fields))})"
        )
    hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
    kwargs = {}
    for key, value in values.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            if isinstance(value, hint):
                kwargs[key] = value
                continue
            if not isinstance(value, Mapping):
                raise ConfigError(f"config.{name}.{key} must be a section, got {value!r}{where}")
            kwargs[key] = _build(hint, value, f"{name}.{key}" if name else key, source, flags)
        else:
            full = f"{name}.{key}" if name else key
            kwargs[key] = _coerce(value, hint, f"config.{full}", _where(source, flags, full))
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        msg = str(e)  # role types name their key as "<section>.<key> ..." (or "config.<section>...")
        if not msg.startswith("config."):
            msg = (
                f"config.{msg}"
                if name and msg.startswith(name.split(".")[0] + ".")
                else f"config.{name or 'root'}: {msg}"
            )
        key = re.match(r"config\.([\w.]+)", msg)
        key = key.group(1).rstrip(".") if key else ""
        raise ConfigError(f"{msg}{_where(source, flags, key) if key in flags else where}") from e


def _coerce(value: Any, hint: Any, key: str, where: str) -> Any:
    """JSON / ConfigDict value -> the field's type (lists -> tuples, ints -> floats)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a sequence, got {value!r}{where}")
        elem = args[0] if args else Any
        return tuple(_coerce(v, elem, key, where) for v in value)
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if hint in (int, float, str, bool) and not isinstance(value, hint):
        raise ConfigError(f"{key} must be a {hint.__name__}, got {value!r}{where}")
    if hint is int and isinstance(value, bool):
        raise ConfigError(f"{key} must be an int, got {value!r}{where}")
    return value


def from_dict(values: Mapping[str, Any], source: str = "", flags: Mapping[str, str] | None = None) -> Settings:
    """`Settings` from a nested dict (a ConfigDict's `to_dict()` or a run's config.json).

    Raises:
      ConfigError: an unknown key or a bad value, naming `config.<section>.<key>` and `source`
        (or the command-line flag in `flags` that set it).
    """
    return dataclasses.replace(_build(Settings, dict(values), "", source, flags or {}), source=source)


def command_line_overrides(argv: Sequence[str]) -> dict[str, str]:
    """`{"index.chunk_rows": "--config.index.chunk_rows=0"}` for the `--config.<key>=<value>` flags of `argv`."""
    out = {}
    for a in argv:
        if a.startswith("--config.") and "=" in a:
            out[a[len("--config.") :].split("=", 1)[0]] = a
    return out


def from_configdict(config: Any, source: str = "", flags: Mapping[str, str] | None = None) -> Settings:
    """`Settings` from an experiment's ConfigDict (`experiments/*.py:get_config()`).

    `eval.row` (one table row) is resolved here into explicit settings: `eval.methods =
    (row,)` plus the row's vectors / hessian settings and index folder, so every stage runs
    exactly that row; the resolved settings are what a run directory records.
    """
    if isinstance(config, Settings):
        return config
    s = from_dict(config.to_dict() if hasattr(config, "to_dict") else dict(config), source=source, flags=flags)
    return with_row(s, s.eval.row) if s.eval.row else s


def with_row(settings: Settings, name: str) -> Settings:
    """`settings` restricted to table row `name`, with that row's settings (`methods.Method.overrides`)."""
    try:
        m = methods_lib.method(name)
    except ValueError as e:
        raise ConfigError(f"config.eval.row: {e}" + (f" (in {settings.source})" if settings.source else "")) from e
    return settings.replace({**m.overrides(settings.index.dir), "eval.methods": (name,), "eval.row": ""})


def to_dict(settings: Any) -> dict:
    """Nested JSON-able dict with the ConfigDict's keys (tuples become lists).

    Takes `Settings` (or any section), a ConfigDict or a plain mapping.
    """
    if dataclasses.is_dataclass(settings):
        d = dataclasses.asdict(settings)
        if isinstance(settings, Settings):
            d.pop("source", None)
    else:
        d = settings.to_dict() if hasattr(settings, "to_dict") else dict(settings)
    return json.loads(json.dumps(d, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


# Keys whose absence from a saved record means another value than today's default: the behaviour
# before the key existed. A table or run recorded then compares as what it was made with.
ABSENT_MEANS = {
    "hessian.r_train_shrinkage": 0.0,  # R_train was used unshrunk before OAS became the default (issue 58)
}


def mismatches(
    saved: Any,
    current: Any,
    sections: Sequence[str] = RUN_SECTIONS + ("train",),
    ignore: Sequence[str] = tuple(f"train.{k}" for k in RESUMABLE_TRAIN_KEYS),
) -> list[str]:
    """Fields of `sections` that differ between two configs (Settings or nested dicts).

    A key absent on one side compares equal to the other side's default (so a run saved
    before a field existed still matches when the field keeps its default), or to its
    `ABSENT_MEANS` value where the default changed what it computes.

    Returns:
      e.g. `["model.embed_dim: saved 64, now 128"]`; empty when they agree.
    """
    defaults = {**flatten(to_dict(Settings())), **ABSENT_MEANS}
    a, b = flatten(to_dict(saved)), flatten(to_dict(current))
    out = []
    for key in sorted(set(a) | set(b)):
        if key.split(".")[0] not in sections or key in ignore or key in RUNTIME_KEYS:
            continue
        va, vb = a.get(key, defaults.get(key, "<absent>")), b.get(key, defaults.get(key, "<absent>"))
        if va != vb:
            out.append(f"{key}: saved {va!r}, now {vb!r}")
    return out


def with_runtime_keys(saved: Settings, current: Settings) -> Settings:
    """`saved` (a run's settings) with the `RUNTIME_KEYS` values of `current` (the stage's)."""
    return saved.replace({k: functools.reduce(getattr, k.split("."), current) for k in RUNTIME_KEYS})


# `config.model` fields that stay the user's choice for an imported model (`model.source` set);
# every other model field (arch and shapes) comes from the imported checkpoint.
IMPORT_USER_FIELDS = ("source", "dtype", "param_dtype", "matmul_dtype", "max_len", "remat")


def resolve_imported_model(
    user: model_lib.LMConfig, imported: model_lib.LMConfig, source: str = ""
) -> model_lib.LMConfig:
    """The model section of a run imported from `user.source`: `imported`'s arch and shapes,
    with the user's `source`, `dtype`, `param_dtype` and `max_len`.

    A user field left at its default (experiments/base.py) is filled from the import; one set
    to anything else must equal the imported value. `max_len` may be shorter than the
    imported model's (its `max_position_embeddings`), never longer.

    Raises:
      ConfigError: a field that disagrees with the import (names it, both values and `source`).
    """
    where = f" (in {source})" if source else ""
    default = model_lib.LMConfig()
    bad = []
    for f in dataclasses.fields(model_lib.LMConfig):
        mine, theirs = getattr(user, f.name), getattr(imported, f.name)
        if f.name in IMPORT_USER_FIELDS or mine == getattr(default, f.name) or mine == theirs:
            continue
        bad.append(f"model.{f.name}={mine!r} but the imported model has {theirs!r}")
    if user.max_len > imported.max_len:
        bad.append(f"model.max_len={user.max_len} exceeds the imported model's {imported.max_len} positions")
    if bad:
        raise ConfigError(
            f"config.model disagrees with the model at model.source={user.source!r}{where}: "
            + "; ".join(bad)
            + " (leave these keys at their defaults or set the imported values)"
        )
    return dataclasses.replace(imported, **{k: getattr(user, k) for k in IMPORT_USER_FIELDS})


def check_matches_run(settings: Settings, workdir: str | os.PathLike, sections: Sequence[str] = RUN_SECTIONS) -> None:
    """Refuses a stage whose config disagrees with the run's `config.json` in `sections`.

    For an imported run (`model.source` set) the config's model section is first resolved
    against the run's (`resolve_imported_model`), so an experiment file that leaves the
    shapes at their defaults matches the run `launch.import_model` wrote.

    Raises:
      ConfigError: naming each differing field, the run's config.json and the config's file.
    """
    path = pathlib.Path(workdir) / CONFIG_FILE
    saved = read_json(path)
    if settings.model.source:
        saved_model = from_dict({"model": saved.get("model", {})}, source=str(path)).model
        if saved_model.source == settings.model.source:
            settings = dataclasses.replace(
                settings, model=resolve_imported_model(settings.model, saved_model, settings.source)
            )
    bad = mismatches(saved, settings, sections=sections, ignore=())
    if bad:
        src = f" ({settings.source})" if settings.source else ""
        raise ConfigError(f"the config{src} disagrees with the run in {workdir} (its {CONFIG_FILE}): " + "; ".join(bad))


def read_json(path: str | os.PathLike) -> dict:
    """A JSON file the pipeline wrote, with a clear error for a missing or damaged one."""
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no run config at {path} (run `python -m launch.train` first)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); restore it or re-create the run") from e


def load_run_settings(workdir: str | os.PathLike) -> Settings:
    """The `Settings` a run was made with (`workdir/config.json`)."""
    path = pathlib.Path(workdir) / CONFIG_FILE
    return from_dict(read_json(path), source=str(path))


def load_table_settings(table: str | os.PathLike) -> Settings:
    """The `Settings` an evaluation ran with (the "settings" of its `table.json`)."""
    return from_dict(read_json(table)["settings"], source=str(table))


def section(name: str, values: Any) -> Any:
    """One typed section (e.g. `section("data", {"source": "text", "path": ...})`) from a
    ConfigDict section or a plain dict, checked like a whole config (notebooks, tests)."""
    return getattr(from_dict({name: to_dict(values)}), name)
