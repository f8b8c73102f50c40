#!/usr/bin/env bash
# The RLHF pipeline on the embedded arithmetic task, end to end (docs/algorithms.md):
#   1. SFT (launch.sft): the warm start on the deliberately imperfect demonstrations;
#   2. a reward model (launch.train_rm) trained on preference pairs made from right answers and
#      wrong or unformatted ones, starting from the SFT policy's trunk; its held-out pairwise
#      accuracy is printed;
#   3. PPO (launch.train) from the SFT policy against that reward model, with no rule reward;
#      held-out accuracy is scored by the exact-answer rule.
# Each stage prints its JSON summary; the last line is the PPO stage's JSON. Everything goes
# under OUT (default runs/rlhf_arith). Extra arguments go to the PPO stage, e.g.
#   bash scripts/rlhf_arith.sh --config.trainer.total_steps=100
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/rlhf_arith}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"

echo "== 1/3 SFT" >&2
python -m launch.sft --config=configs/sft_arith.py --config.trainer.out_dir="$OUT/sft" \
    > "$OUT/sft.log" 2>&1 || { tail -20 "$OUT/sft.log"; exit 1; }
tail -1 "$OUT/sft.log"

echo "== 2/3 reward model" >&2
python -m launch.prepare_data --task=arith_prefs --n_train=1000 --n_test=200 \
    --task_config='{"max_b": 9, "pairs_per_prompt": 4}' --out="$OUT/prefs" \
    > "$OUT/prefs.log" 2>&1 || { tail -20 "$OUT/prefs.log"; exit 1; }
python -m launch.train_rm --config=configs/rm_arith.py --config.model.path="$OUT/sft/hf" \
    --config.rm.train_files="$OUT/prefs/train.parquet" \
    --config.rm.val_files="$OUT/prefs/test.parquet" --config.trainer.out_dir="$OUT/rm" \
    > "$OUT/rm.log" 2>&1 || { tail -20 "$OUT/rm.log"; exit 1; }
tail -1 "$OUT/rm.log"

echo "== 3/3 PPO against the reward model" >&2
python -m launch.train --config=configs/ppo_rm_arith.py --config.model.path="$OUT/sft/hf" \
    --config.reward_model.path="$OUT/rm/hf" --config.trainer.out_dir="$OUT/ppo" "$@" \
    2> "$OUT/ppo.stderr.log"
