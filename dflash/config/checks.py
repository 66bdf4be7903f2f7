"""The rules every group's `validate` shares: a ValueError naming the dotted key and what is allowed."""

from __future__ import annotations

from typing import Any


def check_positive(name: str, value, what: str = "") -> None:
    """An optional number that must be > 0 when set."""
    if value is not None and not value > 0:
        raise ValueError(f"{name} must be > 0{what}, got {value}")


def check_at_least_one(group: str, cfg, keys: str, hints: dict | None = None) -> None:
    """Each of the space-separated integer fields `keys` of `cfg` must be >= 1 (`hints`: a note
    per key for its message)."""
    for key in keys.split():
        if getattr(cfg, key) < 1:
            hint = (hints or {}).get(key, "")
            raise ValueError(f"{group}.{key} must be >= 1{hint}, got {getattr(cfg, key)}")


def check_choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not allowed; choose one of {list(allowed)}")
