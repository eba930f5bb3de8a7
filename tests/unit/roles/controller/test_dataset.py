"""PromptDataset: file formats, chat templating, over-long prompts, epochs and exact resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from roles.controller.dataset import Prompt, PromptDataset
from runtime.config import DataConfig
from runtime.data.data_files import DataError

ROWS = [{"prompt": f"question {i}", "answer": str(i), "source": "unit"} for i in range(10)]


@pytest.fixture(scope="module")
def tok() -> Any:
    from runtime.tiny.model import build_tokenizer

    return build_tokenizer()


def _jsonl(tmp_path: Path, rows: list[dict[str, Any]], name: str = "data.jsonl") -> str:
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def _dataset(tok: Any, path: str, seed: int = 0, **cfg: Any) -> PromptDataset:
    return PromptDataset(DataConfig(source="file", path=path, **cfg), tok, seed=seed)


def _draw(ds: PromptDataset, k: int) -> list[Prompt]:
    return [ds.next() for _ in range(k)]


def test_jsonl_rows_with_chat_template(tok: Any, tmp_path: Path) -> None:
    ds = _dataset(tok, _jsonl(tmp_path, ROWS), shuffle=False)
    assert len(ds) == 10
    first, second = _draw(ds, 2)
    assert (first.uid, first.row, first.answer) == (0, 0, "0")
    assert (second.uid, second.row, second.answer) == (1, 1, "1")
    assert first.metadata == {"source": "unit"}
    decoded = tok.decode(first.prompt_ids)
    assert "<|im_start|>user" in decoded
    assert decoded == first.text == "<|im_start|>user\nquestion 0<|im_end|>\n<|im_start|>assistant\n"


def test_without_chat_template_the_prompt_is_raw_bytes(tok: Any, tmp_path: Path) -> None:
    ds = _dataset(tok, _jsonl(tmp_path, ROWS), shuffle=False, chat_template=False, system_prompt="ignored")
    prompt = ds.next()
    assert prompt.text == "question 0"
    assert prompt.prompt_ids == list(b"question 0")  # byte tokenizer: id == byte


def test_prompt_as_chat_messages_and_system_prompt(tok: Any, tmp_path: Path) -> None:
    rows = [
        {"prompt": [{"role": "user", "content": "hi"}], "answer": "a"},
        {"prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": "yo"}], "answer": "b"},
    ]
    ds = _dataset(tok, _jsonl(tmp_path, rows), shuffle=False, system_prompt="Be terse.")
    first, second = _draw(ds, 2)
    assert first.text == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    # A conversation that brings its own system message keeps it and gets no second one.
    assert second.text == "<|im_start|>system\nown<|im_end|>\n<|im_start|>user\nyo<|im_end|>\n<|im_start|>assistant\n"
    raw = _dataset(tok, _jsonl(tmp_path, rows, "raw.jsonl"), shuffle=False, chat_template=False)
    assert raw.next().text == "hi"
    assert raw.next().text == "own\nyo"


def test_over_long_prompts_are_skipped_and_counted(tok: Any, tmp_path: Path) -> None:
    rows = [{"prompt": "ab"}, {"prompt": "abcdefghij"}, {"prompt": "cd"}]
    ds = _dataset(tok, _jsonl(tmp_path, rows), shuffle=False, chat_template=False, max_prompt_tokens=5)
    assert [p.text for p in _draw(ds, 4)] == ["ab", "cd", "ab", "cd"]
    assert ds.next().uid == 4
    assert ds.skipped_too_long == 2


def test_a_single_short_prompt_among_long_ones_is_always_found(tok: Any, tmp_path: Path) -> None:
    # Reaching it may take the rest of one epoch plus almost all of the reshuffled next one.
    rows = [{"prompt": "ab"}] + [{"prompt": "x" * 20}] * 5
    for seed in range(4):
        ds = _dataset(tok, _jsonl(tmp_path, rows), seed=seed, chat_template=False, max_prompt_tokens=5)
        assert {p.row for p in _draw(ds, 6)} == {0}
        assert ds.skipped_too_long >= 5 * 5  # at least the long rows of the 5 epochs between draws


def test_every_prompt_too_long_is_an_error(tok: Any, tmp_path: Path) -> None:
    ds = _dataset(tok, _jsonl(tmp_path, [{"prompt": "x" * 20}] * 3), chat_template=False, max_prompt_tokens=5)
    with pytest.raises(ValueError, match="longer than the run's limit of 5 tokens"):
        ds.next()


def test_a_skipped_prompt_is_counted_for_the_step_and_logged_once_per_row(tok: Any, tmp_path: Path) -> None:
    """A row over the limit used to be skipped in silence (the count only in checkpoints)."""
    import structlog

    rows = [{"prompt": "x" * 20}, {"prompt": "ok"}, {"prompt": "y" * 30}]
    ds = _dataset(tok, _jsonl(tmp_path, rows), shuffle=False, chat_template=False, max_prompt_tokens=5)
    with structlog.testing.capture_logs() as logs:
        assert [p.text for p in _draw(ds, 4)] == ["ok"] * 4  # two epochs and a bit: each long row met 2-3 times
    assert ds.take_skipped() == ds.skipped_too_long == 7 and ds.take_skipped() == 0
    warned = [(e["row"], e["tokens"], e["limit"]) for e in logs if e["event"] == "prompt_too_long"]
    assert warned == [(0, 20, 5), (2, 30, 5)]


def test_the_launch_check_refuses_data_where_no_prompt_fits(tok: Any, tmp_path: Path) -> None:
    """The check runs before anything starts (the launcher raises it: exit 2, one line),
    as the run's limit counts: data.max_prompt_tokens, at most max_model_len - 1."""
    from runtime.config.load import load_config
    from runtime.data.prompts import check_prompt_lengths, prompt_limit
    from runtime.errors import ConfigError

    cfg = load_config("configs/tiny_cpu.yaml", ["data.max_prompt_tokens=5", "data.chat_template=false"])
    with pytest.raises(ConfigError, match=r"every prompt of the synthetic data \(4096 rows\) is longer than "
                       r"data.max_prompt_tokens=5: the shortest has 8 tokens"):  # fmt: skip
        check_prompt_lengths(cfg, tok)
    check_prompt_lengths(load_config("configs/tiny_cpu.yaml", ["data.chat_template=false"]), tok)
    path = _jsonl(tmp_path, [{"prompt": "x" * 300}, {"prompt": "y" * 260}])
    over = load_config("configs/tiny_cpu.yaml", ["data.source=file", f"data.path={path}", "data.chat_template=false"])
    assert prompt_limit(over) == 255  # rollout.engine.max_model_len 256
    with pytest.raises(ConfigError, match=r"longer than rollout.engine.max_model_len=256 .* shortest has 260 tokens"):
        check_prompt_lengths(over, tok)


def test_epochs_cycle_and_reshuffle_deterministically(tok: Any, tmp_path: Path) -> None:
    path = _jsonl(tmp_path, ROWS)
    rows = [p.row for p in _draw(_dataset(tok, path, seed=3), 30)]
    epochs = [rows[0:10], rows[10:20], rows[20:30]]
    assert all(sorted(e) == list(range(10)) for e in epochs)  # each epoch is a permutation
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled between epochs
    assert rows == [p.row for p in _draw(_dataset(tok, path, seed=3), 30)]
    assert rows != [p.row for p in _draw(_dataset(tok, path, seed=4), 30)]
    assert [p.row for p in _draw(_dataset(tok, path, shuffle=False), 12)] == [*range(10), 0, 1]


@pytest.mark.parametrize("drawn_before", [0, 7, 10, 13])
def test_restore_continues_exactly_like_an_uninterrupted_run(tok: Any, tmp_path: Path, drawn_before: int) -> None:
    rows = [*ROWS, {"prompt": "y" * 600, "answer": "long"}]  # skipped: longer than 512 tokens
    path = _jsonl(tmp_path, rows)
    straight = _dataset(tok, path, seed=5)
    _draw(straight, drawn_before)
    state = json.loads(json.dumps(straight.state()))  # as it is stored in a checkpoint
    resumed = _dataset(tok, path, seed=5)
    resumed.restore(state)
    for a, b in zip(_draw(straight, 15), _draw(resumed, 15), strict=True):
        assert (a.uid, a.row, a.prompt_ids, a.answer) == (b.uid, b.row, b.prompt_ids, b.answer)
    assert resumed.state() == straight.state()


def test_missing_file_is_a_clear_error(tok: Any, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data\.path '.*nope\.jsonl' does not exist"):
        _dataset(tok, str(tmp_path / "nope.jsonl"))


@pytest.mark.parametrize(
    ("lines", "error"),
    [
        ([], r"has no rows"),
        (['{"prompt": "ok"}', '["not", "an", "object"]'], r"bad\.jsonl:2: a row must be a JSON object, not list"),
        (['{"prompt": "ok"}', '{"prompt": "ok"}', '{"question": "q"}'], r"bad\.jsonl:3: no field 'prompt'"),
        (['{"prompt": ""}'], r"bad\.jsonl:1: field 'prompt' is empty"),
        (['{"prompt": 7}'], r"bad\.jsonl:1: field 'prompt' must be text or a list of chat messages, not int"),
    ],
)
def test_every_row_is_checked_and_the_line_named(tok: Any, tmp_path: Path, lines: list[str], error: str) -> None:
    """A row that was not an object once killed the run mid-way, and only
    row 0 was checked for the prompt key (others were trained as empty prompts)."""
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=error):
        _dataset(tok, str(path))


def test_missing_prompt_key_names_the_field(tok: Any, tmp_path: Path) -> None:
    path = _jsonl(tmp_path, [{"question": "q", "answer": "a"}])
    with pytest.raises(ValueError, match=r"no field 'prompt' \(data\.prompt_key\)"):
        _dataset(tok, path)
    assert _dataset(tok, path, prompt_key="question", chat_template=False).next().text == "q"


def test_invalid_json_line_names_the_line(tok: Any, tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n\n{"prompt": oops}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: not valid JSON"):
        _dataset(tok, str(path))


def test_parquet_round_trip(tok: Any, tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed")
    import pyarrow.parquet as pq

    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    ds = _dataset(tok, str(path), shuffle=False, chat_template=False)
    assert [(p.text, p.answer, p.metadata) for p in _draw(ds, 2)] == [
        ("question 0", "0", {"source": "unit"}),
        ("question 1", "1", {"source": "unit"}),
    ]


def test_synthetic_prompts_are_letters_and_answers_repeat_them(tok: Any) -> None:
    cfg = DataConfig(source="synthetic", synthetic_num_prompts=20, synthetic_prompt_len=6)
    ds = PromptDataset(cfg, tok, seed=1)
    assert len(ds) == 20
    for prompt in _draw(ds, 25):
        letters = prompt.answer
        assert len(letters) == 6 and letters.isalpha() and letters.islower()
        assert len(set(letters)) == 6  # distinct letters
        assert f"user\n{letters}<|im_end|>" in prompt.text
        assert prompt.metadata == {"task": "copy"}
    again = PromptDataset(cfg, tok, seed=1)
    assert [r["prompt"] for r in again.rows] == [r["prompt"] for r in ds.rows]
