#!/usr/bin/env bash
# In the background, from /tmp/repo (start_run.sh with CHAIN=grid.sh): short ablations that share
# one data cache. The cache is filled once (GGUF conversion before, as in chain.sh), then one
# budgeted run per setting, one after the other, alone on the GPU; then dflash.tools.compare.
#   GRID="a:train.max_anchors=64;b:train.micro_batch_size=32 train.max_anchors=32" BUDGET=6
# Progress: /tmp/res/status; per run /tmp/res/NAME.out and NAME.metrics.jsonl; end: /tmp/res/done.
cd /tmp/repo && source scripts/device/env.sh
convert_target
common="+exp=$EXP out_root=/tmp/abl data.cache_dir=/tmp/abl_cache $EXTRA"
python3 train.py $common run_name=fill train.time_budget_min=0.01 > /tmp/res/fill.out 2>&1
echo "fill rc=$? $(date +%s)" >> /tmp/res/status
IFS=';' read -ra runs <<< "$GRID"
for r in "${runs[@]}"; do
  name=${r%%:*}
  over=${r#*:}
  env TORCH_LOGS=recompiles python3 train.py $common run_name=$name train.time_budget_min=$BUDGET \
    train.save_every=1000000 $over > /tmp/res/$name.out 2>&1
  echo "$name rc=$? $(date +%s)" >> /tmp/res/status
  cp /tmp/abl/$name/metrics.jsonl /tmp/res/$name.metrics.jsonl 2>/dev/null
done
python3 -m dflash.tools.compare $(for r in "${runs[@]}"; do echo /tmp/abl/${r%%:*}; done) \
  > /tmp/res/compare.txt 2>&1
cat /tmp/res/compare.txt >> /tmp/res/status
touch /tmp/res/done
