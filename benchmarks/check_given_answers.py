"""How far given answers are from the target's own (data.answers=given, train/greedy_agreement).

The target regenerates the first turns of some conversations; those answers, decoded to text and
given back as the rows' assistant turns, and the conversations' own answers (another model's),
are read with data.answers=given. For each set: the seconds the data took and the share of its
response tokens that are the target's greedy token after the text before them (one teacher-forced
forward, as every training step measures it).

  bash ../shared/scripts/fetch_models.sh smollm2 sharegpt
  python benchmarks/check_given_answers.py --target smollm2_135m --rows ~/.cache/dflash/sharegpt/sharegpt.jsonl
  python benchmarks/check_given_answers.py --target tiny_llama --rows FILE   # CPU test
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import replace

import torch
from common import load_target_yaml, report


def first_turns(path: str, n: int, max_chars: int) -> list[dict]:
    """The first n rows whose first two turns are a user turn (at most max_chars) and an answer,
    cut to those two turns (ShareGPT or OpenAI rows)."""
    out = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            turns = r.get("conversations") or r.get("messages") or []
            roles = [t.get("from", t.get("role")) for t in turns[:2]]
            text = (turns[0].get("value", turns[0].get("content")) or "") if turns else ""
            if roles == ["human", "gpt"] or roles == ["user", "assistant"]:
                if 0 < len(text) <= max_chars:
                    out.append({"id": str(r.get("id", len(out))), "conversations": turns[:2]})
            if len(out) == n:
                break
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2_135m")
    ap.add_argument("--rows", required=True, help="ShareGPT / OpenAI jsonl")
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--max-chars", type=int, default=600, help="longest first user turn")
    ap.add_argument("--response-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from dflash.config import DataConfig
    from dflash.data.batch import collate, target_forward
    from dflash.data.dataset import load_or_build_dataset
    from dflash.target.load import load_target

    tc = replace(load_target_yaml(args.target), dtype=args.dtype)
    target = load_target(tc, num_aux=3)
    tok = target.tokenizer
    work = tempfile.mkdtemp(prefix="given-")
    rows = first_turns(os.path.expanduser(args.rows), args.n, args.max_chars)

    def write(name, rs):
        path = os.path.join(work, name)
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rs)
        return path

    dc = DataConfig(
        source="jsonl",
        paths=[write("rows.jsonl", rows)],
        num_samples=len(rows),
        response_len=args.response_len,
        max_length=args.max_chars * 2 + args.response_len,
        regen_batch_size=args.batch,
        turns="first",
        too_long="drop",
    )

    def build(name, cfg):
        t0 = time.perf_counter()
        samples = load_or_build_dataset(cfg, tc, target, os.path.join(work, name), log=print)
        return samples, time.perf_counter() - t0

    regen, t_regen = build("regen", dc)
    exported = []  # the target's answers as the rows' assistant turns, in text
    for r, s in zip(rows, regen):
        ids = s.input_ids[s.loss_mask].tolist()
        ids = ids[:-1] if ids and ids[-1] == tok.eos_token_id else ids
        exported.append({"id": r["id"], "conversations": [r["conversations"][0]]})
        exported[-1]["conversations"].append({"from": "gpt", "value": tok.decode(ids)})
    back, t_back = build(
        "back", replace(dc, paths=[write("back.jsonl", exported)], answers="given")
    )
    theirs, t_theirs = build("theirs", replace(dc, answers="given"))

    def agreement(samples) -> tuple[float, int]:
        hits = total = 0.0
        with torch.no_grad():
            for i in range(0, len(samples), 8):
                tb = target_forward(
                    target, collate(samples[i : i + 8], pad_id=tok.pad_token_id or 0)
                )
                h, t = tb.greedy_agreement().tolist()
                hits, total = hits + h, total + t
        return hits / max(total, 1), int(total)

    same = sum(
        torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        for a, b in zip(regen, back)
    )
    res = {"target": args.target, "dtype": args.dtype, "conversations": len(rows)}
    for name, samples, secs in (
        ("regenerated", regen, t_regen),
        ("regenerated_text_given", back, t_back),
        ("their_own_answers_given", theirs, t_theirs),
    ):
        a, n = agreement(samples)
        res |= {f"{name}_data_s": secs, f"{name}_agreement": a, f"{name}_tokens": n}
    res["regenerated_text_given_equal_samples"] = same
    report(res, args.out)


if __name__ == "__main__":
    main()
