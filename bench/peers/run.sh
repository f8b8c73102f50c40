#!/usr/bin/env bash
# Side-by-side GRPO throughput: Tunix (JAX), TRL (PyTorch) and hfjax on the same workload, on
# 1 CPU device, one framework after another. Not run by CI.
#
#   bash bench/peers/run.sh                # tiny workload, then SmolLM2-135M
#   PEERS_WORKLOADS=tiny bash bench/peers/run.sh
#   PEERS_WORKLOADS=smollm2_natural ...    # SmolLM2 on gsm_symbolic chat prompts, EOS stop
#   PEERS_WARMUP=1 PEERS_TIMED=1 ...       # quick smoke run (fewer steps)
#   PEERS_PROMPTS=2 PEERS_NEW_TOKENS=16 ...  # debug run: fewer prompts, fewer new tokens
#   PEERS_PRECISION=bf16 ...               # bf16 compute over f32 weights, every framework
#
# The peers get their own virtual environments under bench/peers/.venvs/ (git-ignored, created
# once, reused after): google-tunix 0.1.7 with jax 0.10.2, and trl 1.16.0 on torch 2.13.0 (the
# local CPU wheel, installed first so that trl's requirements never pull another torch).
# hfjax runs in the Python it is installed in ($PYTHON, default `python`; scripts/install.sh
# test also installs the SmolLM2 GGUF). Weights, tokenizers, prompts and per-framework results
# go to bench/out/peers/<workload>/. The last line printed is the tiny workload's JSON summary.
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python}
VENVS=bench/peers/.venvs
TUNIX_PY=$VENVS/tunix/bin/python
TRL_PY=$VENVS/trl/bin/python
WORKLOADS=${PEERS_WORKLOADS:-tiny smollm2}
LOG=bench/out/peers/logs
mkdir -p "$LOG"

# Exactly one CPU device for every framework; no inherited device-count or thread overrides.
unset XLA_FLAGS JAX_PLATFORMS CUDA_VISIBLE_DEVICES
export JAX_PLATFORMS=cpu TF_CPP_MIN_LOG_LEVEL=2 TOKENIZERS_PARALLELISM=false

pip_quiet() {  # runs a pip command with its output in $LOG/pip.log; shows it on failure
  if ! "$@" >"$LOG/pip.log" 2>&1; then
    grep -v "is ignored: it is neither a file nor a directory" "$LOG/pip.log" | tail -n 20 >&2
    exit 1
  fi
}

make_venvs() {
  if ! "$TUNIX_PY" -c "import tunix" 2>/dev/null; then
    echo "== creating $VENVS/tunix (google-tunix 0.1.7, jax 0.10.2)"
    "$PY" -m venv "$VENVS/tunix"
    pip_quiet "$TUNIX_PY" -m pip install -q "google-tunix==0.1.7" "jax==0.10.2" "jaxlib==0.10.2"
  fi
  if ! "$TRL_PY" -c "import trl" 2>/dev/null; then
    echo "== creating $VENVS/trl (trl 1.16.0, torch 2.13.0 CPU)"
    "$PY" -m venv "$VENVS/trl"
    pip_quiet "$TRL_PY" -m pip install -q "torch==2.13.0"
    # Refuse a plan that would replace the CPU torch (a CUDA build is gigabytes).
    "$TRL_PY" -m pip install -q --dry-run --report "$VENVS/trl-plan.json" "trl==1.16.0" \
      >/dev/null 2>&1
    if "$TRL_PY" -c "import json,sys; r=json.load(open(sys.argv[1])); \
        sys.exit(any(i['metadata']['name'].lower().startswith(('torch','nvidia')) \
        for i in r['install']))" "$VENVS/trl-plan.json"; then
      pip_quiet "$TRL_PY" -m pip install -q "trl==1.16.0"
    else
      echo "trl's install plan replaces torch 2.13.0; see $VENVS/trl-plan.json" >&2
      exit 1
    fi
  fi
  "$TUNIX_PY" -c "import tunix, jax; assert jax.__version__ == '0.10.2', jax.__version__"
  "$TRL_PY" -c "import torch, trl; assert torch.__version__.startswith('2.13.0'), torch.__version__"
  "$PY" -c "import hfjax" || { echo "hfjax is not installed in $PY; run scripts/install.sh test" >&2; exit 1; }
}

make_assets() {  # $1: workload
  case "$1" in smollm2 | smollm2_natural)
    if [ ! -f "bench/out/peers/$1/model/model.safetensors" ]; then
      local gguf
      gguf=$("$PY" -c "from hfjax.models.smollm2 import smollm2_gguf_path as p; print(p())")
      "$PY" -m launch.convert --src="$gguf" --dst="bench/out/peers/$1/model" 2>/dev/null
    fi
  esac
  case "$1" in
    # Natural-length prompts come from reasoning_gym and hfjax's task rows: hfjax's Python.
    *_natural) "$PY" bench/peers/make_assets.py "$1" ;;
    *) "$TRL_PY" bench/peers/make_assets.py "$1" ;;
  esac
}

run_one() {  # $1: framework, $2: python, $3: workload
  echo "== $3: $1"
  rm -f "bench/out/peers/$3/result_$1.json"
  if ! "$2" "bench/peers/run_$1.py" "$3" >"$LOG/$3_$1.log" 2>&1; then
    echo "$1 failed on $3; last lines of $LOG/$3_$1.log:" >&2
    tail -n 20 "$LOG/$3_$1.log" >&2
    return 1
  fi
  tail -n 1 "$LOG/$3_$1.log"
}

make_venvs
echo "== load average: $(cut -d' ' -f1-3 /proc/loadavg)"
for wl in $WORKLOADS; do
  make_assets "$wl"
  # The peers first, then hfjax; never two at once.
  run_one tunix "$TUNIX_PY" "$wl" || echo "(tunix did not finish $wl)"
  run_one trl "$TRL_PY" "$wl" || echo "(trl did not finish $wl)"
  run_one hfjax "$PY" "$wl"
  echo "== load average: $(cut -d' ' -f1-3 /proc/loadavg)"
  suffix=""; [ "${PEERS_PRECISION:-f32}" = f32 ] || suffix="_${PEERS_PRECISION}"
  "$PY" bench/peers/report.py "$wl" | tee "bench/out/peers/$wl/report$suffix.txt"
done
# The headline, last: the tiny workload's summary line (already last when tiny ran last).
if [[ " $WORKLOADS " == *" tiny "* && "$wl" != tiny ]]; then
  tail -n 1 "bench/out/peers/tiny/report$suffix.txt"
fi
