"""Evaluation that predicts serving: the exact offline greedy simulation.

Per eval prompt we cache the target's greedy completion and the aux states along it. The
drafter then runs once with every completion position as an anchor, through the same block
machinery as training (dflash.blocks), and dflash.metrics walks the rounds exactly as a serving
engine would at temperature 0.

Legend: P prompt length, L completion length, T = P + L, D = B - 1 drafted positions, K top-k.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file

from .blocks import build_blocks, mask_rules
from .data import encode_prompts, generate_greedy, random_prompts, text_prompts
from .drafter import DFlashDrafter
from .metrics import evaluate_prompt, summarize


@dataclass
class EvalItem:
    prompt_ids: torch.Tensor  # [P]
    completion_ids: torch.Tensor  # [L] the target's greedy completion (self-consistent)
    aux_TF: torch.Tensor  # [P+L, K*H] aux states along prompt + completion


@torch.no_grad()
def consistent_greedy(target, prompt: list[int], completion: list[int]) -> EvalItem:
    """Re-run the target over prompt+completion in one forward and keep the completion up to the
    first token that is not the argmax of that forward (batched generation and a one-shot
    forward can disagree at near-ties); the walk then compares against a true fixed point."""
    ids = torch.tensor(list(prompt) + list(completion), dtype=torch.long, device=target.device)[
        None
    ]
    out = target.capture(ids)
    P = len(prompt)
    pred = out.next_token_NT[0, P - 1 : -1].cpu()
    comp = torch.tensor(completion, dtype=torch.long)
    bad = (pred != comp).nonzero()
    n = int(bad[0]) if bad.numel() else len(completion)
    return EvalItem(
        torch.tensor(prompt, dtype=torch.long),
        comp[:n].clone(),
        out.aux_NTF[0, : P + n].cpu().clone(),
    )


def eval_prompts(cfg, target, exclude_training: bool = True) -> list[list[int]]:
    ecfg, dcfg = cfg.eval, cfg.data
    source = ecfg.source or dcfg.source
    if source == "selfgen":
        return random_prompts(
            ecfg.num_prompts, dcfg.prompt_len, target.vocab_size, [target.mask_token_id], ecfg.seed
        )
    if target.tokenizer is None:
        raise ValueError(f"eval source {source!r} needs a target with a tokenizer")
    return encode_prompts(heldout_text_prompts(cfg, exclude_training), target.tokenizer, cfg.target)


def _prompt_key(p) -> str:
    return json.dumps(p, sort_keys=True, default=str)


def heldout_text_prompts(cfg, exclude_training: bool = True) -> list:
    """Eval prompts that are never training prompts: from eval.paths / eval.source when they
    name another source (refused if they overlap the training prompts), else the rows of the
    training source after the ones training uses, with any prompt that training also sees
    removed. exclude_training=False (a published drafter: its training prompts are unknown):
    data.* names the eval prompts themselves, whatever data.num_samples says."""
    from dataclasses import replace

    ecfg, dcfg = cfg.eval, cfg.data
    source = ecfg.source or dcfg.source
    if not exclude_training:
        ed = replace(dcfg, source=source, paths=list(ecfg.paths or dcfg.paths))
        return text_prompts(replace(ed, num_samples=ecfg.num_prompts, seed=ecfg.seed))
    if ecfg.paths or source != dcfg.source:
        ed = replace(
            dcfg,
            source=source,
            paths=list(ecfg.paths),
            num_samples=ecfg.num_prompts,
            seed=ecfg.seed,
        )
        out = text_prompts(ed)[: ecfg.num_prompts]
        if dcfg.source != "selfgen":  # random token prompts never equal text prompts
            seen = {_prompt_key(p) for p in text_prompts(dcfg)}
            both = sum(_prompt_key(p) in seen for p in out)
            if both:
                raise ValueError(
                    f"eval.paths/eval.source: {both} of {len(out)} eval prompts are also training "
                    f"prompts of data.paths/data.source={dcfg.source} {list(dcfg.paths)}; point "
                    "eval.paths at held-out prompts"
                )
        return out
    seen = {_prompt_key(p) for p in text_prompts(dcfg)}
    pool = text_prompts(replace(dcfg, num_samples=dcfg.num_samples + ecfg.num_prompts))
    out = [p for p in pool if _prompt_key(p) not in seen][: ecfg.num_prompts]
    if not out:
        raise ValueError(
            f"eval: no held-out prompts left: data.source={dcfg.source} has no rows beyond the "
            f"{dcfg.num_samples} used for training; lower data.num_samples or set eval.paths "
            "/ eval.source"
        )
    return out


def build_eval_set(
    cfg, target, cache_dir: str | None, log=print, exclude_training: bool = True
) -> list[EvalItem]:
    key = json.dumps(
        {
            "exclude_training": exclude_training,
            "eval": vars(cfg.eval),
            "data": vars(cfg.data),
            "target": vars(cfg.target),
            "layers": target.layer_ids,
        },
        sort_keys=True,
        default=str,
    )
    path = None
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
        path = os.path.join(
            cache_dir, f"eval-{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors"
        )
        if os.path.exists(path):
            items = load_eval_set(path)
            log(f"eval: {len(items)} prompts from cache {path}")
            return items
    prompts = eval_prompts(cfg, target, exclude_training)
    comps = generate_greedy(
        target, prompts, cfg.eval.completion_len, cfg.eval.batch_size, desc="eval greedy"
    )
    items = [consistent_greedy(target, p, c) for p, c in zip(prompts, comps)]
    items = [it for it in items if it.completion_ids.numel() >= 2]
    if not items:
        raise ValueError(
            "eval: no usable prompt (every greedy completion is shorter than 2 tokens)"
        )
    log(
        f"eval: {len(items)} prompts, {sum(it.completion_ids.numel() for it in items)} greedy tokens"
    )
    if path:
        save_eval_set(items, path)
    return items


def save_eval_set(items: list[EvalItem], path: str) -> None:
    t = {}
    for i, it in enumerate(items):
        t[f"{i}.prompt"], t[f"{i}.completion"], t[f"{i}.aux"] = (
            it.prompt_ids,
            it.completion_ids,
            it.aux_TF.contiguous(),
        )
    tmp = f"{path}.tmp{os.getpid()}"
    save_file(t, tmp)
    os.replace(tmp, path)


def load_eval_set(path: str) -> list[EvalItem]:
    t = load_file(path)
    n = len({k.split(".")[0] for k in t})
    return [EvalItem(t[f"{i}.prompt"], t[f"{i}.completion"], t[f"{i}.aux"]) for i in range(n)]


@torch.no_grad()
def draft_all_anchors(
    drafter: DFlashDrafter,
    heads,
    item: EvalItem,
    top_k: int,
    anchor_chunk: int = 64,
    dtype: torch.dtype = torch.float32,
):
    """Drafts for every completion index as anchor: draft_LD, and top-k logprobs/ids [L, D, K]."""
    spec = drafter.spec
    dev = heads.lm_head.weight.device
    P, L = item.prompt_ids.numel(), item.completion_ids.numel()
    ids = torch.cat([item.prompt_ids, item.completion_ids]).to(dev)[None]
    T = ids.shape[1]
    pos = torch.arange(T, device=dev)[None]
    seg = torch.zeros(1, T, dtype=torch.long, device=dev)
    aux = item.aux_TF.to(dev, dtype)[None]
    ctx_kv = drafter.context_kv(drafter.context(aux), pos)
    drafts, lps, tids = [], [], []
    for s in range(0, L, anchor_chunk):
        anchors = (P + torch.arange(s, min(L, s + anchor_chunk), device=dev))[None]
        valid = torch.ones_like(anchors, dtype=torch.bool)
        blk = build_blocks(
            ids,
            pos,
            seg,
            anchors,
            valid,
            spec.block_size,
            spec.mask_token_id,
            mask_rules(spec),
        )
        emb = heads.embed(blk.block_ids_NQ).to(dtype)
        h = drafter(emb, blk.block_pos_NQ, blk.masks, ctx_kv=ctx_kv)
        h = h.view(anchors.shape[1], spec.block_size, -1)[:, 1:]
        logits = drafter.logits(h, heads.lm_head.weight)
        logp = torch.log_softmax(logits, -1)
        drafts.append(logits.argmax(-1).cpu())
        if top_k > 0:
            v, i = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
            lps.append(v.cpu())
            tids.append(i.cpu())
    draft = torch.cat(drafts)
    if top_k > 0:
        return draft, torch.cat(lps), torch.cat(tids)
    return draft, None, None


def evaluate(drafter: DFlashDrafter, heads, items: list[EvalItem], budgets, dtype=torch.float32):
    """Per-prompt reports and the summary (micro-averaged over rounds)."""
    was_training = drafter.training
    drafter.eval()
    reports = []
    for n, it in enumerate(items):
        draft, lp, ids = draft_all_anchors(
            drafter, heads, it, top_k=max(budgets, default=0), dtype=dtype
        )
        full_vocab = lp is not None and lp.shape[-1] == heads.lm_head.weight.shape[0]
        reports.append(
            evaluate_prompt(
                draft,
                it.completion_ids,
                lp,
                ids,
                budgets=list(budgets),
                full_vocab=full_vocab,
                prompt_id=n,
            )
        )
    drafter.train(was_training)
    return reports, summarize(reports)


class Evaluator:
    """In-loop evaluation on the cached set: the same code path as eval.py."""

    def __init__(self, items: list[EvalItem], budgets):
        self.items, self.budgets = items, list(budgets)

    @classmethod
    def from_config(cls, cfg, target, cache_dir: str | None, log=print) -> Evaluator:
        return cls(build_eval_set(cfg, target, cache_dir, log), cfg.eval.budgets)

    def run(self, drafter, heads) -> dict:
        _, summary = evaluate(drafter, heads, self.items, self.budgets)
        return {f"eval/{k}": float(v) for k, v in summary.items()}
