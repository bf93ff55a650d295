"""The evaluation's section types (`config.eval`, `config.tailpatch`, `config.validate`) and
`TableSettings`, what the evaluation reads of the composed config.

`config.py` composes these with the other roles' sections into `config.Settings` and re-exports
them. The evaluation's work (rows, queries, tail-patch, LDS, the explorer's engine) takes a
`TableSettings`: a `Protocol` that `config.Settings` satisfies, naming the sections a table row
composes and the three operations it needs (`replace` for a row's overrides, `to_dict` and
`differences` to record and compare what an evaluation ran with), so this package imports no
`config` and `config` can sit above it.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Mapping, Protocol, Sequence

from trackstar_jax import methods as methods_lib
from trackstar_jax.data import candidates as candidates_lib
from trackstar_jax.data import corpus as data_lib
from trackstar_jax.models import lm as model_lib
from trackstar_jax.retrieval import stage as retrieval_stage
from trackstar_jax.training import step as step_lib

QUERY_MODES = ("gold", "prediction")
PAPER_INCORRECT_PER_BUCKET = 100 / 1000  # §A.4: at most 100 wrong facts among 1000 per bucket


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


class TableSettings(retrieval_stage.RowSettings, Protocol):
    """What the evaluation reads of the composed config (`config.Settings` satisfies it): every
    section a table row composes, and the operations on the whole."""

    @property
    def seed(self) -> int: ...

    @property
    def model(self) -> model_lib.LMConfig: ...

    @property
    def data(self) -> data_lib.DataConfig: ...

    @property
    def candidates(self) -> candidates_lib.CandidateConfig: ...

    @property
    def train(self) -> step_lib.TrainSettings: ...

    @property
    def eval(self) -> EvalSettings: ...

    @property
    def tailpatch(self) -> TailpatchSettings: ...

    @property
    def validate(self) -> ValidateSettings: ...

    @property
    def source(self) -> str: ...

    def replace(self, overrides: Mapping[str, Any]) -> TableSettings:
        """A copy with dotted-key overrides (a row's `methods.Method.overrides`)."""
        ...

    def to_dict(self) -> dict:
        """The nested JSON-able dict (what an evaluation records it ran with)."""
        ...

    def differences(self, saved: Mapping[str, Any], sections: Sequence[str], ignore: Sequence[str] = ()) -> list[str]:
        """`"key: saved x, now y"` for each key of `sections` where `saved` (a recorded dict)
        differs (a key absent from `saved` compares equal to its default)."""
        ...
