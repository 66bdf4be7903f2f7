"""The target's greedy completions of the eval prompts, checked by a one-shot forward, and kept
whole past bf16 near-ties (`eval.near_tie_rounds`).

The eval set keeps a greedy completion only up to the first token where a one-shot forward of
the target parts from the batched decode (`consistent_greedy`): at a near-tie the two forwards'
arithmetic picks different tokens. With rounds > 0 a cut completion goes on from the one-shot
forward's token (the target's verification forward agrees with it), the rest is generated again
from there and the whole is checked again, up to `rounds` times, so a target with many
near-ties (SmolLM2-135M in bf16 cut 105 of 164 HumanEval completions) is scored on whole
completions, not mostly on their early tokens.

Legend: P prompt length, L completion length, T = P + L.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..data.dataset import generate_greedy


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
    return _one_shot(target, prompt, completion)[0]


@torch.no_grad()
def _one_shot(target, prompt, completion) -> tuple[EvalItem, int | None]:
    """consistent_greedy's item, and the one-shot forward's token where it cut (None: whole)."""
    ids = torch.tensor(list(prompt) + list(completion), dtype=torch.long, device=target.device)[
        None
    ]
    out = target.capture(ids, with_final_hidden=True, compiled=False)  # one row: eager
    P = len(prompt)
    pred = out.next_token_NT[0, P - 1 : -1].cpu()
    comp = torch.tensor(completion, dtype=torch.long)
    bad = (pred != comp).nonzero()
    n = int(bad[0]) if bad.numel() else len(completion)
    item = EvalItem(
        torch.tensor(prompt, dtype=torch.long),
        comp[:n].clone(),
        out.aux_NTF[0, : P + n].cpu().clone(),
        out.final_hidden_NTH[0, P - 1 : P - 1 + n].cpu().clone(),
    )
    return item, (int(pred[n]) if n < len(completion) else None)


def checked_items(target, pairs, t0: float, log, rounds: int = 0, batch_size: int = 1):
    """Each completion checked by a one-shot forward (`consistent_greedy`); rounds > 0: a cut one
    continued past the near-tie (`continue_near_ties`, eval.near_tie_rounds)."""
    given = len(pairs)  # an empty completion counts among those left out
    pairs = [(p, c) for p, c in pairs if c]
    checked = [_one_shot(target, p, c) for p, c in pairs]
    cut = sum(fix is not None for _, fix in checked)
    notes = []
    if cut:
        notes.append(
            f"{cut} of {given} completions cut where a one-shot forward of the target parts "
            "from them, a near-tie"
        )
    if cut and rounds:
        checked, note = continue_near_ties(target, pairs, checked, rounds, batch_size)
        notes.append(note)
    items = [it for it, _ in checked if it.completion_ids.numel() >= 2]
    if not items:
        raise ValueError(
            "eval: no usable prompt (every greedy completion is shorter than 2 tokens)"
        )
    short = given - len(items)
    if short:
        notes.append(f"{short} left out: shorter than 2 tokens")
    log(
        f"eval: {len(items)} prompts, {sum(it.completion_ids.numel() for it in items)} greedy "
        f"tokens, built in {time.perf_counter() - t0:.1f} s"
        + (f" ({'; '.join(notes)})" if notes else "")
    )
    return items


def continue_near_ties(
    target,
    pairs: list[tuple[list[int], list[int]]],
    checked: list[tuple[EvalItem, int | None]],
    rounds: int,
    batch_size: int,
) -> tuple[list[tuple[EvalItem, int | None]], str]:
    """(EvalItem, the one-shot token at its cut or None) per (prompt, completion) pair, each
    cut one continued as above; and a note for the eval set's log line. A completion grows no
    longer than it was (the eval's completion length, and for turns of a conversation the room
    data.max_length left), ends at EOS, and stays where it was cut when a round does not get it
    further."""
    tok = getattr(target, "tokenizer", None)
    eos = getattr(tok, "eos_token_id", None)
    limit = [len(c) for _, c in pairs]
    kept_before = sum(it.completion_ids.numel() for it, _ in checked)
    checked = list(checked)
    cut = [i for i, (_, fix) in enumerate(checked) if fix is not None]
    live, ran = list(cut), 0
    while live and ran < rounds:
        ran += 1
        heads = [checked[i][0].completion_ids.tolist() + [checked[i][1]] for i in live]
        want = [0 if h[-1] == eos else limit[i] - len(h) for i, h in zip(live, heads)]
        rests = [[] for _ in live]
        todo = [k for k, w in enumerate(want) if w > 0]
        if todo:
            prompts = [list(pairs[live[k]][0]) + heads[k] for k in todo]
            outs = generate_greedy(
                target, prompts, max(want[k] for k in todo), batch_size, desc="eval near-ties"
            )
            for k, out in zip(todo, outs):
                rests[k] = list(out or [])[: want[k]]
        going = []
        for k, i in enumerate(live):
            item, fix = _one_shot(target, pairs[i][0], heads[k] + rests[k])
            if item.completion_ids.numel() <= checked[i][0].completion_ids.numel():
                continue  # no further than before: it stays cut where it was
            checked[i] = (item, fix)
            if fix is not None:
                going.append(i)
        live = going
    whole = sum(checked[i][1] is None for i in cut)
    more = sum(it.completion_ids.numel() for it, _ in checked) - kept_before
    note = (
        f"continued from the one-shot token over {ran} round(s) (eval.near_tie_rounds="
        f"{rounds}): {whole} of the {len(cut)} whole, {more} greedy tokens more"
    )
    return checked, note
