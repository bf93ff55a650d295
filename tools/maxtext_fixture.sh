#!/usr/bin/env bash
# Regenerates tests/fixtures/maxtext: a tiny llama2-block model trained by real MaxText 0.2.5 and
# MaxText's own logits on it (the reference tests/test_maxtext_import.py compares our import with).
#
#   tools/maxtext_fixture.sh [OUT_DIR [VARIANT ...]]   (default tests/fixtures/maxtext; ~1.4 GB venv once, then ~8 min on a loaded 2-core VM)
#
# MaxText needs Python >= 3.12, so it lives in a side venv, .venv-maxtext (gitignored), built from
# the pyenv 3.12 interpreter (or $PYTHON312) with `maxtext --no-deps` plus the packages its
# training path imports; DECOUPLE_GCLOUD=TRUE keeps it off Google Cloud.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-tests/fixtures/maxtext}"
VENV=.venv-maxtext
PY312="${PYTHON312:-$(ls -d /root/.pyenv/versions/3.12*/bin/python3 "$HOME"/.pyenv/versions/3.12*/bin/python3 2>/dev/null | head -1)}"
export DECOUPLE_GCLOUD=TRUE JAX_PLATFORMS=cpu
if [ ! -x "$VENV/bin/python" ]; then
  [ -n "$PY312" ] || { echo "no Python 3.12 interpreter (set PYTHON312)" >&2; exit 1; }
  "$PY312" -m venv "$VENV"
fi
"$VENV/bin/pip" install -q "maxtext==0.2.5" --no-deps
"$VENV/bin/pip" install -q jax flax optax orbax-checkpoint tensorstore grain pydantic omegaconf \
  sentencepiece tiktoken tokamax qwix aqtp absl-py ml-collections pyyaml etils tensorboardx jaxtyping \
  chex humanize numpy pathwaysutils jinja2 huggingface_hub transformers drjax pillow sympy
"$VENV/bin/python" tools/maxtext_fixture.py "$OUT" "${@:2}"
du -sh "$OUT"
