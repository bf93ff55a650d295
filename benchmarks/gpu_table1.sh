#!/usr/bin/env bash
# Run B's GPU variant on one device host (issue 35): the one documented command
#   python -m launch.evaluate --config=experiments/trex_table1.py:gpu --workdir=W
# from nothing to the table, timed, with what comes back kept small.
#
#   bash benchmarks/gpu_table1.sh OUTDIR [--config.key=value ...]
#
# Prepared here: `bash benchmarks/offline_wheels.sh` and `bash benchmarks/prepare_lama.sh` (it
# also copies the ParaRel patterns); the device tool carries .wheels and .gpu_data. On the host
# the LAMA / ParaRel folders are linked where the config reads them (../shared/data beside the
# checkout) when that folder is absent. The workdir is a temp folder (checkpoints do not come
# back); OUTDIR gets the table (json / md), its pictures, the log and wall.json.
set -uo pipefail
OUT="${1:?usage: benchmarks/gpu_table1.sh OUTDIR [overrides]}"
shift
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source benchmarks/device_env.sh || exit 2
if [[ ! -e ../shared/data/lama && -d .gpu_data/lama ]]; then
  mkdir -p ../shared/data && ln -s "$PWD/.gpu_data/lama" ../shared/data/lama \
    && ln -s "$PWD/.gpu_data/pararel" ../shared/data/pararel \
    || { echo "gpu_table1: cannot link ../shared/data; pass --config.data.path=.gpu_data/lama etc." >&2; exit 2; }
fi
PY="${PYTHON:-python3}"
WORK="${GPU_TABLE1_WORKDIR:-$(mktemp -d)}"
"$PY" -c "import jax; print('gpu_table1: devices', jax.devices())"
# A call killed at its limit is resumed by a second one on the same warm host with this folder.
echo "gpu_table1: workdir $WORK (GPU_TABLE1_WORKDIR=$WORK resumes it)" | tee "$OUT/log.txt"
t0=$(date +%s.%N)
PYTHONUNBUFFERED=1 "$PY" -m launch.evaluate --config=experiments/trex_table1.py:gpu --workdir="$WORK" "$@" 2>&1 | tee -a "$OUT/log.txt"
rc=${PIPESTATUS[0]}
t1=$(date +%s.%N)
cp "$WORK"/eval/table.json "$WORK"/eval/table.md "$WORK"/eval/*.png "$OUT"/ 2>/dev/null
cp "$WORK"/train_summary.json "$WORK"/metrics.jsonl "$WORK"/eval/query_report.json "$OUT"/ 2>/dev/null
"$PY" -c "import json,sys; print(json.dumps({'rc': $rc, 'wall_s': round($t1 - $t0, 1)}))" | tee "$OUT/wall.json"
exit "$rc"
