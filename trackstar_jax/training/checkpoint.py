"""Run directory and checkpoints: orbax `CheckpointManager` over the full `TrainState`.

A checkpoint holds params, the FULL optimizer state (Adafactor's factored second moments
`v_row` / `v_col` / `v` are what TrackStar reads, so they must round-trip bit-exactly), the
step, and the resolved config of the run. Restores go into an abstract, sharded target
(`jax.eval_shape` + shardings), so arrays come back already placed on the mesh.

Run directory (`workdir/`): `config.json` (resolved config), `corpus/` (id -> text), the
tokenizer (`tokenizer.model`, SentencePiece, for a pretrained run; `tokenizer/tokenizer.json`,
Hugging Face, for an imported one), `checkpoints/<step>/{state,config}`, and for an imported
run `opt_state.json` (how its optimizer state was estimated). `Run` is what later stages
need; `stages.load_run(workdir)` reads one (the run's config.json is read above this layer),
`restore_state` / `reload` restore its checkpoints.

Every step folder carries `trackstar_checksums.json` (`CHECKSUM_FILE`): the size and sha256 of
each file orbax wrote, written once the save is final (`seal`). A restore checks it before
orbax reads anything (`verify_step`): a flipped bit, a truncated, missing or extra file is
refused naming the step folder and the file (`CheckpointCorruptError`), so no stage uses
damaged weights. A step folder without it (saved before checksums existed, or killed between
orbax's finish and the seal) restores with one warning line, unverified. The index records
the digest of the checkpoint it was built from (`checkpoint_record`), which
`index.verify_index` compares with the one now on disk.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import pathlib
import shutil
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx
from jax.sharding import Mesh

from trackstar_jax import data as data_lib
from trackstar_jax import files
from trackstar_jax.distributed import sharding as sharding_lib
from trackstar_jax.models import lm as model_lib
from trackstar_jax.training import step as train_lib

CHECKPOINT_DIR = "checkpoints"
CORPUS_DIR = "corpus"
TOKENIZER_FILE = "tokenizer.model"  # SentencePiece (pretrained runs)
HF_TOKENIZER_DIR = "tokenizer"  # Hugging Face tokenizer.json folder (imported runs)
OPT_STATE_INFO_FILE = "opt_state.json"  # imported runs: where opt_state's second moments came from
CHECKSUM_FILE = "trackstar_checksums.json"  # in each step folder: size + sha256 of every file orbax wrote
CHECKSUM_FORMAT = 1


class CheckpointCorruptError(files.InputError):
    """A checkpoint's files differ from the checksums written when it was saved (or orbax
    cannot read it); the message names the step folder and the file."""


def load_run_tokenizer(workdir: str | os.PathLike) -> Any:
    """The run's tokenizer, by what the run directory holds: `tokenizer/tokenizer.json`
    (Hugging Face, imported runs) or `tokenizer.model` (SentencePiece).

    Raises:
      FileNotFoundError: neither is there (names both paths).
    """
    workdir = pathlib.Path(workdir)
    hf_dir = workdir / HF_TOKENIZER_DIR
    if (hf_dir / "tokenizer.json").is_file():
        from trackstar_jax.data import hf_tokenizer  # noqa: PLC0415  (needs the optional `tokenizers`)

        return hf_tokenizer.HFTokenizer.from_pretrained_dir(hf_dir)
    sp = workdir / TOKENIZER_FILE
    if sp.is_file():
        return data_lib.load_tokenizer(sp)
    raise FileNotFoundError(
        f"no tokenizer in {workdir}: expected {sp} (launch.train) or {hf_dir / 'tokenizer.json'} (launch.import_model)"
    )


def read_opt_state_info(workdir: str | os.PathLike) -> dict | None:
    """`opt_state.json` of an imported run (None for a pretrained run, whose state is the optimizer's)."""
    path = pathlib.Path(workdir) / OPT_STATE_INFO_FILE
    return files.read_json(path, "optimizer-state record") if path.exists() else None


def has_checkpoint(workdir: str | os.PathLike) -> bool:
    """Whether the run directory holds a saved checkpoint step (orbax's `<step>` folders)."""
    d = pathlib.Path(workdir) / CHECKPOINT_DIR
    return d.is_dir() and any(p.name.isdigit() for p in d.iterdir())


def diverged_advice(workdir: str | os.PathLike | None = None) -> str:
    """What to do after training diverged, said so that the advice works when followed: a run's
    optimizer keys are fixed once a checkpoint is saved with them."""
    if workdir is not None and not has_checkpoint(workdir):
        return (
            "rerun with a lower --config.train.learning_rate (this workdir holds no checkpoint yet, so its train "
            "settings may still change), or check the data"
        )
    return (
        "to retry with a lower train.learning_rate, use a new --workdir (this run's checkpoints were trained with "
        "the current value, so this workdir refuses another), or check the data"
    )


def state_shardings(abstract_state: Any, mesh: Mesh) -> Any:
    """Shardings of a TrainState-like tree on `mesh`: `sharding.fsdp_shardings`, i.e. every
    leaf replicated when the mesh's fsdp axis has size 1, else each parameter and optimizer
    leaf (Adafactor's v_row / v_col / v, counts) by its own shape over `fsdp`."""
    return sharding_lib.fsdp_shardings(abstract_state, mesh)


def abstract_state(
    model_cfg: model_lib.LMConfig, opt: optax.GradientTransformation, mesh: Mesh | None = None
) -> tuple[nnx.GraphDef, train_lib.TrainState]:
    """`(graphdef, TrainState of ShapeDtypeStructs with shardings)` without allocating."""
    graphdef, params = model_lib.abstract_params(model_cfg)
    params = nnx.to_pure_dict(params)
    state = train_lib.TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32), params=params, opt_state=jax.eval_shape(opt.init, params)
    )
    if mesh is not None:
        sh = state_shardings(state, mesh)
        state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, sh)
    return graphdef, state


def nonfinite_leaves(tree: Any) -> list[str]:
    """Paths (e.g. `params/blocks/0/attn/q/kernel`) of floating leaves holding NaN or inf."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    floats = [(p, x) for p, x in leaves if jnp.issubdtype(getattr(x, "dtype", None) or jnp.int32, jnp.inexact)]
    ok = jax.device_get([jnp.isfinite(x).all() for _, x in floats])
    return [
        "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in p)
        for (p, _), good in zip(floats, ok)
        if not good
    ]


def _step_files(step_dir: pathlib.Path) -> list[pathlib.Path]:
    """Every entry below `step_dir` but the checksum file (and its temporaries), sorted; links
    and other non-regular entries are listed too (`verify_step` refuses them)."""
    out = []
    for root, dirs, names in os.walk(step_dir):
        dirs.sort()
        for n in names:
            if not n.startswith(CHECKSUM_FILE) and not n.startswith(f".{CHECKSUM_FILE}"):
                out.append(pathlib.Path(root) / n)
        out += [pathlib.Path(root) / d for d in dirs if os.path.islink(pathlib.Path(root) / d)]
    return sorted(out)


def checksum_record(step_dir: str | os.PathLike) -> dict:
    """`{"format", "files": {relative path: {"size", "sha256"}}}` of a finished step folder."""
    step_dir = pathlib.Path(step_dir)
    return {
        "format": CHECKSUM_FORMAT,
        "files": {
            f.relative_to(step_dir).as_posix(): {"size": f.stat().st_size, "sha256": files.sha256_file(f)}
            for f in _step_files(step_dir)
        },
    }


def seal(step_dir: str | os.PathLike) -> None:
    """Writes `CHECKSUM_FILE` into a finished step folder (atomically; once orbax has finished it)."""
    step_dir = pathlib.Path(step_dir)
    files.atomic_write_json(step_dir / CHECKSUM_FILE, checksum_record(step_dir), sort_keys=True)


def _digest(record: dict) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(record["files"], sort_keys=True).encode()).hexdigest()


def verify_step(step_dir: str | os.PathLike) -> str | None:
    """Checks every file of a step folder against its `CHECKSUM_FILE`; returns the checkpoint's
    digest (sha256 over the recorded checksums), or None (after one warning line) for a folder
    without checksums.

    Raises:
      CheckpointCorruptError: a file whose size or sha256 differs (a flipped bit, a truncated
        file), a recorded file missing, an unrecorded one present, a link, or a damaged
        checksum file: each names the step folder and the file.
    """
    step_dir = pathlib.Path(step_dir)
    sums = step_dir / CHECKSUM_FILE
    if not sums.exists():
        logging.warning(
            "checkpoint %s has no %s (saved before checkpoints carried checksums, or its save was killed "
            "before they were written): its files are used unverified",
            step_dir,
            CHECKSUM_FILE,
        )
        return None
    fix = "delete that step's folder to fall back to an earlier checkpoint, or restore it from a copy"
    try:
        record = files.read_json(sums, "checkpoint checksum file", fix)
        want = record["files"]
        if record.get("format") != CHECKSUM_FORMAT or not isinstance(want, dict):
            raise KeyError("format")
    except (files.InputError, KeyError, TypeError) as e:
        raise CheckpointCorruptError(
            f"checkpoint {step_dir} is damaged: {sums.name} cannot be read ({e}); {fix}"
        ) from None

    def bad(rel: str, why: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"checkpoint {step_dir} is damaged: file {rel} {why}; {fix}")

    have = {f.relative_to(step_dir).as_posix(): f for f in _step_files(step_dir)}
    missing = sorted(set(want) - set(have))
    if missing:
        raise bad(missing[0], "is missing" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for rel, f in have.items():
        if rel not in want:
            raise bad(rel, "was not written by the save (it is not in the checksums)")
        if f.is_symlink() or not f.is_file():
            raise bad(rel, "is not a regular file")
        size = f.stat().st_size
        if size != want[rel]["size"]:
            raise bad(rel, f"has {size} bytes, {want[rel]['size']} were saved (truncated or overwritten)")
        if files.sha256_file(f) != want[rel]["sha256"]:
            raise bad(rel, "differs from the bytes saved (sha256 mismatch: a flipped bit or an overwrite)")
    return _digest(record)


def checkpoint_record(workdir: str | os.PathLike | None, step: int) -> dict | None:
    """`{"step_dir": "checkpoints/<step>", "digest"}` of a run's sealed checkpoint (what an
    index records of the checkpoint it was built from), or None without a workdir or checksums."""
    if workdir is None:
        return None
    sums = pathlib.Path(workdir) / CHECKPOINT_DIR / str(step) / CHECKSUM_FILE
    try:
        return {"step_dir": f"{CHECKPOINT_DIR}/{step}", "digest": _digest(files.read_json(sums))}
    except (FileNotFoundError, files.InputError, KeyError, TypeError):
        return None


def check_recorded_checkpoint(index_path: str | os.PathLike, recorded: dict | None) -> dict:
    """Compares the checkpoint an index records (`checkpoint_record`) with the one now on disk,
    in the nearest folder above the index holding `checkpoints/` (the run the index belongs to).

    Returns:
      `{"checked": bool, ...}` for the verify report (not checked: no record, or no run above).

    Raises:
      CheckpointCorruptError: the checkpoint is gone, damaged, or not the one indexed.
    """
    if not recorded:
        return {"checked": False, "why": "the index records no checkpoint digest (built before they were recorded)"}
    index_path = pathlib.Path(index_path).absolute()
    run = next((d for d in index_path.parents if (d / CHECKPOINT_DIR).is_dir()), None)
    if run is None:
        return {"checked": False, "why": f"no run directory with {CHECKPOINT_DIR}/ above {index_path}"}
    step_dir = run / recorded["step_dir"]
    if not step_dir.is_dir():
        raise CheckpointCorruptError(
            f"index {index_path} was built from checkpoint {step_dir}, which is no longer on disk: "
            "rebuild the index (`python -m launch.build_index`) from the run's current checkpoint"
        )
    digest = verify_step(step_dir)
    if digest != recorded["digest"]:
        now = digest[:19] if digest else f"none (no {CHECKSUM_FILE})"
        raise CheckpointCorruptError(
            f"checkpoint {step_dir} is not the one index {index_path} was built from (checksum digest {now} "
            f"now, {recorded['digest'][:19]} when indexed): the checkpoint was replaced since; rebuild the "
            "index (`python -m launch.build_index`), or put the indexed checkpoint back"
        )
    return {"checked": True, "step_dir": str(step_dir), "digest": digest}


# Beyond the arrays: orbax's metadata, the resolved config, the tensorstore manifests.
CHECKPOINT_SLACK_BYTES = 256 << 10  # measured: a tiny run's step folder is ~120 KiB over its arrays


class CheckpointManager:
    """orbax `CheckpointManager` for `TrainState` + resolved config under `directory`.

    Saves are refused for a step that is not newer than the latest saved one, so a resumed
    (or re-started) run never overwrites or shadows a newer checkpoint.
    """

    def __init__(self, directory: str | os.PathLike, max_to_keep: int | None = 3):
        self.directory = pathlib.Path(directory).absolute()
        self._unsealed: list[int] = []  # saved by this manager, checksums not written yet
        self._verified: dict[int, str | None] = {}  # step -> digest (None: no checksums), checked once
        self._mngr = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
            item_names=("state", "config"),
        )

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mngr.all_steps())

    def save(self, state: train_lib.TrainState, config: Mapping[str, Any]) -> int:
        """Saves `state` at `state.step` with `config`, the run's resolved config as a JSON dict
        (`config.to_dict(settings)`); async, see `wait_until_finished`.

        Raises:
          ValueError: a checkpoint at the same or a newer step already exists.
        """
        step = int(jax.device_get(state.step))
        bad = nonfinite_leaves({"params": state.params, "opt_state": state.opt_state})
        if bad:  # the logging hook may not have seen this step: never save a NaN state
            raise FloatingPointError(
                f"refusing to save step {step} in {self.directory}: non-finite values in "
                f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''} (training diverged; "
                f"{diverged_advice(self.directory.parent)})"
            )
        latest = self.latest_step()
        if latest is not None and step <= latest:
            raise ValueError(
                f"refusing to save step {step} in {self.directory}: it already holds step {latest} "
                "(a newer or equal checkpoint is never overwritten)"
            )
        self.check_space(step, state)
        self._seal()  # the previous save (orbax waits for it before starting another anyway)
        files.check_tree(self.directory)  # orbax writes by its own paths: no link in checkpoints/
        self._mngr.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(dict(config))),
        )
        self._unsealed.append(step)
        return step

    def _seal(self) -> None:
        """Waits for orbax's pending save, then writes the checksums of every step this manager
        saved (process 0 of a job: orbax has finished every process's files by then)."""
        if not self._unsealed:
            return
        self._mngr.wait_until_finished()
        for step in self._unsealed:
            step_dir = self.directory / str(step)
            if step_dir.is_dir() and jax.process_index() == 0:  # max_to_keep may have removed it
                seal(step_dir)
        self._unsealed = []

    def verify(self, step: int) -> str | None:
        """`verify_step` of checkpoint `step` (once per manager): its digest, None without checksums.

        Raises:
          CheckpointCorruptError: names the step folder and the file.
        """
        if step not in self._verified:
            self._seal()
            self._verified[step] = verify_step(self.directory / str(step))
        return self._verified[step]

    def _read(self, step: int, args: Any) -> Any:
        """orbax's restore of `step` after `verify`; an error orbax / tensorstore raises (a file
        of a checkpoint without checksums damaged) becomes a `CheckpointCorruptError` naming it."""
        self.verify(step)
        try:
            return self._mngr.restore(step, args=args)
        except Exception as e:  # noqa: BLE001  (orbax re-raises tensorstore's errors as a bare Exception)
            # The innermost error names the array and the file (orbax's wrapper dumps the spec).
            cause = e
            while (cause.__cause__ or cause.__context__) is not None:
                cause = cause.__cause__ or cause.__context__
            first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
            raise CheckpointCorruptError(
                f"checkpoint {self.directory / str(step)} cannot be read: {first[:500]} (delete that step's "
                "folder to fall back to an earlier checkpoint, or restore it from a copy)"
            ) from e

    def check_space(self, step: int, state: train_lib.TrainState) -> None:
        """Refuses a save the disk cannot hold, before anything is written: orbax's background
        writers would otherwise fail one array at a time, each logging its own traceback.

        Raises:
          files.WriteError: naming the step's folder, the free and the needed bytes.
        """
        need = sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(state)) + CHECKPOINT_SLACK_BYTES
        free = shutil.disk_usage(self.directory).free
        if free < need:
            raise files.WriteError(
                errno.ENOSPC,
                f"cannot write checkpoint {self.directory / str(step)}: the disk is full ({free / 2**20:.1f} MiB "
                f"free, the checkpoint needs about {need / 2**20:.1f} MiB); free space and rerun (training "
                "resumes from the last checkpoint), or give another --workdir",
            )

    def saved_config(self, step: int | None = None) -> dict:
        """The resolved config stored with checkpoint `step` (default: latest)."""
        step = self._step(step)
        return dict(self._read(step, ocp.args.Composite(config=ocp.args.JsonRestore()))["config"])

    def restore(
        self,
        step: int | None,
        abstract_state: train_lib.TrainState,
        check: Callable[[dict], list[str]] | None = None,
    ) -> tuple[int, train_lib.TrainState]:
        """Restores checkpoint `step` (None: latest) into `abstract_state`'s shapes and shardings.

        Args:
          step: checkpoint step, or None for the latest.
          abstract_state: TrainState of `jax.ShapeDtypeStruct` (with `sharding`), e.g. from
            `abstract_state(...)`.
          check: if given, called with the checkpoint's saved config; the differences it
            returns (e.g. `config.mismatches` against the stage's settings) refuse the restore.

        Raises:
          FileNotFoundError: no checkpoint. ValueError: config mismatch (names the fields).
          CheckpointCorruptError: its files differ from their checksums, or orbax cannot read
            them (names the step folder and the file), before anything of it is used.
        """
        step = self._step(step)
        if check is not None:
            bad = check(self.saved_config(step))
            if bad:
                raise ValueError(f"checkpoint {self.directory}/{step} does not match the config: " + "; ".join(bad))
        out = self._read(step, ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))
        state = out["state"]
        bad = nonfinite_leaves({"params": state.params, "opt_state": state.opt_state})
        if bad:
            raise FloatingPointError(
                f"checkpoint {self.directory}/{step} holds non-finite values in "
                f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}; it cannot be resumed or "
                "attributed (delete that step's folder to fall back to an earlier checkpoint)"
            )
        return step, state

    def restore_latest(
        self, abstract_state: train_lib.TrainState, check: Callable[[dict], list[str]] | None = None
    ) -> tuple[int, train_lib.TrainState]:
        """`restore(None, ...)`: the latest checkpoint."""
        return self.restore(None, abstract_state, check)

    def _step(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint in {self.directory}")
        elif step not in self.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory} (have {self.all_steps()})")
        return step

    def wait_until_finished(self) -> None:
        """Waits for a pending save and writes its checksums."""
        self._mngr.wait_until_finished()
        self._seal()

    def close(self) -> None:
        self.wait_until_finished()
        self._mngr.close()


@dataclasses.dataclass
class Run:
    """Everything later stages need from a pretraining run (`stages.load_run` reads one)."""

    model_cfg: model_lib.LMConfig  # the run's model (with the stage's `config.RUNTIME_KEYS`)
    optimizer: train_lib.OptimizerConfig  # the run's optimizer (`config.train`'s optimizer keys)
    data: data_lib.DataConfig  # the run's data section (where its LAMA files are)
    graphdef: nnx.GraphDef
    params: Any  # pure nested dict
    opt_state: Any  # optax Adafactor chain state (v_row / v_col / v); None: imported without an estimate
    step: int
    tokenizer: data_lib.Tokenizer  # or data.hf_tokenizer.HFTokenizer (same interface)
    corpus: data_lib.Corpus  # the candidates: the passages indexed and retrieved (`config.candidates`)
    workdir: pathlib.Path | None = None
    opt_state_info: dict | None = None  # imported runs: how V was estimated (opt_state.json)


# An imported V estimated from fewer examples than this is reported as too thin to trust: a
# mean of n squared (Gaussian) gradients has a relative standard error of sqrt(2/n) (35% at
# n = 16), which the correction 1/sqrt(V) halves (18%).
V_MIN_EXAMPLES = 16


def second_moment_record(run: Run, correction: bool = True) -> dict:
    """Where the run's V (the second moment of the optimizer correction, §3) came from and from
    how many examples: an imported run's estimate (its `opt_state.json`, all its fields but
    the timing), or a trained run's Adafactor state (its step and decay exponent; its running
    mean weighs about the last `step ** decay_rate` steps). `thin` (with a one-line `note`)
    when an estimate used fewer than `V_MIN_EXAMPLES` examples."""
    if not correction:
        return {"source": "none", "reason": "vectors.correction is off"}
    if run.opt_state is None:
        return {"source": "none", "reason": "imported without an estimate (vectors.estimate_v_examples = 0)"}
    if run.opt_state_info is not None:
        rec = {"source": "import estimate", **{k: v for k, v in run.opt_state_info.items() if k != "seconds"}}
        n = rec.get("num_examples")
        if isinstance(n, int) and n < V_MIN_EXAMPLES:
            rec["thin"] = True
            rec["note"] = (
                f"V is estimated from {n} examples (< {V_MIN_EXAMPLES}: each element's relative error "
                f"is above {(2 / n) ** 0.5:.0%}); raise vectors.estimate_v_examples"
            )
        return rec
    decay = float(run.optimizer.decay_rate)
    return {
        "source": "optimizer state",
        "optimizer": "adafactor",
        "checkpoint_step": int(run.step),
        "decay_rate": decay,
        "effective_steps": int(round(max(int(run.step), 1) ** decay)),
    }


def restore_state(
    workdir: pathlib.Path,
    model_cfg: model_lib.LMConfig,
    optimizer: train_lib.OptimizerConfig,
    step: int | None,
    mesh: Mesh | None,
    check: Callable[[dict], list[str]] | None = None,
) -> tuple[nnx.GraphDef, int, Any, Any, dict | None]:
    """`(graphdef, step, params, opt_state, opt_state_info)` of checkpoint `step` (None: latest)
    of the run in `workdir`, placed on `mesh` (`state_shardings`; default: all devices on the
    data axis; a checkpoint saved from any mesh restores into any other).

    Raises:
      FileNotFoundError: no checkpoints (names the path). ValueError: `check` found differences.
    """
    mesh = sharding_lib.make_mesh() if mesh is None else mesh
    graphdef, target = abstract_state(model_cfg, train_lib.make_optimizer(optimizer), mesh)
    if not (workdir / CHECKPOINT_DIR).is_dir():
        raise FileNotFoundError(f"no checkpoints at {workdir / CHECKPOINT_DIR} (run `python -m launch.train` first)")
    mngr = CheckpointManager(workdir / CHECKPOINT_DIR, max_to_keep=None)
    try:
        step, state = mngr.restore(step, target, check)
    finally:
        mngr.close()
    logging.info("loaded run %s at step %d", workdir, step)
    info = read_opt_state_info(workdir)
    # An import without an estimate holds optax's zero state: no V to correct with (the
    # correction then refuses, naming vectors.correction / the estimate's size key).
    opt_state = None if info is not None and info.get("kind") == "none" else state.opt_state
    return graphdef, int(step), state.params, opt_state, info


def reload(run: Run, *, step: int | None = None, mesh: Mesh | None = None) -> Run:
    """`run` at checkpoint `step` (None: the same step), placed on `mesh`: the same model,
    optimizer, tokenizer and candidates (a run's checkpoints all belong to it: `train` refuses
    a foreign one). For a pod writer's process-local copy and a checkpoint curve."""
    graphdef, step, params, opt_state, info = restore_state(
        run.workdir, run.model_cfg, run.optimizer, run.step if step is None else step, mesh
    )
    return dataclasses.replace(
        run, graphdef=graphdef, params=params, opt_state=opt_state, step=step, opt_state_info=info
    )
