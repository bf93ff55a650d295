#!/usr/bin/env bash
# The test command: creates/uses .venv, installs .[test], runs pytest (CPU, 8 fake devices).
# Extra arguments go to pytest, e.g. `bash launch/test.sh -m slow` or `-k retrieval`.
# The suite runs on TRACKSTAR_TEST_WORKERS pytest-xdist workers (default 2 where there are two
# cores or more; 0 = one process), a test module per unit of work (`--dist loadfile`: a module's
# fixtures are built once; BUILD_NOTES, session 19, has the timings). A `-n N` among the
# arguments wins.
set -euo pipefail
source "$(dirname "$0")/_venv.sh" test
cd "$REPO"
WORKERS="${TRACKSTAR_TEST_WORKERS:-$([ "$(nproc)" -ge 2 ] && echo 2 || echo 0)}"
# --no-loadscope-reorder: modules go out in conftest's order (heaviest first), not by test count
exec "$PY" -m pytest -n "$WORKERS" --dist loadfile --no-loadscope-reorder "$@"
