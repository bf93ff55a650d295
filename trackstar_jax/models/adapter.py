"""Attribute a Flax linen language model the project did not write (the "any Flax model" adapter).

TrackStar needs three things from a model (`features/factored.py`, `features/grads.py`):

1. which parameters are attributed, and under which canonical path (`layer_<i>/attn/...`,
   `layer_<i>/mlp/...`, `layer_<i>/{attn,mlp}_norm`, `final_norm`, `unembed`: the path is
   the key of the block plan, the projection seed and the correction);
2. how they group into blocks: the canonical path says it (`features/projection.py`:
   consecutive `layer_<i>` runs, attention and MLP sides apart);
3. where each dense / norm layer hands `(x, y)` to the tap: its input (a norm's normalised
   input) and its output.

`LinenLM` supplies all three for a linen module `module.apply(variables, tokens [B, T]) ->
next-token logits [B, T, V]` (a causal LM that does not shift its inputs itself) from one list
of **rules**: `(regex, target)` pairs matched (`re.fullmatch`, first match wins) against each
parameterised linen module's path (`"blocks_0/attn/query"`). `target` is the canonical module
path (`re.Match.expand` syntax, e.g. `r"layer_\\1/attn/query"`), or None for a parameter that is
not attributed (the token embedding, a learned position embedding). A parameter whose module
matches no rule is refused, naming it: nothing is silently left out. Attributed modules must
be `nn.Dense`, `nn.DenseGeneral` (input axes trailing, no `batch_dims`), `nn.LayerNorm` or
`nn.RMSNorm` (last-axis features); anything else attributed is refused, naming its type.

The taps are placed with `flax.linen.intercept_methods`: around each attributed module's
`__call__`, the interceptor flattens the input axes of a `DenseGeneral` (a kernel
`[*in, *out]` is attributed as the matrix `[prod(in), prod(out)]`), calls the module, and
hands `(x, y)` to the tap as `<target>/kernel` and then `<target>/bias` (a bias `[*out]`
attributed as a vector); a norm hands its
normalised input (the same module without scale and bias) as `<target>/scale`. The output
the tap returns replaces the module's output. The parameters live in the NNX module under
their canonical paths (kernels as matrices; non-attributed ones under `unattributed/`) and
are reshaped back into the linen tree at every call, so `grads.reference_vectors` (vmap of
grad with respect to them) and `factored.factored_vectors` see the same parameters.

Worked example (tests/test_adapter.py holds the model; flax's examples style):

    rules = [
        (r"blocks_(\\d+)/attn/(query|key|value|out)", r"layer_\\1/attn/\\2"),
        (r"blocks_(\\d+)/ln_attn", r"layer_\\1/attn_norm"),
        (r"blocks_(\\d+)/mlp/(up|down)", r"layer_\\1/mlp/\\2"),
        (r"blocks_(\\d+)/ln_mlp", r"layer_\\1/mlp_norm"),
        (r"ln_final", "final_norm"),
        (r"(token_embed|pos_embed)", None),
    ]
    model = adapter.LinenLM(linen_lm, variables["params"], rules, num_layers=2)
    graphdef, params = lm.split_model(model)
    fn = vectors.make_vector_fn(graphdef, model.cfg, vec_cfg, params, opt_state)
    vecs = fn(params, fn.precond, batch)

`model.cfg` (an `AdapterConfig`) stands in for `LMConfig` where only the layer count is read
(`make_block_plan`, `make_vector_fn`). For the correction, an optimizer state is the project's
Adafactor over these canonical parameters (`training.step.train_step` with this graphdef) or V
estimated by `training.second_moment`. The launch stages rebuild models from `LMConfig`, so
an adapted model is used through the library API (features, retrieval, notebooks).
NNX models need no adapter: call `tap(path, x, y)` in their own layers (`models/layers.py`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from trackstar_jax.models import layers

UNATTRIBUTED = "unattributed"  # top-level node of the parameters a rule maps to None (lm.EXCLUDED_PARAMS)
DENSE_TYPES = (nn.Dense, nn.DenseGeneral)
NORM_TYPES = (nn.LayerNorm, nn.RMSNorm)


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    """What the featurizer reads of a model config: the number of decoder layers."""

    num_layers: int


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One linen parameter: its canonical path, linen path and linen shape."""

    path: str  # canonical ('layer_0/attn/query/kernel') or 'unattributed/<linen.path>'
    linen_path: tuple[str, ...]
    shape: tuple[int, ...]


class _Node(nnx.Module):
    """A plain container so that parameters sit at their canonical path."""


def _module_target(module_path: str, rules: Sequence[tuple[str, str | None]]) -> tuple[bool, str | None]:
    """`(matched, canonical module path or None)` for a linen module path."""
    for pattern, target in rules:
        m = re.fullmatch(pattern, module_path)
        if m:
            return True, (m.expand(target) if target is not None else None)
    return False, None


def _flatten(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, (*prefix, str(k))))
        else:
            out[(*prefix, str(k))] = v
    return out


def _unflatten(flat: Mapping[tuple[str, ...], Any]) -> dict:
    out: dict = {}
    for path, x in flat.items():
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = x
    return out


def _input_axes(module: nn.Module, x_ndim: int) -> int:
    """How many trailing axes of the input a Dense / DenseGeneral contracts (refuses other layouts)."""
    if isinstance(module, nn.Dense):
        return 1
    if module.batch_dims:
        raise ValueError(f"linen module {'/'.join(module.path)!r}: DenseGeneral batch_dims are not supported")
    axes = module.axis if isinstance(module.axis, Sequence) else (module.axis,)
    axes = sorted(a % x_ndim for a in axes)
    if axes != list(range(x_ndim - len(axes), x_ndim)):
        raise ValueError(
            f"linen module {'/'.join(module.path)!r}: DenseGeneral axis={module.axis} must be the input's trailing axes"
        )
    return len(axes)


def _normalised(module: nn.Module, x: Array) -> Array:
    """The norm's output without its scale and bias (what multiplies the scale)."""
    if (module.feature_axes not in (-1, (-1,))) or (module.reduction_axes not in (-1, (-1,))):
        raise ValueError(f"linen module {'/'.join(module.path)!r}: only last-axis norms are supported")
    off = {"use_scale": False} | ({"use_bias": False} if isinstance(module, nn.LayerNorm) else {})
    return module.clone(parent=None, name=None, **off).apply({}, x)


class LinenLM(nnx.Module):
    """A linen causal LM as a project model: `__call__(tokens [B, T], tap=None) -> logits [B, T, V]` float32.

    Args:
      module: the linen module; `module.apply({"params": params}, tokens)` gives logits.
      params: its `params` collection (nested dict of arrays).
      rules: `(regex over the linen module path, canonical module path or None)`, first match wins.
      num_layers: decoder layers (canonical `layer_<i>` for i < num_layers).

    Raises:
      ValueError: naming the linen parameter that matches no rule, an attributed parameter
        whose module cannot hand `(x, y)` to a tap (its type), two parameters mapped to one
        canonical path, or an attributed parameter that is not a kernel / scale / bias.
    """

    def __init__(
        self, module: nn.Module, params: Mapping[str, Any], rules: Sequence[tuple[str, str | None]], num_layers: int
    ):
        self.module = module
        self.cfg = AdapterConfig(int(num_layers))
        flat = _flatten(params)
        kinds = self._discover(module, params)
        leaves, targets, seen = [], {}, set()
        for lpath, x in sorted(flat.items()):
            mpath = "/".join(lpath[:-1])
            matched, target = _module_target(mpath, rules)
            if not matched:
                raise ValueError(
                    f"linen parameter {'/'.join(lpath)!r} matches no adapter rule (module {mpath!r}); "
                    "map its module to a canonical path, or to None if it is not attributed"
                )
            if target is None:
                path = f"{UNATTRIBUTED}/{'.'.join(lpath)}"
            else:
                kind = kinds.get(mpath)
                if kind is None:
                    raise ValueError(
                        f"linen parameter {'/'.join(lpath)!r}: its module is not one the adapter can tap "
                        f"({', '.join(t.__name__ for t in DENSE_TYPES + NORM_TYPES)}), or it is never called; "
                        "map it to None if it is not attributed"
                    )
                if lpath[-1] not in layers.PARAM_KINDS:
                    raise ValueError(f"linen parameter {'/'.join(lpath)!r}: attributed names are {layers.PARAM_KINDS}")
                path = f"{target}/{lpath[-1]}"
                targets[mpath] = (target, kind)
            if path in seen:
                raise ValueError(f"two linen parameters map to {path!r} (the second: {'/'.join(lpath)!r})")
            seen.add(path)
            leaves.append(_Leaf(path, lpath, tuple(x.shape)))
            value = jnp.asarray(x)
            if target is not None and lpath[-1] == "kernel":
                value = value.reshape(math.prod(x.shape[: kinds[mpath][1]]), -1)
            elif target is not None:  # a DenseGeneral bias [*out] is the 1-D bias of the matrix
                value = value.reshape(-1)
            self._set(path, nnx.Param(value))
        self._leaves = tuple(leaves)
        self._targets = tuple(sorted(targets.items()))

    def _set(self, path: str, value: nnx.Param) -> None:
        node = self
        parts = path.split("/")
        for part in parts[:-1]:
            if not hasattr(node, part):
                setattr(node, part, _Node())
            node = getattr(node, part)
        setattr(node, parts[-1], value)

    def _get(self, path: str) -> Array:
        node = self
        for part in path.split("/"):
            node = getattr(node, part)
        return node[...]

    @staticmethod
    def _discover(module: nn.Module, params: Mapping[str, Any]) -> dict[str, tuple[str, int]]:
        """`{linen module path: ("dense", input axes) | ("norm", 0)}` of the tappable modules a call reaches."""
        found: dict[str, tuple[str, int]] = {}

        def record(next_fun, args, kwargs, context):
            m = context.module
            if context.method_name == "__call__" and m.path:
                if isinstance(m, DENSE_TYPES):
                    found["/".join(m.path)] = ("dense", _input_axes(m, args[0].ndim))
                elif isinstance(m, NORM_TYPES):
                    found["/".join(m.path)] = ("norm", 0)
            return next_fun(*args, **kwargs)

        def run(p):
            with nn.intercept_methods(record):
                return module.apply({"params": p}, jnp.zeros((1, 2), jnp.int32))

        jax.eval_shape(run, params)
        return found

    def linen_params(self) -> dict:
        """The linen `params` tree from the canonical parameters (kernels reshaped back)."""
        return _unflatten({leaf.linen_path: self._get(leaf.path).reshape(leaf.shape) for leaf in self._leaves})

    def __call__(self, tokens: Int[Array, "b t"], tap: layers.Tap | None = None) -> Float[Array, "b t v"]:
        targets = dict(self._targets)

        def intercept(next_fun, args, kwargs, context):
            m = context.module
            key = "/".join(m.path) if m.path else None
            if tap is None or context.method_name != "__call__" or key not in targets:
                return next_fun(*args, **kwargs)
            target, (kind, n_in) = targets[key]
            x = args[0]
            y = next_fun(*args, **kwargs)
            lead = x.shape[: x.ndim - n_in] if kind == "dense" else x.shape[:-1]
            if len(lead) != 2:
                raise ValueError(f"linen module {key!r}: the tap needs inputs [batch, time, ...], got {x.shape}")
            y2 = y.reshape(*lead, -1)
            if kind == "dense":
                y2 = tap(f"{target}/kernel", x.reshape(*lead, -1), y2)
            else:
                y2 = tap(f"{target}/scale", _normalised(m, x), y2)
            if m.use_bias if hasattr(m, "use_bias") else False:
                y2 = tap(f"{target}/bias", None, y2)
            return y2.reshape(y.shape)

        with nn.intercept_methods(intercept):
            logits = self.module.apply({"params": self.linen_params()}, tokens)
        return logits.astype(jnp.float32)
