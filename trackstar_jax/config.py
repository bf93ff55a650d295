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
`TrainSettings` (training), `HessianConfig`, `StorageConfig` and `IndexSettings` (index); they are
re-exported here under the same names (one type each). A section that extends a role's type
(`TrainSettings` the optimizer's, `IndexSettings` the storage's) inherits its fields: one list of
keys. The sections only the roles above config read (mesh, retrieval, eval, tail-patch,
validate) are defined here until those roles take sections too (BUILD_NOTES §1).
`to_dict(settings)` gives back the nested dict a
ConfigDict would, so run directories written before the typed config still load.
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
from trackstar_jax.distributed import runtime
from trackstar_jax.features import vectors as vectors_lib
from trackstar_jax.index import hessian as hessian_lib
from trackstar_jax.index import store as store_lib
from trackstar_jax.models import lm as model_lib
from trackstar_jax.training import loop as loop_lib
from trackstar_jax.training import step as step_lib

CONFIG_FILE = "config.json"  # the run directory's resolved config

# Sections a run is defined by: a checkpoint (or an existing workdir) is refused when any of
# these differ. Other sections (vectors, index, retrieval, eval, ...) belong to later stages.
RUN_SECTIONS = ("seed", "model", "data")
# train keys that may change on resume (longer training, other cadences); all other train
# keys (optimizer, batch size) must match.
RESUMABLE_TRAIN_KEYS = (
    "num_steps",
    "log_every_steps",
    "eval_every_steps",
    "num_eval_batches",
    "checkpoint_every_steps",
    "max_checkpoints_to_keep",
    "num_completions",
    "max_new_tokens",
)
QUERY_MODES = ("gold", "prediction")
PAPER_INCORRECT_PER_BUCKET = 100 / 1000  # §A.4: at most 100 wrong facts among 1000 per bucket
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
}


ConfigError = files.ConfigError  # raised by the roles too (files.py, the bottom layer)


# ---------------------------------------------------------------------------------------
# Section types the role packages own (re-exported: one type each)
# ---------------------------------------------------------------------------------------

OptimizerConfig, TrainSettings = step_lib.OptimizerConfig, loop_lib.TrainSettings  # `config.train` (training/)
HessianConfig, HESSIAN_MODES, R_EVAL_SOURCES = (
    hessian_lib.HessianConfig,
    hessian_lib.HESSIAN_MODES,
    hessian_lib.R_EVAL_SOURCES,
)
StorageConfig, STORAGE_DTYPES, IndexSettings = (
    store_lib.StorageConfig,
    store_lib.STORAGE_DTYPES,
    store_lib.IndexSettings,
)
flatten = store_lib.flatten


# ---------------------------------------------------------------------------------------
# Sections read only by the stages
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MeshSettings:
    """`config.mesh`: `shape` (data, fsdp, tensor); -1 = all remaining devices."""

    shape: tuple[int, ...] = (-1, 1, 1)


@dataclasses.dataclass(frozen=True)
class RetrievalSettings:
    """`config.retrieval` (see experiments/base.py for the meaning of each key)."""

    top_k: int = 10
    query_batch_size: int = 64
    read_chunk_rows: int = 65_536
    queries: str = ""
    output: str = ""
    overwrite: bool = False
    token_scores: bool = False
    rerank_k: int = 0
    precision: str = "float32"

    def __post_init__(self):
        if self.precision not in runtime.MATMUL_PRECISIONS:
            raise ValueError(
                f"retrieval.precision must be one of {tuple(runtime.MATMUL_PRECISIONS)}, got {self.precision!r}"
            )
        for key in ("top_k", "query_batch_size", "read_chunk_rows"):
            if getattr(self, key) < 1:
                raise ValueError(f"retrieval.{key} must be >= 1, got {getattr(self, key)}")
        if self.rerank_k < 0:
            raise ValueError(f"retrieval.rerank_k must be >= 0 (0 = no reranking), got {self.rerank_k}")
        if self.output and (pathlib.Path(self.output).name != self.output or self.output.startswith(".")):
            raise ValueError(f"retrieval.output must be a plain file name stem, got {self.output!r}")


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """`config.eval` (§4, §A.4; see experiments/base.py)."""

    query_mode: str = "gold"
    template_variant: int = 0
    max_queries: int = 0
    methods: tuple[str, ...] = ("trackstar",)
    relations: str = ""
    lama_dir: str = ""
    pararel_dir: str = ""
    num_proponents: int = 10
    max_per_bucket: int = 1000
    max_per_relation_target_per_bucket: int = 25
    max_per_relation_target: int = 100
    max_incorrect_per_bucket: int = -1  # §A.4: -1 = the paper's ratio (100 of 1000) of max_per_bucket; 0 = no cap
    bucket_edges: tuple[int, ...] = (1, 10, 100, 1_000, 10_000, 100_000)
    include_unmentioned: bool = False
    max_new_tokens: int = 8
    bm25_k1: float = 1.2
    bm25_b: float = 0.75
    bootstrap_seed: int = 0
    num_examples_shown: int = 3
    output_dir: str = ""
    row: str = ""  # one table row (a name in methods.METHODS): its settings apply to every stage
    optional_methods: tuple[str, ...] = ()  # rows skipped (with a warning) when their model is not installed
    completion_batch_size: int = 64  # prompts per greedy-completion batch (one compiled shape)

    def __post_init__(self):
        if self.query_mode not in QUERY_MODES:
            raise ValueError(f"eval.query_mode must be one of {QUERY_MODES}, got {self.query_mode!r}")
        if not self.methods:
            raise ValueError("eval.methods is empty: name at least one row (e.g. 'bm25', 'trackstar')")
        edges = self.bucket_edges
        if not edges or list(edges) != sorted(set(edges)) or edges[0] < 1:
            raise ValueError(f"eval.bucket_edges must be increasing positive integers, got {edges}")
        if self.num_proponents < 1:
            raise ValueError(f"eval.num_proponents must be >= 1, got {self.num_proponents}")
        if self.max_incorrect_per_bucket < -1:
            raise ValueError(
                f"eval.max_incorrect_per_bucket must be -1 (the paper's ratio), 0 (no cap) or a cap, "
                f"got {self.max_incorrect_per_bucket}"
            )
        if self.output_dir and (
            pathlib.Path(self.output_dir).name != self.output_dir or self.output_dir.startswith(".")
        ):
            raise ValueError(f"eval.output_dir must be a plain folder name inside the workdir, got {self.output_dir!r}")

    @property
    def incorrect_cap(self) -> int:
        """The per-bucket cap on facts the model gets wrong (0 = none).

        §A.4 samples up to 1000 facts per bucket and at most 100 of them wrong under all three
        models; -1 keeps that ratio for any `max_per_bucket` (at least 1).
        """
        if self.max_incorrect_per_bucket >= 0:
            return self.max_incorrect_per_bucket
        return max(1, round(self.max_per_bucket * PAPER_INCORRECT_PER_BUCKET))

    @property
    def relation_list(self) -> tuple[str, ...]:
        """`relations` split on commas ("" = every relation of the corpus)."""
        return tuple(r.strip() for r in self.relations.split(",") if r.strip())


TAILPATCH_STEPS = ("lowrank", "dense")


@dataclasses.dataclass(frozen=True)
class TailpatchSettings:
    """`config.tailpatch` (§4.3)."""

    top_ks: tuple[int, ...] = (1, 3, 5, 10)
    learning_rate: float = -1.0  # < 0: the schedule's value at the final step
    batch_size: int = 16  # proponents per vmapped step
    step: str = "lowrank"  # "lowrank": exact, per-layer factors (evaluation/lowrank.py); "dense": the reference
    queries_per_step: int = 8  # queries measured under each proponent's patched parameters (pairs share its step)
    max_queries: int = 0  # tail-patch a seeded subset of this many queries (0 = every query)
    methods: tuple[str, ...] = ()  # rows tail-patched (() = every row); the others get no tail-patch column
    checkpoint_steps: tuple[int, ...] = ()  # also TrackStar's MRR and tail-patch@10 at these checkpoints (Fig. 2 right)

    def __post_init__(self):
        if not self.top_ks or min(self.top_ks) < 1:
            raise ValueError(f"tailpatch.top_ks must be positive integers, got {self.top_ks}")
        if self.batch_size < 1:
            raise ValueError(f"tailpatch.batch_size must be >= 1, got {self.batch_size}")
        if self.queries_per_step < 1:
            raise ValueError(f"tailpatch.queries_per_step must be >= 1, got {self.queries_per_step}")
        if self.step not in TAILPATCH_STEPS:
            raise ValueError(f"tailpatch.step must be one of {TAILPATCH_STEPS}, got {self.step!r}")
        if self.max_queries < 0:
            raise ValueError(f"tailpatch.max_queries must be >= 0, got {self.max_queries}")
        for name in self.methods:
            if name not in methods_lib.METHODS:
                raise ValueError(f"tailpatch.methods: unknown row {name!r} (known: {', '.join(methods_lib.METHODS)})")
        if any(s < 0 for s in self.checkpoint_steps):
            raise ValueError(f"tailpatch.checkpoint_steps must be checkpoint steps >= 0, got {self.checkpoint_steps}")


@dataclasses.dataclass(frozen=True)
class ValidateSettings:
    """`config.validate`: the linear datamodeling score (TRAK, Park et al. 2023; see evaluation/lds.py)."""

    num_subsets: int = 50  # M retrained subsets (TRAK uses M >= 50)
    fraction: float = 0.5  # alpha: each subset holds round(alpha * N) of the N training examples
    seed: int = 0  # subset i is drawn from (seed, i) alone, so a larger M reuses subsets 0..M-1
    num_steps: int = 0  # retraining steps per subset (0 = train.num_steps)
    methods: tuple[str, ...] = ("trackstar", "bm25")  # rows scored (names in methods.METHODS)
    num_queries: int = 0  # queries (eval.max_queries for the LDS query set; 0 = eval.max_queries as set)
    parallel_subsets: int = 1  # K subsets retrained side by side in one program (vmap; single device); 1 = sharded loop

    def __post_init__(self):
        if self.parallel_subsets < 1:
            raise ValueError(f"validate.parallel_subsets must be >= 1, got {self.parallel_subsets}")
        if self.num_subsets < 2:
            raise ValueError(f"validate.num_subsets must be >= 2 (a correlation over subsets), got {self.num_subsets}")
        if not 0.0 < self.fraction < 1.0:
            raise ValueError(f"validate.fraction must be in (0, 1), got {self.fraction}")
        if self.num_steps < 0 or self.num_queries < 0:
            raise ValueError(
                f"validate.num_steps and validate.num_queries must be >= 0, got {self.num_steps}, {self.num_queries}"
            )
        if not self.methods:
            raise ValueError("validate.methods is empty: name at least one row (e.g. 'trackstar', 'bm25')")
        for name in self.methods:
            if name not in methods_lib.METHODS:
                raise ValueError(f"validate.methods: unknown row {name!r} (known: {', '.join(methods_lib.METHODS)})")


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


def mismatches(
    saved: Any,
    current: Any,
    sections: Sequence[str] = RUN_SECTIONS + ("train",),
    ignore: Sequence[str] = tuple(f"train.{k}" for k in RESUMABLE_TRAIN_KEYS),
) -> list[str]:
    """Fields of `sections` that differ between two configs (Settings or nested dicts).

    A key absent on one side compares equal to the other side's default (so a run saved
    before a field existed still matches when the field keeps its default).

    Returns:
      e.g. `["model.embed_dim: saved 64, now 128"]`; empty when they agree.
    """
    defaults = flatten(to_dict(Settings()))
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


def section(name: str, values: Any) -> Any:
    """One typed section (e.g. `section("data", {"source": "text", "path": ...})`) from a
    ConfigDict section or a plain dict, checked like a whole config (notebooks, tests)."""
    return getattr(from_dict({name: to_dict(values)}), name)
