#!/usr/bin/env bash
# Safe-RLHF on the embedded arithmetic task (docs/algorithms.md): the SFT policy and reward
# model of scripts/rlhf_arith.sh (trained first if OUT does not hold them yet; every stage whose
# output OUT already holds is skipped), a cost model
# (launch.train_rm, configs/cost_arith.py) that learns to score answers writing the forbidden
# digit 7 above 0, then Safe-RLHF (launch.train, configs/safe_rlhf_arith.py). The last line is
# the Safe-RLHF stage's JSON; its metrics.jsonl has cost/mean against the threshold, the
# multiplier (safe_rlhf/lambda), and the rule the cost model was trained on, measured on the
# validation answers (val-aux/cost_reference/mean). Extra arguments go to the last stage.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/rlhf_arith}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"

if [[ ! -f "$OUT/sft/hf/config.json" ]]; then
    echo "== SFT" >&2
    python -m launch.sft --config=configs/sft_arith.py --config.trainer.out_dir="$OUT/sft" \
        > "$OUT/sft.log" 2>&1 || { tail -20 "$OUT/sft.log"; exit 1; }
    tail -1 "$OUT/sft.log"
fi
for kind in prefs cost_prefs; do
    if [[ ! -f "$OUT/$kind/train.parquet" ]]; then
        python -m launch.prepare_data --task="arith_$kind" --n_train=1000 --n_test=200 \
            --task_config='{"max_b": 9, "pairs_per_prompt": 4}' --out="$OUT/$kind" \
            > "$OUT/$kind.log" 2>&1 || { tail -20 "$OUT/$kind.log"; exit 1; }
    fi
done
if [[ ! -f "$OUT/rm/hf/config.json" ]]; then
    echo "== reward model" >&2
    python -m launch.train_rm --config=configs/rm_arith.py --config.model.path="$OUT/sft/hf" \
        --config.rm.train_files="$OUT/prefs/train.parquet" \
        --config.rm.val_files="$OUT/prefs/test.parquet" --config.trainer.out_dir="$OUT/rm" \
        > "$OUT/rm.log" 2>&1 || { tail -20 "$OUT/rm.log"; exit 1; }
    tail -1 "$OUT/rm.log"
fi
if [[ ! -f "$OUT/cost/hf/config.json" ]]; then
    echo "== cost model" >&2
    python -m launch.train_rm --config=configs/cost_arith.py --config.model.path="$OUT/sft/hf" \
        --config.rm.train_files="$OUT/cost_prefs/train.parquet" \
        --config.rm.val_files="$OUT/cost_prefs/test.parquet" --config.trainer.out_dir="$OUT/cost" \
        > "$OUT/cost.log" 2>&1 || { tail -20 "$OUT/cost.log"; exit 1; }
fi
tail -1 "$OUT/cost.log"

echo "== Safe-RLHF" >&2
python -m launch.train --config=configs/safe_rlhf_arith.py --config.model.path="$OUT/sft/hf" \
    --config.reward_model.path="$OUT/rm/hf" --config.cost_model.path="$OUT/cost/hf" \
    --config.trainer.out_dir="$OUT/safe_rlhf" "$@" 2> "$OUT/safe_rlhf.stderr.log"
