"""Hugging Face Trainer checkpoints (issue 54): optimizer.pt's real V in an imported run.

The fixture is a real `transformers.Trainer` run (benchmarks/hf_trainer_v.make_checkpoint: tiny.py's
Llama, 3 steps of 8 passages, weight decay 0.1) with AdamW and with Adafactor. The expected
correction is computed independently of the import: optimizer.pt loaded by `torch.load`, into
the optimizer the Trainer itself builds for the model (`Trainer.create_optimizer`), read by
parameter object and named by `model.named_parameters()`, and hand-mapped to our layout here.
The safe reader's refusals need no torch.
"""

from __future__ import annotations

import os
import pickle
import zipfile

import numpy as np
import pytest
from conftest import arch_config

from trackstar_jax.models import hf_trainer, torch_zip

pytestmark = pytest.mark.usefixtures("fast_compile")

# Our parameter path (and whether HF's tensor is transposed) of an HF Llama name.
_OURS = {
    "self_attn.q_proj.weight": ("attn/query/kernel", True),
    "self_attn.k_proj.weight": ("attn/key/kernel", True),
    "self_attn.v_proj.weight": ("attn/value/kernel", True),
    "self_attn.o_proj.weight": ("attn/out/kernel", True),
    "mlp.gate_proj.weight": ("mlp/gate/kernel", True),
    "mlp.up_proj.weight": ("mlp/up/kernel", True),
    "mlp.down_proj.weight": ("mlp/down/kernel", True),
    "input_layernorm.weight": ("attn_norm/scale", False),
    "post_attention_layernorm.weight": ("mlp_norm/scale", False),
}


def _hand_mapped(name: str) -> tuple[str, bool]:
    if name == "model.embed_tokens.weight":
        return "embed", False
    if name == "model.norm.weight":
        return "final_norm/scale", False
    if name == "lm_head.weight":
        return "unembed/kernel", True
    _, _, i, rest = name.split(".", 3)
    path, t = _OURS[rest]
    return f"layer_{i}/{path}", t


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    pytest.importorskip("torch", reason="the fixture is a real transformers.Trainer run (torch CPU)")
    pytest.importorskip("transformers", reason="the fixture is a real transformers.Trainer run")
    from benchmarks import hf_trainer_v

    root = tmp_path_factory.mktemp("trainer")
    return {o: hf_trainer_v.make_checkpoint(root / o, o, steps=3) for o in ("adamw_torch", "adafactor")}


def _torch_factors(folder, optim):
    """`{HF name: 1/sqrt(V) as the optimizer applies it}` from torch, by parameter object."""
    import torch
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(folder)
    args = transformers.TrainingArguments(
        output_dir=str(folder / "unused"), optim=optim, report_to="none", use_cpu=True
    )
    opt = transformers.Trainer(model=model, args=args).create_optimizer()
    opt.load_state_dict(torch.load(folder / hf_trainer.OPTIMIZER_FILE, weights_only=True))
    out = {}
    for group in opt.param_groups:
        for name, p in model.named_parameters():
            if not any(p is q for q in group["params"]):
                continue
            s = opt.state[p]
            if optim == "adafactor":
                if "exp_avg_sq_row" in s:
                    f = transformers.Adafactor._approx_sq_grad(s["exp_avg_sq_row"], s["exp_avg_sq_col"])
                else:
                    f = s["exp_avg_sq"].rsqrt()
            else:
                b2, eps = group["betas"][1], group["eps"]
                f = 1.0 / ((s["exp_avg_sq"] / (1 - b2 ** float(s["step"]))).sqrt() + eps)
            out[name] = f.double().numpy()
    return out


def _import(folder, workdir):
    from experiments import tiny
    from trackstar_jax import config as config_lib
    from trackstar_jax import stages

    c = tiny.get_config()
    c.model.source = str(folder)  # experiments/tiny.py's other keys as they are: V comes from optimizer.pt
    settings = config_lib.from_configdict(c)
    summary = stages.import_model(settings, workdir)
    return settings, summary, stages.load_run(workdir)


def _check_correction(run, want):
    from trackstar_jax.features import preconditioner
    from trackstar_jax.models import lm

    flat = lm.flat_params(run.params)
    corr = preconditioner.from_opt_state(run.params, run.opt_state, tuple(flat))
    assert len(want) == len(flat)
    for name, f in want.items():
        path, t = _hand_mapped(name)
        got = np.asarray(corr.elementwise(path, flat[path].shape), np.float64)
        np.testing.assert_allclose(got, f.T if t else f, rtol=2e-5, err_msg=name)


def test_adamw_v_is_exact_and_the_run_indexes_and_retrieves(checkpoints, tmp_path):
    from trackstar_jax import stages
    from trackstar_jax.index import build, store
    from trackstar_jax.retrieval import stage as retrieval_stage

    folder = checkpoints["adamw_torch"]
    settings, summary, run = _import(folder, tmp_path / "run")
    sm = summary["second_moment"]
    assert (sm["kind"], sm["source"], sm["optimizer"], sm["global_step"], sm["num_parameters"]) == (
        "checkpoint",
        "hf_trainer",
        "adamw",
        3,
        21,
    )
    # tiny.py factors matrices >= 32; AdamW's V is not rank-one, so the run keeps every v in full
    assert run.optimizer.min_dim_size_to_factor == sm["min_dim_size_to_factor"] > 512
    _check_correction(run, _torch_factors(folder, "adamw_torch"))
    assert stages.import_model(settings, tmp_path / "run") == summary  # a finished import only reports

    stages.build_index(settings, tmp_path / "run")
    man = store.read_manifest(build.index_dir(settings.index, tmp_path / "run"))
    assert man["model"]["second_moment"]["kind"] == "checkpoint" and man["model"]["second_moment"]["global_step"] == 3
    queries = [retrieval_stage.TextQuery("q0", "Monzendais is a city in", " Gasnor")]
    recs, _ = retrieval_stage.retrieve_queries(run, settings, tmp_path / "run", queries, k=5)
    ids = recs[0]["proponent_ids"]
    assert len(set(ids)) == 5 and all(0 <= i < len(run.corpus.examples) for i in ids)


def test_adafactor_v_is_exact(checkpoints, tmp_path):
    folder = checkpoints["adafactor"]
    _, summary, run = _import(folder, tmp_path / "run")
    assert summary["second_moment"]["optimizer"] == "adafactor"
    assert run.optimizer.min_dim_size_to_factor == 32  # rank-one: tiny.py's factoring holds it exactly
    _check_correction(run, _torch_factors(folder, "adafactor"))


def test_parameter_order_and_groups_are_the_trainers():
    """`named_parameter_order` / `parameter_groups` against transformers' own models and
    `Trainer.get_decay_parameter_names`, for every registered architecture's HF classes."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from trackstar_jax.models import hf

    small = dict(vocab_size=61, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4)
    cases = [
        ("LlamaForCausalLM", "LlamaConfig", dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=False)),
        ("LlamaForCausalLM", "LlamaConfig", dict(num_key_value_heads=1, tie_word_embeddings=True)),
        ("Qwen2ForCausalLM", "Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=False)),
        ("MistralForCausalLM", "MistralConfig", dict(num_key_value_heads=2)),
        ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(rotary_pct=0.5, tie_word_embeddings=False)),
        ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(rotary_pct=0.5, tie_word_embeddings=True)),
    ]
    for model_cls, config_cls, kw in cases:
        config = getattr(transformers, config_cls)(**small, **kw)
        model = getattr(transformers, model_cls)(config)
        cfg = hf.config_from_hf(config.to_dict())
        decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
        named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        want = [[x for x in named if x[0] in decay], [x for x in named if x[0] not in decay]]
        assert hf_trainer.parameter_groups(cfg) == want, (model_cls, kw)


def _save_state_dict(folder, sd):
    import torch

    folder.mkdir()
    torch.save(sd, folder / hf_trainer.OPTIMIZER_FILE)
    return folder


def test_groups_that_do_not_match_the_model_are_refused(checkpoints, tmp_path):
    import torch

    from trackstar_jax.models import hf

    folder = checkpoints["adamw_torch"]
    cfg, _ = hf.load_hf(folder)
    sd = torch.load(folder / hf_trainer.OPTIMIZER_FILE, weights_only=True)
    sd["param_groups"][0]["params"][1:3] = sd["param_groups"][0]["params"][2:0:-1]  # q_proj <-> k_proj
    bad = _save_state_dict(tmp_path / "swapped", sd)
    with pytest.raises(
        ValueError,
        match=r"param_groups\[0\]\['params'\]\[1\] \(state index 2, parameter model.layers.0.self_attn.q_proj",
    ):
        hf_trainer.read_second_moments(bad, cfg)
    sd = torch.load(folder / hf_trainer.OPTIMIZER_FILE, weights_only=True)
    sd["param_groups"][1]["params"].pop()
    with pytest.raises(ValueError, match=r"param_groups\[1\] holds 4 parameters; the Trainer's group 1 .* has 5"):
        hf_trainer.read_second_moments(_save_state_dict(tmp_path / "short", sd), cfg)
    sd = torch.load(folder / hf_trainer.OPTIMIZER_FILE, weights_only=True)
    for g in sd["param_groups"]:
        g["amsgrad"] = True
    with pytest.raises(ValueError, match="AMSGrad"):
        hf_trainer.read_second_moments(_save_state_dict(tmp_path / "ams", sd), cfg)
    sd = torch.load(folder / hf_trainer.OPTIMIZER_FILE, weights_only=True)  # as torch SGD(momentum) keeps it
    sgd = {
        "state": {i: {"momentum_buffer": s["exp_avg"]} for i, s in sd["state"].items()},
        "param_groups": [{"momentum": 0.9, "params": g["params"]} for g in sd["param_groups"]],
    }
    with pytest.raises(ValueError, match=r"neither torch Adam/AdamW's .* nor transformers Adafactor's"):
        hf_trainer.read_second_moments(_save_state_dict(tmp_path / "sgd", sgd), cfg)


def test_the_reader_equals_torch_load(checkpoints):
    torch = pytest.importorskip("torch")
    for folder in checkpoints.values():
        want = torch.load(folder / hf_trainer.OPTIMIZER_FILE, weights_only=True)
        got = torch_zip.load(folder / hf_trainer.OPTIMIZER_FILE)
        assert [{k: v for k, v in g.items()} for g in got["param_groups"]] == want["param_groups"]
        for i, s in want["state"].items():
            assert set(got["state"][i]) == set(s)
            for k, x in s.items():
                np.testing.assert_array_equal(got["state"][i][k], x.numpy() if torch.is_tensor(x) else x)


class _Hostile:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _zip(path, payload: bytes):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("optimizer/data.pkl", payload)
        z.writestr("optimizer/byteorder", "little")
    return path


def test_a_hostile_pickle_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    path = _zip(tmp_path / "optimizer.pt", pickle.dumps({"state": _Hostile(marker)}, protocol=2))
    with pytest.raises(torch_zip.UnsafePickleError, match=r"optimizer.pt: its pickle calls posix.system"):
        torch_zip.load(path)
    assert not marker.exists()
    # the same through the Trainer reader (a checkpoint folder holding it)
    with pytest.raises(torch_zip.UnsafePickleError, match="refused without running it"):
        hf_trainer.read_second_moments(tmp_path, None)
    assert not marker.exists()


def test_other_bad_files_are_named(tmp_path):
    legacy = tmp_path / "legacy.pt"
    legacy.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(ValueError, match=r"legacy.pt is not a torch zip file"):
        torch_zip.load(legacy)
    with zipfile.ZipFile(tmp_path / "missing.pt", "w") as z:  # a tensor whose storage file is absent
        z.writestr(
            "archive/data.pkl",
            b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(((X\x07\x00\x00\x00storageq\x00ctorch\nFloatStorage\n"
            b"X\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x02tQK\x00K\x02\x85K\x01\x85\x89ccollections\nOrderedDict\n)RtR.",
        )
    with pytest.raises(ValueError, match=r"storage archive/data/0 is missing"):
        torch_zip.load(tmp_path / "missing.pt")
    with pytest.raises(FileNotFoundError, match="no optimizer.pt in"):
        hf_trainer.read_second_moments(tmp_path, None)


@pytest.mark.parametrize("optimizer", ["adafactor", "adamw"])
def test_a_fused_qkv_split_keeps_v_exact(optimizer):
    """GPT-NeoX's fused `query_key_value` is split into three of our kernels: the V stored in the
    run's Adafactor state (factored where the run factors, for a rank-one Adafactor V) still gives
    each of our entries the `1/sqrt` of V at its HF entry (located by converting entry ids)."""
    from trackstar_jax.features import preconditioner
    from trackstar_jax.models import hf, lm
    from trackstar_jax.training import optimizer_state
    from trackstar_jax.training import step as step_lib

    cfg = arch_config("gpt_neox", norm_bias=True, qkv_bias=True, out_bias=True, mlp_bias=True, tie_embeddings=True)
    _, abstract = lm.abstract_params(cfg)
    params = hf._unflatten({p: np.zeros(x.shape, np.float32) for p, x in lm.flat_params(abstract).items()})
    rng = np.random.default_rng(0)
    v_hf = {}
    for name, shape in hf.expected_tensor_shapes(cfg).items():
        if len(shape) == 2 and optimizer == "adafactor":  # rank-one, as transformers' Adafactor keeps it
            v_hf[name] = hf_trainer.AdafactorMoment(
                rng.uniform(0.5, 2, shape[0]), rng.uniform(0.5, 2, shape[1]), None
            ).v()
        else:
            v_hf[name] = rng.uniform(0.5, 2, shape).astype(np.float32)
    opt_cfg = step_lib.OptimizerConfig(min_dim_size_to_factor=4)
    v = hf.params_from_state_dict(cfg, v_hf, source="test")  # what optimizer_state.hf_trainer_v does
    opt_state, run_opt = optimizer_state.run_state(v, params, opt_cfg, count=3, rank_one=optimizer == "adafactor")
    assert (run_opt.min_dim_size_to_factor == 4) == (optimizer == "adafactor")
    flat = lm.flat_params(params)
    corr = preconditioner.from_opt_state(params, opt_state, tuple(flat))
    if optimizer == "adafactor":
        assert "layer_0/attn/query/kernel" in corr.rank_one_exact  # stored factored, still exact
    checked = set()
    for t in hf._hf_tensors(cfg):
        idx = t.convert(np.arange(v_hf[t.name].size).reshape(t.shape))
        for path, i in idx.items():
            want = 1.0 / np.sqrt(v_hf[t.name].ravel()[i])
            got = np.asarray(corr.elementwise(path, flat[path].shape))
            np.testing.assert_allclose(got, want, rtol=2e-5, err_msg=f"{t.name} -> {path}")
            checked.add(path)
    assert checked == set(flat)
