"""Evaluation that predicts serving: the exact offline greedy simulation.

Per eval prompt we cache the target's greedy completion and the aux states along it. The
drafter then runs once with every completion position as an anchor, through the same block
machinery as training (dflash.blocks), and dflash.metrics walks the rounds exactly as a serving
engine would at temperature 0.

Legend: P prompt length, L completion length, T = P + L, D = B - 1 drafted positions, K top-k.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file

from .blocks import build_blocks, mask_rules
from .data import encode_prompts, generate_greedy, random_prompts, text_prompts
from .drafter import DFlashDrafter
from .metrics import evaluate_prompt, summarize
from .sampling import expected_accepted, overlap, warp

# evaluation-time only, or display: not in the cache key
NOT_IN_KEY = (
    "temperatures",
    "top_p",
    "top_k",
    "real_decode_prompts",
    "decode_tree_budgets",
    "show_rounds",
    "enabled",
)


@dataclass
class EvalItem:
    prompt_ids: torch.Tensor  # [P]
    completion_ids: torch.Tensor  # [L] the target's greedy completion (self-consistent)
    aux_TF: torch.Tensor  # [P+L, K*H] aux states along prompt + completion
    # [L, H] the target's final (normed) hidden states at positions P-1 .. P+L-2: row j gives
    # the target's distribution for completion token j (through lm_head), for eval at T > 0.
    # Cheaper than a target forward at eval time and exact over the whole vocab (top-k
    # logprobs would truncate min(p, q)); 1/K of the aux cache.
    final_LH: torch.Tensor | None = None


@torch.no_grad()
def consistent_greedy(target, prompt: list[int], completion: list[int]) -> EvalItem:
    """Re-run the target over prompt+completion in one forward and keep the completion up to the
    first token that is not the argmax of that forward (batched generation and a one-shot
    forward can disagree at near-ties); the walk then compares against a true fixed point."""
    ids = torch.tensor(list(prompt) + list(completion), dtype=torch.long, device=target.device)[
        None
    ]
    out = target.capture(ids, with_final_hidden=True)
    P = len(prompt)
    pred = out.next_token_NT[0, P - 1 : -1].cpu()
    comp = torch.tensor(completion, dtype=torch.long)
    bad = (pred != comp).nonzero()
    n = int(bad[0]) if bad.numel() else len(completion)
    return EvalItem(
        torch.tensor(prompt, dtype=torch.long),
        comp[:n].clone(),
        out.aux_NTF[0, : P + n].cpu().clone(),
        out.final_hidden_NTH[0, P - 1 : P - 1 + n].cpu().clone(),
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
    cfg,
    target,
    cache_dir: str | None,
    log=print,
    exclude_training: bool = True,
    read_dirs: tuple[str, ...] = (),
) -> list[EvalItem]:
    """The cached eval set of this config from cache_dir or read_dirs (eval.py: the run's own
    cache, where the in-loop eval left it), else built and saved in cache_dir."""
    key = json.dumps(
        {
            "format": 2,  # items carry final_LH
            "exclude_training": exclude_training,
            "eval": {k: v for k, v in vars(cfg.eval).items() if k not in NOT_IN_KEY},
            "data": vars(cfg.data),
            "target": vars(cfg.target),
            "layers": target.layer_ids,
        },
        sort_keys=True,
        default=str,
    )
    name = f"eval-{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors"
    for d in (cache_dir, *read_dirs):
        if d and os.path.exists(os.path.join(d, name)):
            items = load_eval_set(os.path.join(d, name))
            log(f"eval: {len(items)} prompts from cache {os.path.join(d, name)}")
            return items
    path = None
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
        path = os.path.join(cache_dir, name)
    t0 = time.perf_counter()
    prompts = eval_prompts(cfg, target, exclude_training)
    comps = generate_greedy(
        target, prompts, cfg.eval.completion_len, cfg.eval.batch_size, desc="eval greedy", log=log
    )
    items = [consistent_greedy(target, p, c) for p, c in zip(prompts, comps)]
    items = [it for it in items if it.completion_ids.numel() >= 2]
    if not items:
        raise ValueError(
            "eval: no usable prompt (every greedy completion is shorter than 2 tokens)"
        )
    short = len(prompts) - len(items)
    log(
        f"eval: {len(items)} prompts, {sum(it.completion_ids.numel() for it in items)} greedy "
        f"tokens, built in {time.perf_counter() - t0:.1f} s"
        + (
            f" ({short} of {len(prompts)} left out: their batched greedy completion and a one-shot "
            "forward disagree within 2 tokens, a near-tie)"
            if short
            else ""
        )
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
        if it.final_LH is not None:
            t[f"{i}.final"] = it.final_LH.contiguous()
    tmp = f"{path}.tmp{os.getpid()}"
    save_file(t, tmp)
    os.replace(tmp, path)


def load_eval_set(path: str) -> list[EvalItem]:
    t = load_file(path)
    n = len({k.split(".")[0] for k in t})
    return [
        EvalItem(t[f"{i}.prompt"], t[f"{i}.completion"], t[f"{i}.aux"], t.get(f"{i}.final"))
        for i in range(n)
    ]


@torch.no_grad()
def draft_all_anchors(
    drafter: DFlashDrafter,
    heads,
    item: EvalItem,
    top_k: int,
    anchor_chunk: int = 64,
    dtype: torch.dtype = torch.float32,
    sampling: tuple | None = None,
):
    """Drafts for every completion index as anchor: draft_LD, and top-k logprobs/ids [L, D, K].
    sampling=(temperatures, top_p, top_k): also alpha_LDt, the acceptance probability
    sum_x min(p, q) of every (anchor, position) at each temperature, p from the cached target
    states along the completion (dflash.sampling; 0 where no completion token is left)."""
    spec = drafter.spec
    dev = heads.lm_head.weight.device
    P, L = item.prompt_ids.numel(), item.completion_ids.numel()
    ids = torch.cat([item.prompt_ids, item.completion_ids]).to(dev)[None]
    T = ids.shape[1]
    pos = torch.arange(T, device=dev)[None]
    seg = torch.zeros(1, T, dtype=torch.long, device=dev)
    aux = item.aux_TF.to(dev, dtype)[None]
    ctx_kv = drafter.context_kv(drafter.context(aux), pos)
    drafts, lps, tids, alphas = [], [], [], []
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
        if sampling is not None:
            alphas.append(_chunk_overlaps(logits, item, s, heads.lm_head.weight, *sampling))
        if top_k > 0:
            v, i = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
            lps.append(v.cpu())
            tids.append(i.cpu())
    draft = torch.cat(drafts)
    out = (draft, torch.cat(lps), torch.cat(tids)) if top_k > 0 else (draft, None, None)
    return out + (torch.cat(alphas),) if sampling is not None else out


def _chunk_overlaps(q_logits_nDV, item: EvalItem, s0: int, W, temperatures, top_p, top_k):
    """[n, D, t] acceptance probabilities for anchors s0..s0+n-1 (completion indices), a few
    anchors at a time: each warp holds several [rows, D, V] fp32 copies (sort for top-p)."""
    n = q_logits_nDV.shape[0]
    step = 8
    return torch.cat(
        [
            _overlaps(q_logits_nDV[i : i + step], item, s0 + i, W, temperatures, top_p, top_k)
            for i in range(0, n, step)
        ]
    )


def _overlaps(q_logits_nDV, item: EvalItem, s0: int, W, temperatures, top_p, top_k):
    n, D, _ = q_logits_nDV.shape
    L = item.completion_ids.numel()
    rows_nD = s0 + torch.arange(n)[:, None] + torch.arange(1, D + 1)[None]  # completion index
    ok_nD = rows_nD < L
    rows_nD = rows_nD.clamp(max=L - 1)
    out = torch.zeros(n, D, len(temperatures))
    p_logits = None
    for j, temp in enumerate(temperatures):
        if temp <= 0:  # greedy: accepted iff the draft is the cached greedy token
            hit = q_logits_nDV.argmax(-1).cpu() == item.completion_ids[rows_nD]
            out[..., j] = (hit & ok_nD).float()
            continue
        if item.final_LH is None:
            raise ValueError(
                "eval.temperatures > 0 needs the target's final hidden states in the eval "
                "cache; this cache predates them: delete it to rebuild"
            )
        if p_logits is None:
            h = item.final_LH[rows_nD.flatten()].to(W.device, W.dtype)
            p_logits = (h @ W.t()).float().view(n, D, -1)
        a = overlap(warp(p_logits, temp, top_p, top_k), warp(q_logits_nDV, temp, top_p, top_k))
        out[..., j] = a.cpu() * ok_nD
    return out


def evaluate(
    drafter: DFlashDrafter,
    heads,
    items: list[EvalItem],
    budgets,
    dtype=torch.float32,
    temperatures=(),
    top_p: float = 1.0,
    top_k: int = 0,
):
    """Per-prompt reports and the summary (micro-averaged over rounds). With temperatures, the
    summary also has tau_t{T}: 1 + the expected accepted length per round of the greedy walk at
    that temperature (dflash.sampling says exactly what is computed); tau_t0 == tau."""
    was_training = drafter.training
    drafter.eval()
    reports = []
    temps = [float(t) for t in temperatures]
    sampling = (temps, top_p, top_k) if temps else None
    expected = torch.zeros(len(temps), dtype=torch.float64)
    for n, it in enumerate(items):
        draft, lp, ids, *alpha = draft_all_anchors(
            drafter, heads, it, top_k=max(budgets, default=0), dtype=dtype, sampling=sampling
        )
        full_vocab = lp is not None and lp.shape[-1] == heads.lm_head.weight.shape[0]
        rep = evaluate_prompt(
            draft,
            it.completion_ids,
            lp,
            ids,
            budgets=list(budgets),
            full_vocab=full_vocab,
            prompt_id=n,
        )
        reports.append(rep)
        if temps and rep.chain.anchors:
            a = alpha[0][rep.chain.anchors]  # [rounds, D, t]
            avail = torch.tensor(rep.chain.available)
            for j in range(len(temps)):
                expected[j] += expected_accepted(a[..., j], avail).sum()
    drafter.train(was_training)
    summary = summarize(reports)
    for j, t in enumerate(temps):
        rounds = summary["num_rounds"]
        summary[f"tau_t{t:g}"] = 1.0 + float(expected[j]) / rounds if rounds else float("nan")
    return reports, summary


@contextlib.contextmanager
def rounded_to(module: torch.nn.Module, dtype: torch.dtype):
    """The module's weights rounded to `dtype` (kept in their own dtype) for the duration, then
    restored bit-exactly from a CPU copy (no second copy on the accelerator)."""
    saved = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
    with torch.no_grad():
        for v in module.state_dict().values():
            if v.is_floating_point():
                v.copy_(v.to(dtype))
    try:
        yield module
    finally:
        module.load_state_dict(saved)


class Evaluator:
    """In-loop evaluation on the cached set: the same code path as eval.py, on the weights a
    checkpoint exports (fp32 master weights rounded to the serving dtype), so the figures equal
    eval.py's on the checkpoint saved at the same step."""

    def __init__(self, items: list[EvalItem], budgets, temperatures=(), top_p=1.0, top_k=0):
        self.items, self.budgets = items, list(budgets)
        self.sampling = dict(temperatures=list(temperatures), top_p=top_p, top_k=top_k)
        self.reports: list = []  # per-prompt reports of the last run (for loggers)

    @classmethod
    def from_config(cls, cfg, target, cache_dir: str | None, log=print) -> Evaluator:
        e = cfg.eval
        items = build_eval_set(cfg, target, cache_dir, log)
        return cls(items, e.budgets, e.temperatures, e.top_p, e.top_k)

    def run(self, drafter, heads) -> dict:
        from .checkpoint import EXPORT_DTYPE

        with rounded_to(drafter, EXPORT_DTYPE):
            self.reports, summary = evaluate(
                drafter, heads, self.items, self.budgets, **self.sampling
            )
        return {f"eval/{k}": float(v) for k, v in summary.items()}
