"""Prompts as token ids: random ones for tokenizer-less targets, text ones through the target's
tokenizer and chat template (the same conventions for training data and eval prompts)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..config import DataConfig, TargetConfig
from .files import text_prompts


# ----------------------------------------------------------------------------- prompts
def random_prompts(
    num: int, length: int, vocab_size: int, exclude: Iterable[int], seed: int
) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    bad = torch.tensor(sorted(set(exclude)), dtype=torch.long)
    out = []
    for _ in range(num):
        p = torch.randint(0, vocab_size, (length,), generator=g)
        while bad.numel() and bool(torch.isin(p, bad).any()):
            m = torch.isin(p, bad)
            p[m] = torch.randint(0, vocab_size, (int(m.sum()),), generator=g)
        out.append(p.tolist())
    return out


def encode_prompts(prompts: list, tokenizer, tcfg: TargetConfig) -> list[list[int]]:
    """Token ids of prompts with the target's text conventions (the same function
    builds eval prompts, so they are formatted as training saw them). target.chat_template=true: the tokenizer's chat template with a
    generation prompt and `enable_thinking` passed explicitly; false: the raw text."""
    if not prompts:
        raise ValueError("no prompts to encode (the prompt source is empty)")
    if tcfg.chat_template:
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError(
                f"target.chat_template=true but the tokenizer of target {tcfg.name!r} has no "
                "chat template; set target.chat_template=false to use raw prompts"
            )
        if tcfg.enable_thinking and "enable_thinking" not in str(template):
            raise ValueError(
                f"target.enable_thinking=true but the chat template of target {tcfg.name!r} "
                "has no thinking switch; set target.enable_thinking=false"
            )
    prompts = _ending_on_a_user_turn(prompts)
    out = []
    for i in range(0, len(prompts), 1024):  # batched: one fast-tokenizer call per chunk (2x)
        chunk = prompts[i : i + 1024]
        if tcfg.chat_template:
            ids = tokenizer.apply_chat_template(
                [p if isinstance(p, list) else [{"role": "user", "content": p}] for p in chunk],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
                enable_thinking=tcfg.enable_thinking,
            )
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
        else:
            texts = [p if isinstance(p, str) else "\n".join(m["content"] for m in p) for p in chunk]
            ids = tokenizer(texts)["input_ids"]
        out += [list(x) for x in ids]
    return out


def _ending_on_a_user_turn(prompts: list) -> list:
    """A conversation that ends with an assistant turn would get a second assistant turn
    generated after it: its trailing assistant turns are dropped, so the target writes that
    answer itself (its own answer is what the drafter must learn); counted in one line."""
    out, cut, empty = [], 0, 0
    for p in prompts:
        if isinstance(p, list) and p and p[-1].get("role") == "assistant":
            cut += 1
            while p and p[-1].get("role") == "assistant":
                p = p[:-1]
            if not p:
                empty += 1
                continue
        out.append(p)
    if cut:
        print(
            f"data: {cut} conversation(s) ended with an assistant turn: dropped it, the target "
            f"answers the turn before itself"
            + (f"; {empty} held only assistant turns and were skipped" if empty else ""),
            flush=True,
        )
    if not out:
        raise ValueError("no prompts to encode (every conversation held only assistant turns)")
    return out


def build_prompts(dcfg: DataConfig, tcfg: TargetConfig, target) -> list[list[int]]:
    """Token-id prompts for training data, with the target's text conventions applied."""
    if dcfg.source == "selfgen":
        return random_prompts(
            dcfg.num_samples, dcfg.prompt_len, target.vocab_size, [target.mask_token_id], dcfg.seed
        )
    if target.tokenizer is None:
        raise ValueError(
            f"data.source={dcfg.source} needs a target with a tokenizer (this target has none: "
            "set target.tokenizer=bytes for a target built from target.config, or use "
            "data.source=selfgen)"
        )
    return encode_prompts(text_prompts(dcfg), target.tokenizer, tcfg)


def drop_long_prompts(prompts: list[list[int]], max_length: int) -> tuple[list[list[int]], int]:
    """Prompts that leave no room for a response token within max_length can never become a
    sample; they are dropped before regeneration (and counted) instead of being generated for."""
    keep = [p for p in prompts if len(p) < max_length]
    return keep, len(prompts) - len(keep)
