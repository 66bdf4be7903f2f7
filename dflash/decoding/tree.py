"""DDTree speculative decoding: the best-`budget` tree of the drafter's per-position log-probs,
verified in one target forward (attention targets) or as a batch of root-to-leaf chains (hybrid
targets), then the cache is committed to prefix + accepted path.

Legend: B block size, D = B-1 drafted positions, b tree budget, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..target.cache import expand_cache, gather_attention, is_hybrid_cache
from .ddtree import build_ddtree
from .steps import DecodeResult, SpecLoop, arange_row


def tree_verify_mask(tree, start: int, dtype, device) -> torch.Tensor:
    """Additive float mask [1, 1, 1+b, start+1+b]: every row sees the committed prefix and the
    bonus (root); node rows see their ancestors and themselves; the bonus row sees only the
    prefix and itself."""
    b = tree.num_nodes
    allowed = torch.zeros(1 + b, start + 1 + b, dtype=torch.bool, device=device)
    allowed[:, : start + 1] = True
    allowed[1:, start + 1 :] = tree.visibility.to(device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def tree_forward(run, cache, tree, bonus: int, start: int):
    """One target forward over [bonus, tree nodes] appended to the cache (which holds positions
    0..start-1): positions start + depth, ancestor-only mask. Returns greedy [1, 1+b] and aux."""
    dev = run.target.device
    block = torch.cat([torch.tensor([bonus]), tree.tokens]).to(dev)[None]
    pos = (start + torch.cat([torch.zeros(1, dtype=torch.long), tree.depths])).to(dev)[None]
    mask = tree_verify_mask(tree, start, run.model.dtype, dev)
    return run(block, pos, cache, attn_mask=mask)


def walk_tree(tree, node_argmax: list, root_argmax: int, cap: int) -> tuple[list, int]:
    """Longest root path whose tokens are the target's argmax; returns (node path, next bonus)."""
    children = {}
    for i, (p, t) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist())):
        children[(p, t)] = i
    path, nxt = [], root_argmax
    node = -1
    while len(path) < cap:
        child = children.get((node, nxt))
        if child is None:
            break
        path.append(child)
        node = child
        nxt = node_argmax[child]
    return path, nxt


def root_to_leaf_paths(tree) -> list:
    parents = tree.parents.tolist()
    has_child = set(p for p in parents if p >= 0)
    paths = []
    for i in range(len(parents)):
        if i in has_child:
            continue
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = parents[j]
        paths.append(path[::-1])
    return paths


# attention implementations that apply a custom 4D mask as given
MASK_HONOURING = ("sdpa", "eager")


@torch.no_grad()
def generate_tree(
    target,
    drafter,
    prompt_ids,
    max_new_tokens: int,
    budget: int,
    *,
    eos_token_id: int | None = None,
    draft_fn: Callable | None = None,
) -> DecodeResult:
    """DDTree speculative decoding; output identical to greedy.

    Attention-only targets: one forward over [bonus, tree nodes] with depth positions and the
    ancestor-only mask, then the K/V of prefix + bonus + accepted nodes are gathered in order.
    Hybrid targets: root-to-leaf paths verified as a batch of chains (see the `dflash.decoding` docstring).
    The tree is the drafter's own (`DrafterState.draft_tree`: DFlash's per-position DDTree,
    DFlash2's over the selector's rows); draft_fn(drafter_state, start, bonus) -> logits [D, V]
    overrides it with DDTree over softmax(logits) (tests).
    """
    loop = SpecLoop(target, drafter, prompt_ids, max_new_tokens, eos_token_id)
    model, run, cache, dev = target.model, loop.run, loop.cache, loop.dev
    hybrid = is_hybrid_cache(cache)
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if not hybrid and impl not in MASK_HONOURING:
        raise ValueError(
            f"generate_tree verifies the tree with an ancestor-only 4D attention mask, which "
            f"attn_implementation={impl!r} does not apply (the verify would be silently wrong); "
            f"load the target with one of {list(MASK_HONOURING)} (target.attn_implementation)"
        )
    loop.prefill(f"tree@{budget}", int)
    while loop.going:
        bonus, start, cap = loop.bonus, loop.start, loop.cap
        if draft_fn is None:  # the drafter's own tree (DFlash2: over the selector's rows)
            tree = loop.ds.draft_tree(start, bonus, budget)
        else:
            tree = build_ddtree(torch.log_softmax(draft_fn(loop.ds, start, bonus), -1), budget)
        if not hybrid:
            greedy, aux = tree_forward(run, cache, tree, bonus, start)
            loop.res.verify_tokens += 1 + tree.num_nodes
            am = greedy[0].tolist()
            path, nxt = walk_tree(tree, am[1:], am[0], cap)
            rows = [0] + [1 + i for i in path]
            keep_idx = torch.cat(
                [torch.arange(start + 1), start + 1 + torch.tensor(path, dtype=torch.long)]
            )
            gather_attention(cache, keep_idx)
            new_aux = aux[0, rows]
        else:
            path, nxt, n_tok = verify_tree_as_paths(run, model, cache, tree, bonus, start, cap, dev)
            loop.res.verify_tokens += n_tok
            acc_ids = torch.tensor([[bonus] + tree.tokens[path].tolist()], device=dev)
            _, aux = run(acc_ids, arange_row(start, acc_ids.shape[1], dev), cache, last_only=True)
            loop.res.verify_tokens += acc_ids.shape[1]
            new_aux = aux[0]
        loop.res.tree_sizes.append(tree.num_nodes)
        loop.commit(tree.tokens[path].tolist() + [int(nxt)], new_aux)
    return loop.result()


def verify_tree_as_paths(run, model, cache, tree, bonus: int, start: int, cap: int, dev):
    """Hybrid targets: each root-to-leaf path is one row [bonus, path..., pad] of a batch run
    from a batch copy of the committed cache (right padding is harmless: causal). Returns the
    accepted node path, the next bonus token and the number of tokens run."""
    paths = root_to_leaf_paths(tree)
    if not paths:  # empty tree: only the bonus row
        paths = [[]]
    L = 1 + max(len(p) for p in paths)
    toks = tree.tokens.tolist()
    rows = torch.full((len(paths), L), bonus, dtype=torch.long)
    for r, p in enumerate(paths):
        rows[r, 1 : 1 + len(p)] = torch.tensor([toks[i] for i in p], dtype=torch.long)
    bcache = expand_cache(model, cache, len(paths))
    pos = arange_row(start, L, dev).expand(len(paths), L)
    greedy, _ = run(rows.to(dev), pos, bcache, want_aux=False)
    am = greedy.tolist()
    node_argmax = [0] * tree.num_nodes
    for r, p in enumerate(paths):
        for j, i in enumerate(p):
            node_argmax[i] = am[r][j + 1]
    path, nxt = walk_tree(tree, node_argmax, am[0][0], cap)
    return path, nxt, len(paths) * L
