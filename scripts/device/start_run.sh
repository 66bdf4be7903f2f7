#!/usr/bin/env bash
# Remote call after the other chunks are up: copy the last chunk (every chunk this call carries in
# .gl/, or LAST), assemble, start chain.sh detached
# with setsid (it outlives the call while the machine stays warm), then wait like wait_run.sh.
#   EXP=smollm2_coder BUDGET=20 EXTRA="data.num_samples=48000" bash scripts/device/start_run.sh
#   CHAIN=grid.sh BUDGET=6 GRID="a:train.max_anchors=64;b:train.max_anchors=32" bash scripts/device/start_run.sh
#   BUDGET=60 STOP_AFTER_S=1400 bash scripts/device/start_run.sh       (a relay's first leg)
#   RESUME=1 STOP_AFTER_S=1350 bash scripts/device/start_run.sh        (the next, .st uploaded)
source scripts/device/env.sh
if [ -n "${LAST:-}" ]; then cp .gl/$LAST /tmp/a/parts/; else cp .gl/* /tmp/a/parts/; fi
assemble || exit 1
if [ "${RESUME:-0}" = 1 ]; then bash scripts/device/unpack_state.sh || exit 1; fi  # a later relay leg
rm -rf /tmp/repo && mkdir -p /tmp/repo && cp -r $(ls -A | grep -v '^.gl$') /tmp/repo/
export EXP=${EXP:-qwen05_coder} BUDGET=${BUDGET:-20} EXTRA="${EXTRA:-}" FP32=${FP32:-1} RD=${RD:-5}
export GRID="${GRID:-}"  # CHAIN=grid.sh: the ablation settings (see grid.sh)
export HELDOUT="${HELDOUT:-}" RDCHAT="${RDCHAT:-0}"  # chain.sh: N held-out stdlib prompts; chat real decoding
export BENCH="${BENCH:-}"  # chain.sh: bench_loop on the run's samples (its shape arguments)
export AFTER="${AFTER:-}"  # chain.sh: bench13.sh items after the evals (e.g. AFTER=regen_fuse)
export RESUME="${RESUME:-0}" STOP_AFTER_S="${STOP_AFTER_S:-}"  # chain.sh: relay legs (a run over several leases)
touch /tmp/res/started  # wait_run.sh: a machine without it is a fresh one
setsid nohup bash /tmp/repo/scripts/device/${CHAIN:-chain.sh} > /tmp/res/chain.log 2>&1 < /dev/null &
W=${W:-540} bash scripts/device/wait_run.sh
