"""The project's one error root, and how an exception is told in one line.

Every exception class of `runtime` and `roles` derives from `TandemError` beside the builtin
it always was (`ConfigError(TandemError, ValueError)`), so `except ValueError` still catches
what it caught. `transport` keeps its own (it imports nothing of `runtime`).
"""

from __future__ import annotations


class TandemError(Exception):
    """A failure Tandem raises on purpose, with a message meant for the person running it."""


class ConfigError(TandemError, ValueError):
    """A config that cannot run; the message is one line naming the key."""


def one_line(exc: BaseException | None, limit: int = 500) -> str:
    """`Type: message` on one line (whitespace runs collapsed), at most `limit` characters;
    "unknown error" for None."""
    text = f"{type(exc).__name__}: {exc}" if exc is not None else "unknown error"
    return " ".join(text.split())[:limit]
