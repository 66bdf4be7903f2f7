"""The rules every group's `validate` shares: a ValueError naming the dotted key and what is allowed."""

from __future__ import annotations

from typing import Any


def check_positive(name: str, value, what: str = "") -> None:
    """An optional number that must be > 0 when set."""
    if value is not None and not value > 0:
        raise ValueError(f"{name} must be > 0{what}, got {value}")


def check_choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not allowed; choose one of {list(allowed)}")
