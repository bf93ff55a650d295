"""Layer blocks and the two-sided Gaussian random projection (paper §A.1.2, Eq. 3).

Block plan. The attributed parameters (all but the token embedding and attention key
biases, `lm.attributed_paths`) are pooled into `num_blocks` blocks of consecutive decoder
layers, with attention and MLP kept apart, giving `2 * num_blocks` block-sides in the order
(block0_attn, block0_mlp, block1_attn, ...):

* `layer_i/attn/*/{kernel,bias}` and `layer_i/attn_norm/{scale,bias}` -> attention side of block(i);
* `layer_i/mlp/*/{kernel,bias}` and `layer_i/mlp_norm/{scale,bias}`   -> MLP side of block(i);
* `final_norm/{scale,bias}`, `unembed/kernel` (untied, `vectors.unembed`) -> MLP side of the LAST
  block (they are position-wise maps that follow the last MLP, like it);
* anything else is an error naming the parameter.

Biases (of dense layers and of LayerNorms) are attributed like norm scales: §3 attributes
"all model parameters except the token embedding layer".

`block(i) = i * num_blocks // num_layers`: contiguous runs of layers, as even as possible
(the paper's 32 layers / 8 blocks gives 4 layers each).

Projection. Each attributed parameter `W [m, n]` (a dense kernel `[in, out]`; a 1-D norm
scale or bias `[n]` is treated as a `1 x n` matrix) is projected to
`P0 W P1^T [k, k]` with `P0 [k, m]`, `P1 [k, n]`, and the projections of a block-side are
summed. That sum is exactly the projection of the block-diagonal concatenation
`diag(W_1, W_2, ...)` by `[P0_1 | P0_2 | ...]` and `[P1_1 | P1_2 | ...]`.

Scaling. Entries are i.i.d. N(0, 1/k) (variance 1/sqrt(d_block) with d_block = k^2, our
reading of §A.1.2's N(0, 1/sqrt(d))). Then E ||P0 W P1^T||_F^2 = ||W||_F^2 for every shape,
so no module is reweighted by its shape (bergson's row-normalised projection scaled modules
by p^2/(m n) and had to be fixed to this JL scaling).

Randomness. `P0`, `P1` for a parameter come from `fold_in(key(seed), h(path))`, `h` = the
first 4 bytes of sha256 of the path string: never stored, identical on every host, and
independent of tree order, of which other parameters exist, and of the device count.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

ATTN, MLP = 0, 1
_ATTN_PARTS = ("attn", "attn_norm")
_MLP_PARTS = ("mlp", "mlp_norm")
_TOP_LEVEL_MLP = ("final_norm/scale", "final_norm/bias", "unembed/kernel")
KINDS = ("kernel", "scale", "bias")  # the last path component: dense kernel, norm scale, bias


@dataclasses.dataclass(frozen=True)
class PlanEntry:
    """One attributed parameter: its path, block-side index (`2*block + side`) and 2-D shape."""

    path: str
    side: int  # index into the [2*num_blocks] block-sides
    shape: tuple[int, int]  # as a matrix: kernels [in, out]; norm scales and biases [1, n]
    ndim: int  # 1 for norm scales and biases, 2 for kernels

    @property
    def kind(self) -> str:
        """ "kernel", "scale" or "bias" (the last path component)."""
        return self.path.rsplit("/", 1)[-1]


def layout(num_blocks: int, proj_dim: int) -> tuple[int, int]:
    """`(block-sides, dims per side) = (2 * num_blocks, k^2)`; the vector dimension d is their
    product (§A.1.2). The one place d is derived (`VectorConfig.dim`, `BlockPlan.dim` use it)."""
    return 2 * num_blocks, proj_dim**2


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """Hashable assignment of every attributed parameter to a block-side (a jit static arg)."""

    num_blocks: int
    proj_dim: int  # k per side
    entries: tuple[PlanEntry, ...]

    @property
    def num_sides(self) -> int:
        return layout(self.num_blocks, self.proj_dim)[0]

    @property
    def dim(self) -> int:
        """Vector dimension d = 2 * num_blocks * k^2 (`layout`)."""
        return math.prod(layout(self.num_blocks, self.proj_dim))

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(e.path for e in self.entries)

    def entry(self, path: str) -> PlanEntry:
        for e in self.entries:
            if e.path == path:
                return e
        raise KeyError(f"parameter {path!r} is not in the block plan (attributed: {', '.join(self.paths)})")


def _side_of(path: str, num_layers: int, num_blocks: int) -> int:
    parts = path.split("/")
    if parts[-1] not in KINDS:
        raise ValueError(f"parameter {path!r} does not fit the block plan: its name must end in one of {KINDS}")
    if path in _TOP_LEVEL_MLP:
        return 2 * (num_blocks - 1) + MLP
    if parts[0].startswith("layer_") and len(parts) >= 3:
        try:
            layer = int(parts[0][len("layer_") :])
        except ValueError:
            layer = -1
        if not 0 <= layer < num_layers:
            raise ValueError(
                f"parameter {path!r}: layer index outside 0..{num_layers - 1} (model.num_layers={num_layers})"
            )
        block = layer * num_blocks // num_layers
        if parts[1] in _ATTN_PARTS:
            return 2 * block + ATTN
        if parts[1] in _MLP_PARTS:
            return 2 * block + MLP
    raise ValueError(
        f"parameter {path!r} does not fit the block plan: expected layer_<i>/(attn|attn_norm|mlp|mlp_norm)/..., "
        f"{' or '.join(_TOP_LEVEL_MLP)}"
    )


def block_plan(shapes: Mapping[str, tuple[int, ...]], num_layers: int, num_blocks: int, proj_dim: int) -> BlockPlan:
    """Assigns every attributed parameter to one block-side.

    Args:
      shapes: `{path: shape}` of the attributed parameters (embedding already excluded).
      num_layers: decoder layers of the model.
      num_blocks: consecutive-layer blocks (1 <= num_blocks <= num_layers).
      proj_dim: k, the per-side projection size.

    Returns:
      A `BlockPlan` with entries sorted by path.

    Raises:
      ValueError: naming the parameter that fits no block, has a shape that is not 1-D/2-D,
        or the block-side that ends up empty.
    """
    if not 1 <= num_blocks <= num_layers:
        raise ValueError(f"vectors.num_blocks={num_blocks} must be in 1..model.num_layers={num_layers}")
    if proj_dim < 1:
        raise ValueError(f"vectors.proj_dim must be positive, got {proj_dim}")
    entries = []
    for path in sorted(shapes):
        shape = tuple(int(s) for s in shapes[path])
        if len(shape) not in (1, 2):
            raise ValueError(
                f"parameter {path!r} has shape {shape}: only 1-D norm scales / biases and 2-D kernels can be projected"
            )
        if (len(shape) == 2) != (path.endswith("/kernel")):
            raise ValueError(f"parameter {path!r} has shape {shape}: kernels must be 2-D, norm scales and biases 1-D")
        side = _side_of(path, num_layers, num_blocks)
        entries.append(PlanEntry(path, side, shape if len(shape) == 2 else (1, shape[0]), len(shape)))
    used = {e.side for e in entries}
    for s in range(layout(num_blocks, proj_dim)[0]):
        if s not in used:
            raise ValueError(f"block {s // 2} ({'attention' if s % 2 == ATTN else 'MLP'}) has no parameters")
    return BlockPlan(num_blocks, proj_dim, tuple(entries))


def path_hash(path: str) -> int:
    """Stable 31-bit hash of a parameter path (same on every host and Python run)."""
    return int.from_bytes(hashlib.sha256(path.encode("utf-8")).digest()[:4], "little") & 0x7FFFFFFF


def side_matrices(
    seed: int, path: str, shape: tuple[int, int], k: int, dtype: Any = jnp.float32
) -> tuple[Float[Array, "k m"], Float[Array, "k n"]]:
    """The two Gaussian projection matrices of one parameter, N(0, 1/k) entries.

    Args:
      seed: the one projection seed (`vectors.proj_seed`).
      path: the parameter path; with `seed`, the only input to the random stream.
      shape: `(m, n)` of the parameter as a matrix.
      k: per-side projection size.
      dtype: dtype of the returned matrices.

    Returns:
      `(P0 [k, m], P1 [k, n])`.
    """
    m, n = (int(s) for s in shape)
    key = jnp.uint32(seed), jnp.uint32(path_hash(path))
    std = 1.0 / math.sqrt(k)
    return tuple(_normals(*key, side, (int(k), size), std, jnp.dtype(dtype)) for side, size in enumerate((m, n)))


# A draw of `shape` is made as the first `prod(shape)` entries of a flat draw of a power-of-two
# length (at least `_FLAT_MIN`): under jax's partitionable threefry (its default) entry i of a
# draw depends on the key and i only, so the cut has the bits of a draw of `shape` itself
# (pinned in tests/test_projection.py), and every matrix up to 2^16 entries shares one compile of
# the threefry program (~0.33 s each on the 2-core CPU; 7 shapes at the pythia-14m shape). With
# the old, non-partitionable threefry the bits depend on the shape, so each shape is drawn as is.
_FLAT_MIN = 1 << 16


def _normals(seed: Array, path_h: Array, side: int, shape: tuple[int, int], std: float, dtype: Any) -> Array:
    """`std * N(0, 1)` `[k, m]` in `dtype`: side `side` (0: P0, 1: P1) of the parameter whose path
    hashes to `path_h`."""
    draw = shape
    if jax.config.jax_threefry_partitionable:
        draw = (max(_FLAT_MIN, 1 << (math.prod(shape) - 1).bit_length()),)
    return _scaled(_side_normal(seed, path_h, side, draw), shape, std, dtype)


# Jitted on its own with the seed, the path's hash and the side as arguments, so that making
# every parameter's matrices outside a step (`vectors.step_projections`) compiles the threefry
# once per length instead of dispatching each random op; the 1/sqrt(k) scale is a separate
# program (fused into the normals' computation it rounded differently).
@functools.partial(jax.jit, static_argnums=(3,))
def _side_normal(seed, path_h, side, shape):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), path_h), side)
    return jax.random.normal(key, shape, jnp.float32)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _scaled(flat, shape, std, dtype):
    """The first `prod(shape)` entries of `flat` as `shape`, times `std`, in `dtype`."""
    return (flat.reshape(-1)[: math.prod(shape)].reshape(shape) * std).astype(dtype)


def as_matrix(g: Array) -> Array:
    """A 1-D norm-scale or bias gradient `[..., n]` as `[..., 1, n]` (batched ok)."""
    return g[..., None, :]


def project_matrix(g: Float[Array, "m n"], p0: Float[Array, "k m"], p1: Float[Array, "k n"]) -> Float[Array, "k k"]:
    """`P0 G P1^T` (Eq. 3)."""
    return jnp.einsum("km,mn,ln->kl", p0, g, p1, precision=jax.lax.Precision.HIGHEST)


def project_grads(
    grads: Mapping[str, Float[Array, "b ..."]],
    plan: BlockPlan,
    seed: int,
    projections: Mapping[str, tuple[Array, Array]] | None = None,
) -> Float[Array, "b s k k"]:
    """Projects materialised per-example gradients and sums them per block-side.

    Args:
      grads: `{path: [B, *param_shape]}` for every path of the plan (already corrected).
      plan: the block plan.
      seed: projection seed.
      projections: `{path: (P0, P1)}` as `side_matrices` makes them, made outside a jitted step
        and passed in; None makes them here. Made inside a step, every parameter's threefry
        stream is inlined into its HLO (its own call per parameter): 14 MB of HLO and 28 s of
        XLA:CPU compile at 8 x 512 widths against 1 MB and 1.5 s for the fast step (issue 36).

    Returns:
      `[B, 2*num_blocks, k, k]` float32.
    """
    k = plan.proj_dim
    missing = [p for p in plan.paths if p not in grads]
    if missing:
        raise ValueError(f"no gradient for attributed parameter(s): {', '.join(missing)}")
    b = next(iter(grads.values())).shape[0]
    sides = [jnp.zeros((b, k, k), jnp.float32) for _ in range(plan.num_sides)]
    for e in plan.entries:
        g = grads[e.path].astype(jnp.float32)
        g = as_matrix(g) if e.ndim == 1 else g
        p0, p1 = side_matrices(seed, e.path, e.shape, k) if projections is None else projections[e.path]
        sides[e.side] = sides[e.side] + jnp.einsum("km,bmn,ln->bkl", p0, g, p1, precision=jax.lax.Precision.HIGHEST)
    return jnp.stack(sides, axis=1)
