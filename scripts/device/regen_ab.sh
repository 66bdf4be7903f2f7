#!/usr/bin/env bash
# In the background, from /tmp/repo (CHAIN=regen_ab.sh bash scripts/device/start_run.sh): $EXP's
# own regeneration (its prompts, the real target) with each static-decoder option in $VARIANTS
# under the same cap of $MIN minutes each (benchmarks/bench_regen_run.py): prompts reached,
# tokens/s, samples identical to the first variant's. With EXP2 (its target's chunks uploaded
# too), then the same for +exp=$EXP2 with $VARIANTS2 (default: plain fuse) into regen_run2.json.
# No training. Progress: /tmp/res/status.
cd /tmp/repo && source scripts/device/env.sh
convert_target
# shellcheck disable=SC2086  # EXTRA, VARIANTS: split into words
python3 benchmarks/bench_regen_run.py +exp=$EXP $EXTRA --minutes "${MIN:-2}" \
  --variants ${VARIANTS:-fuse fuse+compact fuse+b1024} --workdir /tmp/regen_ab \
  --out /tmp/res/regen_run.json > /tmp/res/regen_run.out 2>&1
echo "regen_run rc=$? $(date +%s)" >> /tmp/res/status
if [ -n "${EXP2:-}" ]; then
  EXP=$EXP2 convert_target
  # shellcheck disable=SC2086
  python3 benchmarks/bench_regen_run.py +exp=$EXP2 --minutes "${MIN2:-${MIN:-2}}" \
    --variants ${VARIANTS2:-plain fuse} --workdir /tmp/regen_ab2 \
    --out /tmp/res/regen_run2.json > /tmp/res/regen_run2.out 2>&1
  echo "regen_run2 rc=$? $(date +%s)" >> /tmp/res/status
fi
touch /tmp/res/done
