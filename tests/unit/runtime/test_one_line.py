"""`runtime.errors.one_line`, the one way an exception is told in a line: every caller that
cuts, keeps one line or marks a cut goes through it."""

from __future__ import annotations

from runtime.errors import one_line


def test_type_and_message_on_one_line() -> None:
    assert one_line(ValueError("a\n  b\tc")) == "ValueError: a b c"
    assert one_line(None) == "unknown error"


def test_a_long_message_is_cut_at_the_limit_with_its_mark() -> None:
    exc = RuntimeError("x" * 1000)
    assert len(one_line(exc)) == 500
    cut = one_line(exc, 100, mark="...")
    assert len(cut) == 100 and cut.endswith("...") and cut.startswith("RuntimeError: xxx")
    assert one_line(RuntimeError("short"), 100, mark="...") == "RuntimeError: short"


def test_one_line_of_a_multi_line_message() -> None:
    exc = ImportError("\nfirst line\nTraceback ...\n  cause: the last line\n")
    assert one_line(exc, line=0) == "ImportError: first line"
    assert one_line(exc, line=-1) == "ImportError: cause: the last line"
    assert one_line(ValueError(""), line=0) == "ValueError:"
