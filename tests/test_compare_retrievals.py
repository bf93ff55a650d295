"""tools/compare_retrievals.py (the top-10 overlap figures of docs/results.md) on two small files."""

import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_overlap_and_same_top1_per_row(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d, lists in ((a, [[1, 2, 3, 4], [5, 6, 7, 8]]), (b, [[1, 9, 3, 8], [6, 5, 7, 8]])):
        d.mkdir()
        (d / "exp1.jsonl").write_text(
            "".join(json.dumps({"example_id": str(i), "proponent_ids": p}) + "\n" for i, p in enumerate(lists))
        )
    (a / "only_a.jsonl").write_text("")
    out = subprocess.run(
        [sys.executable, str(REPO / "tools" / "compare_retrievals.py"), str(a), str(b), "--k=4"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # query 0 shares {1, 3}, query 1 all four; only query 0 keeps its top-1; rows in both folders only
    assert json.loads(out) == {"exp1": {"top4_overlap": 0.75, "same_top1": 0.5, "queries": 2}}
