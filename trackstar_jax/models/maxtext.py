"""Import of a MaxText checkpoint (its `llama2` decoder block): parameters and Adam's `nu`.

A MaxText run saves orbax checkpoints `<dir>/<step>/items` (OCDBT + zarr3) whose tree holds
`params/params/{token_embedder, decoder/...}`, the step and the optimizer state, but no model
config. `load_maxtext` reads only the parameters and Adam's second moment `nu` (with its
`count`) into host numpy (every other leaf an orbax `PLACEHOLDER`, never read), and maps both onto this project's Llama
model (`models.llama`): the same reshapes, permutations and scales for V as for the weights, so
`g / sqrt(V)` in our parameters equals Adam's `g / (sqrt(v_hat + eps_root) + eps)` in MaxText's.

Mapping (MaxText `models/llama2.py`, `layers/attentions.py`, `layers/embeddings.py`, 0.2.5):

* Layers: scanned (`decoder/layers/...`, every tensor stacked on `param_scan_axis`, 1 by
  default) or unscanned (`decoder/layers_{i}/...`); both map to `layer_{i}`.
* `self_attention/{query,key,value}/kernel` `[d, heads, head_dim]` -> `attn/*/kernel`
  `[d, heads * head_dim]`; `out/kernel` `[heads, head_dim, d]` -> `[heads * head_dim, d]`;
  `mlp/wi_0` (silu), `wi_1`, `wo` -> `mlp/gate`, `up`, `down`; `pre_self_attention_layer_norm`,
  `post_self_attention_layer_norm` -> `attn_norm`, `mlp_norm`; `decoder_norm` -> `final_norm`;
  `token_embedder/embedding` -> `embed`; `logits_dense/kernel` -> `unembed/kernel`.
* Query scaling: MaxText attends with logits `q . k` (no 1/sqrt(head_dim)); it folds the scale
  into the query kernel's initialisation (T5's convention). Ours divides by sqrt(head_dim), so
  our query kernel is MaxText's times `c = sqrt(head_dim)`; the gradient scales by `1/c`, so V
  scales by `1/c^2` (applied to Adam's whole step denominator, `eps` included, so the corrected
  gradient is unchanged).
* RoPE: `rope_type="default"` is HF's rotate-half layout (pairs `i, i + head_dim/2`), ours;
  `"llama3.1"` with `rope_use_scale=False` is the interleaved layout (pairs `2i, 2i + 1`):
  the query and key kernels' output columns are permuted within each head to rotate-half
  (q . k is unchanged since both move alike). Refused: llama3.1's frequency scaling
  (`rope_use_scale=True`), `yarn`, a `rope_linear_scaling_factor` other than 1 and a
  `rope_min_timescale` other than 1.
* Adam: `adamw` (optax `scale_by_adam`: `v_hat = nu / (1 - b2^count)`) and `adam_pax`
  (MaxText's, whose `nu` is already bias-corrected by its decay); V stored is
  `features.preconditioner.adam_equivalent_v` of `v_hat` with `adam_eps`, `adam_eps_root`.

Refused by name: decoder blocks other than llama2, optimizers without a per-element second
moment (`sgd`, `muon`), a tied output (`logits_via_embedding`, MaxText scales it by
1/sqrt(d)), fused q/k/v or MLP kernels, and any tensor this mapping does not place.

What the shapes cannot say comes from `config.maxtext` (MaxText's own key names, as the run
was configured): `decoder_block`, `rope_max_timescale`, `normalization_layer_epsilon` and
`tokenizer_path` (a Hugging Face tokenizer folder) have no default and must be set; the others
default to MaxText 0.2.5's `configs/base.yml`. Head counts and sizes are read from the shapes
(`num_query_heads` / `num_kv_heads`, when set, are checked against them).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Any, Callable, Mapping

import jax
import numpy as np

from trackstar_jax.models import hf, lm

ITEMS_DIR = "items"  # MaxText's CheckpointManager item name: <dir>/<step>/items
MAPPED_DECODER_BLOCKS = ("llama2",)
# opt_type -> whether its `nu` still needs Adam's bias correction (MaxText optimizers/optimizers.py)
ADAM_OPTIMIZERS = {"adamw": True, "adam_pax": False}
NO_SECOND_MOMENT = {"sgd": "no optimizer state", "muon": "orthogonalised momentum, no per-element second moment"}
ROPE_TYPES = ("default", "llama3.1", "yarn")


@dataclasses.dataclass(frozen=True)
class MaxTextSettings:
    """`config.maxtext`: the MaxText config keys of the run that its checkpoint does not record.

    Names and defaults are MaxText 0.2.5's (`configs/base.yml`); set each to what the MaxText
    run used. Empty / zero means "not set": `decoder_block`, `rope_max_timescale`,
    `normalization_layer_epsilon` and `tokenizer_path` must be set for a MaxText source.

    Attributes:
      step: the checkpoint step to import (-1: the latest under the directory).
      decoder_block: MaxText's `decoder_block` (only "llama2" is mapped).
      opt_type: MaxText's optimizer ("adamw", "adam_pax"; "sgd" and "muon" are refused).
      adam_b2, adam_eps, adam_eps_root: Adam's second-moment decay and epsilons.
      rope_type: "default" or "llama3.1" (with `rope_use_scale=False`); "yarn" is refused.
      rope_use_scale: llama3.1's frequency scaling (refused when true with rope_type "llama3.1").
      rope_min_timescale, rope_max_timescale: RoPE timescales (theta = rope_max_timescale).
      rope_linear_scaling_factor: "default" RoPE's linear scaling (only 1.0 is mapped).
      normalization_layer_epsilon: RMSNorm epsilon.
      max_target_length: positions the model was trained on (the imported `max_len`).
      param_scan_axis: the axis scanned layers are stacked on.
      num_query_heads, num_kv_heads: optional; checked against the kernels' shapes when set.
      tokenizer_path: a Hugging Face tokenizer folder (`tokenizer.json`) of the run's vocabulary.
    """

    step: int = -1
    decoder_block: str = ""
    opt_type: str = "adamw"
    adam_b2: float = 0.95
    adam_eps: float = 1e-8
    adam_eps_root: float = 0.0
    rope_type: str = "default"
    rope_use_scale: bool = True
    rope_min_timescale: float = 1.0
    rope_max_timescale: float = 0.0
    rope_linear_scaling_factor: float = 1.0
    normalization_layer_epsilon: float = 0.0
    max_target_length: int = 2048
    param_scan_axis: int = 1
    num_query_heads: int = 0
    num_kv_heads: int = 0
    tokenizer_path: str = ""


REQUIRED_KEYS = ("decoder_block", "rope_max_timescale", "normalization_layer_epsilon", "tokenizer_path")


def is_checkpoint(path: pathlib.Path) -> bool:
    """Whether `path` is a MaxText checkpoint: `<dir>` with `<step>/items`, `<dir>/<step>` or its `items`."""
    path = pathlib.Path(path)
    if not path.is_dir():
        return False
    if path.name == ITEMS_DIR or (path / ITEMS_DIR).is_dir():
        return True
    return any(p.name.isdigit() and (p / ITEMS_DIR).is_dir() for p in path.iterdir())


def items_dir(path: pathlib.Path, step: int = -1) -> tuple[pathlib.Path, int]:
    """`(<dir>/<step>/items, step)` of a MaxText checkpoint path (`step=-1`: the latest).

    Raises:
      FileNotFoundError: no such step (names the steps present).
    """
    path = pathlib.Path(path)
    if path.name == ITEMS_DIR:
        path = path.parent
    if (path / ITEMS_DIR).is_dir() and path.name.isdigit():
        if step not in (-1, int(path.name)):
            raise FileNotFoundError(f"maxtext.step={step} but model.source names step {path.name} ({path})")
        return path / ITEMS_DIR, int(path.name)
    steps = sorted(int(p.name) for p in path.iterdir() if p.name.isdigit() and (p / ITEMS_DIR).is_dir())
    if not steps:
        raise FileNotFoundError(f"no MaxText checkpoint (<step>/{ITEMS_DIR}) in {path}")
    if step == -1:
        step = steps[-1]
    if step not in steps:
        raise FileNotFoundError(f"maxtext.step={step}: {path} holds steps {steps}")
    return path / str(step) / ITEMS_DIR, step


def check_settings(s: MaxTextSettings, where: str) -> None:
    """Refuses missing keys and what the mapping does not cover, naming the `config.maxtext` key.

    Raises:
      ValueError: a required key is unset, or a block / optimizer / RoPE variant is not mapped.
    """
    missing = [k for k in REQUIRED_KEYS if not getattr(s, k)]
    if missing:
        raise ValueError(
            f"a MaxText checkpoint ({where}) records no model config: set "
            + ", ".join(f"config.maxtext.{k}" for k in missing)
            + " to the values the MaxText run used"
        )
    if s.decoder_block not in MAPPED_DECODER_BLOCKS:
        raise ValueError(
            f"config.maxtext.decoder_block={s.decoder_block!r} is not mapped (mapped: {', '.join(MAPPED_DECODER_BLOCKS)})"
        )
    if s.opt_type in NO_SECOND_MOMENT:
        raise ValueError(
            f"config.maxtext.opt_type={s.opt_type!r} is refused: {NO_SECOND_MOMENT[s.opt_type]} "
            "(TrackStar's correction needs Adam's per-element nu)"
        )
    if s.opt_type not in ADAM_OPTIMIZERS:
        raise ValueError(f"config.maxtext.opt_type={s.opt_type!r} is not mapped (mapped: {', '.join(ADAM_OPTIMIZERS)})")
    if s.rope_type not in ROPE_TYPES or s.rope_type == "yarn":
        raise ValueError(f"config.maxtext.rope_type={s.rope_type!r} is not mapped (mapped: 'default', 'llama3.1')")
    if s.rope_type == "llama3.1" and s.rope_use_scale:
        raise ValueError(
            "config.maxtext.rope_type='llama3.1' with rope_use_scale=True: llama3.1's RoPE frequency scaling is not mapped"
        )
    if s.rope_type == "default" and s.rope_linear_scaling_factor != 1.0:
        raise ValueError(
            f"config.maxtext.rope_linear_scaling_factor={s.rope_linear_scaling_factor} is not mapped (1.0)"
        )
    if s.rope_min_timescale != 1.0:
        raise ValueError(f"config.maxtext.rope_min_timescale={s.rope_min_timescale} is not mapped (1)")


# ---------------------------------------------------------------------------------------
# Reading the checkpoint: params and nu only (every other leaf an orbax PLACEHOLDER), into host numpy
# ---------------------------------------------------------------------------------------


def _key_name(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _flatten(tree: Any) -> dict[str, Any]:
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
    return {"/".join(_key_name(k) for k in path): leaf for path, leaf in leaves}


PARAMS_PREFIX = "params/params/"


def _tree_metadata(items: pathlib.Path, flat: bool = True) -> Any:
    """The orbax metadata tree of an `items` directory; `flat`: `{path: leaf metadata with .shape}`."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    try:
        meta = ocp.PyTreeCheckpointer().metadata(items)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"{items} is not a readable orbax checkpoint: {e}") from e
    meta = getattr(meta, "item_metadata", None) or getattr(meta, "tree", None) or meta
    return _flatten(meta) if flat else meta


def read_shapes(items: pathlib.Path) -> dict[str, tuple[int, ...]]:
    """`{MaxText param path: shape}` from the checkpoint's metadata alone (no array is read)."""
    flat = _tree_metadata(items)
    return {k[len(PARAMS_PREFIX) :]: tuple(m.shape) for k, m in flat.items() if k.startswith(PARAMS_PREFIX)}


def read_checkpoint(items: pathlib.Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], int, int]:
    """`(params, nu, count, step)` of a MaxText `items` directory, flat `{MaxText path: host array}`.

    Only `params/...`, the Adam state's `nu` and `count` and `step` are read (every other leaf
    is an orbax `PLACEHOLDER`, skipped); `mu` is not. Paths drop the leading `params/params/` (e.g.
    `decoder/layers/mlp/wi_0/kernel`).

    Raises:
      ValueError: not a MaxText train state (no `params/params`), or an optimizer state
        without an Adam `nu` mirroring the parameters (names what is there).
    """
    import orbax.checkpoint as ocp  # noqa: PLC0415

    ckptr = ocp.PyTreeCheckpointer()
    tree = _tree_metadata(items, flat=False)
    flat_meta = _flatten(tree)
    param_keys = [k for k in flat_meta if k.startswith(PARAMS_PREFIX)]
    if not param_keys:
        top = sorted({k.split("/")[0] for k in flat_meta})
        raise ValueError(f"{items} holds no params/params tree: not a MaxText train state (top keys: {top})")
    # optax's Adam state: `.../nu/params/<param path>` beside `.../count` (adamw chains it).
    nu_keys = [k for k in flat_meta if re.search(r"(^|/)nu/params/", k)]
    if not nu_keys:
        opt = sorted({k.split("/")[1] for k in flat_meta if k.startswith("opt_state/") and "/" in k})
        raise ValueError(
            f"{items}: the optimizer state has no Adam 'nu' (opt_state holds {opt or 'nothing'}); "
            "TrackStar's correction needs a per-element second moment"
        )
    nu_root = nu_keys[0][: nu_keys[0].index("nu/params/")]
    want = set(param_keys) | {k for k in nu_keys if k.startswith(nu_root + "nu/")}
    count_key = nu_root + "count"
    want |= {k for k in (count_key, "step") if k in flat_meta}
    # Everything else is an orbax PLACEHOLDER: skipped, not read (mu, the rng state, ...).

    def pick(path, leaf):
        return leaf if "/".join(_key_name(k) for k in path) in want else ocp.PLACEHOLDER

    item = jax.tree_util.tree_map_with_path(pick, tree)
    restore_args = jax.tree_util.tree_map(
        lambda x: x if x is ocp.PLACEHOLDER else ocp.RestoreArgs(restore_type=np.ndarray), item
    )
    got = _flatten(ckptr.restore(items, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args)))
    got = {k: v for k, v in got.items() if k in want}
    params = {k[len(PARAMS_PREFIX) :]: np.asarray(v) for k, v in got.items() if k.startswith(PARAMS_PREFIX)}
    prefix = nu_root + "nu/params/"
    nu = {k[len(prefix) :]: np.asarray(v) for k, v in got.items() if k.startswith(prefix)}
    if set(nu) != set(params):
        diff = sorted(set(nu) ^ set(params))[:5]
        raise ValueError(f"{items}: Adam nu does not mirror the parameters (differs at {', '.join(diff)})")
    count = int(np.asarray(got[count_key])) if count_key in got else -1
    step = int(np.asarray(got["step"])) if "step" in got else -1
    return params, nu, count, step


# ---------------------------------------------------------------------------------------
# The llama2 mapping: one conversion per tensor, applied alike to weights and V
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Map:
    """MaxText tensor -> our path: `ours = scale * convert(x)`, `V_ours = convert(V) / scale^2`."""

    ours: str
    convert: Callable[[np.ndarray], np.ndarray]
    scale: float = 1.0


def _rope_perm(head_dim: int) -> np.ndarray:
    """Column order taking the interleaved RoPE layout (pairs 2i, 2i+1) to rotate-half (i, i + hd/2)."""
    return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])


def _drop(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    return shape[:axis] + shape[axis + 1 :]


def _sizes(shapes: Mapping[str, tuple[int, ...]], s: MaxTextSettings, where: str) -> tuple[dict, bool, int]:
    """`(sizes, scanned, num_layers)` read off the kernels' shapes (`{MaxText path: shape}`)."""
    if "decoder/logits_dense/kernel" not in shapes:
        raise ValueError(
            f"{where} has no decoder/logits_dense/kernel: a tied output (logits_via_embedding=true, "
            "scaled by 1/sqrt(emb_dim) in MaxText) is not mapped"
        )
    if "token_embedder/embedding" not in shapes:
        raise ValueError(f"{where} has no token_embedder/embedding: not a MaxText decoder-only model")
    vocab, d = shapes["token_embedder/embedding"]
    scanned = any(k.startswith("decoder/layers/") for k in shapes)
    unscanned = sorted({int(m.group(1)) for k in shapes if (m := re.match(r"decoder/layers_(\d+)/", k))})
    if scanned == bool(unscanned):
        raise ValueError(
            f"{where}: expected either decoder/layers (scanned) or decoder/layers_<i>, found both or neither"
        )
    if scanned:
        pre, ax = "decoder/layers/", s.param_scan_axis
        q = shapes.get(pre + "self_attention/query/kernel")
        num_layers = q[ax] if q is not None else 0
        q, kv, wi = (
            _drop(shapes[pre + n], ax) if pre + n in shapes else None
            for n in ("self_attention/query/kernel", "self_attention/key/kernel", "mlp/wi_0/kernel")
        )
    else:
        if unscanned != list(range(len(unscanned))):
            raise ValueError(f"{where}: decoder layers {unscanned} are not numbered 0..{len(unscanned) - 1}")
        num_layers = len(unscanned)
        pre = "decoder/layers_0/"
        q, kv, wi = (
            shapes.get(pre + n) for n in ("self_attention/query/kernel", "self_attention/key/kernel", "mlp/wi_0/kernel")
        )
    if q is None or kv is None or wi is None or len(q) != 3 or len(kv) != 3:
        raise ValueError(
            f"{where}: no separate self_attention/query|key kernels [emb, heads, head_dim] and mlp/wi_0 "
            "(fused_qkv / fused_mlp checkpoints are not mapped)"
        )
    heads, head_dim = q[1:]
    kv_heads = kv[1]
    for key, got in (("num_query_heads", heads), ("num_kv_heads", kv_heads)):
        if getattr(s, key) and getattr(s, key) != got:
            raise ValueError(
                f"config.maxtext.{key}={getattr(s, key)} but the checkpoint's kernels have {got} ({where})"
            )
    sizes = dict(vocab=vocab, d=d, heads=heads, head_dim=head_dim, kv_heads=kv_heads, mlp=wi[-1])
    return sizes, scanned, num_layers


def config_from_shapes(
    shapes: Mapping[str, tuple[int, ...]],
    s: MaxTextSettings,
    where: str,
    *,
    dtype: str = "float32",
    param_dtype: str = "float32",
) -> tuple[lm.LMConfig, bool]:
    """`(LMConfig of our llama model, scanned)` from the parameters' shapes and `config.maxtext`.

    Raises:
      ValueError: unset or unmapped `config.maxtext` keys (`check_settings`), a tied output,
        fused kernels, or head counts that disagree with the shapes (named).
    """
    check_settings(s, where)
    z, scanned, num_layers = _sizes(shapes, s, where)
    cfg = lm.LMConfig(
        arch="llama",
        vocab_size=int(z["vocab"]),
        num_layers=int(num_layers),
        embed_dim=int(z["d"]),
        num_heads=int(z["heads"]),
        num_kv_heads=int(z["kv_heads"]),
        head_dim=int(z["head_dim"]),
        mlp_dim=int(z["mlp"]),
        max_len=int(s.max_target_length),
        tie_embeddings=False,
        norm="rms",
        norm_eps=float(s.normalization_layer_epsilon),
        rope_base=float(s.rope_max_timescale),
        dtype=dtype,
        param_dtype=param_dtype,
    )
    return cfg, scanned


def _mapping(cfg: lm.LMConfig, s: MaxTextSettings, scanned: bool) -> dict[str, list[tuple[_Map, int | None]]]:
    """`{MaxText path: [(map, layer index along the scan axis or None)]}` for the llama2 block."""
    hd = cfg.head_dim
    perm = _rope_perm(hd) if s.rope_type == "llama3.1" else None

    def heads_in(rope: bool) -> Callable[[np.ndarray], np.ndarray]:
        def f(x):  # [d, heads, head_dim] -> [d, heads * head_dim]
            if rope and perm is not None:
                x = x[..., perm]
            return x.reshape(x.shape[0], -1)

        return f

    def heads_out(x):  # [heads, head_dim, d] -> [heads * head_dim, d]
        return x.reshape(-1, x.shape[-1])

    def same(x):
        return x

    block = {
        "self_attention/query/kernel": _Map("attn/query/kernel", heads_in(True), float(np.sqrt(hd))),
        "self_attention/key/kernel": _Map("attn/key/kernel", heads_in(True)),
        "self_attention/value/kernel": _Map("attn/value/kernel", heads_in(False)),
        "self_attention/out/kernel": _Map("attn/out/kernel", heads_out),
        "mlp/wi_0/kernel": _Map("mlp/gate/kernel", same),
        "mlp/wi_1/kernel": _Map("mlp/up/kernel", same),
        "mlp/wo/kernel": _Map("mlp/down/kernel", same),
        "pre_self_attention_layer_norm/scale": _Map("attn_norm/scale", same),
        "post_self_attention_layer_norm/scale": _Map("mlp_norm/scale", same),
    }
    out: dict[str, list[tuple[_Map, int | None]]] = {
        "token_embedder/embedding": [(_Map("embed", same), None)],
        "decoder/decoder_norm/scale": [(_Map("final_norm/scale", same), None)],
        "decoder/logits_dense/kernel": [(_Map("unembed/kernel", same), None)],
    }
    for name, m in block.items():
        for i in range(cfg.num_layers):
            layer = _Map(f"layer_{i}/{m.ours}", m.convert, m.scale)
            if scanned:
                out.setdefault(f"decoder/layers/{name}", []).append((layer, i))
            else:
                out[f"decoder/layers_{i}/{name}"] = [(layer, None)]
    return out


def map_tensors(
    tensors: Mapping[str, np.ndarray],
    cfg: lm.LMConfig,
    s: MaxTextSettings,
    scanned: bool,
    *,
    second_moment: bool,
    where: str,
) -> dict[str, np.ndarray]:
    """MaxText tensors -> `{our path: array}`: weights (`second_moment=False`) or V (`True`).

    Raises:
      ValueError: a tensor the llama2 mapping does not place, one it needs that is missing, or a
        shape our model disagrees with (each named, with `where`).
    """
    mapping = _mapping(cfg, s, scanned)
    unknown = sorted(set(tensors) - set(mapping))
    if unknown:
        more = f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else ""
        raise ValueError(f"tensor(s) the llama2 mapping does not place in {where}: {', '.join(unknown[:5])}{more}")
    missing = sorted(set(mapping) - set(tensors))
    if missing:
        raise ValueError(f"tensor(s) missing from {where} for a llama2 decoder: {', '.join(missing[:5])}")
    pdt = np.dtype(jax.numpy.dtype(cfg.param_dtype))  # bfloat16 too (ml_dtypes), as hf.py
    flat: dict[str, np.ndarray] = {}
    for name, targets in mapping.items():
        x = np.asarray(tensors[name], np.float32)
        for m, layer in targets:
            y = m.convert(np.take(x, layer, axis=s.param_scan_axis) if layer is not None else x)
            y = y / np.float32(m.scale**2) if second_moment else y * np.float32(m.scale)
            flat[m.ours] = np.ascontiguousarray(y, dtype=np.float32 if second_moment else pdt)
    _, abstract = lm.abstract_params(cfg)
    want = {p: tuple(x.shape) for p, x in lm.flat_params(abstract).items()}
    got = {p: tuple(x.shape) for p, x in flat.items()}
    if want != got:
        diff = sorted(set(want) ^ set(got)) + sorted(p for p in set(want) & set(got) if want[p] != got[p])
        raise ValueError(f"the tensors of {where} do not fit a llama model of their own sizes at {', '.join(diff[:5])}")
    return flat


@dataclasses.dataclass(frozen=True)
class Imported:
    """What `load_maxtext` returns: our config, params and V (nested dicts of host arrays, the
    same paths), and a record."""

    cfg: lm.LMConfig
    params: dict
    v: dict
    record: dict


def load_maxtext(
    path: str | pathlib.Path,
    s: MaxTextSettings,
    second_moment: Callable[[np.ndarray, int], np.ndarray],
    *,
    dtype: str = "float32",
    param_dtype: str = "float32",
) -> Imported:
    """Reads a MaxText checkpoint (directory, `<dir>/<step>` or its `items`) into our llama model.

    Args:
      second_moment: `(nu, count) -> V` in MaxText's parameter space, elementwise (the
        importer passes Adam's exact step denominator squared,
        `features.preconditioner.adam_equivalent_v`); V is then mapped as the weights are.

    Returns:
      `Imported`: `params` a nested dict of host numpy arrays (the paths of
      `lm.abstract_params(cfg)`), `v` the flat mapped V, and `record` (source, step, count,
      optimizer keys) for `opt_state.json`.

    Raises:
      FileNotFoundError: no such step. ValueError: what `check_settings`, `read_checkpoint`
        and `map_tensors` refuse (named).
    """
    items, step = items_dir(pathlib.Path(path), s.step)
    where = str(items)
    check_settings(s, where)  # before reading any array
    raw, nu, count, saved_step = read_checkpoint(items)
    if count < 1:
        raise ValueError(f"{where}: Adam count is {count}: the checkpoint holds no optimizer update to read nu from")
    cfg, scanned = config_from_shapes(
        {k: tuple(x.shape) for k, x in raw.items()}, s, where, dtype=dtype, param_dtype=param_dtype
    )
    params = map_tensors(raw, cfg, s, scanned, second_moment=False, where=where)
    # Adam's step denominator in MaxText's parameter space (where its eps applies), then mapped.
    v_mt = {k: np.asarray(second_moment(x, count), np.float32) for k, x in nu.items()}
    v = map_tensors(v_mt, cfg, s, scanned, second_moment=True, where=where)
    record = {
        "kind": "checkpoint",
        "source": "maxtext",
        "method": "(sqrt(v_hat + adam_eps_root) + adam_eps)^2 of the checkpoint's Adam nu, v_hat bias-corrected "
        "at its count (features.preconditioner.adam_equivalent_v), mapped as the weights (models.maxtext)",
        "checkpoint": where,
        "step": step,
        "saved_step": saved_step,
        "count": count,
        "scanned_layers": scanned,
        **{
            k: getattr(s, k) for k in ("opt_type", "adam_b2", "adam_eps", "adam_eps_root", "decoder_block", "rope_type")
        },
    }
    return Imported(cfg=cfg, params=hf._unflatten(params), v=hf._unflatten(v), record=record)


def load_tokenizer(s: MaxTextSettings) -> Any:
    """The run's Hugging Face tokenizer (`config.maxtext.tokenizer_path`, a folder with tokenizer.json).

    Raises:
      ValueError: the path is not such a folder (a SentencePiece or tiktoken file is not read).
    """
    from trackstar_jax.data import hf_tokenizer  # noqa: PLC0415  (optional `tokenizers` dependency)

    folder = pathlib.Path(s.tokenizer_path).expanduser()
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(
            f"config.maxtext.tokenizer_path={s.tokenizer_path!r}: expected a Hugging Face tokenizer folder "
            "with tokenizer.json (SentencePiece / tiktoken files are not read; convert them first)"
        )
    return hf_tokenizer.HFTokenizer.from_pretrained_dir(folder)
