"""Aux-state parity of one target under two settings (backend, dtype, device).

    python -m dflash.tools.parity --target qwen3_6_27b_random --tokens 1024 \
        --a torch:bfloat16:cuda --b fla:bfloat16:cuda [--layers 1,16,31,46,61] [--out parity.json]

A setting is BACKEND:DTYPE:DEVICE (backend auto|fla|torch). Both runs see the same token ids and
the same weights: pretrained targets load from disk; random targets are initialised once per run
with the same seed at `--init DEVICE:DTYPE` (default cuda:bfloat16 when CUDA exists, else
cpu:float32) and then converted to the run's dtype and device, so random-weight runs on
different devices still compare identical weights. The Gated-DeltaNet backend is bound when
transformers imports the modeling module, so runs with different backends go to two fresh
subprocesses (one after the other, to hold one copy of the model at a time); runs with the same
backend share one process.

Per aux layer: mean and min per-token cosine similarity, mean and max |a - b|, and the relative
L2 error; a layer passes when its mean cosine >= --threshold. Exit code 0 when every layer
passes, 1 otherwise (2 on usage errors). `--perturb b:LAYER:SCALE` adds Gaussian noise of SCALE
times the RMS to LAYER's output in run b: a self-test that the checker names a broken layer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Setting:
    backend: str
    dtype: str
    device: str

    @classmethod
    def parse(cls, spec: str) -> Setting:
        parts = spec.split(":")
        if len(parts) != 3:
            raise ValueError(
                f"setting {spec!r}: expected BACKEND:DTYPE:DEVICE, e.g. torch:float32:cpu"
            )
        backend, dtype, device = parts
        if backend not in ("auto", "fla", "torch"):
            raise ValueError(f"setting {spec!r}: backend must be auto, fla or torch")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"setting {spec!r}: dtype must be float32, bfloat16 or float16")
        return cls(backend, dtype, device)

    def __str__(self) -> str:
        return f"{self.backend}:{self.dtype}:{self.device}"


# ----------------------------------------------------------------------------- one run
def capture_run(args, setting: Setting, side: str) -> dict:
    """Load the target under `setting`, run the fixed token ids, return per-layer aux states
    (float32, CPU), the greedy tokens and what ran."""
    from ..target.capture import Target
    from ..target.linear_attn import (
        check_bound_backend,
        linear_attn_report,
        select_linear_attn_backend,
    )
    from ..target.load import TargetConfig, load_hf_model, resolve_dtype, target_config_from_yaml

    tcfg: TargetConfig = target_config_from_yaml(args.target)
    if args.num_layers is not None:
        if tcfg.config is None:
            raise ValueError("--num-layers only applies to random-weight targets (target.config)")
        tcfg = replace(tcfg, config={**tcfg.config, "num_hidden_layers": args.num_layers})
    device = torch.device(setting.device)
    backend = select_linear_attn_backend(setting.backend, device)
    init_dev, init_dtype = _init_spec(args.init, tcfg, setting)
    t0 = time.perf_counter()
    model, tokenizer = load_hf_model(
        tcfg, torch.device(init_dev), resolve_dtype(init_dtype, torch.device(init_dev))
    )
    model.to(device=device, dtype=resolve_dtype(setting.dtype, device))
    backend = check_bound_backend(model, backend)
    load_s = time.perf_counter() - t0
    layers = _layer_ids(args.layers, int(model.config.num_hidden_layers))
    target = Target(model, layers, tokenizer, mask_token_id=0, backend=backend)
    ids = token_ids(args.tokens, target.vocab_size, args.seed).to(device)[None]
    handle = None
    if args.perturb and args.perturb[0] == side:
        handle = _plant_noise(target, args.perturb[1], args.perturb[2], args.seed)
    try:
        if device.type == "cuda":  # compile/autotune Triton kernels outside the timed forward
            target.capture(ids)
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = target.capture(ids)
        if device.type == "cuda":
            torch.cuda.synchronize()
        fwd_s = time.perf_counter() - t0
    finally:
        if handle is not None:
            handle.remove()
    H = target.hidden_size
    aux = out.aux_NTF[0].float().cpu()
    result = {
        "setting": str(setting),
        "backend": backend,
        "linear_attn": linear_attn_report(),
        "layers": layers,
        "aux": {lid: aux[:, i * H : (i + 1) * H].clone() for i, lid in enumerate(layers)},
        "next_token": out.next_token_NT[0].cpu(),
        "load_s": load_s,
        "forward_s": fwd_s,
    }
    del target, model, out
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _init_spec(spec: str, tcfg, setting: Setting) -> tuple[str, str]:
    if tcfg.config is None:  # pretrained weights are the same on disk for both runs
        return setting.device, setting.dtype
    if spec == "auto":
        return ("cuda", "bfloat16") if torch.cuda.is_available() else ("cpu", "float32")
    dev, _, dtype = spec.partition(":")
    return dev, dtype or "float32"


def _layer_ids(spec: str | None, num_layers: int) -> list[int]:
    from ..target.shape import check_layer_ids, default_layer_ids

    if not spec:
        return default_layer_ids(num_layers, min(5, max(1, num_layers - 2)))
    return check_layer_ids([int(x) for x in spec.split(",")], num_layers)


def token_ids(num: int, vocab_size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num,), generator=g)


def _plant_noise(target, layer: int, scale: float, seed: int):
    g = torch.Generator().manual_seed(seed + 1)

    def hook(_mod, _inp, out):
        h = out[0] if isinstance(out, (tuple, list)) else out
        rms = h.float().pow(2).mean(-1, keepdim=True).sqrt()
        noise = torch.randn(h.shape, generator=g).to(h.device)
        h = (h.float() + scale * rms * noise).to(h.dtype)
        return (h, *out[1:]) if isinstance(out, (tuple, list)) else h

    return target.decoder_layers()[layer].register_forward_hook(hook)


# ----------------------------------------------------------------------------- comparison
def compare(a: dict, b: dict, threshold: float) -> dict:
    rows = []
    for lid in a["layers"]:
        x, y = a["aux"][lid].double(), b["aux"][lid].double()
        cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
        diff = (x - y).abs()
        rows.append(
            {
                "layer": lid,
                "cos_mean": float(cos.mean()),
                "cos_min": float(cos.min()),
                "abs_mean": float(diff.mean()),
                "abs_max": float(diff.max()),
                "rel_l2": float((x - y).norm() / y.norm().clamp_min(1e-30)),
                "pass": bool(cos.mean() >= threshold),
            }
        )
    agree = float((a["next_token"] == b["next_token"]).double().mean())
    failed = [r["layer"] for r in rows if not r["pass"]]
    return {
        "threshold": threshold,
        "layers": rows,
        "next_token_agreement": agree,
        "failed_layers": failed,
        "pass": not failed,
    }


def format_table(report: dict) -> str:
    lines = [
        f"a: {report['a']['setting']}  (GDN: {report['a']['backend']}, load {report['a']['load_s']:.1f}s, "
        f"forward {report['a']['forward_s']:.2f}s)",
        f"b: {report['b']['setting']}  (GDN: {report['b']['backend']}, load {report['b']['load_s']:.1f}s, "
        f"forward {report['b']['forward_s']:.2f}s)",
        f"target {report['target']}, {report['tokens']} tokens, seed {report['seed']}",
        f"{'layer':>5}  {'cos mean':>10}  {'cos min':>10}  {'mean |a-b|':>11}  {'max |a-b|':>10}  "
        f"{'rel L2':>9}  result",
    ]
    for r in report["layers"]:
        lines.append(
            f"{r['layer']:>5}  {r['cos_mean']:>10.6f}  {r['cos_min']:>10.6f}  {r['abs_mean']:>11.4e}  "
            f"{r['abs_max']:>10.4e}  {r['rel_l2']:>9.2e}  {'pass' if r['pass'] else 'FAIL'}"
        )
    lines.append(f"greedy next-token agreement: {report['next_token_agreement']:.4f}")
    verdict = (
        "PASS"
        if report["pass"]
        else f"FAIL: layers {report['failed_layers']} below cosine {report['threshold']}"
    )
    lines.append(verdict)
    return "\n".join(lines)


def _run_in_subprocess(args, setting: Setting, side: str, workdir: str) -> dict:
    path = os.path.join(workdir, f"{side}.pt")
    cmd = [
        sys.executable,
        "-m",
        "dflash.tools.parity",
        "--worker",
        side,
        "--save",
        path,
        "--a" if side == "a" else "--b",
        str(setting),
    ] + _common_argv(args)
    proc = subprocess.run(cmd, env=os.environ.copy())
    if proc.returncode != 0 or not os.path.exists(path):
        raise RuntimeError(f"parity run {side} ({setting}) failed with exit code {proc.returncode}")
    return torch.load(path)


def _common_argv(args) -> list[str]:
    out = [
        "--target",
        args.target,
        "--tokens",
        str(args.tokens),
        "--seed",
        str(args.seed),
        "--init",
        args.init,
    ]
    if args.layers:
        out += ["--layers", args.layers]
    if args.num_layers is not None:
        out += ["--num-layers", str(args.num_layers)]
    if args.perturb:
        out += ["--perturb", ":".join(str(x) for x in args.perturb)]
    return out


def check_fits(args, *settings: Setting) -> None:
    """Before anything loads: each setting's device exists and holds the weights (a random 27B
    target on a CPU box was OOM-killed after minutes of initialisation)."""
    from ..run.preflight import check_target_resources
    from ..target.load import target_config_from_yaml

    tcfg = target_config_from_yaml(args.target)
    if args.num_layers is not None and tcfg.config is not None:
        tcfg = replace(tcfg, config={**tcfg.config, "num_hidden_layers": args.num_layers})
    for s in settings:
        be = s.backend if s.backend != "auto" else tcfg.linear_attn_backend
        check_target_resources(replace(tcfg, dtype=s.dtype, linear_attn_backend=be), s.device)
    if tcfg.config is not None:
        dev, dtype = _init_spec(args.init, tcfg, settings[0])
        check_target_resources(replace(tcfg, dtype=dtype), dev)


def run_parity(args) -> dict:
    a, b = Setting.parse(args.a), Setting.parse(args.b)
    check_fits(args, a, b)
    separate = args.subprocess or _resolved_backend(a) != _resolved_backend(b)
    if separate:
        with tempfile.TemporaryDirectory(prefix="dflash-parity-") as d:
            ra = _run_in_subprocess(args, a, "a", d)
            rb = _run_in_subprocess(args, b, "b", d)
    else:
        ra = capture_run(args, a, "a")
        rb = capture_run(args, b, "b")
    report = compare(ra, rb, args.threshold)
    strip = lambda r: {k: v for k, v in r.items() if k not in ("aux", "next_token")}
    report.update(
        {
            "a": strip(ra),
            "b": strip(rb),
            "target": args.target,
            "tokens": args.tokens,
            "seed": args.seed,
            "separate_processes": separate,
            "perturb": ":".join(map(str, args.perturb)) if args.perturb else None,
        }
    )
    return report


def _resolved_backend(s: Setting) -> str:
    if s.backend != "auto":
        return s.backend
    from ..target.linear_attn import _fla_importable

    return "fla" if s.device.startswith("cuda") and _fla_importable() else "torch"


def _perturb(spec: str):
    try:
        side, layer, scale = spec.split(":")
        assert side in ("a", "b")
        return side, int(layer), float(scale)
    except (ValueError, AssertionError):
        raise argparse.ArgumentTypeError(
            f"--perturb {spec!r}: expected a|b:LAYER:SCALE, e.g. b:3:0.5"
        ) from None


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m dflash.tools.parity",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", default="tiny_qwen3_5", help="conf/target yaml name or path")
    p.add_argument(
        "--a", default="torch:float32:cpu", help="BACKEND:DTYPE:DEVICE of run a (the reference)"
    )
    p.add_argument("--b", default="torch:float32:cpu", help="BACKEND:DTYPE:DEVICE of run b")
    p.add_argument(
        "--layers", default=None, help="comma-separated aux layer ids (default: 5 evenly spaced)"
    )
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threshold", type=float, default=0.99, help="minimum mean cosine per layer")
    p.add_argument(
        "--init", default="auto", help="DEVICE:DTYPE where random weights are initialised"
    )
    p.add_argument("--num-layers", type=int, default=None, help="truncate a random-weight target")
    p.add_argument(
        "--perturb", type=_perturb, default=None, help="a|b:LAYER:SCALE planted noise (self-test)"
    )
    p.add_argument(
        "--subprocess",
        action="store_true",
        help="run a and b in fresh processes even if their backends agree",
    )
    p.add_argument("--out", default=None, help="write the report as JSON")
    p.add_argument("--worker", choices=("a", "b"), help=argparse.SUPPRESS)
    p.add_argument("--save", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.worker:
            torch.save(
                capture_run(args, Setting.parse(getattr(args, args.worker)), args.worker), args.save
            )
            return 0
        report = run_parity(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
