"""What every decoder shares: the result record, target forwards on a cache with aux capture, the
drafter's growing context and one-block drafting.

Legend: P prompt length, B block size, D = B-1 drafted positions, V vocab.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from ..drafter.blocks import block_attention_mask, mask_rules
from ..target.cache import cache_kw, new_cache
from ..target.shape import embed_table, head_bias
from .ddtree import TreeRows, build_cond_tree, build_ddtree


@dataclass
class DecodeResult:
    mode: str  # "ar", "chain", "tree@b"
    tokens: list  # generated tokens (prompt excluded)
    accepted: list = field(default_factory=list)  # accepted drafted tokens per verify round
    wall_s: float = 0.0  # prefill + decoding
    prefill_s: float = 0.0
    drafts: list = field(default_factory=list)  # chain: drafted tokens per round (D each)
    tree_sizes: list = field(default_factory=list)  # tree: nodes verified per round
    verify_tokens: int = 0  # tokens run through the target after prefill

    @property
    def num_rounds(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Mean accepted + 1 (the bonus) over verify rounds; nan without rounds (AR)."""
        return sum(self.accepted) / len(self.accepted) + 1.0 if self.accepted else math.nan

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else math.nan

    def summary(self) -> dict:
        return {
            "mode": self.mode,
            "tokens": len(self.tokens),
            "rounds": self.num_rounds,
            "tau": self.tau,
            "wall_s": self.wall_s,
            "prefill_s": self.prefill_s,
            "tokens_per_s": self.tokens_per_s,
            "verify_tokens": self.verify_tokens,
        }


class TargetRunner:
    """Target forwards on a cache, with aux states captured by hooks on the aux layers."""

    def __init__(self, target):
        self.target = target
        self.model = target.model
        self.decoder = target.model.get_decoder()
        self.cache_kw = cache_kw(self.decoder)

    @torch.no_grad()
    def __call__(
        self,
        ids_NT: torch.Tensor,
        pos_NT: torch.Tensor,
        cache,
        attn_mask=None,
        want_aux: bool = True,
        last_only: bool = False,
        logits: bool = False,
    ):
        """Returns the target's greedy tokens [N, T] ([N, 1] with last_only) and aux [N, T, K*H]
        (or None). Runs the decoder and takes the argmax of lm_head in chunks
        (`Target.greedy_from_hidden`, as `Target.capture`), so the full [N, T, V] logits of a
        large tree batch are never held. logits=True (sampled decoding, one chain): fp32 logits
        [N, T, V] instead of the greedy tokens."""
        with self.target.tap_aux(enabled=want_aux) as taps:
            out = self.decoder(
                input_ids=ids_NT,
                position_ids=pos_NT,
                attention_mask=attn_mask,
                use_cache=True,
                **{self.cache_kw: cache},
            )
        final = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        if last_only:
            final = final[:, -1:]
        if logits:
            return self.target.lm_head(final).float(), taps.aux()
        return self.target.greedy_from_hidden(final, 4096), taps.aux()


def as_prompt(target, prompt_ids) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise ValueError("prompt_ids is empty")
    return ids.to(target.device)[None]


def arange_row(start: int, n: int, device) -> torch.Tensor:
    return torch.arange(start, start + n, device=device)[None]


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpecLoop:
    """One speculative decode's bookkeeping, the same for the chain, sampled-chain and tree
    decoders: the timer, the target cache, the prefill, the tokens out so far (`out`), the
    drafter's growing context (`ds`) and the next block's anchor position (`start`: the last token
    out, the bonus). Each verify round hands its new tokens (accepted drafts + the target's next)
    and their aux rows to `commit`; `result` closes the decode."""

    def __init__(self, target, drafter, prompt_ids, max_new_tokens: int, eos_token_id):
        self.target, self.drafter, self.dev = target, drafter, target.device
        self.max_new_tokens, self.eos_token_id = max_new_tokens, eos_token_id
        self.run = TargetRunner(target)
        self.ids = as_prompt(target, prompt_ids)
        self.start = self.ids.shape[1]
        sync(self.dev)
        self.t0 = time.perf_counter()
        self.cache = new_cache(target.model)

    def prefill(self, mode: str, first, logits: bool = False) -> None:
        """The prompt's forward; first(last position's greedy token or logits) -> the first token
        out. Starts `res` (DecodeResult `mode`) with the prefill time."""
        P = self.start
        head, aux = self.run(
            self.ids, arange_row(0, P, self.dev), self.cache, last_only=True, logits=logits
        )
        self.out = [first(head[0, -1])]
        self.ended = self.out[0] == self.eos_token_id  # an end of generation emitted
        self.ds = DrafterState(self.target, self.drafter)
        self.ds.append(aux[0])
        sync(self.dev)
        self.res = DecodeResult(mode, [], prefill_s=time.perf_counter() - self.t0)

    @property
    def going(self) -> bool:
        return not self.ended and len(self.out) < self.max_new_tokens

    @property
    def bonus(self) -> int:
        return self.out[-1]

    @property
    def cap(self) -> int:
        """How many more tokens the decode may emit."""
        return self.max_new_tokens - len(self.out)

    def commit(self, new: list, aux_rows: torch.Tensor) -> None:
        """A round's new tokens (its accepted drafts, then the target's next token) and the aux
        rows of the committed block (bonus + accepted drafts) as the drafter's context."""
        self.ds.append(aux_rows)
        self.res.accepted.append(len(new) - 1)
        self.out.extend(new)
        self.start += len(new)
        self.ended = self.eos_token_id is not None and self.eos_token_id in new

    def result(self) -> DecodeResult:
        sync(self.dev)
        self.res.tokens = finish(self.out, self.max_new_tokens, self.eos_token_id)
        self.res.wall_s = time.perf_counter() - self.t0
        return self.res


class DrafterState:
    """The drafter's context K/V cache (positions 0..T-1) and one-block drafting."""

    def __init__(self, target, drafter):
        self.target, self.drafter, self.spec = target, drafter, drafter.spec
        p = next(drafter.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.ctx_kv: list | None = None
        self.T = 0

    @torch.no_grad()
    def append(self, aux_TF: torch.Tensor) -> None:
        """Context features of the next positions T..T+n-1 (only committed positions)."""
        n = aux_TF.shape[0]
        if n == 0:
            return
        pos = arange_row(self.T, n, self.device)
        kv = self.drafter.context_kv(
            self.drafter.context(aux_TF.to(self.device, self.dtype)[None]), pos
        )
        if self.ctx_kv is None:
            self.ctx_kv = kv
        else:
            self.ctx_kv = [
                (torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                for (k0, v0), (k1, v1) in zip(self.ctx_kv, kv)
            ]
        self.T += n

    def masks(self, start: int) -> dict:
        """Per layer type bool [1, 1, B, start + B]: the training/eval rule of dflash.drafter.blocks
        (`dflash.drafter.spec.attention_rule`: context < anchor, then the layer's MaskRule)."""
        spec, dev = self.spec, self.device
        pos = torch.arange(start + 1, device=dev)[None]  # context + the anchor itself
        seg = torch.zeros_like(pos)
        anchors = torch.tensor([[start]], device=dev)
        valid = torch.ones_like(anchors, dtype=torch.bool)
        out = {}
        for t, r in mask_rules(spec).items():
            m = block_attention_mask(
                anchors,
                valid,
                pos,
                seg,
                spec.block_size,
                causal_in_block=r.causal_in_block,
                window=r.window,
                window_both_sides=r.window_both_sides,
            )
            out[t] = torch.cat(
                [m[..., :start], m[..., start + 1 :]], dim=-1
            )  # drop the anchor column
        return out

    @torch.no_grad()
    def draft_hidden(self, start: int, bonus: int) -> torch.Tensor:
        """The drafter's final hidden states [D, H] of block positions 1..B-1 for the block
        anchored at `start` (on the lm_head's device)."""
        if self.T != start:
            raise AssertionError(
                f"drafter context holds {self.T} positions, block anchored at {start}"
            )
        B, dev = self.spec.block_size, self.device
        ids = torch.full(
            (1, B), self.spec.mask_token_id, dtype=torch.long, device=self.target.device
        )
        ids[0, 0] = bonus
        emb = embed_table(self.target.embed_tokens, ids).to(dev, self.dtype)
        h = self.drafter(emb, arange_row(start, B, dev), self.masks(start), ctx_kv=self.ctx_kv)
        return h[0, 1:].to(self.target.lm_head.weight.device)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.drafter.logits(h, self.target.lm_head.weight, head_bias(self.target.lm_head))

    @torch.no_grad()
    def draft_logits(self, start: int, bonus: int) -> torch.Tensor:
        """float32 logits [D, V] of block positions 1..B-1 for the block anchored at `start`."""
        return self._logits(self.draft_hidden(start, bonus))

    @torch.no_grad()
    def draft_tree(self, start: int, bonus: int, budget: int):
        """The draft tree of `budget` nodes for the block anchored at `start`, by the drafter's
        own rule: DDTree over the per-position distributions (DFlash), over the selector's
        conditional rows (DFlash2: `tree_scores`), each at the drafter's `tree_temperature`."""
        h, logits, anchor = self._block(start, bonus)
        scored = self.drafter.tree_scores(h, logits, anchor)  # at its own tree_temperature
        if scored is None:
            return build_ddtree(self.drafter.tree_logprobs(logits[0]), budget)
        return build_cond_tree(TreeRows.from_scores(*scored), budget)

    @torch.no_grad()
    def draft(self, start: int, bonus: int, sampling=None, generator=None):
        """The drafted tokens [D] of the block anchored at `start` by the drafter's own rule
        (`propose`: DFlash each position's argmax, DFlash2 the selector's path) and, when
        sampling, the proposal q [D, V] they were drawn from."""
        tokens, q = self.drafter.propose(*self._block(start, bonus), sampling, generator)
        return tokens[0], None if q is None else q[0]

    def _block(self, start: int, bonus: int):
        """(hidden [1, D, H], logits [1, D, V], anchor [1]) of the block anchored at `start`:
        the inputs of the drafter's rules (`propose`, `tree_scores`)."""
        h = self.draft_hidden(start, bonus)
        return h[None], self._logits(h)[None], torch.tensor([bonus], device=h.device)


def leading_matches(draft: torch.Tensor, tgt: torch.Tensor) -> int:
    m = (draft == tgt).long()
    return int(m.cumprod(0).sum())


def finish(out: list, max_new_tokens: int, eos_token_id: int | None) -> list:
    out = out[:max_new_tokens]
    if eos_token_id is not None and eos_token_id in out:
        out = out[: out.index(eos_token_id) + 1]
    return out
