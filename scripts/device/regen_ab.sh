#!/usr/bin/env bash
# In the background, from /tmp/repo (CHAIN=regen_ab.sh bash scripts/device/start_run.sh): $EXP's
# own regeneration (its prompts, the real target) with each static-decoder option in $VARIANTS
# under the same cap of $MIN minutes each (benchmarks/bench_regen_run.py): prompts reached,
# tokens/s, samples identical to the plain decoder's. No training. Progress: /tmp/res/status.
cd /tmp/repo && source scripts/device/env.sh
convert_target
# shellcheck disable=SC2086  # EXTRA, VARIANTS: split into words
python3 benchmarks/bench_regen_run.py +exp=$EXP $EXTRA --minutes "${MIN:-2}" \
  --variants ${VARIANTS:-fuse fuse+compact fuse+b1024} --workdir /tmp/regen_ab \
  --out /tmp/res/regen_run.json > /tmp/res/regen_run.out 2>&1
echo "regen_run rc=$? $(date +%s)" >> /tmp/res/status
touch /tmp/res/done
