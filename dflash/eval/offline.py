"""Evaluation that predicts serving: the exact offline greedy simulation.

Per eval prompt we cache the target's greedy completion and the aux states along it. The
drafter then runs once with every completion position as an anchor, through the same block
machinery as training (dflash.drafter.blocks), drafts each block by its own rule (`propose`:
DFlash each position's argmax, DFlash2 the selector's path from the anchor token, which depends
only on the committed prefix as the block does) and dflash.eval.metrics walks the rounds exactly
as a serving engine would at temperature 0. DDTree follows the drafter's rule too: DFlash's tree
over its per-position distributions, DFlash2's over the selector's rows (each candidate's
children scored after it: dflash.decoding.ddtree.TreeRows), as real tree decoding builds them.

Legend: P prompt length, L completion length, T = P + L, D = B - 1 drafted positions, K top-k.
"""

from __future__ import annotations

import contextlib

import torch
from tqdm.auto import tqdm

from ..common.loggers import progress_bars_off
from ..config.eval import TreeRule
from ..decoding.ddtree import TreeRows
from ..decoding.rejection import expected_accepted, overlap
from ..decoding.sampled import Sampling
from ..drafter.blocks import build_blocks, mask_rules
from ..drafter.model import DFlashDrafter
from .greedy import EvalItem
from .metrics import evaluate_prompt, summarize, walk_ddtree
from .sets import build_eval_sets


@torch.no_grad()
def draft_all_anchors(
    drafter: DFlashDrafter,
    heads,
    item: EvalItem,
    top_k: int,
    anchor_chunk: int = 64,
    dtype: torch.dtype = torch.float32,
    sampling: tuple | None = None,
    more_rules=(),
    rule_out: dict | None = None,
):
    """Drafts for every completion index as anchor: draft_LD, and top-k logprobs/ids [L, D, K]
    for DDTree (a drafter with `tree_scores`, DFlash2: its TreeRows over [L] anchors, and None),
    their scores built by the drafter's own rule, as real tree decoding builds them;
    `more_rules` (TreeRule): each one's tree inputs too, from the same forward, into
    `rule_out[name]` (TreeRows, or the (logprobs, ids) pair).
    sampling=(temperatures, top_p, top_k): also alpha_LDt2, per (anchor, position, temperature)
    the acceptance probability sum_x min(p, q) ([..., 0]) and the probability min(p(g), q(g))
    of accepting the greedy token g ([..., 1]), p from the cached target states along the
    completion and q the drafter's proposal when the tokens before the position are the
    completion's (`proposal`; dflash.decoding.rejection; 0 where no completion token is left)."""
    spec = drafter.spec
    dev = heads.lm_head.weight.device
    P, L = item.prompt_ids.numel(), item.completion_ids.numel()
    ids = torch.cat([item.prompt_ids, item.completion_ids]).to(dev)[None]
    T = ids.shape[1]
    pos = torch.arange(T, device=dev)[None]
    seg = torch.zeros(1, T, dtype=torch.long, device=dev)
    aux = item.aux_TF.to(dev, dtype)[None]
    ctx_kv = drafter.context_kv(drafter.context(aux), pos)
    drafts, alphas = [], []
    rules = [TreeRule(), *more_rules]  # the drafter's own tree first (name "")
    parts = {r.name: [] for r in rules}
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
        emb = heads.embed_ids(blk.block_ids_NQ).to(dtype)
        h = drafter(emb, blk.block_pos_NQ, blk.masks, ctx_kv=ctx_kv)
        h = h.view(anchors.shape[1], spec.block_size, -1)[:, 1:]
        logits = drafter.logits(h, heads.lm_head.weight, heads.bias)
        anchor_ids = ids[0, anchors[0]]
        draft = drafter.propose(h, logits, anchor_ids)[0]
        drafts.append(draft.cpu())
        if sampling is not None:
            alphas.append(_chunk_overlaps(drafter, heads, h, logits, draft, item, s, *sampling))
        if top_k > 0:
            for r in rules:
                parts[r.name].append(_tree_input(drafter, h, logits, anchor_ids, top_k, r))
    trees = {name: _joined(chunks) for name, chunks in parts.items()}
    if rule_out is not None:
        rule_out.update((r.name, trees[r.name]) for r in more_rules)
    own = trees[""]
    out = (torch.cat(drafts), *((own, None) if isinstance(own, TreeRows) else own))
    return out + (torch.cat(alphas),) if sampling is not None else out


def _joined(chunks):
    """One rule's tree inputs over every anchor chunk: DFlash2's TreeRows, DFlash's (logprobs,
    ids), or (None, None) where no tree was asked for (top_k 0)."""
    if chunks and isinstance(chunks[0], TreeRows):
        return TreeRows.cat(chunks)
    return tuple(torch.cat(x) for x in zip(*chunks)) if chunks else (None, None)


def _tree_input(drafter, h_nDH, logits_nDV, anchor_n, top_k: int, rule: TreeRule):
    """One chunk's tree inputs by `rule`: DFlash2's TreeRows, or DFlash's top-k (logprobs, ids)
    of softmax(logits / T), on the CPU."""
    scored = drafter.tree_scores(h_nDH, logits_nDV, anchor_n, rule.temperature)
    if scored is not None:
        return _rule_rows(logits_nDV, *scored, rule)
    if rule.coverage:
        raise ValueError(
            f"tree rule {rule.name!r}: coverage applies to DFlash2's selector rows "
            "(drafter.variant=dflash2); a DFlash tree already spans the whole vocabulary"
        )
    logp = drafter.tree_logprobs(logits_nDV, rule.temperature)
    v, i = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
    return v.cpu(), i.cpu()


def _rule_rows(logits_nDV, scores_nDKK, cand_nDK, rule: TreeRule) -> TreeRows:
    """DFlash2's rows (the selector's scores, already at the rule's temperature) and, for
    coverage, each depth's rows scaled by the softmax(logits) mass of its candidates."""
    mass = None
    if rule.coverage:
        lg = logits_nDV.float()
        mass = torch.logsumexp(lg.gather(-1, cand_nDK), -1) - torch.logsumexp(lg, -1)
    return TreeRows.from_scores(scores_nDKK, cand_nDK, mass)


def _chunk_overlaps(drafter, heads, h_nDH, q_logits_nDV, draft_nD, item: EvalItem, s0, *sampling):
    """[n, D, t, 2] acceptance probabilities for anchors s0..s0+n-1 (completion indices), a few
    anchors at a time: each warp holds several [rows, D, V] fp32 copies (sort for top-p)."""
    n = q_logits_nDV.shape[0]
    step = 8
    return torch.cat(
        [
            _overlaps(
                drafter,
                heads,
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


def _overlaps(drafter, heads, h_nDH, q_logits_nDV, draft_nD, item, s0, temperatures, top_p, top_k):
    n, D, _ = q_logits_nDV.shape
    L = item.completion_ids.numel()
    rows_nD = s0 + torch.arange(n)[:, None] + torch.arange(1, D + 1)[None]  # completion index
    ok_nD = rows_nD < L
    rows_nD = rows_nD.clamp(max=L - 1)
    out = torch.zeros(n, D, len(temperatures), 2)
    greedy_nD = item.completion_ids[rows_nD]
    p_logits = None
    for j, temp in enumerate(temperatures):
        if temp <= 0:  # greedy: accepted iff the drafter's own draft is the cached greedy token
            hit = draft_nD.cpu() == greedy_nD
            out[..., j, :] = (hit & ok_nD).float()[..., None]
            continue
        if item.final_LH is None:
            raise ValueError(
                "eval.temperatures > 0 needs the target's final hidden states in the eval "
                "cache; this cache predates them: delete it to rebuild"
            )
        if p_logits is None:  # the target's own logits: lm_head(h), its bias included
            W, b = heads.lm_head.weight, heads.bias
            th = item.final_LH[rows_nD.flatten()].to(W.device, W.dtype)
            p_logits = (th @ W.t() + (b if b is not None else 0)).float().view(n, D, -1)
            # the token before each position along the completion (the anchor's own first)
            prev_nD = item.completion_ids[rows_nD - 1].to(q_logits_nDV.device)
        s = Sampling(temp, top_p, top_k)
        p, q = s.probs(p_logits), drafter.proposal(h_nDH, q_logits_nDV, prev_nD, s)
        g = greedy_nD.to(p.device)[..., None]
        out[..., j, 0] = overlap(p, q).cpu() * ok_nD
        out[..., j, 1] = torch.minimum(p.gather(-1, g), q.gather(-1, g))[..., 0].cpu() * ok_nD
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
    tree_rules=(),
    desc: str | None = None,
):
    """Per-prompt reports and the summary (micro-averaged over rounds). ``desc``: a progress bar
    over the prompts under that name (eval.py; DFLASH_NO_PROGRESS=1 turns it off).
    ``tree_rules`` (names, dflash.config.eval.TreeRule): DDTree walked again with each rule's
    trees, figures rule/<name>/tau@<b> beside the drafter's own tau@<b>. With temperatures, the
    summary also has, per temperature T, 1 + the expected accepted length per round of the
    greedy walk: tau_t{T}, an upper estimate (the target's distributions kept on the greedy path
    after a non-greedy draft token is accepted), and tau_t{T}_lower, a lower bound (only
    acceptances along the greedy path counted); dflash.decoding.rejection says exactly what each
    is. At T=0 both equal tau."""
    was_training = drafter.training
    drafter.eval()
    reports = []
    temps = [float(t) for t in temperatures]
    sampling = (temps, top_p, top_k) if temps else None
    expected = torch.zeros(len(temps), 2, dtype=torch.float64)  # [upper estimate, lower bound]
    rules = [TreeRule.parse(r) for r in tree_rules] if budgets else []
    bar = tqdm(
        items,
        desc=desc,
        unit="prompt",
        leave=False,
        disable=desc is None or progress_bars_off(),
    )
    for n, it in enumerate(bar):
        by_rule: dict = {}
        draft, lp, ids, *alpha = draft_all_anchors(
            drafter,
            heads,
            it,
            top_k=max(budgets, default=0),
            dtype=dtype,
            sampling=sampling,
            more_rules=rules,
            rule_out=by_rule,
        )
        rows = lp if isinstance(lp, TreeRows) else None
        if rows is not None:
            lp = None
        full_vocab = lp is not None and lp.shape[-1] == heads.lm_head.weight.shape[0]
        rep = evaluate_prompt(
            draft,
            it.completion_ids,
            lp,
            ids,
            budgets=list(budgets),
            full_vocab=full_vocab,
            prompt_id=n,
            tree_rows=rows,
        )
        for name, inputs in by_rule.items():  # each rule's trees, from the same forward
            rep.rule_trees[name] = _rule_walks(inputs, it, budgets, heads)
        reports.append(rep)
        if temps and rep.chain.anchors:
            a = alpha[0][rep.chain.anchors]  # [rounds, D, t, 2]
            avail = torch.tensor(rep.chain.available)
            for j in range(len(temps)):
                for b in range(2):
                    expected[j, b] += expected_accepted(a[..., j, b], avail).sum()
    drafter.train(was_training)
    summary = summarize(reports)
    rounds = summary["num_rounds"]
    for j, t in enumerate(temps):
        upper, lower = (1.0 + float(x) / rounds if rounds else float("nan") for x in expected[j])
        summary[f"tau_t{t:g}"] = upper
        if t > 0:  # at T=0 both are tau
            summary[f"tau_t{t:g}_lower"] = lower
    return reports, summary


def _rule_walks(inputs, item: EvalItem, budgets, heads):
    """DDTree walks over one rule's tree inputs (DFlash2's TreeRows or DFlash's top-k)."""
    if isinstance(inputs, TreeRows):
        return walk_ddtree(None, None, item.completion_ids, budgets, tree_rows=inputs)
    lp, ids = inputs
    full_vocab = lp.shape[-1] == heads.lm_head.weight.shape[0]
    return walk_ddtree(lp, ids, item.completion_ids, budgets, full_vocab=full_vocab)


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


def metric_prefix(name: str) -> str:
    """eval/ for the unnamed set, eval/<name>/ for a set of eval.sets."""
    return f"eval/{name}/" if name else "eval/"


class Evaluator:
    """In-loop evaluation on the cached sets: the same code path as eval.py, on the weights a
    checkpoint exports (fp32 master weights rounded to the serving dtype), so the figures equal
    eval.py's on the checkpoint saved at the same step. `sets`: name -> items ("" for the one
    unnamed set; a list is that set)."""

    def __init__(self, sets, budgets, temperatures=(), top_p=1.0, top_k=0, tree_rules=()):
        self.sets = sets if isinstance(sets, dict) else {"": sets}
        self.budgets = list(budgets)
        self.sampling = dict(
            temperatures=list(temperatures), top_p=top_p, top_k=top_k, tree_rules=list(tree_rules)
        )
        self.reports_by_set: dict[str, list] = {}  # per-prompt reports of the last run, per set

    @classmethod
    def from_config(cls, cfg, target, cache_dir: str | None, log=print) -> Evaluator:
        e = cfg.eval
        sets = build_eval_sets(cfg, target, cache_dir, log)
        return cls(sets, e.budgets, e.temperatures, e.top_p, e.top_k, e.tree_rules)

    def prefixes(self) -> list[str]:
        """What each set's figures start with (eval/ or eval/<set>/)."""
        return [metric_prefix(name) for name in self.sets]

    def run(self, drafter, heads) -> dict:
        from ..drafter.checkpoint import EXPORT_DTYPE

        out = {}
        with rounded_to(drafter, EXPORT_DTYPE):
            for name, items in self.sets.items():
                reports, summary = evaluate(drafter, heads, items, self.budgets, **self.sampling)
                self.reports_by_set[name] = reports
                out.update({f"{metric_prefix(name)}{k}": float(v) for k, v in summary.items()})
        return out
