"""benchmarks/accelerator.sh, the one bounded GPU check (issue 36): every part runs at toy sizes
on the CPU (`--smoke`), so the script never breaks unseen, and its accelerator time limits fit
the 8-minute budget. One test per part (each a few processes of seconds to a minute)."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
from conftest import REPO

SCRIPT = REPO / "benchmarks" / "accelerator.sh"
# the keys each part's JSON lines must carry (the measurement, not just a line)
PARTS = {
    "train": ("tokens_per_sec", "compile_s"),
    "feat70_f32": ("compile_s", "step_s", "tokens_per_s", "gemm_flops_per_s", "peak_fraction"),
    "feat70_bf16": ("compile_s", "step_s", "tokens_per_s", "gemm_flops_per_s", "peak_fraction"),
    "feat154_bf16": ("compile_s", "step_s", "tokens_per_s"),
    "feat154_f32": ("compile_s", "step_s", "tokens_per_s"),
    "index": ("tokens_per_s", "wall_s", "tokens_per_s_wall"),
    "retrieve_1e6": ("ours_dots_per_s", "plan"),
    "retrieve_1e7": ("ours_dots_per_s", "plan"),
    "tailpatch": ("pairs_per_s", "compile_s"),
    "retrieve_parts": ("dot_s", "topk_s", "topk2_s", "two_stage_equal"),
}


def _smoke(tmp_path, part, lama_dir="") -> tuple[dict, list[dict]]:
    # one CPU device, as on the GPU host (conftest forces 8 for this process)
    xla = os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "").strip()
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO), "LAMA_DIR": lama_dir, "XLA_FLAGS": xla}
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "true"  # toy sizes: compiling is most of each part's time
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path), "--smoke", part], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (summary,) = [json.loads(x) for x in (tmp_path / "summary.jsonl").read_text().splitlines()]
    lines = [json.loads(x) for x in (tmp_path / f"{part}.jsonl").read_text().splitlines()]
    assert summary["part"] == part and summary["exit"] == 0, (tmp_path / f"{part}.log").read_text()[-3000:]
    # what the part printed is on stdout too, the moment it exists
    assert sum(line.startswith("{") for line in proc.stdout.splitlines()) == len(lines) + 1
    return summary, lines


@pytest.mark.parametrize("part", sorted(set(PARTS) - {"index"}))
def test_every_part_runs_at_toy_size(tmp_path, part):
    _, lines = _smoke(tmp_path, part)
    measured = [x for x in lines if "skipped" not in x]
    assert measured and all(k in x for x in measured[:1] for k in PARTS[part]), lines
    if part.startswith("feat"):
        assert all(x["compile_s"] > 0 for x in measured if x["path"] != "summary")
    if part == "feat70_f32":  # the paths agree at the precision they ran
        (ref,) = [x for x in measured if x["path"] == "reference"]
        assert ref["fast_vs_reference_rel_err"] < 1e-4
        assert {x["path"] for x in measured} == {"train", "fast", "reference", "trak", "summary"}
    if part == "retrieve_parts":
        assert all(x["two_stage_equal"] for x in measured)
    elif part.startswith("retrieve"):  # an absent optional method is a line, not a crash
        for method in ("torch", "faiss"):
            try:
                __import__(method)
            except ImportError:
                assert any(x.get("skipped") == method for x in lines)


def test_index_part_builds_lama_end_to_end(tmp_path, shared_data):
    _, lines = _smoke(tmp_path, "index", str(shared_data / "lama"))
    (row,) = lines
    assert row["rows"] > 0 and row["tokens"] > 0 and row["wall_s"] > row["seconds"]


def test_index_part_without_lama_says_so(tmp_path):
    _, lines = _smoke(tmp_path, "index", str(tmp_path / "nowhere"))
    assert lines == [{"bench": "build_index", "skipped": "lama", "reason": lines[0]["reason"]}]


def test_accelerator_limits_fit_eight_minutes_and_name_every_part():
    text = SCRIPT.read_text()
    table = re.search(r"declare -A LIMIT=\((.*?)\)", text, re.S).group(1)
    limits = {k: int(v) for k, v in re.findall(r"\[(\w+)\]=(\d+)", table)}
    default = re.search(r'^ALL="([^"]+)"', text, re.M).group(1).split(",")
    optional = re.search(r'^OPTIONAL="([^"]+)"', text, re.M).group(1).split(",")
    assert set(limits) == set(default) | set(optional) == set(PARTS) and not set(default) & set(optional)
    assert sum(limits[p] for p in default) <= 480
    proc = subprocess.run(
        ["bash", str(SCRIPT), "/tmp/unused_accel_out", "--smoke", "nope"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "unknown part nope" in proc.stderr


def test_ignored_folders_for_the_device_carry():
    ignored = pathlib.Path(REPO / ".gitignore").read_text().split()
    assert ".wheels/" in ignored and ".gpu_data/" in ignored


def _gpu_table1_env(tmp_path) -> dict:
    xla = os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "").strip()
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO), "XLA_FLAGS": xla, "JAX_PLATFORMS": "cpu"}
    env["GPU_TABLE1_WORKDIR"] = str(tmp_path / "work")
    return env


def test_gpu_table1_script_passes_on_the_evaluations_failure(tmp_path):
    """benchmarks/gpu_table1.sh's contract where the evaluation of the `:gpu` variant fails at
    once (no LAMA data where the override points): the script exits with its code, and the log
    (from the workdir line on) and wall.json (with that code) still come back to OUTDIR. The
    whole toy run is the slow test below."""
    out = tmp_path / "out"
    missing = tmp_path / "no_lama"
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_table1.sh"), str(out), f"--config.data.path={missing}"],
        env=_gpu_table1_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode not in (0, None), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((out / "wall.json").read_text())["rc"] == proc.returncode
    log = (out / "log.txt").read_text()
    assert log.startswith(f"gpu_table1: workdir {tmp_path / 'work'} ") and str(missing) in log, log[-3000:]
    assert not (out / "table.json").exists()


@pytest.mark.slow
def test_gpu_table1_script_runs_the_gpu_variant_at_toy_size(tmp_path):
    """benchmarks/gpu_table1.sh (Run B's `:gpu` variant on a device host) at toy sizes on the CPU:
    the table, its log and wall.json come back to OUTDIR."""
    from _lama_util import write_lama

    lama = write_lama(tmp_path / "lama", relations=("P36", "P37"), facts_per_relation=30, sentences=2)
    out = tmp_path / "out"
    env = _gpu_table1_env(tmp_path)
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "true"  # compile time is most of this run; the script is what is tested
    toy = [
        f"--config.data.path={lama}",
        "--config.data.relations=P36,P37",
        "--config.data.pararel_dir=",
        "--config.eval.pararel_dir=",
        "--config.data.statements_per_fact=1",
        "--config.model.dtype=float32",  # XLA:CPU runs no small bfloat16 GEMMs (BUILD_NOTES section 13)
        *(f"--config.model.{k}={v}" for k, v in dict(vocab_size=256, num_layers=4, embed_dim=32).items()),
        *(f"--config.model.{k}={v}" for k, v in dict(num_heads=2, head_dim=16, mlp_dim=64, max_len=48).items()),
        "--config.train.num_steps=20",
        "--config.train.warmup_steps=5",
        "--config.train.min_dim_size_to_factor=32",
        "--config.train.checkpoint_every_steps=10",
        "--config.train.eval_every_steps=10",
        "--config.train.global_batch_size=16",
        "--config.vectors.proj_dim=4",
        "--config.vectors.batch_size=16",
        "--config.hessian.lambda_component_fraction=0.0625",
        "--config.hessian.r_eval_prompts=40",
        "--config.index.chunk_rows=32",
        "--config.retrieval.read_chunk_rows=64",
        "--config.eval.methods=('trex_gold','bm25','trackstar')",
        "--config.tailpatch.methods=('bm25','trackstar')",
        "--config.eval.max_queries=8",
        "--config.eval.max_new_tokens=3",
        "--config.tailpatch.max_queries=4",
        "--config.tailpatch.batch_size=4",
        "--config.tailpatch.checkpoint_steps=(10,20)",
    ]
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_table1.sh"), str(out), *toy],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((out / "wall.json").read_text())["rc"] == 0
    table = json.loads((out / "table.json").read_text())
    assert {r["method"] for r in table["rows"]} == {"trex_gold", "bm25", "trackstar"}
    assert [p["step"] for p in table["checkpoints"]] == [10, 20]
    log = (out / "log.txt").read_text()
    assert log.startswith(f"gpu_table1: workdir {tmp_path / 'work'} ") and "stage tailpatch:" in log  # resumable
