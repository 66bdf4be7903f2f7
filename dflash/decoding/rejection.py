"""Acceptance at temperature > 0, as the reference's generation does it: pure functions.

Legend: D drafted positions per block, V vocab, n anchors, t temperatures.

- `warp`: the reference's sampling distribution (temperature, then top-k, softmax, then top-p
  over the sorted probabilities, renormalised), applied alike to target and drafter logits.
- `rejection_sample_block`: one verify round. Draft token x_i (sampled from q_i) is accepted
  with probability min(1, p_i(x_i) / q_i(x_i)) (the reference draws u and accepts iff
  u * q < p); at the first rejection the next token is sampled from max(p_i - q_i, 0)
  normalised (p_i itself if that is all zero); if all D are accepted the bonus is sampled from
  the target's last distribution p_D. Every emitted token is then distributed as the target's.
- `expected_accepted`: the expected number of accepted drafted tokens of one round,
  sum_k prod_{i<=k} alpha_i with alpha_i = sum_x min(p_i(x), q_i(x)), the probability that
  position i accepts (x ~ q_i).

What the offline evaluation computes with it (dflash.eval.offline): DFlash drafts all D positions
in one pass from [bonus, MASK...], so q_1..q_D do not depend on the sampled draft tokens and are
exact. The target's p_i, however, depends on the tokens accepted before position i; offline we
have the target's distributions only along the cached greedy completion g_1..g_D. Two figures
bracket the exact expectation of a round, averaged over the rounds of the greedy walk:

- `eval/tau_t{T}`, an UPPER ESTIMATE: 1 + sum_k prod_{i<=k} alpha_i with every p_i taken along
  the greedy path, also after a non-greedy draft token was accepted (where the real p_i is
  conditioned on that token, and usually agrees less with q_i). It reads high: on a toy target
  (tests/test_sampling.py enumerates every sampled block) it exceeds the exact expectation.
- `eval/tau_t{T}_lower`, a LOWER BOUND: 1 + sum_k prod_{i<=k} beta_i with beta_i = min(p_i(g_i),
  q_i(g_i)), the probability that position i drafts AND accepts the greedy token. Along the
  greedy path p_i is exact, and P(accepted >= k) >= P(the first k accepted tokens are g_1..g_k)
  = prod_{i<=k} beta_i, so this never exceeds the exact expectation.

At T=0 both distributions are one-hot and both figures equal `eval/tau` exactly; at T>0 they are
bounds on what a sampled decode would accept along this walk, not a replay of one
(`eval.real_decode_prompts` decodes for real beside them; docs/evaluation.md has the gap).
"""

from __future__ import annotations

import torch


def warp(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0):
    """fp32 probabilities [..., V]; temperature <= 0 gives the one-hot argmax (greedy)."""
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(
            f"sampling: temperature={temperature} must be >= 0, top_p={top_p} in (0, 1], "
            f"top_k={top_k} >= 0"
        )
    if temperature <= 0:
        idx = logits.argmax(-1, keepdim=True)
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, idx, 1.0)
    scores = logits.float() / temperature
    V = scores.shape[-1]
    if 0 < top_k < V:
        kth = scores.topk(top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = scores.softmax(-1)
    if top_p < 1.0:
        sp, order = probs.sort(-1, descending=True)
        keep = sp.cumsum(-1) - sp < top_p  # the smallest prefix whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sp * keep)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def overlap(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """alpha = sum_x min(p(x), q(x)): the acceptance probability of one drafted position."""
    return torch.minimum(p, q).sum(-1)


def expected_accepted(alpha_nD: torch.Tensor, avail_n: torch.Tensor | None = None):
    """[n] expected accepted drafted tokens per round from per-position acceptance
    probabilities: sum_{k<=avail} prod_{i<=k} alpha_i (positions past `avail` count as 0)."""
    a = alpha_nD.double()
    if avail_n is not None:
        k = torch.arange(a.shape[-1], device=a.device)
        a = a * (k[None, :] < avail_n[:, None].to(a.device))
    return a.cumprod(-1).sum(-1)


def expected_accept_length(p_DV: torch.Tensor, q_DV: torch.Tensor) -> float:
    """Expected accepted drafted tokens of one round with target distributions p_1..p_D and
    draft distributions q_1..q_D (each p_i fixed, i.e. taken along one continuation)."""
    return float(expected_accepted(overlap(p_DV, q_DV)[None])[0])


def rejection_sample_block(
    p_BV: torch.Tensor,
    q_DV: torch.Tensor,
    draft_D: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """One verify round. p_BV: the target's (warped) distributions at block positions 0..D (row i
    judges draft token i, row D gives the bonus); q_DV: the drafter's; draft_D: the drafted
    tokens. Returns (accepted drafted tokens, the next token: resampled or bonus)."""
    D = draft_D.numel()
    if p_BV.shape[0] != D + 1 or q_DV.shape[0] != D:
        raise ValueError(f"p needs D+1={D + 1} rows and q D={D}: got {p_BV.shape}, {q_DV.shape}")
    dev = p_BV.device
    for i in range(D):
        x = int(draft_D[i])
        u = torch.rand((), generator=generator, device=dev)
        if u * q_DV[i, x] < p_BV[i, x]:
            continue
        residual = (p_BV[i] - q_DV[i]).clamp_min(0)
        total = residual.sum()
        dist = residual / total if total > 0 else p_BV[i]
        return i, int(torch.multinomial(dist, 1, generator=generator))
    return D, int(torch.multinomial(p_BV[D], 1, generator=generator))
