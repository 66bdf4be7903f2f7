"""Prompts as token ids: random ones for tokenizer-less targets, text ones through the target's
tokenizer and chat template (the same conventions for training data and eval prompts)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from ..config import TargetConfig


class TokenTable:
    """Rows of token ids in one flat int32 array with offsets: a million prompts cost their
    tokens (4 bytes each), not a Python list and int objects per prompt. Indexing gives a row
    as a list; a slice gives a list of rows (what a regeneration batch needs)."""

    def __init__(self, rows: Iterable = ()):
        self._parts: list[np.ndarray] = []
        self._lens: list[np.ndarray] = []
        self._flat = self._offsets = None
        self.extend(rows)

    def extend(self, rows: Iterable) -> None:
        rows = [np.asarray(r, dtype=np.int32) for r in rows]
        if rows:
            self._parts.append(np.concatenate(rows))
            self._lens.append(np.array([len(r) for r in rows], dtype=np.int64))
            self._flat = None

    def _arrays(self):
        if self._flat is None:
            # part by part into one array, each part freed once copied: the peak stays near
            # the table's size instead of twice it
            flat = np.empty(sum(len(p) for p in self._parts), dtype=np.int32)
            parts, o = self._parts[::-1], 0
            self._parts = []
            while parts:
                p = parts.pop()
                flat[o : o + len(p)] = p
                o += len(p)
            lens = np.concatenate(self._lens) if self._lens else np.zeros(0, np.int64)
            self._flat, self._offsets = flat, np.concatenate([[0], np.cumsum(lens)])
            self._parts, self._lens = [flat], [lens]
        return self._flat, self._offsets

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self._arrays()[1])

    def __len__(self) -> int:
        return len(self._arrays()[1]) - 1

    def __getitem__(self, i):
        flat, off = self._arrays()
        if isinstance(i, slice):
            return [flat[off[j] : off[j + 1]].tolist() for j in range(*i.indices(len(self)))]
        return flat[off[i] : off[i + 1]].tolist()

    def __iter__(self):
        return (self[j] for j in range(len(self)))

    def take(self, idx) -> TokenTable:
        """The rows `idx` (in that order) as a new table."""
        flat, off = self._arrays()
        idx = np.asarray(idx, dtype=np.int64)
        out = TokenTable()
        if len(idx):
            lens = off[idx + 1] - off[idx]
            starts = np.repeat(off[idx] - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens)
            out._parts = [flat[starts + np.arange(int(lens.sum()))]]
            out._lens = [lens]
        return out

    @property
    def nbytes(self) -> int:
        flat, off = self._arrays()
        return flat.nbytes + off.nbytes


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


def drop_long_prompts(prompts: list[list[int]], max_length: int) -> tuple[list[list[int]], int]:
    """Prompts that leave no room for a response token within max_length can never become a
    sample; they are dropped before regeneration (and counted) instead of being generated for."""
    keep = [p for p in prompts if len(p) < max_length]
    return keep, len(prompts) - len(keep)
