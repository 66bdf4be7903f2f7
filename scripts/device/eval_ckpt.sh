#!/usr/bin/env bash
# Remote call: eval.py with real decoding (bf16) on a checkpoint fetched earlier and uploaded in
# chunks, the target's GGUF chunks up as for start_run.sh. Here, before: cut the checkpoint's
# model.safetensors into .st/ck_NN (split -b 58000000 -d -a 2 ... .st/ck_) and copy its
# config.json, manifest.json and its run's run_config.json to .st/ckcfg.json, ckman.json and
# ckrun.json; upload ck_00, ck_01 ... one call each (`cp .st/ck_NN /tmp/a/state/`), then this
# call carries the last GGUF chunk, the last ck chunk and the three json files.
#   CK=step_00018523 RD=3 EVALX="eval.tree_rules=[t1]" bash scripts/device/eval_ckpt.sh
# Writes $OUT/eval.json and $OUT/eval.out; the target's conversion is timed to the output.
source scripts/device/env.sh
cp .gl/* /tmp/a/parts/ 2>/dev/null
cp .st/ck_* .st/ck*.json /tmp/a/state/ 2>/dev/null
assemble || exit 1
d=/tmp/ck/main/checkpoints/${CK:?set CK=step_NNNNNNNN, the checkpoint folder name}
mkdir -p "$d" && cat /tmp/a/state/ck_?? > "$d/model.safetensors" &&
  cp /tmp/a/state/ckcfg.json "$d/config.json" && cp /tmp/a/state/ckman.json "$d/manifest.json" &&
  cp /tmp/a/state/ckrun.json /tmp/ck/main/run_config.json || exit 1
t=$(date +%s)
# shellcheck disable=SC2086  # EVALX: overrides, split into words
python3 eval.py ckpt="$d" eval.real_decode_prompts=${RD:-3} $EVALX out=$OUT/eval.json \
  eval_dir=/tmp/ev > $OUT/eval.out 2>&1
echo "eval rc=$? $(($(date +%s) - t)) s"
tail -40 $OUT/eval.out
