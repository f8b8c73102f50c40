#!/usr/bin/env bash
# Installs hfjax, then runs the default job (PPO on the embedded arithmetic task).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python -m launch.train "$@"
