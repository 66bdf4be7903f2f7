"""Evaluation that predicts serving: the exact offline greedy simulation.

Per eval prompt we cache the target's greedy completion and the aux states along it. The
drafter then runs once with every completion position as an anchor, through the same block
machinery as training (dflash.drafter.blocks), drafts each block by its own rule (`propose`:
DFlash each position's argmax, DFlash2 the selector's path from the anchor token, which depends
only on the committed prefix as the block does) and dflash.eval.metrics walks the rounds exactly
as a serving engine would at temperature 0. DDTree is built from the drafter's logits either way.

Legend: P prompt length, L completion length, T = P + L, D = B - 1 drafted positions, K top-k.
"""

from __future__ import annotations

import contextlib

import torch

from ..decoding.rejection import expected_accepted, overlap
from ..decoding.sampled import Sampling
from ..drafter.blocks import build_blocks, mask_rules
from ..drafter.model import DFlashDrafter
from .metrics import evaluate_prompt, summarize
from .sets import EvalItem, build_eval_set


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
    states along the completion and q the drafter's proposal when the tokens before the position
    are the completion's (`proposal`; dflash.decoding.rejection; 0 where no completion token is
    left)."""
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
        draft = drafter.propose(h, logits, ids[0, anchors[0]])[0]
        drafts.append(draft.cpu())
        if sampling is not None:
            W = heads.lm_head.weight
            alphas.append(_chunk_overlaps(drafter, W, h, logits, draft, item, s, *sampling))
        if top_k > 0:
            v, i = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
            lps.append(v.cpu())
            tids.append(i.cpu())
    draft = torch.cat(drafts)
    out = (draft, torch.cat(lps), torch.cat(tids)) if top_k > 0 else (draft, None, None)
    return out + (torch.cat(alphas),) if sampling is not None else out


def _chunk_overlaps(drafter, W, h_nDH, q_logits_nDV, draft_nD, item: EvalItem, s0, *sampling):
    """[n, D, t] acceptance probabilities for anchors s0..s0+n-1 (completion indices), a few
    anchors at a time: each warp holds several [rows, D, V] fp32 copies (sort for top-p)."""
    n = q_logits_nDV.shape[0]
    step = 8
    return torch.cat(
        [
            _overlaps(
                drafter,
                W,
                h_nDH[i : i + step],
                q_logits_nDV[i : i + step],
                draft_nD[i : i + step],
                item,
                s0 + i,
                *sampling,
            )
            for i in range(0, n, step)
        ]
    )


def _overlaps(drafter, W, h_nDH, q_logits_nDV, draft_nD, item, s0, temperatures, top_p, top_k):
    n, D, _ = q_logits_nDV.shape
    L = item.completion_ids.numel()
    rows_nD = s0 + torch.arange(n)[:, None] + torch.arange(1, D + 1)[None]  # completion index
    ok_nD = rows_nD < L
    rows_nD = rows_nD.clamp(max=L - 1)
    out = torch.zeros(n, D, len(temperatures))
    p_logits = None
    for j, temp in enumerate(temperatures):
        if temp <= 0:  # greedy: accepted iff the draft is the cached greedy token
            hit = draft_nD.cpu() == item.completion_ids[rows_nD]
            out[..., j] = (hit & ok_nD).float()
            continue
        if item.final_LH is None:
            raise ValueError(
                "eval.temperatures > 0 needs the target's final hidden states in the eval "
                "cache; this cache predates them: delete it to rebuild"
            )
        if p_logits is None:
            th = item.final_LH[rows_nD.flatten()].to(W.device, W.dtype)
            p_logits = (th @ W.t()).float().view(n, D, -1)
            # the token before each position along the completion (the anchor's own first)
            prev_nD = item.completion_ids[rows_nD - 1].to(q_logits_nDV.device)
        s = Sampling(temp, top_p, top_k)
        q = drafter.proposal(h_nDH, q_logits_nDV, prev_nD, s)
        out[..., j] = overlap(s.probs(p_logits), q).cpu() * ok_nD
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
    that temperature (dflash.decoding.rejection says exactly what is computed); tau_t0 == tau."""
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
        from ..drafter.checkpoint import EXPORT_DTYPE

        with rounded_to(drafter, EXPORT_DTYPE):
            self.reports, summary = evaluate(
                drafter, heads, self.items, self.budgets, **self.sampling
            )
        return {f"eval/{k}": float(v) for k, v in summary.items()}
