#!/usr/bin/env bash
# In the background, from /tmp/repo: train within a budget, then eval.py with real decoding (bf16,
# RD prompts, default 5), the chat-domain eval where ShareGPT was uploaded (eval=code_and_chat) and
# the fp32 check (3 prompts), with HELDOUT=N tau on N held-out stdlib prompts. Progress:
# /tmp/res/status; end: /tmp/res/done.
cd /tmp/repo && source scripts/device/env.sh
# The GGUF -> transformers conversion runs before the clock (a user with the HF weights has no
# such step); its time goes to the status file.
convert_target
date +%s > /tmp/res/t0
env TORCH_LOGS=recompiles python3 train.py +exp=$EXP run_name=main out_root=/tmp/runs \
  train.time_budget_min=$BUDGET $EXTRA > /tmp/res/train.out 2>&1
echo "train rc=$? $(date +%s)" >> /tmp/res/status
ck=$(ls -d /tmp/runs/main/checkpoints/step_* | tail -1)
echo "ckpt $ck" >> /tmp/res/status
python3 eval.py ckpt=$ck eval.real_decode_prompts=${RD:-5} out=/tmp/res/eval.json > /tmp/res/eval.out 2>&1
echo "eval rc=$? $(date +%s)" >> /tmp/res/status
if [ -f /tmp/a/sharegpt/sharegpt.jsonl ] && ! grep -q "override /eval: code_and_chat" conf/exp/$EXP.yaml; then
  # the chat recipe's eval sets on this drafter: its ShareGPT figure on the same conversations
  python3 eval.py ckpt=$ck eval=code_and_chat data.max_length=1024 out=/tmp/res/eval_chat.json \
    > /tmp/res/eval_chat.out 2>&1
  echo "eval_chat rc=$? $(date +%s)" >> /tmp/res/status
fi
if [ -n "${HELDOUT:-}" ]; then  # HELDOUT=N: tau on N stdlib prompts training did not read
  # (same format and domain as the training prompts): beside HumanEval's tau, it separates
  # over-fitting (both low against the train accuracy) from the stdlib -> HumanEval shift
  python3 eval.py ckpt=$ck "eval.sets=[{name: stdlib_heldout, source: stdlib, heldout: true, \
num_prompts: $HELDOUT}]" out=/tmp/res/eval_heldout.json > /tmp/res/eval_heldout.out 2>&1
  echo "eval_heldout rc=$? $(date +%s)" >> /tmp/res/status
fi
if [ -n "${BENCH:-}" ]; then  # the loop bench on this run's own samples (same rows / anchors)
  # BENCH="--target qwen2_5_coder_0_5b --rows 16 --seq 768 --anchors 64" (the recipe's shape)
  python3 benchmarks/bench_loop.py $BENCH --samples "$(ls /tmp/runs/main/data/train-*.pt | head -1)" \
    --steps 10 --warmup 3 --ab-rounds 2 --compile --fuse --label-sampling by_weight \
    --compile-target --quick --out /tmp/res/bench_run_samples.json > /tmp/res/bench.out 2>&1
  echo "bench rc=$? $(date +%s)" >> /tmp/res/status
fi
if [ "${FP32:-1}" = 1 ]; then  # FP32=0: no fp32 check (saves ~1 min of GPU time)
  python3 eval.py ckpt=$ck eval.num_prompts=3 eval.real_decode_prompts=3 target.dtype=float32 \
    out=/tmp/res/eval32.json > /tmp/res/eval32.out 2>&1
  echo "eval32 rc=$? $(date +%s)" >> /tmp/res/status
fi
touch /tmp/res/done
