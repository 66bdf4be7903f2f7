"""Rows of every supported format as one normalized conversation.

Formats (docs/data.md has an example row of each):
  sharegpt  {"id": ..., "conversations": [{"from": "human", "value": "..."}, {"from": "gpt", ...}]}
  openai    {"messages": [{"role": "user", "content": "..."}, ...]}
  prompt    {"prompt": "..."} (data.prompt_field)

A row that fits no format is an error naming where it is and what was expected. A row that
fits but cannot become a sample (an unknown role, an empty turn, no user turn) is skipped and
counted by reason (`SkipCounts`), never silently.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass

# ShareGPT's role names and their aliases in the wild, and the OpenAI ones
ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}
ID_FIELDS = ("id", "conversation_id", "prompt_id")  # a row's own id, when it has one
LIST_FIELD = {"sharegpt": "conversations", "openai": "messages"}
TURN_KEYS = {"sharegpt": ("from", "value"), "openai": ("role", "content")}


@dataclass
class Conversation:
    """messages: [{"role": system | user | assistant, "content": str}] in the row's order.
    plain: the row was a bare prompt (encoded as before: one user turn)."""

    messages: list[dict]
    cid: str | None = None
    plain: bool = False

    @property
    def key(self) -> str:
        """Content hash: identifies a conversation where rows carry no id."""
        text = json.dumps([[m["role"], m["content"]] for m in self.messages], ensure_ascii=False)
        return hashlib.sha1(text.encode()).hexdigest()[:20]

    def user_indices(self) -> list[int]:
        return [i for i, m in enumerate(self.messages) if m["role"] == "user"]

    def prompt(self, turns: str):
        """The first prompt the target answers: a string (plain rows) or a message list. first /
        all: the system messages and the first user turn; last: everything up to the last user
        turn (the row's own earlier answers included)."""
        if self.plain:
            return self.messages[0]["content"]
        users = self.user_indices()
        if turns == "last":
            return self.messages[: users[-1] + 1]
        return [m for m in self.messages[: users[0]] if m["role"] == "system"] + [
            self.messages[users[0]]
        ]

    def answers(self, turns: str) -> list[str]:
        """data.answers=given: the row's own answers to the user turns the target would answer
        (all: each user turn in order, up to the first one without an answer; first / last: that
        user turn's), each the first assistant message after its user turn. [] for a bare prompt
        or when the first of those user turns has no answer."""
        if self.plain:
            return []
        users = self.user_indices()
        asked = users[:1] if turns == "first" else users[-1:] if turns == "last" else users
        out = []
        for u in asked:
            end = next((i for i in users if i > u), len(self.messages))
            a = next(
                (m["content"] for m in self.messages[u + 1 : end] if m["role"] == "assistant"), ""
            )
            if not a.strip():
                break
            out.append(a)
        return out

    def skeleton(self) -> list[dict]:
        """turns=all: system and user messages in order, the dataset's answers left out (the
        target answers each user turn itself)."""
        return [m for m in self.messages if m["role"] != "assistant"]


class SkipCounts:
    """Rows skipped, by reason, with the first place each reason was seen."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.first: dict[str, str] = {}

    def add(self, reason: str, where: str) -> None:
        self.counts[reason] += 1
        self.first.setdefault(reason, where)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        return ", ".join(
            f"{why}: {n} (first at {self.first[why]})" for why, n in self.counts.most_common()
        )


def detect_format(row: dict, prompt_field: str) -> str | None:
    if "conversations" in row:
        return "sharegpt"
    if "messages" in row:
        return "openai"
    if prompt_field in row:
        return "prompt"
    return None


def expected(fmt: str, prompt_field: str) -> str:
    if fmt == "sharegpt":
        return "'conversations': a list of {'from': str, 'value': str} (ShareGPT)"
    if fmt == "openai":
        return "'messages': a list of {'role': str, 'content': str} (OpenAI)"
    if fmt == "prompt":
        return f"a {prompt_field!r} string (set data.prompt_field to read another field)"
    return (
        "'conversations' (ShareGPT), 'messages' (OpenAI) or a 'prompt' string (set "
        "data.prompt_field to read another field)"
    )


def normalize(row, fmt: str, prompt_field: str, turns: str, where: str, skips: SkipCounts):
    """The row as a Conversation, or None (skipped and counted). Raises ValueError, naming
    `where`, for a row that fits no format (fmt="auto") or not the one data.format asks for."""
    if not isinstance(row, dict):
        raise ValueError(
            f"{where}: a row must be a JSON object with {expected(fmt, prompt_field)}; got {_kind(row)}"
        )
    found = detect_format(row, prompt_field) if fmt == "auto" else fmt
    field = prompt_field if found == "prompt" else LIST_FIELD.get(found)
    if found is None or field not in row:
        want = (
            ("rows need " + expected(fmt, prompt_field))
            if fmt != "auto"
            else (f"rows need a {prompt_field!r} or 'messages' field or 'conversations'")
        )
        raise ValueError(
            f"{where}: {want}; found {sorted(row)} (set data.prompt_field / data.format)"
        )
    cid = next((str(row[k]) for k in ID_FIELDS if isinstance(row.get(k), (str, int))), None)
    value = row[field]
    if found == "prompt":
        if not isinstance(value, str):
            raise ValueError(f"{where}: {field!r} must be a string, got {_kind(value)}")
        if not value.strip():
            skips.add("empty turn", where)
            return None
        return Conversation([{"role": "user", "content": value}], cid, plain=True)
    if value == []:  # a conversation without turns (ShareGPT dumps hold some): nothing to ask
        skips.add("no user turn", where)
        return None
    messages = _turns(value, found, field, where)
    return _checked(messages, cid, turns, where, skips)


def _turns(value, fmt: str, field: str, where: str) -> list[tuple[str, str]]:
    """[(role, text)] of a ShareGPT / OpenAI list; a turn may spell its keys either way."""
    rk, ck = TURN_KEYS[fmt]
    out = []
    for t in value if isinstance(value, list) else ():
        if not isinstance(t, dict):
            break
        role = t.get(rk, t.get("role" if rk == "from" else "from"))
        text = t.get(ck, t.get("content" if ck == "value" else "value"))
        if not (isinstance(role, str) and isinstance(text, str)):
            break
        out.append((role, text))
    if out and len(out) == len(value):
        return out
    raise ValueError(
        f"{where}: {field!r} must be a non-empty list of {{{rk!r}: str, {ck!r}: str}}, "
        f"got {json.dumps(value, default=str)[:80]}"
    )


def _checked(pairs, cid, turns: str, where: str, skips: SkipCounts) -> Conversation | None:
    messages = []
    for role, text in pairs:
        norm = ROLE_ALIASES.get(role.strip().lower())
        if norm is None:
            skips.add(f"unknown role {role!r}", where)
            return None
        messages.append({"role": norm, "content": text})
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        skips.add("no user turn", where)
        return None
    # a turn the prompts would use: system and user turns, and under turns=last the row's own
    # answers before the last user turn
    used = [
        m
        for i, m in enumerate(messages)
        if m["role"] != "assistant" or (turns == "last" and i < users[-1])
    ]
    if any(not m["content"].strip() for m in used):
        skips.add("empty turn", where)
        return None
    return Conversation(messages, cid)


def _kind(v) -> str:
    return f"{type(v).__name__} {json.dumps(v, default=str)[:40]}"
