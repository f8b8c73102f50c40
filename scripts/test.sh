#!/usr/bin/env bash
# Installs hfjax with its test extras, then runs the whole test suite (8 simulated CPU devices
# per test process). Test modules are spread over one process per core, at most 4 (pytest-xdist;
# a module's tests stay in one process, so its module fixtures are built once); extra arguments
# go to pytest, e.g. `bash scripts/test.sh -n 0 tests/run/test_rl_loop.py` for one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
ruff check .
python -m pytest -q --numprocesses=auto --maxprocesses=4 --dist=loadfile --durations=15 "$@"
