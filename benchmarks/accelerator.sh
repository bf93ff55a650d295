#!/usr/bin/env bash
# Runs the benchmarks at accelerator sizes on a GPU/TPU host and keeps every JSON line.
#
#   bash benchmarks/accelerator.sh OUTDIR [PARTS]
#
# PARTS: comma list of retrieve, featurize, featurize_154m, train, index (default: all).
# Each part writes OUTDIR/<part>.jsonl (JSON lines only) and OUTDIR/<part>.log (everything),
# and runs under its own time limit (BENCH_PART_TIMEOUT seconds, default 540) so that one
# slow part cannot starve the others. The device's Python must already have the package's
# dependencies (pip install -e . or wheels on PYTHONPATH); nothing is downloaded here.
set -uo pipefail
OUT="${1:?usage: benchmarks/accelerator.sh OUTDIR [PARTS]}"
PARTS="${2:-retrieve,featurize,featurize_154m,train,index}"
LIMIT="${BENCH_PART_TIMEOUT:-540}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
# Leave GPU memory for torch (the retrieval benchmark's same-device reference) beside JAX.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.6}"

run_part() {
  local name="$1"; shift
  echo "[accelerator.sh] $name: $*" >&2
  local t0=$SECONDS
  timeout "$LIMIT" "$PY" "$@" > >(tee "$OUT/$name.log" | grep --line-buffered '^{' > "$OUT/$name.jsonl") 2>&1
  echo "[accelerator.sh] $name: exit $? after $((SECONDS - t0)) s" >&2
}

for part in ${PARTS//,/ }; do
  case "$part" in
    retrieve) run_part retrieve -m benchmarks.retrieve --methods=ours,torch,faiss,numpy \
                --repeats=3 --max_resident_gb=8 --max_seconds=30 ;;
    featurize) run_part featurize -m benchmarks.featurize --configs=small,medium --dims=4096,65536 ;;
    featurize_154m) run_part featurize_154m -m benchmarks.featurize --configs=paper_154m --dims=65536 \
                --batch=8 --seq_len=512 --steps=3 --trak_batch=2 --trak_max_chunks=4 ;;
    train) run_part train -m benchmarks.train --steps_tiny=100 --steps_small=50 ;;
    index) run_part index -m benchmarks.index --config=experiments/tiny.py --workdir=/tmp/bench_index_tiny ;;
    *) echo "[accelerator.sh] unknown part $part" >&2; exit 2 ;;
  esac
done
