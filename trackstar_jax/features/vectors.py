"""TrackStar gradient features `P_d (grad Loss(z) / sqrt(V))` (paper §3 Eq. 2, §A.1.1-A.1.2).

The one jit-compiled featurize step. It returns raw projected vectors (float32, no R^{-1/2},
no unit norm: those belong to the index / Hessian stage) with layout `[2*num_blocks, k, k]`
flattened, block-sides ordered (block0_attn, block0_mlp, block1_attn, ...); see
`projection.py` for the block plan and `preconditioner.py` for the correction.

Typical use (index builder, queries, evaluation):

    fn = vectors.make_vector_fn(graphdef, model_cfg, vec_cfg, params, opt_state, mesh=mesh)
    vecs = fn(params, fn.precond, batch)            # [B, d] numpy float32, checked
    qvecs = fn_q(params, fn_q.precond, query_batch)  # fn_q built with role="query"

`batch` follows the project's batch convention (`tokens`, `loss_mask`, `example_id`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jaxtyping import Array, Float

from trackstar_jax.distributed import memory as memory_lib
from trackstar_jax.distributed import runtime
from trackstar_jax.distributed import sharding as sharding_lib
from trackstar_jax.features import factored as factored_lib
from trackstar_jax.features import grads as grads_lib
from trackstar_jax.features import preconditioner as precond_lib
from trackstar_jax.features import projection as proj_lib
from trackstar_jax.models import lm as model_lib

PATHS = ("fast", "reference")


@dataclasses.dataclass(frozen=True)
class VectorConfig:
    """Gradient-feature settings (hashable; mirrors `config.vectors`).

    Attributes:
      output_fn: "loss" | "margin" | "logit" | "trak" (§A.1.1; see grads.py).
      num_blocks: consecutive-layer blocks, attention and MLP kept apart (§A.1.2).
      proj_dim: k per side; d = 2 * num_blocks * k^2.
      proj_seed: the one projection seed.
      correction: divide by sqrt(V) from the optimizer state.
      path: "fast" (factored) or "reference" (vmap(grad), materialised).
      exact_v: on the fast path, apply an element-wise (Adam, unfactored Adafactor) V exactly
        by materialising one layer's per-example gradient at a time (`factored.py`); False:
        its Adafactor-style rank-one factorisation (no per-example gradient is materialised).
        No effect where V is rank-one (factored Adafactor) or on the reference path.
      unembed: also attribute an untied output embedding (`unembed/kernel`, joined to the last
        block's MLP side). Off by default: the paper's models tie it to the token embedding,
        which §3 leaves out, and, corrected, its vocab x d entries dominate the vector
        (`lm.UNEMBED`). No effect on tied models.
      batch_size: examples per featurize step (global; used by the pipeline).
      estimate_v_method: how V is estimated for an imported model, which ships no optimizer
        state (`training.second_moment.ESTIMATORS`): "minibatch" (the optimizer's own V: an
        Adafactor EMA over `estimate_v_steps` steps of `estimate_v_batch_sequences`-sequence
        minibatch gradients) or "per_example" (mean of squared per-example gradients).
      estimate_v_source: the text V is estimated from (`second_moment.V_SOURCES`): "heldout",
        "candidates", "lama:<relations>", "file:<path>".
      estimate_v_examples: per_example: texts whose gradients estimate V (0 = no estimate).
      estimate_v_batch_sequences: minibatch: sequences per step (B, accumulated in micro-batches of `batch_size`).
      estimate_v_steps: minibatch: optimizer steps (N; 0 = no estimate).
      estimate_v_seed: seed of the sample.
      matmul_precision: "float32" | "tf32" | "bf16": the precision of the step's float32 GEMMs
        (`runtime.MATMUL_PRECISIONS`; float32 = exact on every chip; on a CPU, "bf16" rounds
        the operands through the model's `matmul_dtype`, `PRECISION_BY_OPERANDS`, and "tf32"
        is float32; a bf16 model's GEMMs are bf16 at every setting).
    """

    output_fn: str = "loss"
    num_blocks: int = 8
    proj_dim: int = 64
    proj_seed: int = 0
    correction: bool = True
    path: str = "fast"
    exact_v: bool = False
    unembed: bool = False
    batch_size: int = 32
    estimate_v_method: str = "minibatch"
    estimate_v_source: str = "heldout"
    estimate_v_examples: int = 256
    estimate_v_batch_sequences: int = 64
    estimate_v_steps: int = 16
    estimate_v_seed: int = 0
    matmul_precision: str = "float32"

    def __post_init__(self):
        if self.matmul_precision not in runtime.MATMUL_PRECISIONS:
            raise ValueError(
                f"vectors.matmul_precision must be one of {tuple(runtime.MATMUL_PRECISIONS)}, got {self.matmul_precision!r}"
            )
        for field in ("estimate_v_examples", "estimate_v_steps"):
            if getattr(self, field) < 0:
                raise ValueError(f"vectors.{field} must be >= 0, got {getattr(self, field)}")
        if self.estimate_v_batch_sequences < 1:
            raise ValueError(f"vectors.estimate_v_batch_sequences must be >= 1, got {self.estimate_v_batch_sequences}")
        if self.output_fn not in grads_lib.OUTPUT_FNS:
            raise ValueError(f"vectors.output_fn must be one of {grads_lib.OUTPUT_FNS}, got {self.output_fn!r}")
        if self.path not in PATHS:
            raise ValueError(f"vectors.path must be one of {PATHS}, got {self.path!r}")
        for field in ("num_blocks", "proj_dim", "batch_size"):
            if getattr(self, field) <= 0:
                raise ValueError(f"vectors.{field} must be positive, got {getattr(self, field)}")

    @property
    def dim(self) -> int:
        """d = 2 * num_blocks * k^2 (`projection.layout`)."""
        return math.prod(block_layout(self))


def block_layout(cfg: VectorConfig) -> tuple[int, int]:
    """`(number of block-sides = 2 * num_blocks, dims per block-side = k^2)` (`projection.layout`)."""
    return proj_lib.layout(cfg.num_blocks, cfg.proj_dim)


# The VectorConfig fields that may differ between featurizers sharing one pass (`shared_pass_error`):
# the correction folds into the projections and k only sizes them (sets of other k stack along
# k: Figure 2's d sweep); output functions share the forward pass, each with its own backward
# (`factored.factored_vectors`); the import-time keys do not enter the step.
SHAREABLE_FIELDS = (
    "correction", "output_fn", "proj_dim", "estimate_v_method", "estimate_v_source", "estimate_v_examples",
    "estimate_v_batch_sequences", "estimate_v_steps", "estimate_v_seed",
)  # fmt: skip


def shared_pass_error(a: VectorConfig, b: VectorConfig) -> str | None:
    """Why `a` and `b` cannot be featurized in one forward and backward pass (None: they can).

    They can when they differ only in `SHAREABLE_FIELDS`, on the fast path, with every
    correction folded into the projections (`exact_v` off): the forward is the same, only the
    projections (`factored.stack_projections`, of their own k) and, for another output function,
    the backward differ."""
    if a.path != "fast" or b.path != "fast":
        return "only the fast path shares a pass (the reference path materialises each gradient)"
    if a.exact_v or b.exact_v:
        return "an element-wise correction (vectors.exact_v) does not fold into the projections"
    differ = [
        f.name
        for f in dataclasses.fields(VectorConfig)
        if f.name not in SHAREABLE_FIELDS and getattr(a, f.name) != getattr(b, f.name)
    ]
    return f"they differ in {', '.join(f'vectors.{f}' for f in differ)}" if differ else None


# Platforms whose float32 GEMMs ignore `jax.default_matmul_precision` (XLA:CPU computes them
# in float32 whatever is asked): there a precision below float32 rounds the operands itself,
# through the model's `matmul_dtype` (`layers.lowp_matmul`: float32 accumulation), so that
# `vectors.matmul_precision="bf16"` does on a CPU what it does on a GPU or TPU.
PRECISION_BY_OPERANDS = {"cpu": {"bf16": "bfloat16"}}


def step_graphdef(graphdef: nnx.GraphDef, model_cfg: model_lib.LMConfig, vec_cfg: VectorConfig) -> nnx.GraphDef:
    """The model graph the featurize step runs: `graphdef`, or on a platform that emulates
    `vec_cfg.matmul_precision` (`PRECISION_BY_OPERANDS`) the same model with that operand
    dtype, unless the model sets `matmul_dtype` itself or computes in a low-precision dtype."""
    dt = PRECISION_BY_OPERANDS.get(runtime.target_platform(), {}).get(vec_cfg.matmul_precision)
    if dt is None or model_cfg.matmul_dtype or jnp.dtype(model_cfg.dtype) != jnp.float32:
        return graphdef
    return model_lib.abstract_params(dataclasses.replace(model_cfg, matmul_dtype=dt))[0]


def make_block_plan(params: Any, model_cfg: model_lib.LMConfig, vec_cfg: VectorConfig) -> proj_lib.BlockPlan:
    """The block plan of a (possibly abstract) parameter tree; errors name the offending parameter."""
    flat = model_lib.flat_params(grads_lib.pure_params(params))
    shapes = {p: tuple(flat[p].shape) for p in model_lib.attributed_paths(flat, vec_cfg.unembed)}
    return proj_lib.block_plan(shapes, model_cfg.num_layers, vec_cfg.num_blocks, vec_cfg.proj_dim)


def make_precond(
    params: Any,
    opt_state: Any,
    vec_cfg: VectorConfig,
    plan: proj_lib.BlockPlan | None = None,
    model_cfg: model_lib.LMConfig | None = None,
) -> precond_lib.Correction | None:
    """The correction for `vec_cfg`: None when `correction=False`; otherwise read from `opt_state`
    (exact element-wise V kept for the reference path, and for the fast one with `exact_v`).
    Raises if `opt_state` is None."""
    if not vec_cfg.correction:
        return None
    if plan is None:
        if model_cfg is None:
            raise ValueError("make_precond needs the block plan or the model config")
        plan = make_block_plan(params, model_cfg, vec_cfg)
    return precond_lib.from_opt_state(
        params, opt_state, plan.paths, exact=vec_cfg.path == "reference" or vec_cfg.exact_v
    )


def step_projections(
    vec_cfg: VectorConfig, plan: proj_lib.BlockPlan, precond: precond_lib.Correction | None
) -> dict[str, tuple[Array, Array]] | None:
    """The step's projection matrices, made once per featurizer and passed to every step as an
    argument (inside the step their threefry streams would be compiled into it): the fast
    path's with the correction folded in (`factored.step_projections`), the reference path's
    plain `(P0, P1)` (it applies the correction to the materialised gradients)."""
    if vec_cfg.path != "fast":
        return factored_lib.folded_projections(plan, None, vec_cfg.proj_seed)
    return factored_lib.step_projections(plan, precond, vec_cfg.proj_seed, vec_cfg.exact_v)


def vector_step(
    params: Any,
    precond: precond_lib.Correction | None,
    batch: Mapping[str, Array],
    projections: Mapping[str, tuple[Array, Array]] | None = None,
    *,
    graphdef: nnx.GraphDef,
    vec_cfg: VectorConfig,
    plan: proj_lib.BlockPlan,
    role: str = "index",
    output_fns: tuple[str, ...] | None = None,
    set_dims: tuple[int, ...] | None = None,
) -> tuple[Float[Array, "b d"], dict[str, Array]]:
    """Pure featurize step: vectors plus per-row checks (jit it with `jit_vector_step`).

    Args:
      params: model parameters.
      precond: correction (None: no correction).
      batch: `tokens [B, T]`, `loss_mask [B, T]` (other keys are ignored).
      projections: `step_projections(vec_cfg, plan, precond)` (None: made in the step), or
        n featurizers' sets stacked (`factored.stack_projections`; fast path only).
      graphdef, vec_cfg, plan: static.
      role: "index" or "query" (only matters for output_fn="trak").
      output_fns: static; for n stacked sets, each set's output function (None: every set
        takes `vec_cfg.output_fn`), one forward for all (`factored.factored_vectors`).
      set_dims: static; each stacked set's k (`factored.factored_vectors`; None: `plan`'s).

    Returns:
      `(vectors [B, d] float32 ([B, d_0 + ... + d_{n-1}] for n stacked sets, set i's after
      set i - 1's), aux)` with
      `aux["num_targets"] [B]` (target tokens per row), `aux["finite"] [B] bool` (no NaN/inf
      in the row's vectors) and, for TRAK's index rows on the fast path, `aux["mean_prob"] [B]`
      (p̄ of the row's targets, from the same forward).
    """
    # TRAK's index rows: p̄ from the pass's own forward (the index caches Q = 1 - p̄,
    # `index.trak`); queries have no use for it
    fns = output_fns or (vec_cfg.output_fn,)
    mean_prob = vec_cfg.path == "fast" and "trak" in fns and role == "index"
    if output_fns and vec_cfg.path != "fast":
        raise ValueError("only the fast path featurizes several output functions in one pass")
    if set_dims and vec_cfg.path != "fast":
        raise ValueError("only the fast path featurizes sets of several k in one pass")
    if vec_cfg.path == "fast":
        fn = functools.partial(
            factored_lib.factored_vectors,
            exact_v=vec_cfg.exact_v,
            projections=projections,
            return_mean_prob=mean_prob,
            set_dims=set_dims,
        )
    else:
        fn = functools.partial(grads_lib.reference_vectors, projections=projections)
    batch = {"tokens": batch["tokens"], "loss_mask": batch["loss_mask"]}
    # Every GEMM traced here without its own precision takes the configured one (on a GPU the
    # float32 default would otherwise be TF32: 1.2e-3 relative error, issue 36).
    with jax.default_matmul_precision(runtime.MATMUL_PRECISIONS[vec_cfg.matmul_precision]):
        vecs = fn(
            params,
            precond,
            batch,
            graphdef=graphdef,
            plan=plan,
            output_fn=output_fns or vec_cfg.output_fn,
            role=role,
            seed=vec_cfg.proj_seed,
        )
    vecs, pbar = vecs if mean_prob else (vecs, None)
    aux = {
        "num_targets": jnp.sum(batch["loss_mask"][:, 1:] > 0, axis=-1).astype(jnp.int32),
        "finite": jnp.all(jnp.isfinite(vecs.reshape(vecs.shape[0], -1)), axis=-1),
    }
    if pbar is not None:
        aux["mean_prob"] = pbar
    return vecs, aux


def param_shardings(params: Any, mesh: Mesh) -> Any:
    """Parameter shardings for the featurize step: `sharding.fsdp_shardings` (replicated, or,
    when the mesh has an `fsdp` axis of size > 1, each parameter split along its largest
    dimension divisible by it; XLA gathers what each layer needs; the batch is split over
    (data, fsdp) as well)."""
    return sharding_lib.fsdp_shardings(params, mesh)


def jit_vector_step(
    graphdef: nnx.GraphDef,
    vec_cfg: VectorConfig,
    plan: proj_lib.BlockPlan,
    mesh: Mesh,
    role: str = "index",
    params: Any = None,
    output_fns: tuple[str, ...] | None = None,
    set_dims: tuple[int, ...] | None = None,
):
    """`vector_step` jitted with explicit shardings: batch split over (data, fsdp), correction
    replicated, vectors `[B, d]` split like the batch; parameters replicated, or split over the
    `fsdp` axis when it has size > 1 (pass `params`, possibly abstract, to derive those).
    `output_fns`, `set_dims`: see `vector_step`.

    Returns:
      `jitted(params, precond, batch, projections) -> (vectors, aux)` (`step_projections`).
    """
    params_sh = None  # replicated
    if int(mesh.shape[sharding_lib.FSDP]) > 1:
        if params is None:
            raise ValueError("jit_vector_step needs `params` (shapes) to shard them over the fsdp axis")
        leaves, treedef = jax.tree.flatten(param_shardings(grads_lib.pure_params(params), mesh))
        params_sh = (treedef, tuple(leaves))
    return _jit_vector_step(graphdef, vec_cfg, plan, mesh, role, params_sh, output_fns, set_dims)


# One jitted step per (model, settings, mesh, role): the stages' VectorFns (build_index, query
# featurization, evaluate's memory check) share it, so a shape compiled once, for a memory
# check or a batch, is not compiled again in the same process.
@functools.lru_cache(maxsize=16)
def _jit_vector_step(graphdef, vec_cfg, plan, mesh, role, params_sh, output_fns=None, set_dims=None):
    rep = sharding_lib.replicated(mesh)
    rows = NamedSharding(mesh, sharding_lib.logical_to_spec(("batch",)))
    params_sh = rep if params_sh is None else jax.tree.unflatten(params_sh[0], params_sh[1])
    step = functools.partial(
        vector_step,
        graphdef=graphdef,
        vec_cfg=vec_cfg,
        plan=plan,
        role=role,
        output_fns=output_fns,
        set_dims=set_dims,
    )
    return jax.jit(step, in_shardings=(params_sh, rep, rows, rep), out_shardings=(rows, rows))


def abstract_precond(
    params: Any, opt_state: Any, vec_cfg: VectorConfig, plan: proj_lib.BlockPlan
) -> precond_lib.Correction | None:
    """`make_precond` on shapes only (`jax.eval_shape`; parameters and optimizer state may be
    ShapeDtypeStructs): the correction's ShapeDtypeStructs, nothing computed."""
    if not vec_cfg.correction:
        return None
    return jax.eval_shape(lambda p, o: make_precond(p, o, vec_cfg, plan), params, opt_state)


def compile_vector_step(
    step: Any,
    params: Any,
    precond: Any,
    batch_size: int,
    seq_len: int,
    mesh: Mesh,
    vec_cfg: VectorConfig,
    plan: proj_lib.BlockPlan,
    projections: Any = None,
) -> Any:
    """AOT-compiles a `jit_vector_step` (on `mesh`) for a `[batch_size, seq_len]` batch on the
    shapes of `params` / `precond` (arrays or ShapeDtypeStructs; nothing is computed or
    allocated). The structs carry the step's own shardings, so that a later call with arrays of
    these shapes reuses the executable (JAX's cache of `step`; without them it compiles again).
    `projections`: the step's (stacked) projections or their shapes (None: `vec_cfg`'s own)."""
    pure = grads_lib.pure_params(params)
    rep, rows = sharding_lib.replicated(mesh), sharding_lib.batch_sharding(mesh, 2)
    params_sh = (
        param_shardings(pure, mesh) if int(mesh.shape[sharding_lib.FSDP]) > 1 else jax.tree.map(lambda _: rep, pure)
    )
    sds = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)  # noqa: E731
    batch = {k: jax.ShapeDtypeStruct((batch_size, seq_len), np.int32, sharding=rows) for k in ("tokens", "loss_mask")}
    if projections is None:
        projs = jax.eval_shape(lambda c: step_projections(vec_cfg, plan, c), precond)
    else:
        projs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), projections)
    args = (jax.tree.map(sds, pure, params_sh), jax.tree.map(lambda x: sds(x, rep), precond), batch)
    return step.lower(*args, jax.tree.map(lambda x: sds(x, rep), projs)).compile()


def featurize_step_memory(
    graphdef: nnx.GraphDef,
    model_cfg: model_lib.LMConfig,
    vec_cfg: VectorConfig,
    params: Any,
    opt_state: Any,
    mesh: Mesh,
    *,
    seq_len: int | None = None,
    role: str = "index",
) -> dict:
    """The featurize step's memory per device (`memory.compiled_memory`) for `vec_cfg.batch_size`
    rows of `seq_len` tokens (default `model_cfg.max_len`), from abstract parameters and
    optimizer state (ShapeDtypeStructs, e.g. `checkpoint.abstract_state`): the planner's figure."""
    plan = make_block_plan(params, model_cfg, vec_cfg)
    precond = abstract_precond(params, opt_state, vec_cfg, plan)
    step = jit_vector_step(step_graphdef(graphdef, model_cfg, vec_cfg), vec_cfg, plan, mesh, role, params=params)
    compiled = compile_vector_step(
        step, params, precond, vec_cfg.batch_size, seq_len or model_cfg.max_len, mesh, vec_cfg, plan
    )
    return memory_lib.compiled_memory(compiled)


def check_outputs(vectors: Any, aux: Mapping[str, Any], example_ids: Any) -> None:
    """Raises ValueError naming the example ids whose vector has NaN/inf or that have no target token.

    Padding rows (`example_id < 0`) are exempt from both checks (their vectors are discarded).
    """
    ids = np.asarray(example_ids)
    finite = np.asarray(aux["finite"])
    num_targets = np.asarray(aux["num_targets"])
    empty = ids[(num_targets == 0) & (ids >= 0)]
    if empty.size:
        raise ValueError(
            f"example id(s) {empty.tolist()} have no target tokens (loss_mask is 0 on every token after BOS; "
            "a query with an empty target?)"
        )
    bad = ids[~finite & (ids >= 0)]
    if bad.size:
        raise ValueError(f"NaN/inf in the gradient vectors of example id(s) {bad.tolist()}")
    del vectors


class VectorFn:
    """Callable featurizer: `fn(params, precond, batch) -> np.ndarray [B, d]` (checked).

    With `companions` (settings that share its pass, `shared_pass_error`), one step gives every
    setting's vectors side by side: `[B, sum(dims)]`, `vec_cfg`'s first (`split` parts them).

    Attributes:
      precond: the correction built from the optimizer state (None if correction is off).
      plan: the block plan.
      vec_cfg: the settings.
      configs: `(vec_cfg, *companions)`, the settings whose vectors a call returns.
      dims: each of `configs`' vector dimension d.
      jitted: `jitted(params, precond, batch) -> (vectors, aux)` device arrays, unchecked: the
        compiled step (`step`) after placing the parameters in their shardings.
      step: the underlying `jit_vector_step`.
      mesh: the mesh the step is sharded over.
    """

    def __init__(self, graphdef, model_cfg, vec_cfg, params, opt_state, mesh, role, companions=()):
        self.vec_cfg, self.model_cfg, self.role = vec_cfg, model_cfg, role
        self.configs = (vec_cfg, *companions)
        for c in companions:
            why = shared_pass_error(vec_cfg, c)
            if why:
                raise ValueError(f"cannot featurize {c} in the pass of {vec_cfg}: {why}")
        self.mesh = mesh if mesh is not None else sharding_lib.make_mesh()
        plans = [make_block_plan(params, model_cfg, c) for c in self.configs]
        self.plan, self.dims = plans[0], tuple(p.dim for p in plans)
        graphdef = step_graphdef(graphdef, model_cfg, vec_cfg)
        fns = tuple(c.output_fn for c in self.configs)  # several: one forward, a backward each
        ks = tuple(p.proj_dim for p in plans)  # several k: the step slices each set's own block
        self.step = jit_vector_step(
            graphdef,
            vec_cfg,
            self.plan,
            self.mesh,
            role,
            params=params,
            output_fns=fns if len(set(fns)) > 1 else None,
            set_dims=ks if len(set(ks)) > 1 else None,
        )
        self.precond = make_precond(params, opt_state, vec_cfg, self.plan)
        if self.precond is not None:
            # the step takes it replicated on the mesh (it may come from an fsdp-sharded optimizer
            # state); placed as `compile_vector_step` describes it, a call reuses that compile
            self.precond = jax.device_put(self.precond, sharding_lib.replicated(self.mesh))
        self.projections = self._projections(self.precond)
        if companions:  # the companions' projections stacked after ours: one pass serves all
            sets = [self.projections]
            for c, plan in zip(companions, plans[1:]):
                sets.append(step_projections(c, plan, make_precond(params, opt_state, c, plan)))
            self.projections = jax.device_put(factored_lib.stack_projections(sets), sharding_lib.replicated(self.mesh))
        self._placed = None  # (params as passed, the same placed in fsdp shards)

    @property
    def dim(self) -> int:
        return self.plan.dim

    def split(self, vectors: Any) -> list:
        """A call's `[B, sum(dims)]` as each setting's `[B, d_i]`, `configs`' order."""
        offs = np.cumsum(self.dims)[:-1].tolist()
        return list(jnp.split(vectors, offs, axis=1)) if isinstance(vectors, jax.Array) else np.split(vectors, offs, 1)

    def check_fits(self, params: Any, seq_len: int | None = None) -> dict:
        """Refuses (`memory.DoesNotFitError`, naming the knobs) a featurize step of
        `vec_cfg.batch_size` rows of `seq_len` tokens (default `model.max_len`, the longest
        batch) that does not fit in device memory; before any batch runs. Compiles the step on
        shapes only; the stage's own batches of that shape reuse it.

        Returns:
          The step's `memory.compiled_memory` (`{}` without an analysis).
        """
        seq_len = seq_len or self.model_cfg.max_len
        bs = self.vec_cfg.batch_size
        compiled = compile_vector_step(
            self.step, params, self.precond, bs, seq_len, self.mesh, self.vec_cfg, self.plan, self.projections
        )
        mem = memory_lib.compiled_memory(compiled)
        what = f"{self.vec_cfg.path} path, {bs} rows x {seq_len} tokens on mesh {dict(self.mesh.shape)}"
        memory_lib.check_fits("featurize", mem.get("peak_bytes"), what=what)
        return mem

    def place_params(self, params: Any) -> Any:
        """`params` in the step's shardings, placed once per parameter tree: fsdp shards when
        the mesh has an fsdp axis > 1, else replicated device arrays. Arrays already replicated
        on a mesh without fsdp pass through; host arrays (numpy, e.g. `models.hf.load_hf`'s)
        and device arrays in another sharding (training's) are put there once instead of at
        every call (at pythia-70m, 0.1 s of a 0.44 s query), typed as `compile_vector_step`
        describes them, so that calls reuse its compile."""
        fsdp = int(self.mesh.shape[sharding_lib.FSDP]) > 1
        rep = sharding_lib.replicated(self.mesh)
        if not fsdp and all(isinstance(x, jax.Array) and x.sharding == rep for x in jax.tree.leaves(params)):
            return params
        if self._placed is None or self._placed[0] is not params:
            pure = grads_lib.pure_params(params)
            sh = param_shardings(pure, self.mesh) if fsdp else rep
            self._placed = (params, jax.device_put(pure, sh))
        return self._placed[1]

    def _projections(self, precond: precond_lib.Correction | None):
        projs = step_projections(self.vec_cfg, self.plan, precond)
        if projs is not None:
            projs = jax.device_put(projs, sharding_lib.replicated(self.mesh))  # as the precond
        return projs

    def jitted(self, params: Any, precond: precond_lib.Correction | None, batch: Mapping[str, Any]):
        """The compiled step without the host-side checks: `(vectors, aux)` as device arrays."""
        host = {k: np.asarray(v) for k, v in batch.items() if not isinstance(v, jax.Array)}
        if host:  # placed as `compile_vector_step` describes the batch: a call reuses that compile
            batch = {**batch, **sharding_lib.device_batch(host, self.mesh)}
        if precond is self.precond:
            projs = self.projections
        elif len(self.configs) > 1:
            raise ValueError("a featurizer with companions runs with its own correction (fn.precond) only")
        else:
            projs = self._projections(precond)
        return self.step(self.place_params(params), precond, batch, projs)

    def __call__(self, params: Any, precond: precond_lib.Correction | None, batch: Mapping[str, Any]) -> np.ndarray:
        tokens = batch["tokens"]
        n_shards = sharding_lib.data_parallel_size(self.mesh)
        if tokens.shape[0] % n_shards:
            raise ValueError(f"batch size {tokens.shape[0]} is not divisible by the {n_shards} data shards of the mesh")
        ids = batch.get("example_id")
        ids = np.arange(tokens.shape[0]) if ids is None else np.asarray(ids)
        vecs, aux = self.jitted(params, precond, {"tokens": tokens, "loss_mask": batch["loss_mask"]})
        check_outputs(vecs, aux, ids)
        return np.asarray(vecs)


def make_vector_fn(
    graphdef: nnx.GraphDef,
    model_cfg: model_lib.LMConfig,
    vec_cfg: VectorConfig,
    params: Any,
    opt_state: Any,
    *,
    mesh: Mesh | None = None,
    role: str = "index",
    companions: tuple[VectorConfig, ...] = (),
) -> VectorFn:
    """Builds the checked, jit-compiled featurizer for one model + optimizer state.

    Args:
      graphdef: model graph definition.
      model_cfg: model config (for the number of layers).
      vec_cfg: feature settings.
      params: parameters (used for the block plan and the correction's shapes).
      opt_state: optimizer state (Adafactor or Adam); may be None when `correction=False`.
      mesh: device mesh (default: all devices on the data axis).
      role: "index" for corpus rows, "query" for queries (matters for output_fn="trak").
      companions: settings featurized in the same pass (`shared_pass_error`); a call then
        returns their vectors side by side, `[B, sum(fn.dims)]` (`fn.split`).

    Returns:
      A `VectorFn`; call it as `fn(params, fn.precond, batch)`.

    Raises:
      ValueError: bad settings, a parameter tree that does not fit the block plan (naming
        the parameter), a missing optimizer state while the correction is on, or a
        companion that cannot share the pass (saying why).
    """
    if role not in grads_lib.ROLES:
        raise ValueError(f"role must be one of {grads_lib.ROLES}, got {role!r}")
    return VectorFn(graphdef, model_cfg, vec_cfg, params, opt_state, mesh, role, tuple(companions))


def projection_dim_for(d: int, num_blocks: int) -> int:
    """k such that 2 * num_blocks * k^2 == d; raises if there is none."""
    sides = proj_lib.layout(num_blocks, 1)[0]
    k = math.isqrt(d // sides) if d % sides == 0 else 0
    if k < 1 or math.prod(proj_lib.layout(num_blocks, k)) != d:
        raise ValueError(f"d={d} is not 2 * num_blocks * k^2 for num_blocks={num_blocks}")
    return k
