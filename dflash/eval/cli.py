"""eval.py: load a drafter checkpoint, check it against the target, run the offline simulation."""

from __future__ import annotations

import dataclasses
import os

from ..common.layout import drafter_dir, read_run_config, run_dir_of
from ..config import EVAL_BEFORE_THE_KEY, DataConfig, EvalConfig, RunConfig, TargetConfig
from ..drafter.checkpoint import load_drafter
from ..drafter.variants import variant
from ..target.load import load_target
from ..target.shape import Heads
from .decode import decode_report
from .offline import evaluate
from .report import print_report, write_json
from .sets import build_eval_set, build_eval_sets


def run_config_of(ckpt: str) -> dict | None:
    """Our checkpoints sit in <run_dir>/checkpoints/step_*; the run's config is next to them."""
    for cand in (os.path.join(ckpt, "..", ".."), ckpt):
        if os.path.isfile(os.path.join(cand, "run_config.json")):
            return read_run_config(os.path.normpath(cand))
    return None


def _run_caches(ckpt: str, prev: dict | None) -> tuple[str, ...]:
    """The data cache of the run a checkpoint belongs to: its eval set is reused when this eval
    asks for the same one (same key), so eval.py scores the prompts the in-loop eval scored."""
    if prev is None:
        return ()
    run_dir = run_dir_of(ckpt) or ckpt  # or a step dir holding its own run_config.json
    return (prev.get("data", {}).get("cache_dir") or os.path.join(run_dir, "data"),)


def checkpoint_of(rc: RunConfig) -> str:
    """The drafter directory `ckpt=` names (a run dir, checkpoints/latest or a step dir)."""
    if not rc.ckpt:
        raise ValueError("ckpt is not set: python eval.py ckpt=/path/to/drafter_dir")
    return drafter_dir(rc.ckpt)


def eval_dir(rc: RunConfig, root: str = "evals") -> str:
    """evals/<run>-<step> for our checkpoints (<run>/checkpoints/step_*), evals/<dir name> for a
    published one; checked here so that a bad ckpt leaves no directory behind."""
    ck = os.path.abspath(checkpoint_of(rc))
    parent = os.path.dirname(ck)
    name = os.path.basename(ck)
    if os.path.basename(parent) == "checkpoints":
        name = f"{os.path.basename(os.path.dirname(parent))}-{name}"
    return rc.eval_dir or os.path.join(root, name)


# What a run config saved before a key existed ran with, where the key's default differs: such a
# run's eval.py restores this value, so it scores the set the in-loop eval scored.
BEFORE_THE_KEY = {"eval": EVAL_BEFORE_THE_KEY}


def _restore_group(rc: RunConfig, group: str, cls, saved: dict, user_set: set[str]):
    """The run's own values of a config group, with the keys the command line names on top
    (`eval.real_decode_prompts=8` keeps the run's eval prompts)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    mine = sorted({k.split(".")[1] for k in user_set if k.startswith(group + ".")} & fields)
    merged = {**BEFORE_THE_KEY.get(group, {}), **{k: v for k, v in saved.items() if k in fields}}
    merged.update({k: getattr(getattr(rc, group), k) for k in mine})
    label = group + (f" (but {', '.join(f'{group}.{k}' for k in mine)})" if mine else "")
    return dataclasses.replace(rc, **{group: cls(**merged)}), label


def run_eval(rc: RunConfig, out_dir: str, overrides: list[str]) -> dict:
    ck = checkpoint_of(rc)
    if os.path.normpath(os.path.expanduser(rc.ckpt)) != ck:
        print(f"checkpoint: {ck}")
    rc = dataclasses.replace(rc, ckpt=ck)
    drafter = _load_and_describe(rc.ckpt)
    prev = run_config_of(rc.ckpt)
    rc = _with_the_runs_settings(rc, prev, overrides)
    target = _target_for(rc, drafter.spec)
    where = dict(exclude_training=prev is not None, read_dirs=_run_caches(rc.ckpt, prev))
    cache = os.path.join(out_dir, "data")
    if rc.eval.sets:
        sets = build_eval_sets(rc, target, cache, log=print, **where)
    else:
        sets = {"": build_eval_set(rc, target, cache, log=print, **where)}
    drafter = drafter.to(target.device)
    results = {}
    per_set = {es.name: es.real_decode_prompts for es in rc.eval.sets}
    for name, items in sets.items():
        n_real = per_set.get(name)
        n_real = rc.eval.real_decode_prompts if n_real is None else n_real
        results[name] = _evaluate_set(rc, target, drafter, items, n_real, name or "eval")
        if name:
            print(f"eval set {name}:")
        print_report(*results[name], rc.eval.budgets, rc.eval.show_rounds)
    if rc.eval.sets:
        reports = []
        summary = {f"{n}/{k}": v for n, (_, s) in results.items() for k, v in s.items()}
    else:
        reports, summary = results[""]
    if rc.out:
        spec = drafter.spec
        meta = {
            "ckpt": os.path.abspath(rc.ckpt),
            "target": rc.target.name,
            "architecture": variant(spec.variant).architecture,
            "block_size": spec.block_size,
            "target_layer_ids": spec.target_layer_ids,
            "eval": dataclasses.asdict(rc.eval),
        }
        write_json(rc.out, reports, summary, meta, results if rc.eval.sets else None)
        print(f"wrote {rc.out}")
    return summary


def _load_and_describe(ckpt: str):
    """The checkpoint's drafter, and what it is (variant, fc input, tensors) said first."""
    drafter, report = load_drafter(ckpt, strict=False)
    spec = drafter.spec
    fc_in = report["fc_input"]
    extra = ", ".join(f"{k}={v}" for k, v in spec.variant_config.items())
    print(f"Drafter: {variant(spec.variant).architecture}" + (f" ({extra})" if extra else ""))
    print(
        f"Detected fc input: {fc_in} = {spec.num_aux} target layers x {spec.hidden_size} "
        f"(target_layer_ids {spec.target_layer_ids}, from the checkpoint)"
    )
    print(
        f"Loaded {report['loaded']} tensors; skipped (not drafter weights): {report['skipped'] or 'none'}; "
        f"missing: {report['missing'] or 'none'}"
    )
    if report["missing"]:
        raise ValueError(
            f"{ckpt}: missing drafter weights {report['missing'][:5]}; the checkpoint is incomplete"
        )
    return drafter


def _with_the_runs_settings(rc: RunConfig, prev: dict | None, overrides: list[str]) -> RunConfig:
    """The run's own target, data conventions (chat template, prompt source) and eval set,
    unless the command line names them: the drafter is judged on prompts formatted as it saw
    them in training."""
    if prev is None:
        print(
            "no run config next to the checkpoint (a published drafter): its training prompts "
            f"are unknown, so the eval prompts are the first eval.num_prompts={rc.eval.num_prompts} "
            "rows of eval.paths (or data.paths)"
        )
        return rc
    user_set = {o.split("=")[0].lstrip("+") for o in overrides}
    restored = []
    for group, cls in (("target", TargetConfig), ("data", DataConfig), ("eval", EvalConfig)):
        if group in prev and group not in user_set:  # `eval=default` takes the whole group
            rc, label = _restore_group(rc, group, cls, prev[group], user_set)
            restored.append(label)
    if restored:
        print(
            f"from the checkpoint's run config: {', '.join(restored)} (target {rc.target.name}, "
            + (
                f"eval sets {', '.join(s.name for s in rc.eval.sets)})"
                if rc.eval.sets
                else f"eval source {rc.eval.source or rc.data.source}, "
                f"{rc.eval.num_prompts} prompts)"
            )
        )
    return rc


def _evaluate_set(
    rc: RunConfig, target, drafter, items, n_real: int, desc: str
) -> tuple[list, dict]:
    reports, summary = evaluate(
        drafter,
        Heads(target.embed_tokens, target.lm_head),
        items,
        rc.eval.budgets,
        temperatures=rc.eval.temperatures,
        top_p=rc.eval.top_p,
        top_k=rc.eval.top_k,
        tree_rules=rc.eval.tree_rules,
        desc=desc,
    )
    if n_real:
        summary.update(decode_report(target, drafter, items, n_real, rc.eval, log=print))
    return reports, summary


def _target_for(rc: RunConfig, spec):
    """Load the target with the checkpoint's layer ids and mask token, refusing mismatches."""
    target = load_target(
        rc.target, layer_ids=spec.target_layer_ids, mask_token_id=spec.mask_token_id
    )
    if spec.hidden_size != target.hidden_size:
        raise ValueError(
            f"drafter hidden size {spec.hidden_size} != target hidden size {target.hidden_size} "
            f"(target={rc.target.name}); evaluate with the target it was trained for"
        )
    if spec.vocab_size != target.vocab_size:
        raise ValueError(
            f"drafter vocab {spec.vocab_size} != target vocab {target.vocab_size} "
            f"(target={rc.target.name})"
        )
    print(
        f"target: {rc.target.name}, {target.num_layers} layers, Gated-DeltaNet backend: {target.backend}"
    )
    return target
