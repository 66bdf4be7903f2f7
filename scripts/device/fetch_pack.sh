#!/usr/bin/env bash
# There, after pack_run.sh: parts 4I..4I+3 of $PACK and the SHA256 into $OUT (at most 64 MiB come
# back from a call). Run I=0, 1, ... back to back (a gap of over ~30 s releases the machine).
#   I=0 bash scripts/device/fetch_pack.sh
PACK=${PACK:-/tmp/pack} I=${I:?set I=0, 1, ... (4 parts a call)}
if [ ! -f "$PACK/SHA256" ]; then
  echo "NO PACK ON THIS MACHINE: the machine holding the stopped run was released, or the leg has"
  echo "not ended (status: $(tail -1 /tmp/res/status 2>/dev/null))"
  exit 3
fi
parts=("$PACK"/part_*)
n=${#parts[@]} last=$(((${#parts[@]} - 1) / 4))
[ "$I" -le "$last" ] || { echo "I=$I: only I=0..$last"; exit 2; }
cp "$PACK/SHA256" "${parts[@]:$((4 * I)):4}" "$OUT/" || exit 1
echo "fetched I=$I of 0..$last ($n parts)"
[ "$I" -eq "$last" ] && echo "ALL PARTS FETCHED: here, bash scripts/device/relay_collect.sh DIR..."
exit 0
