#!/usr/bin/env bash
# Copies the LAMA T-REx files into .gpu_data/lama and, when it is beside them, the ParaRel
# patterns folder into .gpu_data/pararel (ignored by git) so that they travel with the working
# tree to a device host (the device tool's `carry`), where ../shared/data does not exist.
#
#   bash benchmarks/prepare_lama.sh [SRC]     # SRC default: ../shared/data/lama
#
# Refuses a copy over 48 MiB (the device tool carries at most 64 MiB in all, wheels included).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SRC="${1:-../shared/data/lama}"
DST=.gpu_data/lama
[[ -f "$SRC/relations.jsonl" && -d "$SRC/TREx" ]] || { echo "prepare_lama: $SRC holds no relations.jsonl + TREx/" >&2; exit 2; }
size_kib=$(du -sk "$SRC" | cut -f1)
(( size_kib <= 48 * 1024 )) || { echo "prepare_lama: $SRC is ${size_kib} KiB, over the 48 MiB budget" >&2; exit 2; }
rm -rf "$DST"; mkdir -p "$DST"
cp -r "$SRC/relations.jsonl" "$SRC/TREx" "$DST/"
if [[ -d "$SRC/../pararel" ]]; then rm -rf .gpu_data/pararel; cp -r "$SRC/../pararel" .gpu_data/pararel; fi
echo "prepare_lama: $DST ($(du -sh "$DST" | cut -f1))"
