"""How much of the eval's greedy text a bf16 target keeps past near-ties, with and without
`eval.near_tie_rounds`: the eval prompts' greedy completions decoded once (batched, as the eval
set does), then checked and kept once per rounds value in the same process.

  DFLASH_ASSETS=/tmp/a python benchmarks/bench_near_ties.py --target smollm2_135m \
      --prompts 40 --dtype bfloat16 --rounds 0,4

Prints, per rounds value: the greedy tokens kept of those decoded, the seconds the check (and
the continuation) took, and the eval set's log line (completions cut, and made whole).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch
from common import load_target_yaml, report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default="smollm2_135m", help="a conf/target name")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--source", default="humaneval", help="eval.source")
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--completion-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", default="0,4", help="comma-separated eval.near_tie_rounds values")
    ap.add_argument("--out", default=None, help="also write the figures as JSON")
    a = ap.parse_args()

    from dflash.config import EvalConfig, RunConfig
    from dflash.data.dataset import generate_greedy
    from dflash.eval.greedy import checked_items
    from dflash.eval.sets import eval_prompts
    from dflash.target.load import load_target

    torch.manual_seed(0)
    tcfg = replace(load_target_yaml(a.target), dtype=a.dtype, device=a.device)
    target = load_target(tcfg, num_aux=3)
    ecfg = EvalConfig(
        source=a.source, num_prompts=a.prompts, completion_len=a.completion_len, batch_size=a.batch
    )
    prompts = eval_prompts(RunConfig(target=tcfg, eval=ecfg), target)
    t0 = time.perf_counter()
    comps = generate_greedy(target, prompts, a.completion_len, a.batch, desc="greedy")
    pairs = [(p, c) for p, c in zip(prompts, comps) if c]
    decoded = sum(len(c) for _, c in pairs)
    res = {
        "target": a.target,
        "dtype": a.dtype,
        "device": str(target.device),
        "prompts": len(pairs),
        "greedy_tokens_decoded": decoded,
        "decode_s": time.perf_counter() - t0,
    }
    for rounds in (int(r) for r in a.rounds.split(",")):
        lines = []
        t0 = time.perf_counter()
        items = checked_items(target, pairs, t0, lines.append, rounds, a.batch)
        kept = sum(it.completion_ids.numel() for it in items)
        res[f"rounds{rounds}_kept_tokens"] = kept
        res[f"rounds{rounds}_kept_share"] = kept / decoded
        res[f"rounds{rounds}_s"] = time.perf_counter() - t0
        res[f"rounds{rounds}_log"] = lines[-1]
    report(res, a.out)


if __name__ == "__main__":
    main()
