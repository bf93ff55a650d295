#!/usr/bin/env bash
# The test command: creates/uses .venv, installs .[test], runs pytest (CPU, 8 fake devices).
# Extra arguments go to pytest, e.g. `bash launch/test.sh -m slow` or `-k retrieval`.
set -euo pipefail
source "$(dirname "$0")/_venv.sh" test
cd "$REPO"
exec "$PY" -m pytest "$@"
