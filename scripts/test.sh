#!/usr/bin/env bash
# Installs hfjax with its test extras, then runs the whole test suite (8 simulated CPU devices
# per test process). Its modules are spread over pytest-xdist's workers, one more than the
# machine has cores (at most 4): a worker that waits on a command, a socket or a timeout leaves
# its core to the others. Each module is one unit of work (--dist=loadgroup; tests/conftest.py),
# so its module fixtures are built once, and the longest go first. Extra arguments go to
# pytest, e.g. `bash scripts/test.sh -n 0 tests/run/test_rl_loop.py` for one process, or
# `-m "smoke or not smoke"` for the suite and the smoke tier together (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
ruff check .
workers=$(( $(nproc) + 1 ))
if [ "$workers" -gt 4 ]; then workers=4; fi
python -m pytest -q --numprocesses="$workers" --dist=loadgroup --durations=15 "$@"
