#!/usr/bin/env bash
# There, at the end of a relay leg (chain.sh with STOP_AFTER_S): the stopped run's directory as
# one tar.gz (run.lock and profile/ left out), its sha256, cut into PART_BYTES parts in $PACK; a
# call brings back 4 of them (fetch_pack.sh). Prints one status line.
#   RUNS=/tmp/runs PACK=/tmp/pack bash scripts/device/pack_run.sh
set -o pipefail
RUNS=${RUNS:-/tmp/runs} PACK=${PACK:-/tmp/pack} PART_BYTES=${PART_BYTES:-16000000}
t=$(date +%s)
rm -rf "$PACK" && mkdir -p "$PACK" || exit 1
if [ ! -f "$RUNS/main/checkpoints/latest" ]; then  # stopped before its first save
  echo "pack rc=1 ($RUNS/main has no checkpoint: nothing to resume; start the run again)"
  exit 1
fi
tar -C "$RUNS" --exclude=main/run.lock --exclude=main/profile -cf - main | gzip -1 \
  > "$PACK/run.tgz" || { echo "pack rc=1 (tar of $RUNS/main failed)"; exit 1; }
# SHA256 last: fetch_pack.sh takes its presence for a whole pack
(cd "$PACK" && split -b "$PART_BYTES" -d -a 3 run.tgz part_ && sha256sum run.tgz > SHA256.tmp \
  && rm run.tgz && mv SHA256.tmp SHA256) || { echo "pack rc=1 (split failed)"; exit 1; }
n=$(ls "$PACK"/part_* | wc -l)
echo "pack rc=0 $n parts, $(cat "$PACK"/part_* | wc -c) bytes, $(($(date +%s) - t)) s;" \
  "fetch with I=0..$(((n - 1) / 4)) bash scripts/device/fetch_pack.sh"
