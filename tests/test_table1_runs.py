"""Run A and Run B of issue 35 through their one command (`python -m launch.evaluate`), at tiny
size, on a synthetic LAMA-format folder with any relation ids (`--config.data.path`,
`--config.data.relations`): import included (Run A), natural-sentence candidates, the λ sweep,
tail-patch on a query subset of the verdict rows with each pair computed once and cached,
stage wall times, the PNG pictures, and TrackStar over checkpoints (Run B)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from _lama_util import write_lama

REPO = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _evaluate(config: str, workdir: pathlib.Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-m", "launch.evaluate", f"--config={config}", f"--workdir={workdir}", *overrides]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert res.returncode == 0, res.stderr[-6000:]
    return res


def _png_ok(path: pathlib.Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, path  # a real picture, not an empty canvas


def _check_pairs_once(workdir: pathlib.Path, table: dict) -> None:
    lines = (next((workdir / "tailpatch_pairs").glob("*.jsonl"))).read_text().splitlines()
    keys = [json.loads(x)["k"] for x in lines]
    assert len(keys) == len(set(keys)) == table["tailpatch"]["num_pairs"]  # each distinct pair once


@pytest.fixture(scope="module")
def lama(tmp_path_factory):
    return write_lama(tmp_path_factory.mktemp("lama"), relations=("P36", "P37"), facts_per_relation=30, sentences=2)


@pytest.fixture(scope="module")
def hf_tiny_llama(tmp_path_factory, lama):
    """A random Llama with experiments/tiny.py's shapes and a BPE tokenizer of the LAMA sentences."""
    pytest.importorskip("transformers")
    from test_import import _save_llama, _save_tokenizer

    from experiments import tiny
    from trackstar_jax import config as config_lib
    from trackstar_jax import data as data_lib

    s = config_lib.from_configdict(tiny.get_config())
    folder = tmp_path_factory.mktemp("tiny_llama")
    texts = data_lib.build_corpus(data_lib.DataConfig(source="lama", path=str(lama), eval_fraction=0.0)).texts
    _save_tokenizer(texts, folder)
    _save_llama(folder, s.model, s.model.vocab_size)
    return folder


def test_run_a_one_command_imports_and_evaluates(tmp_path, hf_tiny_llama, lama):
    workdir = tmp_path / "run_a"
    overrides = (
        f"--config.model.source={hf_tiny_llama}",
        f"--config.data.path={lama}",
        "--config.data.relations=P36,P37",
        "--config.eval.pararel_dir=",
        "--config.data.pararel_dir=",
    )
    res = _evaluate("experiments/smollm2_table1.py:tiny", workdir, *overrides)
    assert "stage import:" in res.stderr
    out = workdir / "eval"
    table = json.loads((out / "table.json").read_text())
    rows = {r["method"]: r for r in table["rows"]}
    from experiments import smollm2_table1, trex_table1

    want = set(trex_table1.ALL_METHODS) - {"dense"}
    assert want <= set(rows)
    assert {"trackstar_l050", "trackstar_l090", "trackstar_l099"} <= set(rows)
    for name, r in rows.items():  # tail-patch only on the verdict rows, on the tail-patched subset
        n_tp = r["tailpatch_at_10_n"]
        assert (n_tp > 0) == (name in smollm2_table1.VERDICT_ROWS), name
        assert n_tp <= table["tailpatch"]["num_queries"] == 8 < table["num_queries"]
    assert {"queries", "tailpatch", "retrieve:trackstar", "retrieve:trak"} <= set(table["stage_seconds"])
    assert table["query_report"]["corpus"]["candidates"]["passages"] == "natural"
    _check_pairs_once(workdir, table)
    for name in ("rows.png", "lambda.png"):
        _png_ok(out / name)
    assert "![rows.png](rows.png)" in (out / "table.md").read_text()
    verdicts = {(c["group"], c["metric"]) for c in table["comparisons"] if c["judged"]}
    assert ("c", "tailpatch_at_10") in verdicts and ("a", "tailpatch_at_10") in verdicts

    # Resumable: a second run reuses the import, the indices and every tail-patch pair.
    res = _evaluate(
        "experiments/smollm2_table1.py:tiny",
        workdir,
        *overrides,
        "--config.eval.output_dir=again",
        "--config.tailpatch.max_queries=10",
    )
    again = json.loads((workdir / "again" / "table.json").read_text())
    assert again["tailpatch"]["num_pairs"] >= table["tailpatch"]["num_pairs"]
    assert f"{table['tailpatch']['num_pairs']} cached" in res.stderr or " cached, " in res.stderr


def test_run_b_candidates_and_checkpoints(tmp_path, lama):
    workdir = tmp_path / "run_b"
    _evaluate(
        "experiments/trex_table1.py:tiny",
        workdir,
        f"--config.data.path={lama}",
        "--config.data.relations=P36,P37",
        "--config.data.pararel_dir=",
        "--config.eval.pararel_dir=",
        "--config.data.statements_per_fact=1",
        "--config.eval.methods=('trex_gold','bm25','exp2','trackstar')",
        "--config.tailpatch.methods=('trex_gold','bm25','trackstar')",
    )
    table = json.loads((workdir / "eval" / "table.json").read_text())
    info = table["query_report"]["corpus"]
    assert info["num_templated_statements"] > 0  # the model was trained on statements ...
    cand = info["candidates"]  # ... which are never candidates
    assert cand["num_candidates"] == cand["num_corpus_passages"] - info["num_templated_statements"]
    assert table["corpus"]["num_examples"] == cand["num_candidates"]
    assert [p["step"] for p in table["checkpoints"]] == [20, 40]
    final = {r["method"]: r for r in table["rows"]}["trackstar"]
    assert table["checkpoints"][-1]["mrr"] == pytest.approx(final["mrr"])  # the final step is the main row
    assert all(p["tailpatch_at_10_n"] > 0 for p in table["checkpoints"])
    _png_ok(workdir / "eval" / "checkpoints.png")
    assert (workdir / "index_step20").is_dir()
