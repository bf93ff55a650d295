"""The planner's figures against hand arithmetic (tiny config), and the refusal, at each
stage's start, of a step that does not fit a forced device-memory limit."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import skip_if_not_enough_devices, tiny_run_config

from trackstar_jax import config as config_lib
from trackstar_jax import index, plan, stages
from trackstar_jax.distributed import memory, runtime, sharding
from trackstar_jax.features import vectors
from trackstar_jax.models import head as head_lib
from trackstar_jax.models import layers
from trackstar_jax.models import lm as model_lib
from trackstar_jax.retrieval import stage as retrieval_stage
from trackstar_jax.retrieval import topk

pytestmark = pytest.mark.usefixtures("fast_compile")


def _hand_params(m) -> int:
    """Parameter count of the abstract model (no arrays); 155,968 is the figure README states."""
    _, params = model_lib.abstract_params(m)
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def test_figures_equal_hand_arithmetic(tiny_config):
    settings = config_lib.from_configdict(tiny_config)
    mesh = sharding.make_mesh((1, 8, 1), devices=jax.devices()[:8])
    rates = plan.Rates(flops_per_s=1e12, bytes_per_s=1e11, source="stated")
    out = plan.plan(settings, mesh, num_examples=10_000, tokens_per_example=50, rates=rates, num_queries=1000)
    n_params = out["num_params"]
    assert n_params == _hand_params(settings.model) == 155_968  # README: the 156K-parameter tiny model
    assert out["params"]["total_bytes"] == 4 * n_params  # float32
    # fsdp 8: each leaf's shard by the rule, summed by hand
    by_hand = 0
    _, abstract = model_lib.abstract_params(settings.model)
    for x in jax.tree.leaves(abstract):
        spec = sharding.fsdp_spec(x.shape, mesh)
        shape = [s // 8 if ax == "fsdp" else s for s, ax in zip(x.shape, tuple(spec) + (None,) * 8)]
        by_hand += 4 * int(np.prod(shape))
    assert out["params"]["per_device_bytes"] == by_hand < out["params"]["total_bytes"] / 4
    d = 2 * 2 * 8**2  # tiny: 2 blocks x 2 sides x k^2, k = 8
    assert out["dim"] == d
    assert out["index_bytes"] == {
        "float32": 10_000 * d * 4,
        "bfloat16": 10_000 * d * 2,
        "float16": 10_000 * d * 2,
        "int8": 10_000 * (d + 4),
    }
    assert out["r_bytes"] == 4 * 64 * 64 * 4
    assert out["retrieval_bytes_per_query_batch"] == 10_000 * d * 2
    assert out["featurize_flops"] == 6 * n_params * 10_000 * 50
    assert out["featurize_seconds"] == pytest.approx(6 * n_params * 10_000 * 50 / (1e12 * 8))
    assert out["retrieval_seconds_per_1k_queries"] == pytest.approx(16 * 10_000 * d * 2 / (1e11 * 8))  # 1000/64 -> 16
    m = out["train_step"]
    assert m["argument_bytes"] >= out["params"]["per_device_bytes"] + out["opt_state"]["per_device_bytes"]
    assert m["peak_bytes"] == m["argument_bytes"] + m["output_bytes"] + m["temp_bytes"] - m["alias_bytes"] > 0
    # Featurize (both paths; fast configured), tail-patch, retrieval: compiled on abstract shapes.
    f = out["featurize_step"]
    assert f["configured"] == "fast" and set(f) == {"fast", "reference", "configured"}
    for m in (f["fast"], f["reference"], out["tailpatch_step"]):
        assert m["argument_bytes"] >= out["params"]["per_device_bytes"]  # the parameters are an argument
        assert m["peak_bytes"] == m["argument_bytes"] + m["output_bytes"] + m["temp_bytes"] - m["alias_bytes"] > 0
    # tiny: tailpatch.batch_size 16 (a multiple of the 8 data shards), 8 queries per proponent
    assert (out["tailpatch_step"]["proponents"], out["tailpatch_step"]["queries_per_step"]) == (16, 8)
    r = out["retrieval_step"]
    assert r["chunk_rows"] == 256 and r["query_batch_size"] == 64  # tiny: read_chunk_rows 256, 64 queries a batch
    assert r["prefetch_bytes"] == (256 * d * 2 + 256 * 4) // 8  # the next bfloat16 chunk + its scales, per device
    assert r["results_bytes"] == 16 * 4 * 64 * settings.retrieval.top_k * 4  # 16 query batches, 4 [64, k] lists
    assert r["argument_bytes"] >= 64 * d * 4 + 256 * d * 2 // 8  # the float32 query batch + this device's rows
    assert plan.peaks(out) == {
        "train": out["train_step"]["peak_bytes"],
        "featurize": f["fast"]["peak_bytes"],
        "tailpatch": out["tailpatch_step"]["peak_bytes"],
        "retrieve": r["peak_bytes"],
    }
    # More rows per step, more memory per device (activations; each tail-patch pair a parameter copy).
    double = settings.replace({"vectors.batch_size": 2 * settings.vectors.batch_size, "tailpatch.batch_size": 32})
    assert plan.featurize_step_memory(double, mesh)["peak_bytes"] > f["fast"]["peak_bytes"]
    assert plan.tailpatch_step_memory(double, mesh)["peak_bytes"] > out["tailpatch_step"]["peak_bytes"]


def test_a_step_that_does_not_fit_is_refused_before_training(tmp_path, monkeypatch):
    c = tiny_run_config(num_facts=4, num_distractors=4, num_steps=2, chunk_rows=8)
    monkeypatch.setenv(memory.MEMORY_ENV, "100000")  # 100 kB: far below the train step's ~50 MB
    with pytest.raises(memory.DoesNotFitError, match=r"lower config\.train\.global_batch_size .* fsdp axis"):
        stages.train(config_lib.from_configdict(c), tmp_path)
    assert not list(tmp_path.glob("checkpoints/*"))  # no step ran, nothing saved
    monkeypatch.delenv(memory.MEMORY_ENV)
    assert memory.device_memory_limit() is None  # CPU reports no limit of its own
    memory.check_fits("train", 10**12, limit=None)  # no limit: never refused


TINY = 100_000  # bytes: far below any step of the tiny model (its featurize step needs ~5 MB)


@pytest.fixture(scope="module")
def small_run(tiny_run):
    """A 2-step tiny run (its stages write under names of this module: index_plan, ...)."""
    c = tiny_run_config(num_facts=4, num_distractors=4, num_steps=2, chunk_rows=8)
    c.index.dir = "index_plan"
    return c, tiny_run(tiny_run_config(num_facts=4, num_distractors=4, num_steps=2, chunk_rows=8))


def test_stages_refuse_a_step_that_does_not_fit_before_any_work(small_run, monkeypatch):
    c, workdir = small_run
    settings = config_lib.from_configdict(c)
    # build_index: the featurize step, before the index directory exists.
    monkeypatch.setenv(memory.MEMORY_ENV, str(TINY))
    with pytest.raises(memory.DoesNotFitError, match=r"the featurize step .* lower config\.vectors\.batch_size"):
        stages.build_index(settings, workdir)
    assert not (workdir / "index_plan").exists()
    # Without the limit it runs.
    monkeypatch.delenv(memory.MEMORY_ENV)
    assert stages.build_index(settings, workdir)["complete"]
    assert index.verify_index(workdir / "index_plan")["ok"]
    # retrieve: query featurization, before any output is written.
    queries = [retrieval_stage.TextQuery(0, "The capital of", " France")]
    monkeypatch.setenv(memory.MEMORY_ENV, str(TINY))
    with pytest.raises(memory.DoesNotFitError, match=r"the featurize step .* config\.vectors\.batch_size"):
        stages.retrieve(settings, workdir, queries, name="plan_q")
    assert not list((workdir / "retrieval").glob("plan_q*"))
    monkeypatch.delenv(memory.MEMORY_ENV)
    man = stages.retrieve(settings, workdir, queries, name="plan_q")
    assert man["num_queries"] == 1 and (workdir / "retrieval" / "plan_q.jsonl").exists()
    # evaluate: a gradient row's featurize step; without one, the tail-patch step; no output folder.
    monkeypatch.setenv(memory.MEMORY_ENV, str(TINY))
    for methods, knob in ((("trex_gold", "trackstar"), "vectors"), (("trex_gold", "bm25"), "tailpatch")):
        ev = settings.replace({"eval.methods": methods, "eval.output_dir": "eval_plan"})
        with pytest.raises(memory.DoesNotFitError, match=rf"lower config\.{knob}\.batch_size"):
            stages.evaluate(ev, workdir)
        assert not (workdir / "eval_plan").exists()


def test_check_fits_benchmark_times_every_row_and_the_tailpatch_step(small_run, capsys):
    from benchmarks import check_fits as bench

    _, workdir = small_run
    bench.main(["--workdir", str(workdir)])
    out = json.loads(capsys.readouterr().out)
    rows = config_lib.load_run_settings(workdir).eval.methods
    assert set(out["check_fits_s"]) <= set(rows) and "trackstar" in out["check_fits_s"]
    assert out["tailpatch_s"] > 0 and out["total_s"] >= out["open_run_s"] + out["tailpatch_s"]


def test_the_retrieval_read_chunk_is_refused_naming_read_chunk_rows(monkeypatch):
    """The scoring step of a 2^17-row bfloat16 read chunk (8 MB per device here) under a 1 MB limit:
    refused from shapes alone (nothing read or allocated); a 1k-row chunk fits."""
    mesh = sharding.make_mesh((8, 1, 1))
    kw = dict(num_rows=1 << 20, query_batch_size=64)
    monkeypatch.setenv(memory.MEMORY_ENV, str(1 << 20))
    bf16 = np.dtype(ml_dtypes.bfloat16)
    with pytest.raises(
        memory.DoesNotFitError, match=r"the retrieve step \(read chunks of 131072 rows x d=256 bfloat16"
    ):
        topk.check_fits(64, 256, bf16, 10, 1 << 17, mesh, **kw)
    with pytest.raises(memory.DoesNotFitError, match=r"lower config\.retrieval\.read_chunk_rows"):
        topk.check_fits(64, 256, bf16, 10, 1 << 17, mesh, **kw)
    small = topk.check_fits(64, 256, bf16, 10, 1024, mesh, **kw)
    assert small["prefetch_bytes"] == (1024 * 256 * 2 + 1024 * 4) // 8 and 0 < small["peak_bytes"] < 1 << 20


def test_dot_flops_counts_products_loops_and_branches():
    """2 per multiply-add of every dot_general, batch axes included; a scan's body `length`
    times (what XLA's `cost_analysis()` does not), a cond's costliest branch; a while loop
    (no trip count) is refused."""
    a, b = jnp.ones((3, 5)), jnp.ones((5, 7))
    assert plan.dot_flops(jnp.matmul, a, b) == 2 * 3 * 5 * 7
    x = jnp.ones((4, 3, 5))
    assert plan.dot_flops(lambda x: jnp.einsum("bij,bjk->bik", x, jnp.ones((4, 5, 2))), x) == 2 * 4 * 3 * 5 * 2
    assert plan.dot_flops(lambda x: jax.lax.map(lambda m: m @ b, x), x) == 4 * 2 * 3 * 5 * 7
    assert plan.dot_flops(jax.jit(lambda x: jax.lax.map(lambda m: m @ b, x)), x) == 4 * 2 * 3 * 5 * 7
    branches = lambda p, m: jax.lax.cond(p, lambda m: m @ b, lambda m: m @ b @ jnp.eye(7), m)  # noqa: E731
    assert plan.dot_flops(branches, True, a) == 2 * 3 * 5 * 7 + 2 * 3 * 7 * 7
    with pytest.raises(ValueError, match="while loop"):
        plan.dot_flops(lambda m: jax.lax.while_loop(lambda c: c[0, 0] < 9, lambda c: c @ c, m), jnp.ones((2, 2)))


def test_dot_flops_of_a_training_step_equal_the_hand_count():
    """A GPT-NeoX (2 layers, width 32, MLP 64, vocabulary 512; 4 x 16 targets): the train step
    (fused head) does 6 FLOPs per layer weight and per head weight per token (forward, input
    and weight gradients) and 12 t d per layer per token of attention over t positions; the
    loss alone 2 and 4 t d."""
    import functools

    import optax

    from trackstar_jax.models import hf
    from trackstar_jax.training import step as step_lib

    h, n_layers, f, v, b, t = 32, 2, 64, 512, 4, 16
    hf_cfg = dict(
        model_type="gpt_neox", hidden_size=h, num_hidden_layers=n_layers, num_attention_heads=2, intermediate_size=f,
        vocab_size=v, rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False,
        max_position_embeddings=64, hidden_act="gelu", layer_norm_eps=1e-5, rotary_emb_base=10000,
    )  # fmt: skip
    cfg = hf.config_from_hf(hf_cfg)
    graphdef, params = model_lib.split_model(model_lib.make_model(cfg))
    tokens = np.random.default_rng(0).integers(0, v, (b, t + 1)).astype(np.int32)
    batch = {"tokens": tokens, "loss_mask": np.ones_like(tokens)}
    opt = optax.sgd(0.1)
    state = step_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt.init(params))
    weights = n_layers * (4 * h * h + 2 * h * f) + h * v
    attention = 4 * t * h * n_layers
    train = plan.dot_flops(functools.partial(step_lib.train_step, graphdef=graphdef, opt=opt), state, batch)
    assert train == (6 * weights + 3 * attention) * b * t == 13_369_344
    loss = plan.dot_flops(lambda p: model_lib.nll_sum(graphdef, p, *model_lib.lm_targets(batch)), params)
    assert loss == (2 * weights + attention) * b * t


def test_calibrate_reports_each_matmul_shape_and_the_best():
    """`plan.calibrate(matmuls=...)`: one rate per `MxKxN` shape, `flops_per_s` their best
    (what peer_race's roofline uses), and the memory rate."""
    m = plan.calibrate(seconds=0.01, matmuls=((8, 16, 4), (32, 32, 32)))
    assert set(m["flops_per_s_by_shape"]) == {"8x16x4", "32x32x32"}
    assert m["flops_per_s"] == max(m["flops_per_s_by_shape"].values()) > 0
    assert m["bytes_per_s"] > 0


def test_a_target_platform_plans_its_own_featurize_step(tiny_config, monkeypatch):
    """`launch.plan --target_platform=gpu` on CPU devices compiles the accelerator's step: its
    fused head takes the whole batch as one chunk (the CPU's takes 128 tokens at a time), so the
    logits it holds at once, and its temporaries, are larger."""
    settings = config_lib.from_configdict(tiny_config)
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    monkeypatch.delenv(runtime.TARGET_ENV, raising=False)
    cpu_chunk = head_lib.head_chunk_tokens(settings.model.embed_dim)
    cpu = plan.featurize_step_memory(settings, mesh)
    monkeypatch.setenv(runtime.TARGET_ENV, "gpu")
    # the platform is read when a step is traced (the planner sets it before any): forget this
    # process's traces of the CPU's step
    vectors._jit_vector_step.cache_clear()
    jax.clear_caches()
    gpu = plan.featurize_step_memory(settings, mesh)
    vectors._jit_vector_step.cache_clear()
    jax.clear_caches()
    rows = settings.vectors.batch_size * (settings.model.max_len - 1)
    assert cpu_chunk < rows <= head_lib.head_chunk_tokens(settings.model.embed_dim)  # one chunk on the accelerator
    logits_growth = (rows - cpu_chunk) * settings.model.vocab_size * 4
    assert gpu["temp_bytes"] - cpu["temp_bytes"] >= logits_growth / 2, (gpu, cpu)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dense_layers_flatten_only_on_the_cpu_and_give_the_same_values(dtype, monkeypatch):
    """`layers.dense_matmul`: `matmul_2d` (leading axes flattened) on the CPU, an einsum for an
    accelerator target; equal values."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 5, 16)), dtype)
    w = jnp.asarray(rng.standard_normal((16, 8)), dtype)
    monkeypatch.delenv(runtime.TARGET_ENV, raising=False)
    assert "reshape" in str(jax.make_jaxpr(lambda x, w: layers.dense_matmul(x, w))(x, w))  # a new function: traced anew
    y_cpu = layers.dense_matmul(x, w)
    monkeypatch.setenv(runtime.TARGET_ENV, "tpu")
    assert "reshape" not in str(jax.make_jaxpr(lambda x, w: layers.dense_matmul(x, w))(x, w))
    y_acc = layers.dense_matmul(x, w)
    assert y_acc.shape == y_cpu.shape == (2, 5, 8) and y_acc.dtype == y_cpu.dtype == x.dtype
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == "bfloat16" else dict(rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(y_acc, np.float32), np.asarray(y_cpu, np.float32), **tol)


def test_the_flattened_dense_layers_hold_more_of_a_sharded_train_step(monkeypatch):
    """Why accelerators keep the einsum (`layers.MATMUL_FLATTEN`): with the flattening reshape a
    train step on 8 devices (one sequence each; the 8B config's shape scaled down) holds more
    temporaries; at the 8B shape 66.2 against 57.7 GB per device (BUILD_NOTES, issue 14)."""
    from experiments import paper_8b

    c = paper_8b.get_config()
    c.mesh.shape = (1, 8, 1)
    c.train.global_batch_size = 8
    c.model.num_layers, c.vectors.num_blocks = 2, 2
    c.model.embed_dim, c.model.mlp_dim, c.model.num_heads, c.model.head_dim = 1024, 4096, 8, 128
    c.model.max_len, c.model.vocab_size = 512, 4096
    settings = config_lib.from_configdict(c)
    mesh = sharding.make_mesh((1, 8, 1), devices=jax.devices()[:8])
    temp = {}
    monkeypatch.setitem(layers.LOWP_MATMUL, "cpu", ())  # the bf16 config's GEMMs as accelerators run them
    for flatten in (True, False):
        monkeypatch.setitem(layers.MATMUL_FLATTEN, "cpu", flatten)
        jax.clear_caches()
        temp[flatten] = plan.train_step_memory(settings, mesh)["temp_bytes"]
    jax.clear_caches()
    assert temp[False] < 0.95 * temp[True], temp


def test_an_import_config_plans_the_imported_model_from_its_header(tiny_config, tmp_path):
    """`model.source` set: the planner's model is the source's (its config.json alone; no weights
    exist in the folder), not base.py's shapes."""
    folder = tmp_path / "hf"
    folder.mkdir()
    hf_cfg = {
        "model_type": "llama",
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_attention_heads": 3,
        "num_key_value_heads": 1,
        "num_hidden_layers": 3,
        "vocab_size": 300,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
    }
    (folder / "config.json").write_text(json.dumps(hf_cfg))
    # As experiments/smollm2.py: the model section at base.py's defaults but source and max_len.
    settings = config_lib.from_configdict(tiny_config).replace(
        {f"model.{k}": v for k, v in config_lib.to_dict(model_lib.LMConfig(source=str(folder), max_len=64)).items()}
    )
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    rates = plan.Rates(flops_per_s=1e12, bytes_per_s=1e11, source="stated")
    out = plan.plan(settings, mesh, num_examples=100, tokens_per_example=50, rates=rates, compile_steps=False)
    m = plan.with_imported_model(settings).model
    assert (m.arch, m.num_layers, m.embed_dim, m.kv_heads, m.max_len) == ("llama", 3, 48, 1, 64)
    assert out["num_params"] == _hand_params(m) != _hand_params(settings.model)
    assert out["model"] == {"arch": "llama", "source": str(folder), "num_layers": 3}


def test_a_batch_the_mesh_cannot_split_names_the_knob_and_the_nearest_size(tiny_config):
    skip_if_not_enough_devices(8)
    mesh = sharding.make_mesh((8, 1, 1), devices=jax.devices()[:8])
    assert sharding.batch_split_error(16, mesh, "k") is None
    assert "the nearest is 8)" in sharding.batch_split_error(4, mesh, "config.vectors.batch_size")
    assert "the nearest is 8)" in sharding.batch_split_error(11, mesh, "k")
    assert "the nearest is 16)" in sharding.batch_split_error(13, mesh, "k")
    settings = config_lib.from_configdict(tiny_config).replace(
        {"vectors.batch_size": 12, "train.global_batch_size": 20, "tailpatch.batch_size": 8}
    )
    rates = plan.Rates(flops_per_s=1e12, bytes_per_s=1e11, source="stated")
    out = plan.plan(settings, mesh, num_examples=1000, tokens_per_example=50, rates=rates)
    errs = plan.errors(out)
    assert errs == sorted(
        [
            "config.train.global_batch_size=20 is not divisible by the 8 data-parallel shards of mesh "
            "{'data': 8, 'fsdp': 1, 'tensor': 1}: set it to a multiple of 8 (the nearest is 24), or shrink the "
            "data axes (config.mesh.shape)",
            "config.vectors.batch_size=12 is not divisible by the 8 data-parallel shards of mesh "
            "{'data': 8, 'fsdp': 1, 'tensor': 1}: set it to a multiple of 8 (the nearest is 16), or shrink the "
            "data axes (config.mesh.shape)",
        ]
    )
    assert set(plan.peaks(out)) == {"tailpatch", "retrieve"}
    text = "\n".join(plan.summary(out))
    assert "cannot run as configured: config.vectors.batch_size=12" in text
    assert "MiB" in text and "0.2M parameters" in text


def test_the_summary_reads_in_human_units():
    out = {
        "model": {"arch": "llama", "source": "smollm2", "num_layers": 30},
        "num_params": 134_515_008,
        "mesh": {"data": 256},
        "devices": 256,
        "params": {"total_bytes": 538 * 2**20, "per_device_bytes": 3 * 2**30},
        "opt_state": {"total_bytes": 2**20, "per_device_bytes": 2**10},
        "dim": 65536,
        "index_bytes": {"bfloat16": 5 * 2**40},
        "index_dtype": "bfloat16",
        "r_bytes": 2**30,
        "featurize_seconds": 9000.0,
        "retrieval_seconds_per_1k_queries": 200.0,
        "rates": {"source": "stated"},
    }
    text = "\n".join(plan.summary(out))
    assert "llama imported from smollm2, 134.5M parameters, 30 layers" in text
    assert "538.000 MiB, 3.000 GiB per device" in text and "bfloat16 5120.000 GiB" in text
    assert "about 2.5 hours on the mesh" in text and "about 3.3 min per 1000 queries" in text
