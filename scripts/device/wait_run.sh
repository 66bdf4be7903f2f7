#!/usr/bin/env bash
# Wait up to W s for the chain to finish, then tar what is there into $OUT/all.tgz (a call brings
# back a few files only) and print the status, the last log lines and the decode tables.
W=${W:-540}; t=0
if [ ! -f /tmp/res/started ]; then  # a fresh machine: the previous one (and its run) is gone
  echo "NO RUN ON THIS MACHINE: the machine holding the run was released (a gap of more than 30 s"
  echo "between calls); its /tmp is lost. Start again (upload the chunks, start_run.sh)."
  exit 3
fi
while [ ! -f /tmp/res/done ] && [ $t -lt $W ]; do sleep 10; t=$((t+10)); done
# run_config.json too: the fetched res/ is then a run folder for python -m dflash.tools.compare
cp /tmp/runs/main/metrics.* /tmp/runs/main/train.log /tmp/runs/main/run_config.json /tmp/res/ 2>/dev/null
tar czf $OUT/all.tgz -C /tmp res 2>/dev/null
cat /tmp/res/status 2>/dev/null
grep -E "tau|tokens_per_s|time budget" /tmp/res/train.out | tail -6
echo "recompile lines: $(grep -c Recompiling /tmp/res/train.out 2>/dev/null)"
[ -f /tmp/res/done ] && [ -f /tmp/res/eval.out ] && tail -28 /tmp/res/eval.out
[ -f /tmp/res/done ] && [ -f /tmp/res/eval32.out ] && tail -12 /tmp/res/eval32.out
[ -f /tmp/res/regen_run.out ] && tail -40 /tmp/res/regen_run.out  # CHAIN=regen_ab.sh
[ -f /tmp/res/regen_run2.out ] && tail -20 /tmp/res/regen_run2.out  # with EXP2
[ -f /tmp/res/done ] && [ -f /tmp/res/metrics.jsonl ] && python3 - <<'PY'  # in-loop vs eval.py (each set), chat eval, bench
import json, os
rows = [json.loads(x) for x in open("/tmp/res/metrics.jsonl") if x.strip()]
last = [r for r in rows if any(k.startswith("eval/") and k.endswith("tau") for k in r)][-1]
loop = {k[5:]: v for k, v in last.items() if k.startswith("eval/") and k.endswith("tau")}
for name in ("eval",):  # every set of the one eval.py call (chain.sh)
    path = f"/tmp/res/{name}.json"
    if os.path.exists(path):
        s = json.load(open(path))["summary"]
        print(name, {k: round(v, 4) for k, v in s.items() if k.endswith("tau")},
              "| in-loop", {k: round(v, 4) for k, v in loop.items()} if name == "eval" else "")
if os.path.exists("/tmp/res/bench_run_samples.json"):
    b = json.load(open("/tmp/res/bench_run_samples.json"))
    ovl = b.get("loop_source_overlap_ms")
    print("bench on the run's samples: loop", round(b["loop_tokens_per_s"]), "tokens/s; overlapped",
          "source", round(b["tokens_per_step"] / ovl * 1e3) if ovl else "-", "tokens/s;",
          round(b["tokens_per_step"]), "tokens a step (the run: perf/tokens_per_s above)")
import glob
for path in sorted(glob.glob("/tmp/res/bench13/regen_fuse_*.json")):  # AFTER=regen_fuse
    r = json.load(open(path))
    print(f"regen batch {r['batch']}: plain {r['static_tokens_per_s']:,.0f} tokens/s, fused",
          f"{r.get('static_fused_tokens_per_s', float('nan')):,.0f} ({r.get('fuse_speedup', 0):.2f}x),",
          f"first fused call {r.get('static_fused_first_call_s', 0):.1f} s,",
          f"identical rows {r.get('identical_rows_fused_vs_static')};",
          f"compacted {r['compact_speedup']:.2f}x, fused + compacted",
          f"{r.get('fuse_compact_speedup', 0):.2f}x (rows as compacted:",
          f"{r.get('identical_rows_fused_compact_vs_compact')})")
PY
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
