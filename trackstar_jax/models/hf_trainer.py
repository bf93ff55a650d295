"""A Hugging Face `Trainer` checkpoint's optimizer second moments, by Hugging Face tensor name.

A `Trainer` checkpoint folder (`checkpoint-N/`) holds the model as `hf.load_hf` reads it
(config.json, model.safetensors) and the optimizer's `state_dict()` in `optimizer.pt`:
`{"state": {i: {...}}, "param_groups": [{..., "params": [i, ...]}]}`, keyed by integer index
in the order of the groups' parameters. `Trainer.create_optimizer` (transformers 5) builds two
groups from `model.named_parameters()` (those with `requires_grad`): the weight-decay group
(names matching none of `NO_DECAY_PATTERNS`) then the no-decay group. `parameter_groups`
rebuilds that order from the architecture's module order (`MODULE_ORDER`, a registry by
`lm.Architecture` name), and `read_second_moments` checks every index's state against it by
shape, so a checkpoint made with other groups is refused naming the group, index and parameter.

`optimizer.pt` is read by `torch_zip.load` (numpy, no torch, no arbitrary unpickling). Two
optimizers are read, each with the exact quantity its update divides by:

* torch `Adam` / `AdamW` (`optim="adamw_torch"`, the Trainer's default): `exp_avg_sq`, its own
  `step`, and the group's `betas` / `eps` (`AdamMoment`; the update is
  `m̂ / (sqrt(v / (1 - beta2^step)) + eps)`). AMSGrad is refused (its denominator is another state).
* transformers' `Adafactor` (`optim="adafactor"`): `exp_avg_sq_row` / `exp_avg_sq_col` for a
  matrix, `exp_avg_sq` for a vector (`AdafactorMoment`; the update is `g / sqrt(V)` with
  `V = row col^T / mean(row)`, its `_approx_sq_grad`).

Anything else (SGD, 8-bit optimizers, another state layout) is refused naming its state keys.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Any, Mapping

import numpy as np

from trackstar_jax import files as files_lib
from trackstar_jax.models import hf, lm, torch_zip

OPTIMIZER_FILE = "optimizer.pt"
TRAINER_STATE_FILE = "trainer_state.json"
# transformers 5 `Trainer.get_decay_parameter_names`: names matching one of these (lowercased)
# get no weight decay; so do parameters of `nn.LayerNorm`s, whose names here all match too.
NO_DECAY_PATTERNS = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")

# `model.named_parameters()` order per registered architecture: module prefixes before the
# layers, each layer's submodules in registration order (`{pre}.layers.{i}.<submodule>`), and
# after the layers. A module's weight comes before its bias.
MODULE_ORDER: dict[str, tuple[tuple[str, ...], str, tuple[str, ...], tuple[str, ...]]] = {
    "llama": (
        ("model.embed_tokens",),
        "model.layers",
        (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
            "post_attention_layernorm",
        ),
        ("model.norm", "lm_head"),
    ),
    "gpt_neox": (
        ("gpt_neox.embed_in",),
        "gpt_neox.layers",
        (
            "input_layernorm",
            "post_attention_layernorm",
            "attention.query_key_value",
            "attention.dense",
            "mlp.dense_h_to_4h",
            "mlp.dense_4h_to_h",
        ),
        ("gpt_neox.final_layer_norm", "embed_out", "lm_head"),
    ),
}


@dataclasses.dataclass(frozen=True)
class AdamMoment:
    """torch Adam(W)'s second moment of one parameter: `exp_avg_sq [HF shape]` after `step`
    updates, with its group's `beta2` and `eps`."""

    exp_avg_sq: np.ndarray
    step: float
    beta2: float
    eps: float


@dataclasses.dataclass(frozen=True)
class AdafactorMoment:
    """transformers Adafactor's second moment of one parameter: `row [*shape[:-1]]` and
    `col [*shape[:-2], shape[-1]]` for a factored one, else `full [HF shape]`."""

    row: np.ndarray | None
    col: np.ndarray | None
    full: np.ndarray | None

    def v(self) -> np.ndarray:
        """The V whose `1/sqrt` Adafactor's update applies: `row col^T / mean(row)` (its
        `_approx_sq_grad`), or `full`. float32, the parameter's HF shape."""
        if self.full is not None:
            return np.asarray(self.full, np.float32)
        row, col = np.asarray(self.row, np.float32), np.asarray(self.col, np.float32)
        return row[..., :, None] * col[..., None, :] / row.mean(axis=-1)[..., None, None]


@dataclasses.dataclass(frozen=True)
class TrainerMoments:
    """What `read_second_moments` returns.

    Attributes:
      optimizer: "adamw" or "adafactor".
      moments: `{HF parameter name: AdamMoment | AdafactorMoment}`, every trained parameter.
      global_step: `trainer_state.json`'s `global_step` (None without that file).
      hyper: the optimizer's group settings that define the update (betas / eps, or eps /
        decay_rate / clip_threshold), for the record.
      path: the `optimizer.pt` read.
    """

    optimizer: str
    moments: dict[str, AdamMoment | AdafactorMoment]
    global_step: int | None
    hyper: dict
    path: str


def is_trainer_checkpoint(folder: str | pathlib.Path) -> bool:
    """Whether `folder` holds a Trainer's `optimizer.pt` beside the model."""
    return (pathlib.Path(folder) / OPTIMIZER_FILE).is_file()


def named_parameter_order(cfg: lm.LMConfig, names: list[str]) -> list[str]:
    """`names` (HF parameter names of a `cfg` model) in `model.named_parameters()` order.

    Raises:
      ValueError: the architecture has no registered module order, or a name it does not place.
    """
    if cfg.arch not in MODULE_ORDER:
        raise ValueError(
            f"reading a Trainer's optimizer.pt needs the parameter order of model.arch={cfg.arch!r}, "
            f"which is not registered (registered: {', '.join(MODULE_ORDER)})"
        )
    before, layers, within, after = MODULE_ORDER[cfg.arch]
    layer_re = re.compile(rf"^{re.escape(layers)}\.(\d+)\.(.+)\.(weight|bias)$")
    other_re = re.compile(r"^(.+)\.(weight|bias)$")

    def key(name: str) -> tuple:
        m = layer_re.match(name)
        if m and m.group(2) in within:
            return (1, int(m.group(1)), within.index(m.group(2)), m.group(3) == "bias")
        m = other_re.match(name)
        if m and m.group(1) in before:
            return (0, 0, before.index(m.group(1)), m.group(2) == "bias")
        if m and m.group(1) in after:
            return (2, 0, after.index(m.group(1)), m.group(2) == "bias")
        raise ValueError(f"parameter {name!r} has no place in the registered {cfg.arch} module order")

    return sorted(names, key=key)


def parameter_groups(cfg: lm.LMConfig) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The Trainer's optimizer groups of a `cfg` model: `[decay, no_decay]`, each a list of
    `(HF name, HF shape)` in `named_parameters()` order (a tied output embedding is not a
    parameter of its own)."""
    shapes = {n: s for n, s in hf.expected_tensor_shapes(cfg).items()}
    if cfg.tie_embeddings:
        shapes.pop("lm_head.weight", None)
    else:  # the untied output embedding under the architecture's current name
        shapes[hf._output_names(cfg)[-1]] = shapes.pop("lm_head.weight")
    ordered = named_parameter_order(cfg, list(shapes))
    no_decay = [any(re.search(p, n.lower()) for p in NO_DECAY_PATTERNS) for n in ordered]
    return [
        [(n, shapes[n]) for n, nd in zip(ordered, no_decay) if not nd],
        [(n, shapes[n]) for n, nd in zip(ordered, no_decay) if nd],
    ]


def _array(x: Any, what: str, path: pathlib.Path) -> np.ndarray:
    if not isinstance(x, np.ndarray) or (x.dtype.kind != "f" and x.dtype.name != "bfloat16"):
        raise ValueError(f"{path}: {what} is not a floating-point tensor ({type(x).__name__})")
    return x


def _kind(group: Mapping[str, Any], state: Mapping[str, Any], where: str) -> str:
    """ "adamw" or "adafactor" from a group's settings and one parameter's state keys."""
    if "betas" in group and "exp_avg_sq" in state and "step" in state:
        if group.get("amsgrad") or "max_exp_avg_sq" in state:
            raise ValueError(f"{where}: AMSGrad Adam is not read (its update divides by max_exp_avg_sq)")
        return "adamw"
    if "decay_rate" in group and "clip_threshold" in group and ("exp_avg_sq_row" in state or "exp_avg_sq" in state):
        return "adafactor"
    raise ValueError(
        f"{where}: state keys {sorted(state)} with group keys {sorted(k for k in group if k != 'params')} are "
        "neither torch Adam/AdamW's (exp_avg_sq, step, betas) nor transformers Adafactor's "
        "(exp_avg_sq_row/col or exp_avg_sq, decay_rate); only those two optimizers' second moments are read"
    )


def read_second_moments(folder: str | pathlib.Path, cfg: lm.LMConfig) -> TrainerMoments:
    """The second moment of every parameter of a Trainer checkpoint of a `cfg` model.

    Args:
      folder: the `checkpoint-N/` folder (`optimizer.pt`, optionally `trainer_state.json`).
      cfg: the model (from the folder's config.json, `hf.config_from_hf`).

    Raises:
      FileNotFoundError: no optimizer.pt.
      torch_zip.UnsafePickleError: its pickle names a global besides tensor rebuilding.
      ValueError: not a torch state dict; groups or indices that do not match the model's
        (the group, index and parameter named); a tensor of the wrong shape; another optimizer.
    """
    folder = pathlib.Path(folder)
    path = folder / OPTIMIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {OPTIMIZER_FILE} in {folder}: not a Trainer checkpoint folder")
    sd = torch_zip.load(path)
    if not isinstance(sd, Mapping) or not isinstance(sd.get("state"), Mapping) or "param_groups" not in sd:
        raise ValueError(f"{path} is not an optimizer state_dict (no 'state' / 'param_groups')")
    want = parameter_groups(cfg)
    groups = list(sd["param_groups"])
    if len(groups) != len(want):
        raise ValueError(
            f"{path} has {len(groups)} parameter groups; the Trainer makes {len(want)} (weight decay, no weight decay) "
            f"for this {cfg.arch} model: was it saved by transformers.Trainer's own optimizer?"
        )
    moments: dict[str, AdamMoment | AdafactorMoment] = {}
    kinds, hyper = set(), {}
    for g, (group, names) in enumerate(zip(groups, want)):
        ids = list(group.get("params", []))
        if len(ids) != len(names):
            raise ValueError(
                f"{path}: param_groups[{g}] holds {len(ids)} parameters; the Trainer's group {g} of this "
                f"{cfg.arch} model has {len(names)} ({', '.join(n for n, _ in names[:3])}, ...)"
            )
        for k, (i, (name, shape)) in enumerate(zip(ids, names)):
            where = f"{path}: param_groups[{g}]['params'][{k}] (state index {i}, parameter {name} {shape})"
            state = sd["state"].get(i)
            if not state:
                raise ValueError(f"{where} has no optimizer state: it was never updated")
            kind = _kind(group, state, where)
            kinds.add(kind)
            if kind == "adamw":
                beta2, eps = float(group["betas"][1]), float(group["eps"])
                v = _array(state["exp_avg_sq"], "exp_avg_sq", path)
                if tuple(v.shape) != shape:
                    raise ValueError(f"{where}: exp_avg_sq has shape {tuple(v.shape)}")
                moments[name] = AdamMoment(v, float(np.asarray(state["step"])), beta2, eps)
                hyper[g] = {"betas": [float(b) for b in group["betas"]], "eps": eps}
            else:
                if "exp_avg_sq_row" in state:
                    row = _array(state["exp_avg_sq_row"], "exp_avg_sq_row", path)
                    col = _array(state["exp_avg_sq_col"], "exp_avg_sq_col", path)
                    if tuple(row.shape) != shape[:-1] or tuple(col.shape) != shape[:-2] + shape[-1:]:
                        raise ValueError(
                            f"{where}: exp_avg_sq_row {tuple(row.shape)} / exp_avg_sq_col {tuple(col.shape)} "
                            f"do not factor {shape}"
                        )
                    moments[name] = AdafactorMoment(row, col, None)
                else:
                    v = _array(state["exp_avg_sq"], "exp_avg_sq", path)
                    if tuple(v.shape) != shape:
                        raise ValueError(f"{where}: exp_avg_sq has shape {tuple(v.shape)}")
                    moments[name] = AdafactorMoment(None, None, v)
                hyper[g] = {k: group[k] for k in ("eps", "decay_rate", "clip_threshold") if k in group}
                hyper[g]["eps"] = [float(e) for e in hyper[g].get("eps", ())]
    if len(kinds) > 1:
        raise ValueError(f"{path} mixes optimizer states ({', '.join(sorted(kinds))})")
    state_file = folder / TRAINER_STATE_FILE
    step = None
    if state_file.is_file():
        step = files_lib.read_json(state_file, "Trainer state").get("global_step")
    return TrainerMoments(
        optimizer=kinds.pop() if kinds else "adamw",
        moments=moments,
        global_step=None if step is None else int(step),
        hyper={str(g): h for g, h in hyper.items()},
        path=str(path),
    )
