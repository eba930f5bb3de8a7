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


def one_line(exc: BaseException | None, limit: int = 500, *, line: int | None = None, mark: str = "") -> str:
    """`Type: message` on one line (whitespace runs collapsed), at most `limit` characters,
    the last of them `mark` where the text was cut; "unknown error" for None. `line` keeps
    only that line of a multi-line message (0 the first, -1 the last: a traceback's cause)."""
    if exc is None:
        return "unknown error"
    message = str(exc)
    if line is not None:
        message = (message.strip().splitlines() or [""])[line]
    text = " ".join(f"{type(exc).__name__}: {message}".split())
    if len(text) <= limit:
        return text
    return text[: limit - len(mark)] + mark
