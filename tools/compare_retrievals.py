"""How far two evaluations' proponent lists agree, row by row (e.g. float32 vs bf16 featurizing).

Reads `<dir>/<row>.jsonl` (the evaluation's `eval/retrievals/`, one line per query with
`example_id` and ranked `proponent_ids`) from both folders, for every row file the two share (or
`--rows`), and prints one JSON object: per row the mean top-k overlap |A ∩ B| / k, the fraction
of queries with the same top-1, and the number of queries compared.

    python tools/compare_retrievals.py runs/a/eval/retrievals runs/b/eval/retrievals --k=10
"""

from __future__ import annotations

import argparse
import json
import pathlib


def _read(path: pathlib.Path) -> dict[str, list[int]]:
    with path.open() as f:
        return {str(r["example_id"]): list(r["proponent_ids"]) for r in map(json.loads, f) if r}


def compare(a: pathlib.Path, b: pathlib.Path, rows: list[str], k: int) -> dict:
    out = {}
    for row in rows:
        la, lb = _read(a / f"{row}.jsonl"), _read(b / f"{row}.jsonl")
        common = sorted(set(la) & set(lb))
        if not common:
            raise SystemExit(f"{row}: the two files share no query (example_id)")
        overlap = [len(set(la[q][:k]) & set(lb[q][:k])) / k for q in common]
        same1 = [bool(la[q][:1]) and la[q][:1] == lb[q][:1] for q in common]
        out[row] = {
            f"top{k}_overlap": round(sum(overlap) / len(common), 4),
            "same_top1": round(sum(same1) / len(common), 4),
            "queries": len(common),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", type=pathlib.Path)
    ap.add_argument("b", type=pathlib.Path)
    ap.add_argument("--rows", default="", help="comma-separated rows (default: every row file in both)")
    ap.add_argument("--k", type=int, default=10)
    args = ap.parse_args()
    rows = (
        args.rows.split(",")
        if args.rows
        else sorted(p.stem for p in args.a.glob("*.jsonl") if (args.b / p.name).exists())
    )
    print(json.dumps(compare(args.a, args.b, rows, args.k)))


if __name__ == "__main__":
    main()
