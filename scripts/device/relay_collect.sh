#!/usr/bin/env bash
# Here, after the fetch_pack.sh calls: the parts from their files_at folders into one tar,
# checked against its SHA256, re-cut into CHUNK_BYTES upload chunks $ST/st_NN (one call each in
# the next machine lease: README.md, "A run longer than one machine lease").
#   bash scripts/device/relay_collect.sh /work/.device/13 /work/.device/14 ...
set -euo pipefail
ST=${ST:-.st} CHUNK_BYTES=${CHUNK_BYTES:-58000000}
[ $# -gt 0 ] || { echo "usage: relay_collect.sh FILES_AT_DIR..." >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for d in "$@"; do cp "$d"/part_* "$d"/SHA256 "$tmp"/; done
n=$(ls "$tmp"/part_* | wc -l)
for i in $(seq 0 $((n - 1))); do
  [ -f "$(printf '%s/part_%03d' "$tmp" "$i")" ] || {
    echo "part_$(printf %03d "$i") is missing: fetch it (I=$((i / 4))) and name its folder too" >&2
    exit 1
  }
done
cat "$tmp"/part_* > "$tmp/run.tar"
(cd "$tmp" && sha256sum --quiet -c SHA256) || { echo "the parts do not match SHA256: one missing (every I fetched?) or damaged" >&2; exit 1; }
# the last leg's chunks go; other uploads kept there (eval_ckpt.sh's ck_*) stay
mkdir -p "$ST" && rm -f "$ST"/st_* "$ST/SHA256" && cp "$tmp/SHA256" "$ST/"
split -b "$CHUNK_BYTES" -d -a 2 "$tmp/run.tar" "$ST/st_"
echo "$n parts -> $(ls "$ST"/st_* | wc -l) upload chunks in $ST ($(cat "$ST"/st_* | wc -c) bytes)"
