#!/usr/bin/env bash
# In the background, from /tmp/repo: train within a budget, then eval.py with real decoding (bf16,
# 5 prompts) and the fp32 check (3 prompts). Progress: /tmp/res/status; end: /tmp/res/done.
cd /tmp/repo && source scripts/device/env.sh
date +%s > /tmp/res/t0
env TORCH_LOGS=recompiles python3 train.py +exp=$EXP run_name=main out_root=/tmp/runs \
  train.time_budget_min=$BUDGET $EXTRA > /tmp/res/train.out 2>&1
echo "train rc=$? $(date +%s)" >> /tmp/res/status
ck=$(ls -d /tmp/runs/main/checkpoints/step_* | tail -1)
echo "ckpt $ck" >> /tmp/res/status
python3 eval.py ckpt=$ck eval.real_decode_prompts=5 out=/tmp/res/eval.json > /tmp/res/eval.out 2>&1
echo "eval rc=$? $(date +%s)" >> /tmp/res/status
python3 eval.py ckpt=$ck eval.num_prompts=3 eval.real_decode_prompts=3 target.dtype=float32 \
  out=/tmp/res/eval32.json > /tmp/res/eval32.out 2>&1
echo "eval32 rc=$? $(date +%s)" >> /tmp/res/status
touch /tmp/res/done
