"""The report's timeline draws a distillation teacher's answer to each group as a span on its
own lane, from the request to the reply the schedule's `teacher` record gives."""

from __future__ import annotations

import pytest

from runtime.views.report.timeline import build_timeline


def test_teacher_records_become_spans_on_their_lane() -> None:
    schedule = [
        {"ev": "run", "t": 100.0, "step": 0, "version": 0, "next_g": 0},
        {"ev": "sync", "t": 100.5, "t0": 100.25, "to": "rollout-0", "version": 1, "receive_s": 0.1, "load_s": 0.1},
        {"ev": "teacher", "t": 103.0, "g": 0, "to": "teacher-0", "s": 1.5, "tok": 64, "fail": 0},
        {"ev": "teacher", "t": 103.5, "g": 1, "to": "teacher-0", "s": 1.0, "tok": 60, "fail": 2},
    ]
    tl = build_timeline(schedule)
    assert "teacher-0 scoring" in tl.rows
    spans = [s for s in tl.spans if s.kind == "teacher"]
    assert [(s.row, s.start, s.end) for s in spans] == [
        ("teacher-0 scoring", pytest.approx(1.5), pytest.approx(3.0)),
        ("teacher-0 scoring", pytest.approx(2.5), pytest.approx(3.5)),
    ]
    assert spans[1].text == "teacher-0 scores group 1: 60 tokens in 1.0s, 2 failed"
