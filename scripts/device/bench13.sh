#!/usr/bin/env bash
# Remote call: the loop, 27B and regeneration benchmarks on random weights (no uploads), each
# under its own time limit, figures and logs to $OUT. Pick what to run (default: all, ~8 min;
# split over two calls):
#   WHAT="smollm2 qwen05" bash scripts/device/bench13.sh  (smollm2_r32 / qwen05_r32: 32 rows)
#   WHAT="drafter27b regen" bash scripts/device/bench13.sh
#   WHAT=worker27b bash scripts/device/bench13.sh  (carry .fla: the fla wheels)
#   WHAT=qwen05_cg bash scripts/device/bench13.sh  (the step as CUDA graphs: --cudagraph-ab)
#   WHAT=regen_prof bash scripts/device/bench13.sh  (regeneration at the recipe's shape, profiled)
#   WHAT=regen_fuse bash scripts/device/bench13.sh  (data.regen_fuse vs plain, batch 512 and 1024)
#   WHAT="qwen05 qwen05_dflash2" bash scripts/device/bench13.sh  (DFlash2's step: fused vs plain head)
#   WHAT="topk qwen05_dflash2" bash scripts/device/bench13.sh  (DFlash2's top-16: torch vs tiled; the
#     fused head's pass, row vs tile stats; the step with its fused, plain and tiles heads)
#   WHAT="drafter27b drafter27b_dflash2" bash scripts/device/bench13.sh  (the 27B drafter step, both)
source scripts/device/env.sh
OUT=${OUT:-/tmp/res/bench13}
mkdir -p "$OUT"
pack_profile() {  # keep the command's status; the profile dir as one file (a call brings back few)
  local rc=$?
  tar czf "$OUT/prof_$1.tgz" -C "$OUT" "prof_$1" && rm -rf "$OUT/prof_$1"
  return $rc
}
# the recipe's step (64 anchors a row, compiled, fused, labels by weight), compiled target layers
LOOP="--anchors 64 --seq 640 --min-len 64 --steps 10 --warmup 3 --ab-rounds 2 --compile
  --fuse --label-sampling by_weight --compile-target --quick"
for w in ${WHAT:-smollm2 qwen05 drafter27b regen}; do
  t=$(date +%s)
  case $w in
    smollm2 | qwen05 | smollm2_r32 | qwen05_r32)  # _r32: 32 rows a step instead of 16
      name=$([ ${w%_r32} = smollm2 ] && echo smollm2_135m || echo qwen2_5_coder_0_5b)
      rows=$([ $w = ${w%_r32} ] && echo 16 || echo 32)
      timeout 280 python3 benchmarks/bench_loop.py --target $name --rows $rows $LOOP \
        --profile "$OUT/prof_$w" --out "$OUT/loop_$w.json"
      pack_profile $w ;;
    qwen05_dflash2)  # the recipe's loop with drafter.variant=dflash2: its fused, plain and tiles heads
      timeout 280 python3 benchmarks/bench_loop.py --target qwen2_5_coder_0_5b --rows 16 $LOOP \
        --variant dflash2 --head-ab --profile "$OUT/prof_$w" --out "$OUT/loop_$w.json"
      pack_profile $w ;;
    topk)  # DFlash2's candidates: torch.topk vs tiled_topk at the recipe's chunk, Qwen2.5 and 3.6
      # vocab; then the fused head's whole pass over the chunk, row stats vs tile stats (--head)
      for v in 151936 248320; do
        timeout 120 python3 benchmarks/bench_topk.py --vocab $v --out "$OUT/topk_$v.json"
        timeout 150 python3 benchmarks/bench_topk.py --vocab $v --head --out "$OUT/head_$v.json"
      done ;;
    qwen05_cg)  # the 16-row loop with the drafter step as CUDA graphs vs compiled as now
      timeout 280 python3 benchmarks/bench_loop.py --target qwen2_5_coder_0_5b --rows 16 $LOOP \
        --cudagraph-ab --out "$OUT/loop_$w.json" ;;
    drafter27b) timeout 240 python3 benchmarks/bench_train_step.py --shape qwen3_6_27b --seq 3072 \
      --anchors 512 --compile --fuse --label-sampling both --out "$OUT/step_27b.json" ;;
    drafter27b_dflash2)  # the same 27B drafter step as DFlash2 (the drafter yaml's selector)
      timeout 240 python3 benchmarks/bench_train_step.py --shape qwen3_6_27b --seq 3072 \
        --anchors 512 --compile --fuse --label-sampling by_weight --variant dflash2 \
        --out "$OUT/step_27b_dflash2.json" ;;
    worker27b)  # carry .fla too (fla wheels): eager (fla conv1d, and the torch one) vs compile_gdn=mlp|layer
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .fla/*.whl
      timeout 420 python3 benchmarks/bench_target.py --target qwen3_6_27b_random --backend fla \
        --seq 4096 --iters 3 --compile-layers --profile "$OUT/prof_$w" --out "$OUT/worker_27b.json"
      pack_profile $w ;;
    regen) for b in 512 1024; do
        timeout 120 python3 benchmarks/bench_regen.py --target qwen2_5_coder_0_5b --batch $b \
          --new 256 --out "$OUT/regen_$b.json"
      done ;;
    regen_prof)  # the recipe's regeneration shape, profiled: where a decode step's ~9-14 ms go,
      # plain and with data.regen_fuse (prof_regen_prof_fused), no HF reference, no whole-step compile
      timeout 240 python3 benchmarks/bench_regen.py --target qwen2_5_coder_0_5b --batch 512 \
        --new 256 --prompt-min 64 --prompt-max 384 --repeat 1 --skip-hf --fuse \
        --profile "$OUT/prof_$w" --out "$OUT/regen_prof.json"
      pack_profile $w; tar czf "$OUT/prof_${w}_fused.tgz" -C "$OUT" "prof_${w}_fused" \
        && rm -rf "$OUT/prof_${w}_fused" ;;
    regen_fuse)  # data.regen_fuse against the plain graph step, batch 512 and 1024 (one call)
      for b in 512 1024; do
        timeout 150 python3 benchmarks/bench_regen.py --target qwen2_5_coder_0_5b --batch $b \
          --new 256 --prompt-min 64 --prompt-max 384 --repeat 2 --skip-hf --fuse \
          --out "$OUT/regen_fuse_$b.json"
      done ;;
    *) echo "unknown: $w" ;;
  esac > "$OUT/$w.log" 2>&1
  echo "$w rc=$? $(( $(date +%s) - t )) s" | tee -a "$OUT/status"
  grep -v "DEBUG\|^W1[0-9]" "$OUT/$w.log" | tail -40
done
