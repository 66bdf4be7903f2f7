"""Real speculative decoding vs autoregressive greedy, timed in the same process.

    OMP_NUM_THREADS=1 python benchmarks/bench_decode.py [--targets tiny_llama,tiny_qwen3_5]
        [--drafter random|oracle] [--ckpt PATH] [--budgets 4,16,64] [--prompts 3]
        [--prompt-len 32] [--new-tokens 64] [--block-size 16] [--temperature T]

For each target (a conf/target/*.yaml name) and drafter, decodes the same prompts with
`generate_ar`, `generate_chain` and `generate_tree` (one per budget), checks that every output
is token-for-token identical to AR, and prints tokens/s, tau and the speedup over AR.

Drafters: `--ckpt PATH` (a serving-format drafter directory; the target's aux layers and mask
token come from it), `random` (random weights: tau ~ 1, shows the pure overhead of drafting and
verifying), `oracle` (dflash.tools.testing.OracleDrafter over the random drafter: the target's own
greedy tokens pushed in with a hashed pattern of hits, runner-ups and misses; an instrument to
time the acceptance regime of a trained drafter, not a drafter). Prompts are random token ids.
`--temperature T` > 0 adds sampled AR and sampled chain decoding (`sample_ar`, `sample_chain`,
seeded per prompt): their outputs are samples, so they are timed but not compared with AR.
Exit status 1 if any greedy output differs from AR.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash.decoding import (  # noqa: E402
    Sampling,
    generate_ar,
    generate_chain,
    generate_tree,
    sample_ar,
    sample_chain,
)
from dflash.tools.testing import OracleDrafter  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name: str, args):
    from omegaconf import OmegaConf

    from dflash.config import DrafterConfig, TargetConfig
    from dflash.drafter.model import DFlashDrafter
    from dflash.drafter.spec import resolve_spec
    from dflash.target.linear_attn import linear_attn_report
    from dflash.target.load import load_target

    raw = OmegaConf.to_container(
        OmegaConf.load(os.path.join(ROOT, "conf", "target", f"{name}.yaml")), resolve=True
    )
    tcfg = TargetConfig(**raw)
    if args.ckpt:
        from dflash.drafter.checkpoint import load_drafter

        drafter, _ = load_drafter(args.ckpt)
        target = load_target(
            tcfg, drafter.spec.target_layer_ids, mask_token_id=drafter.spec.mask_token_id
        )
    else:
        target = load_target(tcfg, num_aux=args.num_aux)
        dcfg = DrafterConfig(
            num_layers=args.drafter_layers,
            target_layer_ids=list(target.layer_ids),
            block_size=args.block_size,
        )
        spec = resolve_spec(dcfg, target.shape)
        drafter = DFlashDrafter(spec)
        drafter.init_weights(0.02, torch.Generator().manual_seed(0))
    drafter = drafter.to(target.device, torch.float32).eval()
    gdn = linear_attn_report()
    return target, drafter, gdn


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--targets", default="tiny_llama,tiny_qwen3_5")
    ap.add_argument("--drafter", default="oracle", choices=["random", "oracle"])
    ap.add_argument(
        "--ckpt", default=None, help="drafter checkpoint directory (overrides --drafter)"
    )
    ap.add_argument("--budgets", default="4,16,64")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-aux", type=int, default=3)
    ap.add_argument("--drafter-layers", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="> 0: also sampled AR and sampled chain decoding (seeded; not compared to AR)",
    )
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",") if b]
    torch.manual_seed(args.seed)
    ok = True
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"drafter {'ckpt ' + args.ckpt if args.ckpt else args.drafter}, block {args.block_size}, "
        f"{args.prompts} prompts x {args.new_tokens} new tokens"
    )
    for name in [t for t in args.targets.split(",") if t]:
        target, drafter, gdn = load(name, args)
        g = torch.Generator().manual_seed(args.seed)
        bad = {target.mask_token_id}
        prompts = []
        for _ in range(args.prompts):
            p = torch.randint(0, target.vocab_size, (args.prompt_len,), generator=g).tolist()
            prompts.append([t if t not in bad else 0 for t in p])
        print(
            f"\n== {name}: {type(target.model).__name__}, {target.num_layers} layers, "
            f"{target.dtype}, {target.device}"
            + (f", GDN ops {sorted(set(gdn.values()))}" if gdn else "")
        )
        modes = [("ar", None), ("chain", None)] + [("tree", b) for b in budgets]
        rows = {}
        # warm-up (first-call allocations, lazy kernel binding)
        generate_ar(target, prompts[0], 8)
        for i, prompt in enumerate(prompts):
            ar = generate_ar(target, prompt, args.new_tokens)
            d = drafter
            if args.drafter == "oracle" and not args.ckpt:
                d = OracleDrafter(
                    drafter, target.lm_head.weight, prompt + ar.tokens, "mixed", seed=i
                )
            if i == 0:
                generate_chain(target, d, prompt, 8)
                generate_tree(target, d, prompt, 8, budgets[0] if budgets else 1)
            for mode, b in modes:
                if mode == "ar":
                    res = ar
                elif mode == "chain":
                    res = generate_chain(target, d, prompt, args.new_tokens)
                else:
                    res = generate_tree(target, d, prompt, args.new_tokens, b)
                same = res.tokens == ar.tokens
                ok &= same
                r = rows.setdefault(
                    res.mode, {"tokens": 0, "wall": 0.0, "acc": [], "same": True, "vt": 0}
                )
                r["tokens"] += len(res.tokens)
                r["wall"] += res.wall_s
                r["acc"] += res.accepted
                r["same"] &= same
                r["vt"] += res.verify_tokens
            if args.temperature > 0:
                s = Sampling(args.temperature, seed=args.seed + i)
                for res in (
                    sample_ar(target, prompt, args.new_tokens, s),
                    sample_chain(target, d, prompt, args.new_tokens, s),
                ):
                    r = rows.setdefault(
                        res.mode, {"tokens": 0, "wall": 0.0, "acc": [], "same": None, "vt": 0}
                    )
                    r["tokens"] += len(res.tokens)
                    r["wall"] += res.wall_s
                    r["acc"] += res.accepted
                    r["vt"] += res.verify_tokens
        ar_tps = rows["ar"]["tokens"] / rows["ar"]["wall"]
        print(
            f"{'mode':>9} {'tokens':>7} {'rounds':>7} {'tau':>6} {'verify tok':>10} {'wall s':>8} "
            f"{'tok/s':>8} {'vs AR':>6} {'== AR':>6}"
        )
        for mode, r in rows.items():
            tps = r["tokens"] / r["wall"]
            tau = f"{statistics.mean(r['acc']) + 1:.2f}" if r["acc"] else "-"
            same = "-" if r["same"] is None else "yes" if r["same"] else "NO"
            print(
                f"{mode:>9} {r['tokens']:>7} {len(r['acc']) or '-':>7} {tau:>6} {r['vt']:>10} "
                f"{r['wall']:>8.3f} {tps:>8.1f} {tps / ar_tps:>5.2f}x {same:>6}"
            )
    if not ok:
        print("\nERROR: some speculative output differs from greedy decoding")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
