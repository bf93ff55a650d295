"""retrieval.py: exact sharded / streamed top-k and bottom-k vs a numpy lexsort over the full
score matrix (planted ties), over devices, mesh axis types, storage dtypes, formulations,
uneven row counts, k larger than a shard, real zarr indices, and bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import skip_if_not_enough_devices, tiny_run_config, update_compiler_config
from jax.sharding import AxisType

from trackstar_jax import config as config_lib
from trackstar_jax import index, stages
from trackstar_jax.distributed import sharding
from trackstar_jax.retrieval import kernel, native, score_plan
from trackstar_jax.retrieval import stage as retrieval_stage
from trackstar_jax.retrieval import topk as retrieval

pytestmark = pytest.mark.usefixtures("fast_compile")  # conftest.py: cheaper compiles, restored on exit

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "int8": np.int8}


def tied_data(n, d=16, q=5, seed=0):
    """Small-integer rows and queries: every score is an exact integer in float32 (any
    summation order, any dtype), so the data is full of exact ties -- plus planted duplicate
    rows across shard / block / chunk boundaries and rows scoring exactly zero."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-2, 3, (n, d)).astype(np.float32)
    for dst, src in ((n - 1, 0), (n // 2, 1), (n // 3, 1), (min(n - 2, 5), n - 3)):
        x[dst] = x[src]
    x[n // 4] = 0  # scores exactly 0 for every query (sign-of-zero canonicalisation)
    queries = rng.integers(-2, 3, (q, d)).astype(np.float32)
    return x, queries


def mesh_of(num_devices, axis_type=AxisType.Auto, shape=None):
    skip_if_not_enough_devices(num_devices)
    return sharding.make_mesh(shape, devices=jax.devices()[:num_devices], axis_type=axis_type)


def assert_exact(res, ref):
    for name, got, want in zip(retrieval.TopK._fields, res, ref):
        if name.endswith("ids"):
            np.testing.assert_array_equal(got, want, err_msg=name)
        else:
            np.testing.assert_array_equal(got, np.asarray(want, np.float32), err_msg=name)


# ------------------------------------------------------------------------------------------
# Exactness vs numpy
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_devices", [1, 8])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n, k, block_rows", [(37, 10, None), (1001, 7, 64)])
def test_topk_equals_argsort_with_ties(num_devices, dtype, n, k, block_rows):
    # n=37 on 8 devices: shards of 5 rows < k=10, 3 padding rows; n=1001, blocks of 64:
    # several blocks per shard, the last one clamped and overlapping.
    x, q = tied_data(n)
    mesh = mesh_of(num_devices)
    scale = None
    if dtype == "int8":  # int8 rows always come with a per-row scale; powers of two keep scores exact
        scale = 2.0 ** np.random.default_rng(1).integers(-2, 3, n).astype(np.float32)
    plan = retrieval.make_score_plan(len(q), x.shape[1], DTYPES[dtype], block_rows=block_rows) if block_rows else None
    res = retrieval.topk(q, x.astype(DTYPES[dtype]), k, row_scale=scale, mesh=mesh, plan=plan)
    assert_exact(res, retrieval.reference_topk(q, x, k, scale))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_running_merge_over_blocks_is_exact(monkeypatch, dtype):
    # Many queries x rows take the block-by-block running merge instead of one dot per shard.
    monkeypatch.setattr(kernel, "_SCORE_ALL", 0)
    kernel.sharded_fn.cache_clear()
    x, q = tied_data(1001)
    plan = retrieval.make_score_plan(len(q), x.shape[1], DTYPES[dtype], block_rows=64)
    assert plan.upcast in ("none", "bf16_split3", "native")
    ref = retrieval.reference_topk(q, x, 7)
    assert_exact(retrieval.topk(q, x.astype(DTYPES[dtype]), 7, mesh=mesh_of(8), plan=plan), ref)
    assert_exact(
        retrieval.stream_topk(q, retrieval.ArrayReader(x.astype(DTYPES[dtype])), 7, 300, mesh=mesh_of(8), plan=plan),
        ref,
    )
    kernel.sharded_fn.cache_clear()


def test_signed_zero_scores_tie_by_id():
    # XLA's top_k orders floats totally (+0 above -0); -0 * anything must still tie with +0.
    x, q = tied_data(64)
    x[::2] = 0  # every other row scores zero ...
    scale = np.where(np.arange(64) % 4 == 0, -1.0, 1.0).astype(np.float32)  # ... half of them as -0
    res = retrieval.topk(q, x, 64, row_scale=scale, mesh=mesh_of(8))
    assert_exact(res, retrieval.reference_topk(q, x, 64, scale))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "query_major, upcast, contract",
    [
        (True, None, "dot"),
        (False, None, "dot"),
        (True, "convert", "dot"),
        (False, "convert", "dot"),
        (False, "convert", "reduce"),
        (True, "bf16_pairs", "dot"),
        (False, "bf16_split3", "dot"),
        (False, "native", "dot"),
    ],
)
def test_every_formulation_is_exact(dtype, query_major, upcast, contract):
    x, q = tied_data(203, q=20)
    if dtype == "float32" and upcast not in (None, "native"):
        upcast = "none"
    if upcast == "native" and not native.available():
        pytest.skip("native kernels unavailable (no compiler or TRACKSTAR_JAX_NATIVE=0)")
    plan = retrieval.make_score_plan(
        len(q), x.shape[1], DTYPES[dtype], block_rows=16, query_major=query_major, upcast=upcast, contract=contract
    )
    res = retrieval.topk(q, x.astype(DTYPES[dtype]), 9, mesh=mesh_of(8), plan=plan)
    assert_exact(res, retrieval.reference_topk(q, x, 9))


def test_plan_picks_layout_by_regime():
    one = retrieval.make_score_plan(1, 4096, np.float32, backend="cpu")
    many = retrieval.make_score_plan(1024, 4096, np.float32, backend="cpu")
    assert not one.query_major and many.query_major and one.upcast == "none"
    few_bf16 = "native" if native.available() and native.isa() == "avx512" else "bf16_split3"
    assert retrieval.make_score_plan(8, 4096, np.float32, backend="cpu").upcast == few_bf16.replace(
        "bf16_split3", "none"
    )
    assert retrieval.make_score_plan(64, 4096, np.float32, backend="gpu").upcast == "none"
    assert retrieval.make_score_plan(1, 4096, ml_dtypes.bfloat16, backend="cpu").upcast == few_bf16
    assert retrieval.make_score_plan(16, 4096, ml_dtypes.bfloat16, backend="cpu").upcast == few_bf16
    assert retrieval.make_score_plan(64, 4096, ml_dtypes.bfloat16, backend="cpu").upcast == few_bf16.replace(
        "split3", "pairs"
    )
    assert retrieval.make_score_plan(128, 4096, ml_dtypes.bfloat16, backend="cpu").upcast == "bf16_pairs"
    assert retrieval.make_score_plan(1, 4096, ml_dtypes.bfloat16, backend="gpu").upcast == "bf16_split3"
    assert retrieval.make_score_plan(64, 4096, ml_dtypes.bfloat16, backend="gpu").upcast == "bf16_split3"
    assert retrieval.make_score_plan(1, 4096, np.int8, backend="cpu").upcast == "convert"
    assert many.block_rows * 1024 <= 1 << 21  # the score tile stays small


@pytest.mark.parametrize("num_devices", [1, 8])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("score_all", [None, 0])
@pytest.mark.parametrize("segment", [None, 4, 16])
def test_accelerator_plan_forced_on_cpu_is_exact(num_devices, dtype, score_all, segment):
    """The GPU/TPU plan (stored-dtype GEMMs, query-major scores, HBM tiles) run on the CPU:
    exact against the numpy lexsort, scored whole (`score_all` from the plan) or block by block
    with the running merge (score_all=0, 64-row blocks, the last one clamped), selected in one
    stage or in two (segments of 4 < k and of 16; 1001 rows and every block pad the last one)."""
    x, q = tied_data(1001)
    scale = 2.0 ** np.random.default_rng(1).integers(-2, 3, len(x)).astype(np.float32) if dtype == "int8" else None
    plan = retrieval.make_score_plan(len(q), x.shape[1], DTYPES[dtype], backend="gpu")
    assert plan.query_major and plan.score_all == score_plan._ACCEL_SCORE_ALL
    assert plan.upcast == {"float32": "none", "bfloat16": "bf16_split3"}.get(dtype, "convert")
    plan = dataclasses.replace(plan, segment=segment)
    if score_all == 0:
        plan = dataclasses.replace(plan, block_rows=64, score_all=0)
    res = retrieval.topk(q, x.astype(DTYPES[dtype]), 7, row_scale=scale, mesh=mesh_of(num_devices), plan=plan)
    assert_exact(res, retrieval.reference_topk(q, x, 7, scale))


@pytest.mark.parametrize("n, k, segment", [(1, 1, 4), (37, 10, 4), (100, 3, 7), (1024, 10, 256), (3000, 50, 64)])
def test_two_stage_selection_equals_one_top_k(n, k, segment):
    """`_select` in two stages returns what one `lax.top_k` does, values and positions, on rows
    full of ties and -inf (padding and masked rows), whatever the segment against k and n."""
    rng = np.random.default_rng(n + k)
    s = rng.integers(-3, 4, (5, n)).astype(np.float32)
    s[rng.random((5, n)) < 0.2] = -np.inf
    s[0] = -np.inf  # a row of nothing but -inf: positions in order
    s = jnp.asarray(s)
    kk = min(k, n)
    want = jax.lax.top_k(s, kk)
    got = kernel.select(s, kk, segment)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_gpu_plan_selects_few_queries_in_two_stages():
    assert retrieval.make_score_plan(1, 4096, ml_dtypes.bfloat16, backend="gpu").segment == score_plan._SEGMENT
    assert retrieval.make_score_plan(8, 4096, np.float32, backend="gpu").segment == score_plan._SEGMENT
    assert retrieval.make_score_plan(64, 4096, np.float32, backend="gpu").segment is None
    assert retrieval.make_score_plan(1, 4096, np.float32, backend="tpu").segment is None
    assert retrieval.make_score_plan(1, 4096, np.float32, backend="cpu").segment is None
    assert retrieval.make_score_plan(1, 4096, np.float32, backend="gpu", segment=None).segment is None
    with pytest.raises(ValueError, match="segment"):
        retrieval.Plan(block_rows=64, query_major=True, upcast="none", segment=0)


def test_accelerator_plan_tiles_and_precision_checks():
    one = retrieval.make_score_plan(1, 4096, ml_dtypes.bfloat16, backend="gpu")
    many = retrieval.make_score_plan(1024, 4096, ml_dtypes.bfloat16, backend="tpu")
    assert one.block_rows * 1 >= 1 << 26 and many.block_rows * 1024 == 1 << 26  # HBM tiles, not the CPU's 2^21
    assert retrieval.make_score_plan(1, 4096, np.int8, backend="gpu").block_rows * 4096 <= 1 << 28
    assert retrieval.make_score_plan(64, 4096, ml_dtypes.bfloat16, backend="cpu", precision="bf16").upcast == (
        "bf16_split3"  # bf16 pairs and the native kernel score in float32 only
    )
    with pytest.raises(ValueError, match="retrieval.precision"):
        retrieval.make_score_plan(1, 64, np.float32, precision="fp8")
    with pytest.raises(ValueError, match="float32 only"):
        retrieval.Plan(block_rows=64, query_major=False, upcast="bf16_pairs", precision="tf32")


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_lower_precisions_score_what_they_promise(backend, dtype, precision):
    """`precision="bf16"` scores the bfloat16-rounded query (and rows) exactly: equal to the
    float64 reference over the rounded values; "tf32" scores bf16 rows against a 2-term query
    split (16 significand bits): within 2^-15 of the float32 scores (XLA:CPU runs its float32
    dots at full precision, so there "tf32" on float32 rows is exact)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((300, 64)).astype(DTYPES[dtype])
    q = rng.standard_normal((6, 64)).astype(np.float32)
    plan = retrieval.make_score_plan(len(q), 64, DTYPES[dtype], backend=backend, precision=precision)
    res = retrieval.topk(q, x, 10, plan=plan)
    x32 = x.astype(np.float32)
    if precision == "bf16":
        qr, xr = (a.astype(ml_dtypes.bfloat16).astype(np.float32) for a in (q, x32))
        ts, ti, bs, bi = retrieval.reference_topk(qr, xr, 10)
        np.testing.assert_allclose(res.top_scores, ts, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(res.bottom_scores, bs, rtol=1e-6, atol=1e-6)
        # the float32 reference differs by more than float32 rounding: the check can fail
        assert np.abs(res.top_scores - retrieval.reference_topk(q, x32, 10)[0]).max() > 1e-4
    else:
        ts, ti, bs, bi = retrieval.reference_topk(q, x32, 10)
        np.testing.assert_allclose(res.top_scores, ts, rtol=2**-15, atol=2**-15 * np.abs(ts).max())
    assert (res.top_ids == ti).mean() > 0.9 and (res.bottom_ids == bi).mean() > 0.9


@pytest.mark.parametrize("num_devices", [1, 8])
@pytest.mark.parametrize(
    "dtype, nq", [("float32", 4), ("bfloat16", 4), ("bfloat16", 80)]
)  # bf16: native (or split3), pairs
def test_random_floats_match_float64_reference(num_devices, dtype, nq):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((517, 64)).astype(DTYPES[dtype])
    q = rng.standard_normal((nq, 64)).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, 517).astype(np.float32)
    res = retrieval.topk(q, x, 12, row_scale=scale, mesh=mesh_of(num_devices))
    x = x.astype(np.float32)
    ts, ti, bs, bi = retrieval.reference_topk(q, x, 12, scale)
    full = (q.astype(np.float64) @ x.T.astype(np.float64)) * scale
    np.testing.assert_allclose(res.top_scores, ts, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(res.bottom_scores, bs, rtol=1e-5, atol=1e-5)
    # every returned id really has the returned score (ids may only differ at float near-ties)
    np.testing.assert_allclose(np.take_along_axis(full, res.top_ids, 1), res.top_scores, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.take_along_axis(full, res.bottom_ids, 1), res.bottom_scores, rtol=1e-5, atol=1e-5)
    assert (res.top_ids == ti).mean() > 0.95 and (res.bottom_ids == bi).mean() > 0.95


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2)])
def test_explicit_and_auto_mesh_axes(axis_type, shape):
    x, q = tied_data(301)
    mesh = mesh_of(8, axis_type, shape)
    ref = retrieval.reference_topk(q, x, 40)  # k=40 > 38 rows per shard
    assert_exact(retrieval.topk(q, x, 40, mesh=mesh), ref)
    assert_exact(retrieval.stream_topk(q, retrieval.ArrayReader(x), 40, 100, mesh=mesh), ref)


# ------------------------------------------------------------------------------------------
# Streaming
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_devices", [1, 8])
@pytest.mark.parametrize("chunk_rows, query_batch_size", [(1, None), (100, 2), (333, 3), (1000, 1)])
def test_stream_equals_in_memory(num_devices, chunk_rows, query_batch_size):
    x, q = tied_data(700, q=7)
    mesh = mesh_of(num_devices)
    scale = 2.0 ** np.random.default_rng(2).integers(-1, 2, 700).astype(np.float32)
    reader = retrieval.ArrayReader(x.astype(np.int8), row_scale=scale)  # int8-style reader scale
    extra = np.where(np.arange(700) % 3 == 0, 0.5, 1.0).astype(np.float32)  # e.g. 1/||R^-1/2 g||
    k = 15
    streamed = retrieval.stream_topk(
        q, reader, k, chunk_rows, mesh=mesh, row_scale=extra, query_batch_size=query_batch_size
    )
    in_memory = retrieval.topk(q, x.astype(np.int8), k, row_scale=scale * extra, mesh=mesh)
    assert_exact(streamed, in_memory)
    assert_exact(streamed, retrieval.reference_topk(q, x, k, scale * extra))


def test_stream_random_floats_equals_in_memory():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((900, 32)).astype(ml_dtypes.bfloat16)
    q = rng.standard_normal((6, 32)).astype(np.float32)
    a = retrieval.stream_topk(q, retrieval.ArrayReader(x), 20, 256, mesh=mesh_of(8), query_batch_size=4)
    b = retrieval.topk(q, x, 20, mesh=mesh_of(8))
    np.testing.assert_allclose(a.top_scores, b.top_scores, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(a.bottom_scores, b.bottom_scores, rtol=1e-6, atol=1e-6)
    assert (a.top_ids == b.top_ids).mean() > 0.97 and (a.bottom_ids == b.bottom_ids).mean() > 0.97


def _tiny_index(path, dtype, num_rows=300):
    rng = np.random.default_rng(0)
    data = rng.standard_normal((num_rows, 64)).astype(np.float32)
    manifest = index.make_manifest(
        num_rows=num_rows,
        dim=64,
        num_blocks_total=4,
        storage=index.StorageConfig(dtype=dtype, chunk_rows=64),
        model={"checkpoint_step": 1, "fingerprint": "sha256:m"},
        vectors={"proj_seed": 0},
        corpus={"name": "t", "fingerprint": "sha256:c", "num_examples": num_rows},
    )
    index.IndexBuilder(path, manifest).build(lambda lo, hi: data[lo:hi])
    return index.open_index(path)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_stream_over_zarr_index(tmp_path, dtype):
    reader = _tiny_index(tmp_path / "ix", dtype)
    q = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    res = retrieval.stream_topk(q, reader, 8, 100, mesh=mesh_of(8))
    rows = reader.read_dequantized(0, reader.num_rows)
    ts, ti, bs, bi = retrieval.reference_topk(q, rows, 8)
    np.testing.assert_allclose(res.top_scores, ts, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(res.bottom_scores, bs, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(res.top_ids, ti)
    np.testing.assert_array_equal(res.bottom_ids, bi)
    same = retrieval.search(q, tmp_path / "ix", 8, chunk_rows=128)  # notebook API, by path
    np.testing.assert_array_equal(same.top_ids, ti)


def test_corrupt_chunk_error_names_the_rows(tmp_path):
    reader = _tiny_index(tmp_path / "ix", "bfloat16")
    (tmp_path / "ix" / "vectors" / "c" / "2" / "0").unlink()
    q = np.ones((2, 64), np.float32)
    with pytest.raises(index.IndexCorruptError, match=r"rows \[128, 192\)"):
        retrieval.stream_topk(q, reader, 5, 64)


# ------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------


def test_bad_k_and_shapes_are_clear_errors():
    x, q = tied_data(20)
    reader = retrieval.ArrayReader(x)
    for k in (0, -3):
        with pytest.raises(ValueError, match="k must be >= 1"):
            retrieval.topk(q, x, k)
        with pytest.raises(ValueError, match="k must be >= 1"):
            retrieval.stream_topk(q, reader, k, 8)
    with pytest.raises(ValueError, match=r"k=21 is larger than the number of index rows \(20\)"):
        retrieval.topk(q, x, 21)
    with pytest.raises(ValueError, match=r"k=21 is larger than the number of index rows \(20\)"):
        retrieval.stream_topk(q, reader, 21, 8)
    with pytest.raises(ValueError, match=r"queries must be \[num_queries, 16\]"):
        retrieval.topk(q[:, :8], x, 3)
    with pytest.raises(ValueError, match=r"row_scale has shape \(19,\), expected \(20,\)"):
        retrieval.stream_topk(q, reader, 3, 8, row_scale=np.ones(19))
    with pytest.raises(ValueError, match="unsupported row dtype float64"):
        retrieval.topk(q, x.astype(np.float64), 3)
    bad = q.copy()
    bad[2, 0] = np.nan
    with pytest.raises(ValueError, match=r"query index\(es\) \[2\]"):
        retrieval.topk(bad, x, 3)


def test_non_finite_rows_are_an_error():
    x, q = tied_data(50)
    x[7, 0] = np.inf
    with pytest.raises(ValueError, match="non-finite retrieval scores"):
        retrieval.topk(q, x, 50, mesh=mesh_of(8))


def test_empty_query_set_gives_empty_output():
    x, _ = tied_data(20)
    for res in (
        retrieval.topk(np.zeros((0, 16)), x, 4),
        retrieval.stream_topk(np.zeros((0, 16)), retrieval.ArrayReader(x), 4, 8),
    ):
        assert all(a.shape == (0, 4) for a in res)


def test_reader_errors_propagate_from_the_prefetch_thread():
    x, q = tied_data(100)

    class Broken(retrieval.ArrayReader):
        def read_block(self, start, stop):
            if start >= 50:
                raise index.IndexCorruptError(f"rows [{start}, {stop}) cannot be read")
            return super().read_block(start, stop)

    with pytest.raises(index.IndexCorruptError, match=r"rows \[50, 75\)"):
        retrieval.stream_topk(q, Broken(x), 3, 25)


# ------------------------------------------------------------------------------------------
# End to end: train the tiny model briefly -> index -> pipeline.retrieve
# ------------------------------------------------------------------------------------------


def _e2e_config():
    # 100 steps: enough for the tiny model to complete its facts (checked below).
    c = tiny_run_config(
        num_facts=12,
        num_distractors=30,
        num_steps=100,
        chunk_rows=32,
        **{"train.learning_rate": 0.02, "train.warmup_steps": 20},
    )
    c.eval.max_new_tokens = 4
    c.retrieval.read_chunk_rows = 40  # several chunks, the last one partial
    # tiny.py's d = 256 is too few dimensions for gradient cosines on this corpus: measured on
    # such a run, exact full-gradient cosine puts a stating passage first for 10/12 facts, a
    # dense JL to 256 dims of the same gradients for 1/12, to 4096 dims for 6/12 (BUILD_NOTES
    # "Issue 5"). Here d = 2 * 2 * 16^2 = 1024 with R_train (12 queries are too few for the
    # automatic R_eval mixing, which measured worse than chance on this run).
    c.vectors.proj_dim = 16
    c.hessian.mode = "train"
    return c


def _chance_mrr(n, g):
    """Expected 1/(1 + rank of the first of g gold rows) under a uniformly random ranking of n."""
    from math import comb

    return sum((comb(n - r, g) - comb(n - r - 1, g)) / comb(n, g) / (r + 1) for r in range(n - g + 1))


@pytest.fixture(scope="module")
def trained_run(tiny_run):
    """A tiny run trained until it knows its facts, with its index (module-scoped: built once)."""
    old = update_compiler_config({"jax_disable_most_optimizations": True})  # compile time dominates here
    try:
        c = _e2e_config()
        workdir = tiny_run(c, index=True)
        stages.build_index(config_lib.from_configdict(c), workdir)  # finds it built
        yield c, workdir
    finally:
        update_compiler_config(old)


def test_end_to_end_learned_facts_rank_their_passages_first(trained_run):
    import json

    c, workdir = trained_run
    n = len(stages.load_run(workdir).corpus.examples)
    c.retrieval.top_k = n  # full ranking: every row's rank is known
    man = stages.retrieve(config_lib.from_configdict(c), workdir)  # default query source: the evaluation's fact queries
    recs = [json.loads(line) for line in open(man["output"])]
    assert man["num_queries"] == len(recs) > 0 and man["k"] == n and man["index_rows"] == n
    fields = (
        "example_id",
        "inputs_plaintext",
        "targets_plaintext",
        "proponents",
        "proponent_ids",
        "proponent_scores",
        "opponents",
        "opponent_ids",
        "opponent_scores",
    )
    learned = [r for r in recs if r["model_correct"] and r["entailing_ids"]]
    assert len(learned) >= len(recs) // 2, "the tiny model should have learned most of its facts"
    for r in recs:
        assert all(f in r for f in fields)
        assert sorted(r["proponent_ids"]) == list(range(n))  # a permutation of every row
        assert r["proponent_scores"] == sorted(r["proponent_scores"], reverse=True)
        assert r["opponent_scores"] == sorted(r["opponent_scores"])
        np.testing.assert_allclose(r["opponent_scores"], r["proponent_scores"][::-1])
    first = [min(r["proponent_ids"].index(i) for i in r["entailing_ids"]) for r in learned]
    for r, f in zip(learned, first):
        assert r["proponent_correct"][f] and not any(r["proponent_correct"][:f])
    mrr = np.mean([1 / (1 + f) for f in first])
    chance = np.mean([_chance_mrr(n, len(r["entailing_ids"])) for r in learned])
    # The passages stating a learned fact rank far above chance (chance: MRR ~0.08, median first rank ~16).
    assert mrr > max(0.3, 3 * chance) and np.median(first) <= 4, (mrr, chance, first)


def test_retrieve_manifest_says_where_the_time_went(trained_run, monkeypatch):
    """The retrieval manifest's `seconds_by_part` (also the log's last line): opening the run,
    featurizing the queries, scoring / top-k over the index, writing the output, which sum to at
    most the stage's `seconds` (structure only: no figure is timed). A run handed over as
    `loaded` is not loaded again."""
    import json

    from trackstar_jax.training import checkpoint

    c, workdir = trained_run
    settings = config_lib.from_configdict(c).replace({"retrieval.output": "parts", "retrieval.queries": ""})
    man = stages.retrieve(settings, workdir)
    parts = man["seconds_by_part"]
    assert list(parts) == ["load_run", "featurize_queries", "score_topk", "write_output"]
    assert all(v >= 0 for v in parts.values()) and sum(parts.values()) <= man["seconds"]
    on_disk = json.loads((workdir / "retrieval" / "parts.manifest.json").read_text())
    assert on_disk["seconds_by_part"] == parts and on_disk["seconds"] == man["seconds"]

    loaded = stages.open_run(settings, workdir)

    def no_reload(*args, **kwargs):
        raise AssertionError("the run was loaded again")

    monkeypatch.setattr(checkpoint, "restore_state", no_reload)
    again = stages.retrieve(settings.replace({"retrieval.overwrite": True}), workdir, loaded=loaded)
    assert again["num_queries"] == man["num_queries"] and sum(again["seconds_by_part"].values()) <= again["seconds"]


def test_pipeline_refusals_and_custom_queries(trained_run, tmp_path):

    c, workdir = trained_run
    qfile = tmp_path / "mine.jsonl"
    qfile.write_text("\n")  # an empty query set is refused by name, before the run loads
    c.retrieval.queries = str(qfile)
    with pytest.raises(ValueError, match=r"mine\.jsonl: no queries \(the file is empty or blank\)"):
        stages.retrieve(config_lib.from_configdict(c), workdir)
    qfile.write_text('{"prompt": "The", "target": " capital"}\n')
    man = stages.retrieve(config_lib.from_configdict(c), workdir)
    assert man["num_queries"] == 1 and len((workdir / "retrieval" / "mine.jsonl").read_text().splitlines()) == 1
    with pytest.raises(FileExistsError, match="overwrite"):
        stages.retrieve(config_lib.from_configdict(c), workdir)
    qfile.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"mine.jsonl:1: expected an object with string fields"):
        stages.retrieve(config_lib.from_configdict(c), workdir)
    # The same checks through the Python API, on one loaded run.
    run = stages.load_run(workdir)
    mine = [retrieval_stage.TextQuery("q7", "The", " capital")]
    recs, info = retrieval_stage.retrieve_queries(run, config_lib.from_configdict(c), workdir, mine, k=3)
    assert recs[0]["example_id"] == "q7" and len(recs[0]["proponent_ids"]) == len(recs[0]["opponent_ids"]) == 3
    with pytest.raises(ValueError, match=r"top_k=1000000 must be in \[1, "):
        retrieval_stage.retrieve_queries(run, config_lib.from_configdict(c), workdir, mine, k=10**6)
    c.vectors.proj_seed = 1  # queries would be projected differently from the index
    with pytest.raises(index.IndexMismatchError, match="vectors.proj_seed"):
        retrieval_stage.retrieve_queries(run, config_lib.from_configdict(c), workdir, mine)
    c.vectors.proj_seed = 0
    import dataclasses

    other = dataclasses.replace(run, params=jax.tree.map(lambda x: x * 1.5, run.params))  # other weights
    with pytest.raises(index.IndexMismatchError, match="model.fingerprint"):
        retrieval_stage.retrieve_queries(other, config_lib.from_configdict(c), workdir, mine)
