"""A run's own regeneration (its prompts, its target) with each option of the static decoder, one
after another in one process under the same time cap: prompts reached, response tokens a second,
and whether each variant's samples equal the plain decoder's (the same seeded batch order; in bf16
another kernel or batch size may flip a near-tie, so the share is reported).

  python benchmarks/bench_regen_run.py +exp=qwen05_coder --minutes 1.5 \
      --variants plain fuse fuse+compact fuse+b1024 --workdir /tmp/regen_ab
  python benchmarks/bench_regen_run.py data.num_samples=64 --minutes 1   # the default tiny job

Positional arguments are train.py's overrides (the run whose data is regenerated); each variant
is that run's data config with data.regen_time_limit_min=--minutes and the named options on
(`fuse`: data.regen_fuse, `compact`: data.regen_compact, `compile`: data.regen_compile, `bN`:
data.regen_batch_size=N; joined by `+`). The first variant is the baseline of the ratios. The
options act on the CUDA static decoder only: on CPU every variant is HF generate (the script
still runs end to end). A conversation recipe (+exp=qwen05_chat) regenerates in rounds, turn
by turn: its tokens and seconds are summed over them. bench_regen.py times the same options on
random prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import os
import re
import shutil
import tempfile
import time

import torch
from common import report

OPTIONS = {"fuse": "regen_fuse", "compact": "regen_compact", "compile": "regen_compile"}


def variant_flags(name: str) -> dict:
    """`plain` or options joined by `+` (fuse+compact, fuse+b1024) as data.* settings."""
    parts = [] if name == "plain" else name.split("+")
    sizes = [p for p in parts if re.fullmatch(r"b[1-9]\d*", p)]
    bad = sorted(set(parts) - set(OPTIONS) - set(sizes))
    if bad or len(sizes) > 1:
        raise SystemExit(
            f"variant {name!r}: unknown option(s) {bad or sizes}; use plain, or of "
            f"{list(OPTIONS)} and one bN (data.regen_batch_size=N) joined by +"
        )
    flags = {flag: opt in parts for opt, flag in OPTIONS.items()}
    return flags | ({"regen_batch_size": int(sizes[0][1:])} if sizes else {})


def regen_figures(lines: list[str]) -> dict:
    """Tokens, seconds and prompts reached from the regeneration's log lines, summed over its
    rounds (a conversation recipe answers turn 2, 3, ... in rounds of their own); prompts
    reached: the first round's (every conversation's first turn), "all" when no cap cut it."""
    found = [re.search(r"(\d+) new tokens in ([\d.]+) s", x) for x in lines]
    found = [m for m in found if m]
    out: dict = {}
    if found:
        tokens, secs = sum(int(m.group(1)) for m in found), sum(float(m.group(2)) for m in found)
        out |= {"new_tokens": tokens, "regen_s": round(secs, 1), "rounds": len(found)}
        out["tokens_per_s"] = round(tokens / max(secs, 1e-9), 1)
    first = r"^regenerate: time limit .* after (\d+) of (\d+) prompts"  # turn 1's round
    cut = next((m for x in lines if (m := re.search(first, x))), None)
    out["prompts_reached"] = int(cut.group(1)) if cut else "all"
    return out


def by_prompt(samples) -> dict:
    """Each sample's (tokens, response start) under a digest of its prompt: under a time cap,
    variants reach other prompts (sample ids count the samples kept, so they name other prompts)."""
    out = {}
    for s in samples:
        n = int(s.loss_mask.int().argmax()) if bool(s.loss_mask.any()) else len(s.input_ids)
        out[hashlib.sha1(s.input_ids[:n].numpy().tobytes()).digest()] = (s.input_ids, n)
    return out


def parts_at(a: tuple, b: tuple) -> int | None:
    """The response token where two samples of one prompt first differ (None: the same text);
    a text that is the other's prefix parts where it ends."""
    (x, n), (y, _) = a, b
    if torch.equal(x, y):
        return None
    k = min(len(x), len(y))
    diff = (x[:k] != y[:k]).nonzero()
    return (int(diff[0]) if len(diff) else k) - n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="train.py overrides, e.g. +exp=qwen05_coder")
    ap.add_argument("--minutes", type=float, default=2.0, help="each variant's regeneration cap")
    ap.add_argument("--variants", nargs="+", default=["plain", "fuse"])
    ap.add_argument(
        "--workdir", default=None, help="the variants' sample files (default: a temp dir)"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    flags = {v: variant_flags(v) for v in args.variants}
    from dflash.data.dataset import decoder_name, generate_greedy, regenerate_dataset
    from dflash.run.cli import run_config
    from dflash.target.load import load_target

    cfg = run_config(args.overrides)
    t = time.perf_counter()
    target = load_target(cfg.target, num_aux=1)
    res = {
        "overrides": " ".join(args.overrides),
        "target": cfg.target.name,
        "dtype": str(target.dtype),
        "device": str(target.device),
        "decoder": decoder_name(target, cfg.data.regen_temperature),
        "num_samples": cfg.data.num_samples,
        "regen_batch_size": cfg.data.regen_batch_size,
        "minutes_cap": args.minutes,
        "target_load_s": round(time.perf_counter() - t, 1),
    }
    generate_greedy(target, [[1, 2, 3]] * 2, 4, 2)  # the first forward's warm-up, not timed
    work = args.workdir or tempfile.mkdtemp(prefix="regen_run_")
    os.makedirs(work, exist_ok=True)
    got = {}
    for name in args.variants:
        dcfg = dataclasses.replace(cfg.data, regen_time_limit_min=args.minutes, **flags[name])
        path = os.path.join(work, f"{name.replace('+', '_')}.pt")
        for old in glob.glob(path + "*"):  # never resume an earlier call's partial file
            shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)
        lines: list[str] = []

        def log(msg, lines=lines):
            print(f"[{name}] {msg}", flush=True)
            lines.append(msg)

        t = time.perf_counter()
        samples = regenerate_dataset(dcfg, cfg.target, target, path, log)
        res[f"{name}_wall_s"] = round(time.perf_counter() - t, 1)
        res[f"{name}_batch"] = dcfg.regen_batch_size
        res.update({f"{name}_{k}": v for k, v in regen_figures(lines).items()})
        res[f"{name}_samples"] = len(samples)
        got[name] = by_prompt(samples)
    base = args.variants[0]
    for name in args.variants[1:]:
        common = got[name].keys() & got[base].keys()
        at = sorted(p for i in common if (p := parts_at(got[name][i], got[base][i])) is not None)
        res[f"identical_samples_{name}_vs_{base}"] = f"{len(common) - len(at)}/{len(common)}"
        if at:  # late and spread: near-ties; early and many: a decoder that computes otherwise
            q = [at[int(f * (len(at) - 1))] for f in (0.25, 0.5, 0.75)]
            res[f"{name}_parts_at_response_token_quartiles"] = q
        if f"{base}_tokens_per_s" in res and f"{name}_tokens_per_s" in res:
            res[f"{name}_speedup"] = round(
                res[f"{name}_tokens_per_s"] / res[f"{base}_tokens_per_s"], 3
            )
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    report(res, args.out)


if __name__ == "__main__":
    main()
