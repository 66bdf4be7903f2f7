#!/usr/bin/env bash
# There, at the start of a later relay leg (start_run.sh with RESUME=1): the uploaded chunks of the
# stopped run ($STATE/st_NN and SHA256, from relay_collect.sh) checked and unpacked to $RUNS/main.
#   STATE=/tmp/a/state RUNS=/tmp/runs bash scripts/device/unpack_state.sh
STATE=${STATE:-/tmp/a/state} RUNS=${RUNS:-/tmp/runs}
(cd "$STATE" && ls st_* > /dev/null 2>&1 && cat st_* > run.tar && sha256sum --quiet -c SHA256) || {
  rm -f "$STATE/run.tar"
  echo "STATE INCOMPLETE OR BROKEN: upload every .st/st_NN and .st/SHA256 to $STATE"
  exit 1
}
rm -rf "$RUNS/main" && mkdir -p "$RUNS" && tar -C "$RUNS" -xf "$STATE/run.tar" || exit 1
rm "$STATE/run.tar"
echo "unpacked $RUNS/main: $(cat "$RUNS"/main/checkpoints/latest 2>/dev/null) (the resume recomputes the eval sets' states from their tokens files)"
