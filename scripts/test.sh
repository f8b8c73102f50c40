#!/usr/bin/env bash
# Installs hfjax with its test extras, then runs the whole test suite (8 simulated CPU devices).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
ruff check .
python -m pytest -q "$@"
