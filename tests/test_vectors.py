"""The jitted, sharded featurize step: determinism, 1 vs 8 devices, config and bad input."""

import dataclasses
import functools
import logging

import jax
import numpy as np
import pytest
from conftest import arch_config, covering, skip_if_not_enough_devices

from trackstar_jax import config as config_lib

# Same model / batch shapes as test_factored.py and test_grads.py.
from trackstar_jax.distributed import sharding
from trackstar_jax.features import vectors
from trackstar_jax.models import lm as model_lib
from trackstar_jax.training import step as train

VOCAB, B, T = 97, 8, 12


pytestmark = pytest.mark.usefixtures("fast_compile")  # conftest.py


@functools.lru_cache(maxsize=None)
def _state():
    cfg = model_lib.LMConfig(
        vocab_size=VOCAB,
        num_layers=2,
        embed_dim=32,
        num_heads=2,
        head_dim=16,
        mlp_dim=64,
        max_len=16,
        tie_embeddings=False,
    )
    opt = train.make_optimizer(train.OptimizerConfig(min_dim_size_to_factor=16, warmup_steps=1))
    graphdef, state = train.init_state(cfg, opt, seed=0)
    state, _ = train.train_step(state, _batch(0), graphdef=graphdef, opt=opt)
    return cfg, graphdef, state


def _batch(seed, prompt=2):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCAB, size=(B, T)).astype(np.int32)
    tokens[:, 0] = 1
    mask = np.ones((B, T), np.float32)
    mask[:, : 1 + prompt] = 0
    return {"tokens": tokens, "loss_mask": mask, "example_id": np.arange(10, 10 + B, dtype=np.int32)}


VC = vectors.VectorConfig(num_blocks=2, proj_dim=4, correction=True, proj_seed=3)


@functools.lru_cache(maxsize=None)
def _fn(num_devices, correction=True):
    cfg, graphdef, state = _state()
    vc = VC if correction else vectors.VectorConfig(num_blocks=2, proj_dim=4, correction=False, proj_seed=3)
    mesh = sharding.make_mesh(devices=jax.devices()[:num_devices])
    return vectors.make_vector_fn(graphdef, cfg, vc, state.params, state.opt_state if correction else None, mesh=mesh)


def test_deterministic_and_equal_on_1_and_8_devices():
    skip_if_not_enough_devices(8)
    cfg, graphdef, state = _state()
    batch = _batch(1)
    fn8 = _fn(8)
    first = fn8(state.params, fn8.precond, batch)
    second = fn8(state.params, fn8.precond, {k: v.copy() for k, v in batch.items()})
    np.testing.assert_array_equal(first, second)  # bit-identical across runs
    out, _ = fn8.jitted(state.params, fn8.precond, {k: batch[k] for k in ("tokens", "loss_mask")})
    assert len(out.sharding.device_set) == 8  # the batch really was split over the data axis
    fn1 = _fn(1)
    one = fn1(state.params, fn1.precond, batch)
    np.testing.assert_allclose(one, first, rtol=1e-5, atol=1e-5 * np.abs(first).max())
    assert first.shape == (B, VC.dim) and first.dtype == np.float32


def test_params_sharded_over_fsdp_give_the_same_vectors():
    skip_if_not_enough_devices(8)
    cfg, graphdef, state = _state()
    batch = _batch(1)
    mesh = sharding.make_mesh((2, 4, 1), devices=jax.devices()[:8])
    fn = vectors.make_vector_fn(graphdef, cfg, VC, state.params, state.opt_state, mesh=mesh)
    sh = vectors.param_shardings(state.params, mesh)
    assert sh["layer_0"]["mlp"]["up"]["kernel"].spec == jax.sharding.PartitionSpec(None, "fsdp")
    got = fn(state.params, fn.precond, batch)
    want = _fn(1)(state.params, _fn(1).precond, batch)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # The unchecked `jitted` (used by the index builder) places replicated params as well.
    raw, _ = fn.jitted(state.params, fn.precond, {k: batch[k] for k in ("tokens", "loss_mask")})
    np.testing.assert_array_equal(np.asarray(raw), got)


@pytest.mark.parametrize("num_devices", [1, 8])
def test_host_params_are_placed_once_and_give_the_same_vectors(num_devices):
    """Numpy parameters (what `models.hf.load_hf` returns) and device arrays outside the step's
    sharding are put there once per tree, not at every call, and give the same vectors."""
    skip_if_not_enough_devices(num_devices)
    cfg, graphdef, state = _state()
    host = jax.tree.map(np.asarray, state.params)
    fn = _fn(num_devices)
    placed = fn.place_params(host)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(placed))
    assert fn.place_params(host) is placed  # cached by tree identity
    on_device = fn.place_params(state.params)  # training's single-device arrays: placed once too
    assert fn.place_params(state.params) is on_device
    assert fn.place_params(on_device) is on_device  # already in the step's sharding: passes through
    np.testing.assert_array_equal(fn(host, fn.precond, _batch(1)), fn(state.params, fn.precond, _batch(1)))


@functools.lru_cache(maxsize=None)
def _full_v_state():
    # min_dim_size_to_factor above every dim: Adafactor keeps an element-wise V, as Adam does.
    cfg = _state()[0]
    opt = train.make_optimizer(train.OptimizerConfig(min_dim_size_to_factor=128, warmup_steps=1))
    graphdef, state = train.init_state(cfg, opt, seed=0)
    state, _ = train.train_step(state, _batch(0), graphdef=graphdef, opt=opt)
    return cfg, graphdef, state


def test_exact_v_equals_reference_on_1_and_8_devices_and_fsdp():
    # vectors.exact_v through the jitted, sharded step: 1 device, 8 on the data axis, and
    # params sharded over fsdp (2 x 4) all equal the unsharded reference path.
    skip_if_not_enough_devices(8)
    cfg, graphdef, state = _full_v_state()
    batch = _batch(4)
    meshes = {
        "1": sharding.make_mesh(devices=jax.devices()[:1]),
        "8": sharding.make_mesh(devices=jax.devices()[:8]),
        "fsdp2x4": sharding.make_mesh((2, 4, 1), devices=jax.devices()[:8]),
    }
    out = {}
    for path, exact_v in (("reference", False), ("fast", True), ("fast", False)):
        vc = vectors.VectorConfig(num_blocks=2, proj_dim=4, correction=True, proj_seed=3, path=path, exact_v=exact_v)
        for name, mesh in meshes.items():
            if (path == "reference" or not exact_v) and name != "1":
                continue  # the references run unsharded
            fn = vectors.make_vector_fn(graphdef, cfg, vc, state.params, state.opt_state, mesh=mesh)
            # the element-wise V is kept (reference, exact_v), or reduced to rank one (default fast)
            assert bool(fn.precond.full) == (path == "reference" or exact_v)
            with jax.default_matmul_precision("highest"):
                out[path, exact_v, name] = np.asarray(fn(state.params, fn.precond, batch))
    want = out["reference", False, "1"]
    assert want.shape == (B, VC.dim) and np.abs(want).max() > 0
    for name in meshes:
        got = out["fast", True, name]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max(), err_msg=name)
    # The default rank-one fast path really differs here (so the equality above is not vacuous).
    rank1 = out["fast", False, "1"]
    assert np.max(np.abs(rank1 - want)) > 1e-3 * np.abs(want).max()


def test_bad_input_errors():
    cfg, graphdef, state = _state()
    with pytest.raises(ValueError, match="correction=False"):
        vectors.make_vector_fn(graphdef, cfg, VC, state.params, None)
    fn = _fn(1)
    batch = _batch(2)
    batch["loss_mask"][3, 1:] = 0  # a query whose target is empty
    with pytest.raises(ValueError, match=r"\[13\]"):
        fn(state.params, fn.precond, batch)
    batch["example_id"][3] = -1  # ... unless it is a padding row
    assert np.all(fn(state.params, fn.precond, batch)[3] == 0)
    with pytest.raises(ValueError, match="not divisible"):
        _fn(8)(state.params, fn.precond, {k: v[:3] for k, v in batch.items()})
    nan_params = jax.tree.map(lambda x: x * np.nan, state.params)
    with pytest.raises(ValueError, match=r"NaN/inf .*\[10, 11, 12, 14, 15, 16, 17\]"):
        fn(nan_params, fn.precond, batch)
    aux = {"finite": np.array([True, False, True, False]), "num_targets": np.array([3, 3, 3, 3])}
    with pytest.raises(ValueError, match=r"\[7, 9\]"):
        vectors.check_outputs(None, aux, np.array([6, 7, 8, 9]))


def test_parameter_tree_must_match_the_block_plan():
    cfg, graphdef, state = _state()
    params = dict(state.params)
    params["layer_0"] = dict(params["layer_0"], lora={"kernel": np.ones((4, 4), np.float32)})
    with pytest.raises(ValueError, match="layer_0/lora/kernel"):
        vectors.make_block_plan(params, cfg, VC)


def test_correction_off_needs_no_optimizer_state():
    cfg, graphdef, state = _state()
    fn = _fn(8, correction=False)
    assert fn.precond is None
    out = fn(state.params, None, _batch(1))
    assert out.shape == (B, VC.dim)
    assert np.abs(out - _fn(8)(state.params, _fn(8).precond, _batch(1))).max() > 1e-3 * np.abs(out).max()


def test_config_and_layout():
    assert vectors.block_layout(vectors.VectorConfig(num_blocks=8, proj_dim=64)) == (16, 4096)
    assert vectors.VectorConfig(num_blocks=8, proj_dim=64).dim == 2**16
    assert vectors.projection_dim_for(2**12, 2) == 32
    with pytest.raises(ValueError, match="d=1000"):
        vectors.projection_dim_for(1000, 2)
    with pytest.raises(ValueError, match="output_fn"):
        vectors.VectorConfig(output_fn="kl")
    with pytest.raises(ValueError, match="vectors.path"):
        vectors.VectorConfig(path="slow")
    from experiments import base, tiny

    for mod in (base, tiny):
        vc = config_lib.from_configdict(mod.get_config()).vectors
        assert vc.dim == 2 * vc.num_blocks * vc.proj_dim**2
    with pytest.raises(ValueError, match="proj_dims"):
        config_lib.from_dict({"vectors": {"proj_dims": 3}})


# Imported architectures (issue 11): the jitted, sharded step on 1 and 8 devices, fast and
# reference paths, with and without the correction.
ARCH_CONFIGS = {
    "llama": arch_config("llama", vocab_size=VOCAB, qkv_bias=True, tie_embeddings=False),
    "gpt_neox": arch_config("gpt_neox", vocab_size=VOCAB, parallel_residual=False, tie_embeddings=True),
}


@functools.lru_cache(maxsize=None)
def _arch_state(arch):
    cfg = ARCH_CONFIGS[arch]
    opt = train.make_optimizer(train.OptimizerConfig(min_dim_size_to_factor=16, warmup_steps=1))
    graphdef, state = train.init_state(cfg, opt, seed=0)
    state, _ = train.train_step(state, _batch(0), graphdef=graphdef, opt=opt)
    return cfg, graphdef, state


# each architecture and each correction setting in CI: the pairs test_factored's eager test
# leaves (on other variants of the architectures)
@pytest.mark.parametrize("arch,correction", covering(sorted(ARCH_CONFIGS), [False, True], strength=1))
def test_imported_architectures_fast_equals_reference_on_1_and_8_devices(arch, correction):
    skip_if_not_enough_devices(8)
    cfg, graphdef, state = _arch_state(arch)
    batch = _batch(3)
    opt_state = state.opt_state if correction else None
    out = {}
    for path in ("fast", "reference"):
        vc = vectors.VectorConfig(num_blocks=2, proj_dim=4, correction=correction, proj_seed=3, path=path)
        for n in (1, 8) if path == "fast" else (1,):  # the reference is the unsharded truth
            mesh = sharding.make_mesh(devices=jax.devices()[:n])
            fn = vectors.make_vector_fn(graphdef, cfg, vc, state.params, opt_state, mesh=mesh)
            with jax.default_matmul_precision("highest"):
                out[path, n] = fn(state.params, fn.precond, batch)
    want = out["reference", 1]
    assert want.shape == (B, VC.dim) and np.abs(want).max() > 0
    for key, got in out.items():
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max(), err_msg=str(key))


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_the_step_compiled_ahead_is_the_one_calls_run():
    """`check_fits` compiles the step ahead of time on shapes; calls on host batches of that
    shape (int32, as `data.pad_batch` makes them) with the parameters as training left them run
    that executable: one trace and one XLA compile of the step in all. (Calls used to trace and
    compile again: their parameters, correction and batch were typed without the mesh.)"""
    cfg, graphdef, state = _state()
    vc = vectors.VectorConfig(num_blocks=2, proj_dim=4, correction=True, proj_seed=41, batch_size=B)  # a new step
    batches = [{**b, "loss_mask": b["loss_mask"].astype(np.int32)} for b in (_batch(1), _batch(2))]
    log = _Messages()
    logging.getLogger("jax._src.dispatch").addHandler(log)  # where jax_log_compiles writes
    jax.config.update("jax_log_compiles", True)  # process-wide
    try:
        fn = vectors.make_vector_fn(graphdef, cfg, vc, state.params, state.opt_state)
        fn.check_fits(state.params, T)
        got = [fn(state.params, fn.precond, b) for b in batches]
    finally:
        jax.config.update("jax_log_compiles", False)
        logging.getLogger("jax._src.dispatch").removeHandler(log)
    for what in ("Finished tracing vector_step", "Finished XLA compilation of jit(vector_step)"):
        assert sum(what in m for m in log.messages) == 1, (what, log.messages)
    ref = vectors.make_vector_fn(graphdef, cfg, vc, state.params, state.opt_state)  # compiled at its first call
    np.testing.assert_array_equal(got[0], ref(state.params, ref.precond, batches[0]))


def test_matmul_precision_is_traced_into_every_gemm_and_paths_agree_at_it():
    """`vectors.matmul_precision` sets the precision of every GEMM of the step that has none of
    its own (before issue 36 none was set: TF32 on a GPU, 1.2e-3 relative error): HIGHEST for
    "float32", HIGH for "tf32", the BF16_BF16_F32 algorithm for "bf16". At "bf16" the fast and
    reference paths agree (to float32 round-off here: XLA:CPU computes float32 dots in float32
    whatever is asked; on a GPU `benchmarks.featurize` compares them at the precision run)."""
    cfg, graphdef, state = _state()
    batch = {k: _batch(3)[k] for k in ("tokens", "loss_mask")}
    marks = {"float32": "HIGHEST", "tf32": "HIGH,", "bf16": "lhs_precision_type = bf16"}
    out = {}
    for precision, mark in marks.items():
        for path in ("fast", "reference"):
            vc = vectors.VectorConfig(num_blocks=2, proj_dim=4, proj_seed=3, path=path, matmul_precision=precision)
            plan = vectors.make_block_plan(state.params, cfg, vc)
            pre = vectors.make_precond(state.params, state.opt_state, vc, plan)
            projs = vectors.step_projections(vc, plan, pre)
            step = jax.jit(functools.partial(vectors.vector_step, graphdef=graphdef, vec_cfg=vc, plan=plan))
            text = step.lower(state.params, pre, batch, projs).as_text()
            dots = [line for line in text.splitlines() if "dot_general" in line and "f32>" in line.split("->")[0]]
            # the reference path's projections keep their own HIGHEST; every other GEMM takes the knob
            assert sum(mark in line for line in dots) >= len(dots) // 2 > 0, (precision, path, len(dots))
            if precision == "bf16":
                out[path] = np.asarray(step(state.params, pre, batch, projs)[0])
    np.testing.assert_allclose(out["fast"], out["reference"], rtol=1e-4, atol=1e-4 * np.abs(out["reference"]).max())
    with pytest.raises(ValueError, match="vectors.matmul_precision"):
        vectors.VectorConfig(matmul_precision="fp8")


# on 8 devices (the step's out sharding splits the batch axis of [B, sum d]); CI runs Llama, `-m slow`
# GPT-NeoX too (the companions' code is the same for both; each architecture's own vectors are
# checked against the reference in CI by test_imported_architectures_fast_equals_reference_...)
@pytest.mark.parametrize(
    "arch", [pytest.param(a, marks=pytest.mark.slow if a != "llama" else ()) for a in sorted(ARCH_CONFIGS)]
)
def test_companions_share_one_pass_and_equal_their_own_featurizers(arch):
    """A featurizer with companions (correction on and off: Exp. 4's and Exp. 1's indices; another
    k, Figure 2's d sweep; TRAK's margin rows, another output function, whose backward runs
    beside the loss's after one forward) returns each setting's vectors from one pass, equal to
    that setting's own featurizer, and TRAK's p̄ as its own pass gives it; the step is compiled
    ahead (`check_fits`) with the stacked projections; settings that cannot share a pass are
    refused, saying why."""
    skip_if_not_enough_devices(8)
    cfg, graphdef, state = _arch_state(arch)
    batch = _batch(3)
    on = vectors.VectorConfig(num_blocks=2, proj_dim=4, correction=True, proj_seed=3)
    off = vectors.VectorConfig(num_blocks=2, proj_dim=4, correction=False, proj_seed=3)
    trak = dataclasses.replace(off, output_fn="trak")
    wide = dataclasses.replace(on, proj_dim=6)  # d = 144 beside 64
    make = functools.partial(vectors.make_vector_fn, graphdef, cfg, params=state.params, opt_state=state.opt_state)
    host = {k: batch[k] for k in ("tokens", "loss_mask")}
    with jax.default_matmul_precision("highest"):
        own = [(f := make(vec_cfg=vc))(state.params, f.precond, batch) for vc in (on, off, trak, wide)]
        own_pbar = np.asarray((f := make(vec_cfg=trak)).jitted(state.params, f.precond, host)[1]["mean_prob"])
        fn = make(vec_cfg=on, companions=(off, wide, on))
        fn.check_fits(state.params, seq_len=T)
        got = fn(state.params, fn.precond, batch)
        mixed = make(vec_cfg=trak, companions=(on, off))
        mixed.check_fits(state.params, seq_len=T)
        got_mixed, aux = mixed.jitted(state.params, mixed.precond, host)
    assert fn.dims == (64, 64, 144, 64) and mixed.dims == (64,) * 3
    assert got.shape == (B, sum(fn.dims)) and got_mixed.shape == (B, 3 * on.dim)
    for i, (part, want) in enumerate(zip(fn.split(got), [own[0], own[1], own[3], own[0]])):
        np.testing.assert_allclose(part, want, rtol=1e-5, atol=1e-6 * np.abs(want).max(), err_msg=str(i))
    for i, (part, want) in enumerate(zip(mixed.split(got_mixed), [own[2], own[0], own[1]])):
        assert isinstance(part, jax.Array)  # `split` keeps device rows on the device
        np.testing.assert_allclose(
            np.asarray(part), want, rtol=1e-5, atol=1e-6 * np.abs(want).max(), err_msg=f"mixed {i}"
        )
    np.testing.assert_allclose(np.asarray(aux["mean_prob"]), own_pbar, rtol=1e-6)
    assert np.abs(own[0] - own[1]).max() > 1e-3 * np.abs(own[0]).max()  # the correction changes them
    assert np.abs(own[1] - own[2]).max() > 1e-3 * np.abs(own[1]).max()  # and the output function
    for other, why in [
        (dataclasses.replace(off, proj_seed=4), "vectors.proj_seed"),
        (dataclasses.replace(off, num_blocks=1), "vectors.num_blocks"),
        (dataclasses.replace(off, path="reference"), "fast path"),
        (dataclasses.replace(off, exact_v=True), "exact_v"),
    ]:
        with pytest.raises(ValueError, match=why):
            make(vec_cfg=on, companions=(other,))


def test_bf16_precision_rounds_the_operands_on_a_cpu():
    """XLA:CPU computes float32 GEMMs in float32 whatever precision is asked, so there
    `matmul_precision="bf16"` runs the step with the model's bf16 operand dtype
    (`vectors.PRECISION_BY_OPERANDS`): the vectors are those of `model.matmul_dtype=bfloat16` to
    float32 round-off (two programs, fused as XLA chooses; bit for bit under XLA:CPU's default
    emitters), and differ from float32's at bf16 rounding, ~100x further."""
    cfg, graphdef, state = _state()
    batch = _batch(3)
    vc = {
        p: vectors.VectorConfig(num_blocks=2, proj_dim=4, proj_seed=3, matmul_precision=p) for p in ("float32", "bf16")
    }
    got = {}
    for p, c in vc.items():
        fn = vectors.make_vector_fn(graphdef, cfg, c, state.params, state.opt_state)
        got[p] = fn(state.params, fn.precond, batch)
    bf_cfg = dataclasses.replace(cfg, matmul_dtype="bfloat16")
    bf_graphdef = model_lib.abstract_params(bf_cfg)[0]
    fn = vectors.make_vector_fn(bf_graphdef, bf_cfg, vc["float32"], state.params, state.opt_state)
    scale = np.abs(got["float32"]).max()
    np.testing.assert_allclose(got["bf16"], fn(state.params, fn.precond, batch), rtol=0, atol=1e-6 * scale)
    rel = np.abs(got["bf16"] - got["float32"]).max() / scale
    assert 1e-4 < rel < 5e-2, rel
    assert vectors.step_graphdef(bf_graphdef, bf_cfg, vc["bf16"]) is bf_graphdef  # the model's own dtype wins
