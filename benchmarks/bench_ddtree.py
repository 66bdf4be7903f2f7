"""Time DDTree construction/acceptance per block and the offline walks, on CPU.

    OMP_NUM_THREADS=1 python benchmarks/bench_ddtree.py [--blocks 20] [--budgets 4,8,...]

Synthetic drafter-like blocks: at position k the drafter puts probability p_k (0.95 at k=1
down to 0.5 at k=D) on one token, and the target's greedy token is that token with
probability p_k, else one of its runner-ups (rank 2..6), so acceptance depths are realistic. Prints
measured figures only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflash.decoding.ddtree import build_ddtree
from dflash.eval.ddtree import ddtree_accept, ddtree_accept_many, ddtree_accept_topk
from dflash.eval.metrics import walk_chain, walk_ddtree


def drafter_like_block(gen: torch.Generator, D: int, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs [D, V], greedy target [D]): top-1 prob p_k from 0.95 (k=1) to 0.5 (k=D)."""
    logits = torch.randn(D, V, generator=gen) * 1.5
    p_top = torch.linspace(0.95, 0.5, D, dtype=torch.float64)
    top = torch.randint(0, V, (D,), generator=gen)
    rest = logits.double().scatter(1, top[:, None], -float("inf")).logsumexp(-1)
    logits[torch.arange(D), top] = (torch.log(p_top / (1 - p_top)) + rest).float()
    lp = torch.log_softmax(logits, dim=-1)
    hit = torch.rand(D, generator=gen, dtype=torch.float64) < p_top
    runner = lp.topk(6, dim=-1).indices[torch.arange(D), torch.randint(1, 6, (D,), generator=gen)]
    return lp, torch.where(hit, top, runner)


def ms_per_call(fn, items) -> float:
    fn(items[0])  # warm-up
    t0 = time.perf_counter()
    for it in items:
        fn(it)
    return (time.perf_counter() - t0) * 1e3 / len(items)


def bench_blocks(args, V: int, topk: bool) -> None:
    gen = torch.Generator().manual_seed(args.seed)
    blocks = [drafter_like_block(gen, args.D, V) for _ in range(args.blocks)]
    bmax = max(args.budgets)
    if topk:  # what evaluation stores: top-bmax per position
        blocks = [(*torch.topk(lp, bmax, dim=-1), tgt) for lp, tgt in blocks]
        build = lambda b: lambda x: build_ddtree(x[0], b, x[1])  # noqa: E731
        accept = lambda bs: lambda x: ddtree_accept_topk(x[0], x[1], x[2], bs)  # noqa: E731
        first = [ddtree_accept_topk(v, i, t, args.budgets) for v, i, t in blocks]
    else:
        build = lambda b: lambda x: build_ddtree(x[0], b)  # noqa: E731
        accept = lambda bs: lambda x: ddtree_accept(x[0], x[1], bs)  # noqa: E731
        first = [ddtree_accept(lp, t, args.budgets) for lp, t in blocks]
    kind = f"top-{bmax} of V={V}" if topk else f"full V={V}"
    print(f"\n[{kind}, D={args.D}, {args.blocks} blocks] ms per block")
    print(f"{'budget':>7} {'build_ddtree':>13} {'ddtree_accept':>14} {'mean accepted':>14}")
    for b in args.budgets:
        t_build = ms_per_call(build(b), blocks)
        t_acc = ms_per_call(accept([b]), blocks)
        mean_acc = statistics.mean(r[b] for r in first)
        print(f"{b:>7} {t_build:>13.3f} {t_acc:>14.3f} {mean_acc:>14.2f}")
    t_all = ms_per_call(accept(args.budgets), blocks)
    print(f"{'all':>7} {'':>13} {t_all:>14.3f}   (one heap run to {bmax} for all budgets)")


def bench_walks(args) -> None:
    gen = torch.Generator().manual_seed(args.seed)
    L, D, V = args.walk_len, args.D, 1000
    g = torch.randint(0, V, (L,), generator=gen)
    target_LD = g[(torch.arange(L)[:, None] + torch.arange(1, D + 1)[None, :]).clamp(max=L - 1)]
    right = torch.rand(L, D, generator=gen) < torch.linspace(0.9, 0.4, D)
    draft = torch.where(right, target_LD, (target_LD + 1) % V)
    reps = 20
    walk_chain(draft, g)
    t0 = time.perf_counter()
    for _ in range(reps):
        w = walk_chain(draft, g)
    dt = (time.perf_counter() - t0) / reps
    print(
        f"\n[walk_chain, L={L}, D={D}] {w.num_rounds} rounds, streak {w.streak:.2f}: "
        f"{w.num_rounds / dt:,.0f} rounds/s ({dt * 1e3:.2f} ms per prompt)"
    )

    # DDTree walk on stored top-k (what eval does), every budget, one prompt
    K = max(args.budgets)
    n = min(L, args.walk_tree_len)
    blocks = [drafter_like_block(gen, D, 4096) for _ in range(n)]
    vals = torch.stack([torch.topk(lp, K, dim=-1).values for lp, _ in blocks])
    ids = torch.stack([torch.topk(lp, K, dim=-1).indices for lp, _ in blocks])
    tg = torch.empty(n, dtype=torch.long)
    tg[1:] = torch.stack([t[0] for _, t in blocks[:-1]])
    tg[0] = 0
    t0 = time.perf_counter()
    walks = walk_ddtree(vals, ids, tg, args.budgets)
    dt = time.perf_counter() - t0
    rounds = sum(w.num_rounds for w in walks.values())
    print(
        f"[walk_ddtree, L={n}, D={D}, top-{K}, budgets {args.budgets}] {rounds} rounds in "
        f"{dt:.2f} s ({dt * 1e3 / n:.2f} ms per completion token)"
    )
    t0 = time.perf_counter()
    before = walk_per_visited_anchor(vals, ids, tg, args.budgets)
    dt_before = time.perf_counter() - t0
    assert before == {b: w.accepted for b, w in walks.items()}
    print(
        f"[walk_ddtree as before: one ddtree_accept_topk per visited anchor] {dt_before:.2f} s: "
        f"walk_ddtree (all anchors batched) is {dt_before / dt:.2f}x faster, same walks"
    )
    tgt_ND = torch.stack([t for _, t in blocks])
    t0 = time.perf_counter()
    ddtree_accept_many(vals, ids, tgt_ND, args.budgets)
    dt = time.perf_counter() - t0
    print(
        f"[ddtree_accept_many, N={n}, all budgets] {n / dt:,.0f} anchors/s ({dt * 1e3 / n:.2f} ms per anchor)"
    )


def walk_per_visited_anchor(vals, ids, tg, budgets) -> dict[int, list[int]]:
    """walk_ddtree's walks the way it computed them until 2026-12-03: one ddtree_accept_topk
    per anchor a walk visits (memoized across budgets). Accepted lengths per budget."""
    L, D = tg.numel(), vals.shape[1]
    memo: dict[int, dict[int, int]] = {}
    out = {}
    for b in sorted(budgets):
        i, acc = 0, []
        while i < L - 1:
            if i not in memo:
                memo[i] = ddtree_accept_topk(vals[i], ids[i], tg[i + 1 : i + 1 + D], budgets)
            acc.append(memo[i][b])
            i += memo[i][b] + 1
        out[b] = acc
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--D", type=int, default=15, help="drafted positions per block (block_size - 1)"
    )
    ap.add_argument(
        "--budgets",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[4, 8, 16, 32, 64, 128, 256, 512, 1024],
    )
    ap.add_argument("--blocks", type=int, default=20, help="random blocks timed per setting")
    ap.add_argument("--vocab-large", type=int, default=248320)
    ap.add_argument("--vocab-small", type=int, default=32000)
    ap.add_argument("--walk-len", type=int, default=4096, help="completion length for walk_chain")
    ap.add_argument(
        "--walk-tree-len", type=int, default=512, help="completion length for walk_ddtree"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    bench_blocks(args, args.vocab_large, topk=True)
    bench_blocks(args, args.vocab_small, topk=False)
    bench_walks(args)


if __name__ == "__main__":
    main()
