#!/bin/bash
# The whole cross-process matrix (tests/run/test_process_matrix.py, docs/scaling.md): every
# layout x async mode x algorithm cell on 2 or 3 processes, each killed and resumed, one at a
# time.
# CI runs only the cells in that file's CI set. Extra arguments go to pytest (e.g. -k pool_each).
set -euo pipefail
cd "$(dirname "$0")/.."
HFJAX_PROCESS_MATRIX=1 exec python -m pytest -q -n 0 -rA -p no:cacheprovider \
    tests/run/test_process_matrix.py "$@"
