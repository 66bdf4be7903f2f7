"""Reading + encoding conversations at scale, on CPU: peak RSS and conversations per second.

  python benchmarks/bench_data.py --conversations 100000               # the figures in docs
  python benchmarks/bench_data.py --conversations 100000 --mode lists  # the list-of-dicts way

Writes N synthetic ShareGPT conversations (1-6 user turns of 20-120 words, a system prompt in
one of ten) to a jsonl file, then measures in this process: the rows read and normalized
(dflash.data.files, streamed) and encoded for data.turns=all (dflash.data.turns: each first
prompt through the chat template, the glue before every later user turn while the tokens stay
under --max-length), into flat token tables. --mode lists does what a loader that keeps rows
does: every row parsed into a list of dicts first, every prompt a Python list of ints.

Tokenizer: --tokenizer PATH (a local Hugging Face tokenizer directory; default SmolLM2's, once
a run has converted its GGUF), or `bytes` (the tiny targets' byte-level tokenizer).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import tempfile
import time

from common import report

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no what "
    "code function python error value list data model train file return class loop test memory"
).split()


def write_conversations(path: str, n: int, seed: int = 0) -> int:
    """n ShareGPT rows, one a line; returns the file's size in bytes."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            turns = [{"from": "system", "value": f"You are assistant number {i % 10}."}]
            for _ in range(rng.randint(1, 6)):
                for who in ("human", "gpt"):
                    text = " ".join(rng.choices(WORDS, k=rng.randint(20, 120)))
                    turns.append({"from": who, "value": text})
            f.write(json.dumps({"id": f"c{i}", "conversations": turns}) + "\n")
    return os.path.getsize(path)


def rss_mb() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MB."""
    with open("/proc/self/status") as f:
        kv = dict(line.split(":", 1) for line in f)
    return int(kv["VmRSS"].split()[0]) / 1024, int(kv["VmHWM"].split()[0]) / 1024


def load_tokenizer(spec: str | None):
    from dflash.data.corpora import assets_dir
    from dflash.target.tokenizer import byte_tokenizer

    if spec == "bytes":
        return byte_tokenizer(512), "bytes"
    path = spec or os.path.join(assets_dir(), "smollm2", "hf-SmolLM2-135M-Instruct.Q4_1")
    if not os.path.isdir(path):
        if spec:
            raise SystemExit(f"--tokenizer {spec}: not a directory")
        return byte_tokenizer(512), "bytes (no converted SmolLM2 directory found)"
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path), path


def encode_streamed(path: str, tok, tcfg, max_length: int, n: int):
    from dflash.config import DataConfig
    from dflash.data.files import iter_conversations
    from dflash.data.turns import encode_turns

    dcfg = DataConfig(source="jsonl", paths=[path], num_samples=n, max_length=max_length)
    tp = encode_turns(iter_conversations(dcfg), tok, tcfg, "all", max_length)
    tokens = int(tp.first.lengths.sum() + tp.glue.lengths.sum())
    return len(tp), tp.stats["turns"], tokens, tp.first.nbytes + tp.glue.nbytes


def encode_lists(path: str, tok, tcfg, max_length: int, n: int):
    """Rows kept as parsed JSON, then prompts as lists of ints (first turns only: already
    fewer tokens than the streamed mode encodes)."""
    from dflash.data.prompts import encode_prompts

    with open(path) as f:
        rows = [json.loads(line) for line in f][:n]
    msgs = [
        [
            {
                "role": {"human": "user", "gpt": "assistant"}.get(t["from"], t["from"]),
                "content": t["value"],
            }
            for t in r["conversations"][:2]
        ]
        for r in rows
    ]
    ids = encode_prompts(msgs, tok, tcfg)
    return len(ids), len(ids), sum(len(x) for x in ids), None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=100_000)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--tokenizer", default=None, help="a tokenizer directory, or bytes")
    ap.add_argument("--mode", choices=("streamed", "lists"), default="streamed")
    ap.add_argument("--file", default=None, help="reuse this jsonl (else a temporary one)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from dflash.config import TargetConfig

    tok, tok_name = load_tokenizer(a.tokenizer)
    tcfg = TargetConfig(name="bench", chat_template=True, enable_thinking=False)
    with tempfile.TemporaryDirectory() as tmp:
        path = a.file or os.path.join(tmp, "conversations.jsonl")
        size = os.path.getsize(path) if a.file else write_conversations(path, a.conversations)
        base, _ = rss_mb()
        t0, c0 = time.perf_counter(), time.process_time()
        run = encode_streamed if a.mode == "streamed" else encode_lists
        convs, turns, tokens, table_bytes = run(path, tok, tcfg, a.max_length, a.conversations)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        _, peak = rss_mb()
    res = {
        "mode": a.mode,
        "tokenizer": tok_name,
        "conversations": convs,
        "user_turns_encoded": turns,
        "tokens": tokens,
        "file_mb": round(size / 2**20, 1),
        "seconds": round(dt, 2),
        "conversations_per_s": round(convs / dt, 1),
        "cpu_seconds": round(cpu, 2),  # this process's CPU time: the figure a shared machine keeps
        "conversations_per_cpu_s": round(convs / cpu, 1),
        "rss_before_mb": round(base, 1),
        "peak_rss_mb": round(peak, 1),
        "peak_rss_growth_mb": round(peak - base, 1),
        "ru_maxrss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    if table_bytes is not None:
        res["token_tables_mb"] = round(table_bytes / 2**20, 1)
    report(res, a.out)


if __name__ == "__main__":
    main()
