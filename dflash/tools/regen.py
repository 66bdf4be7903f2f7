"""Regenerate a training dataset with the target (its own greedy responses) to a file.

    python -m dflash.tools.regen --target smollm2_135m --data stdlib --out stdlib.pt \
        [--set num_samples=200 response_len=64] [--target-set device=cpu] [--jsonl stdlib.jsonl]
    python -m dflash.tools.regen --target smollm2_135m --data stdlib --cache-dir outputs/data

Hydra-free: --target / --data name conf/target and conf/data yamls (or paths); `--set` and
`--target-set` override their keys (values parsed as YAML). The run is resumable: interrupt it
and rerun the same command, it continues from `OUT.partial`. With --cache-dir the file gets the
name a training run with `data.cache_dir=DIR` and the same target/data settings looks for, so
training starts from the regenerated data. --jsonl also writes prompt/response text per sample.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def _overrides(items) -> dict:
    import yaml

    out = {}
    for item in items or ():
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"override {item!r}: expected KEY=VALUE")
        out[key] = yaml.safe_load(value)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m dflash.tools.regen",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("--target", required=True, help="conf/target yaml name or path")
    p.add_argument("--data", required=True, help="conf/data yaml name or path")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="data.* overrides")
    p.add_argument(
        "--target-set", nargs="*", default=[], metavar="KEY=VALUE", help="target.* overrides"
    )
    p.add_argument("--out", default=None, help="output .pt file (list of samples)")
    p.add_argument(
        "--cache-dir", default=None, help="write to DIR/train-<fingerprint>.pt instead of --out"
    )
    p.add_argument(
        "--jsonl", default=None, help="also write prompt/response ids and text per sample"
    )
    return p.parse_args(argv)


def regen(args) -> dict:
    import dataclasses

    from ..config import DataConfig, TargetConfig
    from ..data.corpora import check_training_source
    from ..data.dataset import dataset_path, regenerate_dataset
    from ..target.load import load_conf, load_target, target_config_from_yaml

    for prefix, cls, over in (
        ("target", TargetConfig, args.target_set),
        ("data", DataConfig, args.set),
    ):
        known = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(_overrides(over)) - known)
        if bad:
            raise ValueError(
                f"unknown key(s) {', '.join(f'{prefix}.{k}' for k in bad)}; "
                f"valid: {', '.join(sorted(known))}"
            )
    tcfg = target_config_from_yaml(args.target, **_overrides(args.target_set))
    dcfg = DataConfig(**{**load_conf("data", args.data), **_overrides(args.set)})
    if (args.out is None) == (args.cache_dir is None):
        raise ValueError("give exactly one of --out FILE and --cache-dir DIR")
    check_training_source(dcfg.source, dcfg.paths)
    out = args.out or dataset_path(dcfg, tcfg, args.cache_dir)
    target = load_target(tcfg, num_aux=1)
    print(
        f"target {tcfg.name}: {target.num_layers} layers, H={target.hidden_size}, {target.dtype}, "
        f"{target.device}, linear-attn {target.backend}"
    )
    t0 = time.perf_counter()
    samples = regenerate_dataset(dcfg, tcfg, target, out, log=print)
    secs = time.perf_counter() - t0
    resp = sum(int(s.loss_mask.sum()) for s in samples)
    total = sum(s.input_ids.numel() for s in samples)
    summary = {
        "out": out,
        "samples": len(samples),
        "tokens": total,
        "response_tokens": resp,
        "seconds": round(secs, 2),
        "response_tokens_per_s": round(resp / max(secs, 1e-9), 1),
    }
    if args.jsonl:
        write_jsonl(samples, target.tokenizer, args.jsonl)
        summary["jsonl"] = args.jsonl
    return summary


def write_jsonl(samples, tokenizer, path: str) -> None:
    with open(path, "w") as f:
        for s in samples:
            ids, mask = s.input_ids.tolist(), s.loss_mask.tolist()
            n = mask.index(True) if True in mask else len(ids)
            row = {"sample_id": s.sample_id, "prompt_ids": ids[:n], "response_ids": ids[n:]}
            if tokenizer is not None:
                row["prompt"] = tokenizer.decode(ids[:n])
                row["response"] = tokenizer.decode(ids[n:])
            f.write(json.dumps(row) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        summary = regen(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
