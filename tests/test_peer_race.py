"""benchmarks/peer_race.py: the JSON row schema on a micro run without bergson (the side
virtualenv with torch / transformers / datasets must exist; the race creates it)."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import peer_race

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_top10_cosine_and_overlap_match_brute_force():
    rng = np.random.default_rng(0)
    q, rows = rng.normal(size=(3, 5)), rng.normal(size=(20, 5)) * rng.uniform(0.1, 10, (20, 1))
    top = peer_race.top10_cosine(q, rows)
    for i in range(3):
        cos = [q[i] @ r / np.linalg.norm(q[i]) / np.linalg.norm(r) for r in rows]
        assert list(top[i]) == list(np.argsort(cos)[::-1][:10])
    assert peer_race.overlap(top, top) == 1.0
    assert peer_race.overlap(top, top[:, ::-1]) == 1.0  # order inside the top 10 does not matter
    assert peer_race.overlap(top[:, :10], np.full_like(top, 99)) == 0.0


def test_tokens_are_deterministic_and_in_vocab():
    a = peer_race.make_tokens(8, 16, 512, seed=1)
    assert a.shape == (8, 16) and a.dtype == np.int32
    assert np.array_equal(a, peer_race.make_tokens(8, 16, 512, seed=1))
    assert a.min() >= 4 and a.max() < 512


def featurize_flops_lower_bound(shape: str, seq_len: int, exact_v: bool) -> float:
    """A hand count of the race's featurize step's GEMM FLOPs per token (GPT-NeoX; the projections
    left out, so a lower bound): the forward and input-gradient backward over the layers' dense
    weights and the output head (2 + 2 per weight per position, no weight gradients), attention's
    scores and mixing over T = seq_len - 1 positions (4 T d forward, 8 T d backward per layer),
    with `exact_v` the per-example weight gradients (2 per layer weight per position); per
    position, times T / seq_len per counted token."""
    c = peer_race.SHAPES[shape]
    d, f, n_layers, v, t = (
        c["hidden_size"],
        c["intermediate_size"],
        c["num_hidden_layers"],
        c["vocab_size"],
        seq_len - 1,
    )
    layer_weights = n_layers * (4 * d * d + 2 * d * f)  # query_key_value, dense, dense_h_to_4h, dense_4h_to_h
    per_position = 4 * (layer_weights + d * v) + 12 * t * d * n_layers + (2 * layer_weights if exact_v else 0)
    return per_position * t / seq_len


def test_featurize_flops_lower_bound_by_hand():
    """pythia-70m shape, 127 positions: layers 6 (4 * 512^2 + 2 * 512 * 2048) = 18,874,368
    weights, head 512 * 50,304 = 25,755,648."""
    layers, head = 6 * (4 * 512**2 + 2 * 512 * 2048), 512 * 50_304
    assert (layers, head) == (18_874_368, 25_755_648)
    want = 4 * (layers + head) + 12 * 127 * 512 * 6
    assert featurize_flops_lower_bound("70m", 128, False) == want * 127 / 128 == 183_201_792 * 127 / 128
    assert featurize_flops_lower_bound("70m", 128, True) == (want + 2 * layers) * 127 / 128


@pytest.mark.slow
def test_micro_race_schema_without_bergson(tmp_path):
    if not peer_race.venv_ready(peer_race.DEFAULT_VENV, need_bergson=False):
        pytest.skip(
            f"the peer virtualenv {peer_race.DEFAULT_VENV} (torch, transformers, datasets, tokenizers) is absent; "
            "`python -m benchmarks.peer_race --quick` creates it"
        )
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.peer_race", "--quick", "--no_bergson", "--corrections", "adam"]
        + ["--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        # conftest's 8 fake devices would split the one-query batch 8 ways: the race runs as a user does
        env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
    )
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1
    row = rows[0]
    for f in peer_race.ROW_FIELDS:
        assert f in row, f
    assert row["shape"] == "micro" and row["correction"] == "adam" and row["ours_exact_v"] is True
    assert row["d"] == 2 * 2 * 4**2
    assert row["ours_tokens_per_s"] > 0 and row["ours_peak_rss_bytes"] > 0 and row["ours_query_seconds"] > 0
    assert row["ours_tokens_per_s_warm_cache"] > 0
    assert set(row["ours_build_phases_s"]) == {"import", "load", "first_batch", "rest"}
    assert 0.0 <= row["ours_top10_overlap"] <= 1.0
    assert row["bergson_tokens_per_s"] is None and row["ours_over_bergson"] is None
    assert row["gemm_peak_gflops"] > 0 and row["train_rounds"] == 2
    # --quick alternates two cold builds; the row's figure is their median (here their mean)
    assert row["build_rounds"] == 2 and len(row["ours_tokens_per_s_rounds"]) == 2
    np.testing.assert_allclose(row["ours_tokens_per_s"], np.mean(row["ours_tokens_per_s_rounds"]), rtol=1e-4)
    # `plan.dot_flops` of the build's step: the hand count plus the projections (k = 4 at this
    # width of 32: a few per cent more)
    bound = featurize_flops_lower_bound("micro", 128, exact_v=True)
    assert bound <= row["ours_flops_per_token"] <= 1.3 * bound, (row["ours_flops_per_token"], bound)
    np.testing.assert_allclose(
        row["ours_roofline_tokens_per_s"], row["gemm_peak_gflops"] * 1e9 / row["ours_flops_per_token"], rtol=1e-4
    )
