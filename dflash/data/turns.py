"""Conversations as token ids for regeneration: the first prompt of each conversation and, under
data.turns=all, the template's tokens between one answer and the next (the glue).

A conversation is regenerated in token space: its first prompt is the chat template applied to
the system and first user turn with a generation prompt, as a server formats it
(`encode_prompts`); each later user turn adds the glue after the target's answer: the end of the
assistant turn, the next user turn and the next generation prompt, as the template renders them
(read off a render whose earlier answers are a placeholder). The target's answers stay exactly
the tokens it generated, so every answer sits right after the tokens it was generated from and
a sample's tokens are the target's greedy tokens wherever the loss falls.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from ..config import TargetConfig
from .conversations import Conversation
from .prompts import TokenTable, encode_prompts

# stands for an earlier answer in a render; split on to find the glue
PLACEHOLDER = "\u27e6dflash answer\u27e7"
CHUNK = 1024  # conversations encoded per batched template / tokenizer call


@dataclass
class TurnPrompts:
    """C conversations: first prompts [C], glue rows of every conversation in order, and where
    each conversation's glue rows start ([C + 1]: conversation c has glue rows
    glue_start[c]..glue_start[c+1], one per user turn after the first). Under data.answers=given
    the rows' own answers, as token ids, likewise (answer_start [C + 1]; a conversation without
    any is regenerated)."""

    first: TokenTable
    glue: TokenTable = field(default_factory=TokenTable)
    glue_start: np.ndarray | None = None
    sources: np.ndarray | None = None  # data.mix source of each conversation
    stats: dict = field(default_factory=dict)
    answers: TokenTable = field(default_factory=TokenTable)
    answer_start: np.ndarray | None = None

    def __post_init__(self):
        n = len(self.first)
        if self.glue_start is None:
            self.glue_start = np.zeros(n + 1, dtype=np.int64)
        if self.sources is None:
            self.sources = np.zeros(n, dtype=np.int64)
        if self.answer_start is None:
            self.answer_start = np.zeros(n + 1, dtype=np.int64)

    def given_mask(self) -> np.ndarray:
        """[C] bool: whether each conversation's answers are its row's own (data.answers=given)."""
        return np.diff(self.answer_start) > 0

    def answer_of(self, c: int, k: int) -> list[int]:
        """The row's own answer k (0-based) of conversation c, as the target's tokens would be."""
        return self.answers[int(self.answer_start[c]) + k]

    def __len__(self) -> int:
        return len(self.first)

    def num_turns(self, c: int) -> int:
        return 1 + int(self.glue_start[c + 1] - self.glue_start[c])

    def glue_of(self, c: int, k: int) -> list[int]:
        """The glue after answer k (0-based) of conversation c."""
        return self.glue[int(self.glue_start[c]) + k]


def encode_turns(
    convs: Iterable[Conversation],
    tokenizer,
    tcfg: TargetConfig,
    turns: str,
    max_length: int,
    sources: Iterable[int] | None = None,
    max_turns: int | None = None,
    answers: str = "regenerate",
    response_len: int | None = None,
) -> TurnPrompts:
    """Token ids of the conversations' turns, a chunk at a time. A conversation whose first
    prompt leaves no room for an answer within max_length is left out (counted); later turns are
    encoded while the prompts so far leave room (the answers' lengths are not known yet), up to
    max_turns user turns (None: all; the rest counted).

    answers="given": a conversation's own answers (`Conversation.answers`) become token ids as
    the target would have generated them (the text's tokens, then EOS; cut at response_len like
    a regenerated answer), and its turns end at the first user turn without one (counted)."""
    first, glue, given = TokenTable(), TokenTable(), TokenTable()
    starts, srcs, given_starts = [0], [], [0]
    stats = {
        "prompt_too_long": 0,
        "turns": 0,
        "turns_past_max_length": 0,
        "turns_past_max_turns": 0,
    }
    if answers == "given":
        stats["turns_without_given_answer"] = 0
    src_iter = iter(sources) if sources is not None else None
    chunk: list = []

    def flush():
        ids = encode_prompts([c.prompt(turns) for c, _ in chunk], tokenizer, tcfg)
        keep = [j for j, p in enumerate(ids) if len(p) < max_length]
        stats["prompt_too_long"] += len(chunk) - len(keep)
        kept = [chunk[j][0] for j in keep]
        texts = [c.answers(turns) if answers == "given" else [] for c in kept]
        caps = [len(t) or None for t in texts]  # given answers end the turns they reach
        glues = _glues(
            kept, [ids[j] for j in keep], tokenizer, tcfg, max_length, turns, max_turns, caps
        )
        first.extend([ids[j] for j in keep])
        glue.extend([row for g in glues for row in g])  # one part per chunk
        given.extend(_answer_ids(texts, glues, tokenizer, response_len))
        for c, g, t in zip(kept, glues, texts):
            starts.append(starts[-1] + len(g))
            given_starts.append(given_starts[-1] + (1 + len(g) if t else 0))
            users = len(c.user_indices()) if turns == "all" and not c.plain else 1
            capped = min(users, max_turns) if max_turns else users
            stats["turns_past_max_turns"] += users - capped
            if t and len(t) < capped:
                stats["turns_without_given_answer"] += capped - len(t)
                capped = len(t)
            stats["turns"] += 1 + len(g)
            stats["turns_past_max_length"] += capped - 1 - len(g)
        srcs.extend(chunk[j][1] for j in keep)
        chunk.clear()

    for c in convs:
        chunk.append((c, next(src_iter) if src_iter is not None else 0))
        if len(chunk) == CHUNK:
            flush()
    if chunk:
        flush()
    return TurnPrompts(
        first,
        glue,
        np.array(starts, dtype=np.int64),
        np.array(srcs, dtype=np.int64),
        stats,
        given,
        np.array(given_starts, dtype=np.int64),
    )


def _answer_ids(texts, glues, tokenizer, response_len: int | None) -> list[list[int]]:
    """The given answers of every conversation of a chunk that has them (one per turn it
    keeps), as a regeneration would have returned them: the text's tokens and EOS, at most
    response_len tokens (a longer answer is cut as the regeneration's cap cuts it, without EOS)."""
    flat = [a for t, g in zip(texts, glues) if t for a in t[: 1 + len(g)]]
    if not flat:
        return []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids = tokenizer(flat, add_special_tokens=False)["input_ids"]
    return [(list(a) + eos)[:response_len] for a in ids]


def _glues(
    convs,
    firsts,
    tokenizer,
    tcfg: TargetConfig,
    max_length: int,
    turns: str,
    max_turns=None,
    caps=None,
):
    """Per conversation, the glue token ids after each answer but the last, while the tokens so
    far stay below max_length and the turns within max_turns (and the conversation's own cap:
    caps[j] user turns, None for no cap)."""
    out: list[list[list[int]]] = [[] for _ in convs]
    if turns != "all":
        return out
    skels = [c.skeleton() if not c.plain else [] for c in convs]
    users = [[i for i, m in enumerate(s) if m["role"] == "user"] for s in skels]
    if caps is not None:
        users = [u[:cap] if cap else u for u, cap in zip(users, caps)]
    used = [len(f) for f in firsts]
    k = 1
    last = max_turns or max((len(u) for u in users), default=0)
    while k < last and (
        todo := [j for j in range(len(convs)) if len(users[j]) > k and used[j] < max_length]
    ):
        texts = _glue_texts([_history(skels[j], users[j], k) for j in todo], k, tokenizer, tcfg)
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        for j, g in zip(todo, ids):
            out[j].append(list(g))
            used[j] += len(g)
        k += 1
    return out


def _history(skel: list[dict], users: list[int], k: int) -> list[dict]:
    """The messages up to user turn k (0-based), a placeholder answer after each earlier one."""
    msgs = []
    for i, m in enumerate(skel[: users[k] + 1]):
        msgs.append(m)
        if m["role"] == "user" and i != users[k]:
            msgs.append({"role": "assistant", "content": PLACEHOLDER})
    return msgs


def _glue_texts(histories: list[list[dict]], k: int, tokenizer, tcfg: TargetConfig) -> list[str]:
    """For each history, the text after its last placeholder answer: what the template renders
    after an assistant turn, up to and including the next generation prompt."""
    if not tcfg.chat_template:  # raw text: the next turns' texts, each on its own line
        out = []
        for msgs in histories:
            last = max(i for i, m in enumerate(msgs) if m["content"] == PLACEHOLDER)
            out.append("\n" + "\n".join(m["content"] for m in msgs[last + 1 :]) + "\n")
        return out
    texts = tokenizer.apply_chat_template(
        histories,
        add_generation_prompt=True,
        tokenize=False,
        enable_thinking=tcfg.enable_thinking,
    )
    if any(t.count(PLACEHOLDER) != k for t in texts):
        raise ValueError(
            f"the chat template of target {tcfg.name!r} does not render assistant turns as "
            "given (data.turns=all places the target's own answers in the history); use "
            "data.turns=first or data.turns=last"
        )
    return [t.rsplit(PLACEHOLDER, 1)[1] for t in texts]
