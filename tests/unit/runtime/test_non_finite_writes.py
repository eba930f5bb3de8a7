"""NaN and infinities are written as the text "nan" / "inf" / "-inf" in metrics.jsonl and in
every JSON log: valid JSON that runtime/views/records.py reads back as floats, where
msgspec wrote null and Python's json an invalid `NaN`."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

from roles.controller.metrics import REQUIRED_KEYS, MetricsSink
from runtime.config import MetricsConfig
from runtime.logs import get_logger, json_ready, setup_logging
from runtime.views.records import metric, usable_metrics


def test_json_ready_replaces_non_finite_floats_at_any_depth() -> None:
    rec = {"a": math.nan, "b": [1.0, math.inf, {"c": -math.inf}], "d": (2, "x"), "e": 0.5}
    assert json_ready(rec) == {"a": "nan", "b": [1.0, "inf", {"c": "-inf"}], "d": [2, "x"], "e": 0.5}
    assert json_ready(3) == 3 and json_ready("nan") == "nan"


def test_a_metrics_line_with_nan_is_valid_json_and_reads_back(tmp_path: Path) -> None:
    sink = MetricsSink(tmp_path / "metrics.jsonl", MetricsConfig(), tmp_path, "t")
    rec = {k: 0.0 for k in REQUIRED_KEYS} | {"step": 1, "loss": math.nan, "grad_norm": math.inf}
    sink.write(rec)
    sink.close()
    line = (tmp_path / "metrics.jsonl").read_text()
    back = json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))  # strict JSON
    assert back["loss"] == "nan" and back["grad_norm"] == "inf" and usable_metrics(back)
    assert math.isnan(metric(back, "loss")) and metric(back, "grad_norm") == math.inf


def test_a_log_line_with_nan_says_nan_not_null() -> None:
    stream = io.StringIO()
    setup_logging(None, "test", stream=stream)
    get_logger("t").info("step", loss=math.nan, norms=[math.inf, 1.0])
    rec = json.loads(stream.getvalue())
    assert rec["loss"] == "nan" and rec["norms"] == ["inf", 1.0]
