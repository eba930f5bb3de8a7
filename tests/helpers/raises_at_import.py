"""A reward module that raises while it is imported (a user's module with a bug at top level)."""

raise RuntimeError("reward table missing")


def score(**_: object) -> float:  # pragma: no cover (never reached)
    return 0.0
