#!/usr/bin/env bash
# There, at the end of a relay leg (chain.sh with STOP_AFTER_S): the stopped run's directory as
# one tar (run.lock, profile/ and the eval sets' caches left out, but for their tokens files),
# its sha256, cut into PART_BYTES parts in $PACK; a call brings back 4 of them (fetch_pack.sh).
# Prints one status line.
# Measured 2026-12-06 (Qwen2.5-Coder-0.5B, DFlash2): train_state.pt 834 MB, model.safetensors
# 139 MB, data/train-*.pt 84 MB, data/eval-*.safetensors 581 MB. The eval cache is the target's
# greedy text and hidden states for the eval prompts: only its tokens files travel
# (eval-*.tokens.safetensors, under 1 MB), and the resume recomputes the states along the same
# text in seconds on any GPU kind (PACK_EVAL=1 ships the cache, ~9 fetch calls more). No gzip:
# fp32 weights and Adam state hardly compress, and gzip -1 took 81 s for the 1.64 GB directory.
#   RUNS=/tmp/runs PACK=/tmp/pack bash scripts/device/pack_run.sh
set -o pipefail
RUNS=${RUNS:-/tmp/runs} PACK=${PACK:-/tmp/pack} PART_BYTES=${PART_BYTES:-16000000}
t=$(date +%s)
rm -rf "$PACK" && mkdir -p "$PACK" || exit 1
if [ ! -f "$RUNS/main/checkpoints/latest" ]; then  # stopped before its first save
  echo "pack rc=1 ($RUNS/main has no checkpoint: nothing to resume; start the run again)"
  exit 1
fi
ex=(--exclude=main/run.lock --exclude=main/profile)
[ "${PACK_EVAL:-0}" = 1 ] || ex+=("--exclude=main/data/eval-*")
tar -C "$RUNS" "${ex[@]}" -cf "$PACK/run.tar" main || { echo "pack rc=1 (tar of $RUNS/main failed)"; exit 1; }
if [ "${PACK_EVAL:-0}" != 1 ]; then  # the eval sets' text: the resume evaluates the same prompts
  toks=$(cd "$RUNS" && ls main/data/eval-*.tokens.safetensors 2>/dev/null)
  [ -z "$toks" ] || tar -C "$RUNS" -rf "$PACK/run.tar" $toks || { echo "pack rc=1 (tar -r failed)"; exit 1; }
fi
# SHA256 last: fetch_pack.sh takes its presence for a whole pack
(cd "$PACK" && split -b "$PART_BYTES" -d -a 3 run.tar part_ && sha256sum run.tar > SHA256.tmp \
  && rm run.tar && mv SHA256.tmp SHA256) || { echo "pack rc=1 (split failed)"; exit 1; }
n=$(ls "$PACK"/part_* | wc -l)
echo "pack rc=0 $n parts, $(cat "$PACK"/part_* | wc -c) bytes, $(($(date +%s) - t)) s;" \
  "fetch with I=0..$(((n - 1) / 4)) bash scripts/device/fetch_pack.sh"
