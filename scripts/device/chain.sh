#!/usr/bin/env bash
# In the background, from /tmp/repo: train within a budget, then one eval.py with real decoding
# (bf16, RD prompts, default 5) on HumanEval, the chat-domain set where ShareGPT was uploaded and,
# with HELDOUT=N, N held-out stdlib prompts; then the fp32 check (3 prompts). Progress:
# /tmp/res/status; end: /tmp/res/done.
cd /tmp/repo && source scripts/device/env.sh
# The GGUF -> transformers conversion runs before the clock (a user with the HF weights has no
# such step); its time goes to the status file.
convert_target
date +%s > /tmp/res/t0
# A run longer than one 30-minute lease of the GPU machine goes in relay legs: STOP_AFTER_S=N
# sends SIGTERM after N s (the step finishes and is saved, exit 143) and packs the run directory
# for fetch_pack.sh; RESUME=1 continues the run start_run.sh unpacked (its budget's clock goes on).
cmd=(python3 train.py +exp=$EXP run_name=main out_root=/tmp/runs train.time_budget_min=$BUDGET)
[ "${RESUME:-0}" = 1 ] && cmd=(python3 train.py resume=/tmp/runs/main)
[ -n "${STOP_AFTER_S:-}" ] &&
  cmd=(timeout --foreground --preserve-status -s TERM -k 300 "$STOP_AFTER_S" "${cmd[@]}")
# shellcheck disable=SC2086  # EXTRA: overrides, split into words
env TORCH_LOGS=recompiles "${cmd[@]}" $EXTRA > /tmp/res/train.out 2>&1
rc=$?
echo "train rc=$rc $(date +%s)" >> /tmp/res/status
# stopped before its budget (143: saved on SIGTERM; 137: killed 300 s later, the last periodic
# checkpoint stands): pack, no eval
if [ -n "${STOP_AFTER_S:-}" ] && { [ "$rc" = 143 ] || [ "$rc" = 137 ]; }; then
  bash scripts/device/pack_run.sh >> /tmp/res/status 2>&1
  touch /tmp/res/done
  exit 0
fi
ck=$(ls -d /tmp/runs/main/checkpoints/step_* | tail -1)
echo "ckpt $ck" >> /tmp/res/status
# One eval.py for every set, so the target loads once: HumanEval with real decoding (RD prompts);
# where ShareGPT was uploaded, the chat recipe's held-out conversations (its eval=code_and_chat
# set, cut at its data.max_length=1024: for +exp=qwen05_chat its own set, read from the run's
# cache; RDCHAT real-decoded prompts, default 0); with HELDOUT=N, N stdlib prompts training did
# not read (same format and domain as the training prompts: beside HumanEval's tau it separates
# over-fitting from the stdlib -> HumanEval shift). Without either, the run's own eval sets.
# EVALX: more eval.py overrides, e.g. EVALX="eval.tree_rules=[t0.7,coverage]" (an A/B of trees).
# EVAL=0: no eval.py (the run's last in-loop eval stands: a relay's last leg that must fit a lease)
run_eval() {
  local sets="" extra=""
  if [ -f /tmp/a/sharegpt/sharegpt.jsonl ]; then
    sets="$sets, {name: sharegpt, source: jsonl, paths: [/tmp/a/sharegpt/sharegpt.jsonl], \
heldout: true, rows: last, turns: each, num_prompts: 48, real_decode_prompts: ${RDCHAT:-0}}"
    extra="data.max_length=1024"
  fi
  if [ -n "${HELDOUT:-}" ]; then
    sets="$sets, {name: stdlib_heldout, source: stdlib, heldout: true, num_prompts: $HELDOUT, \
real_decode_prompts: 0}"
  fi
  local args=()
  [ -n "$sets" ] && args=("eval.sets=[{name: humaneval, source: humaneval, num_prompts: 164}$sets]")
  # shellcheck disable=SC2086  # extra, EVALX: overrides, split into words
  python3 eval.py ckpt=$ck eval.real_decode_prompts=${RD:-5} "${args[@]}" $extra $EVALX \
    out=/tmp/res/eval.json > /tmp/res/eval.out 2>&1
  echo "eval rc=$? $(date +%s)" >> /tmp/res/status
}
if [ "${EVAL:-1}" = 0 ]; then echo "eval skipped (EVAL=0)" >> /tmp/res/status; else run_eval; fi
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
if [ -n "${AFTER:-}" ]; then  # AFTER="regen_fuse regen_prof": bench13.sh items on the same machine
  # (random weights, no uploads), their JSON and profiles in /tmp/res/bench13 (in all.tgz)
  WHAT="$AFTER" OUT=/tmp/res/bench13 bash scripts/device/bench13.sh > /tmp/res/after.out 2>&1
  echo "after rc=$? $(date +%s)" >> /tmp/res/status
fi
touch /tmp/res/done
