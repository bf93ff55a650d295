# Sourced by launch/quickstart.sh and launch/test.sh: create/refresh .venv with the package.
# Reinstalls only when setup.cfg / pyproject.toml change (a stamp holds their hash).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TRACKSTAR_VENV:-$REPO/.venv}"
EXTRAS="${1:-test}"
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
STAMP="$VENV/.trackstar_stamp_$EXTRAS"
WANT="$(cat "$REPO/setup.cfg" "$REPO/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "[trackstar_jax] installing .[$EXTRAS] into $VENV" >&2
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$REPO[$EXTRAS]"
  echo "$WANT" > "$STAMP"
fi
PY="$VENV/bin/python"
