"""benchmarks/scaling.py: the points of each axis are the documented shapes and lengths, each
loads and validates, and the memory plan's refusal of a point that cannot fit is its reason."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from benchmarks.async_vs_sync import decoder_param_count
from benchmarks.scaling import points, refusal
from runtime.memory.auto import load_settled


def _params(cfg) -> int:  # type: ignore[no-untyped-def]
    t = msgspec.structs.asdict(cfg.model.tiny)
    hf = {"model_type": "qwen2", "hidden_size": t["hidden_size"], "num_hidden_layers": t["num_layers"],
          "num_attention_heads": t["num_heads"], "num_key_value_heads": t["num_kv_heads"],
          "intermediate_size": t["intermediate_size"], "vocab_size": t["vocab_size"] or 259,
          "tie_word_embeddings": t["tie_word_embeddings"]}  # fmt: skip
    return decoder_param_count(hf)


def test_model_axis_has_the_four_shapes() -> None:
    pts = points("model", "h200", 1.0)
    assert [p.name for p in pts] == ["0.5b", "1.5b", "3b", "7b"]
    sizes = [_params(load_settled(p.config, p.overrides)) / 1e9 for p in pts]
    # Qwen2.5-0.5B: 0.49B; the 1.5B bench shape 1.54B; 3B 3.09B; 7B 7.62B
    assert sizes == pytest.approx([0.494, 1.544, 3.086, 7.616], rel=0.01)
    half = load_settled(pts[0].config, pts[0].overrides).model.tiny
    shape = (half.hidden_size, half.num_layers, half.num_heads, half.num_kv_heads, half.intermediate_size)
    assert shape == (896, 24, 14, 2, 4864) and half.vocab_size == 151936


def test_length_axis_budgets_and_room() -> None:
    pts = points("length", "h200", 1.0)
    assert [p.x for p in pts] == [512, 2048, 8192]
    for p in pts:
        cfg = load_settled(p.config, p.overrides)
        r = cfg.rollout
        assert (r.length_dist.kind, r.length_dist.mean_tokens, r.max_tokens) == ("lognormal", p.x, 4 * p.x)
        assert r.ignore_eos and r.engine.max_model_len > r.max_tokens
        assert cfg.model.tiny.max_position_embeddings >= r.engine.max_model_len
        assert cfg.trainer.micro_batch_tokens >= r.engine.max_model_len


def test_a_point_that_cannot_fit_is_refused_with_the_plans_reason() -> None:
    seven = points("model", "h200", 1.0)[3]
    why = refusal(load_settled(seven.config, [*seven.overrides, "memory.gpu_gb=40", "memory.host_gb=512"]))
    assert why is not None and why.startswith("memory plan: GPU 0 of node 0 needs ")
    assert refusal(load_settled(seven.config, [*seven.overrides, "memory.gpu_gb=141", "memory.host_gb=512"])) is None
    assert refusal(load_settled("configs/tiny_cpu.yaml")) is None


def test_add_to_grows_a_curve_over_sittings(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`--add-to`: the earlier file's points are kept, a point run again replaces its old
    result, the axis order holds, and a file measured otherwise is refused before anything
    runs. `run_point` is a stand-in here: the launches are the smoke test's business."""
    import json

    import benchmarks.scaling as scaling

    ran: list[str] = []

    def run_point(point, args, run_root, env=None):  # type: ignore[no-untyped-def]
        ran.append(point.name)
        return {"point": point.name, "x": point.x, "refused": None, "sitting": len(ran), **scaling.provenance()}

    monkeypatch.setattr(scaling, "run_point", run_point)
    first, second, third = (tmp_path / f"{n}.json" for n in ("first", "second", "third"))
    common = ["--axis", "model", "--steps", "12", "--run-root", str(tmp_path / "runs")]
    scaling.main([*common, "--only", "3b", "--only", "0.5b", "--out", str(first)])
    scaling.main([*common, "--only", "1.5b", "--only", "3b", "--add-to", str(first), "--out", str(second)])
    result = json.loads(second.read_text())
    assert [(p["point"], p["sitting"]) for p in result["points"]] == [("0.5b", 1), ("1.5b", 3), ("3b", 4)]
    assert all(p["measured_at"] and "commit" in p for p in result["points"])
    for argv, message in ((["--steps", "6"], "steps was 12, now 6"), (["--staleness", "4"], "staleness was 2, now 4"),
                          (["rollout.n=4"], r"overrides was \[\], now \['rollout.n=4'\]")):  # fmt: skip
        with pytest.raises(SystemExit, match=message):
            scaling.main([*common, *argv, "--only", "7b", "--add-to", str(second), "--out", str(third)])
    with pytest.raises(SystemExit, match="axis was 'model', now 'length'"):
        scaling.main(["--axis", "length", "--steps", "12", "--only", "mean-512", "--add-to", str(second)])
    assert ran == ["0.5b", "3b", "1.5b", "3b"] and not third.exists()  # the refused ones ran nothing


def _as_new_recipe(result: str, config: str, tmp_path: Path) -> Path:
    """A copy of a committed async_vs_sync result as if its recipe had had its new name."""
    import json

    copy = tmp_path / f"as_{Path(config).stem}_{Path(result).name}"
    copy.write_text(json.dumps({**json.loads(Path(result).read_text()), "config": config}))
    return copy


def test_import_takes_a_point_that_async_vs_sync_measured_exactly(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`--import 1.5b=FILE` with the committed 1.5B result (10 steps, staleness 2) as if measured
    under the recipe's new name: the point's figures are that file's, its headline the file's, its
    provenance the file's; the other points still run; a file that measured anything else is
    refused, the committed one too (its recipe, bench_h200x1.yaml, pinned the H200's settings)."""
    import json

    import benchmarks.scaling as scaling

    monkeypatch.setattr(scaling, "run_point", lambda point, args, run_root, env=None: {
        "point": point.name, "x": point.x, "refused": None})  # fmt: skip
    committed = "benchmarks/results/async_vs_sync_h200x1.json"
    renamed = _as_new_recipe(committed, "configs/bench_1.5b.yaml", tmp_path)
    measured = json.loads(renamed.read_text())
    out = tmp_path / "model.json"
    common = ["--axis", "model", "--run-root", str(tmp_path / "runs"), "--out", str(out)]
    scaling.main([*common, "--steps", "10", "--only", "0.5b", "--import", f"1.5b={renamed}"])
    got = {p["point"]: p for p in json.loads(out.read_text())["points"]}
    assert list(got) == ["0.5b", "1.5b"]
    point = got["1.5b"]
    assert point["speedup"] == measured["speedup"] == 1.613
    assert point["sync_samples_per_s"] == measured["variants"]["sync"]["samples_per_s"]
    assert point["async_trainer_mfu"] == measured["variants"]["async"]["trainer_mfu"]
    assert (point["commit"], point["measured_at"]) == ("093f3cd", "2026-12-04T02:14:00Z")
    assert point["imported_from"] == str(renamed) and point["overrides"] == ["trainer.total_steps=10"]

    no_commit = tmp_path / "no_commit.json"
    no_commit.write_text(json.dumps({k: v for k, v in measured.items() if k != "commit"}))
    fixed512 = _as_new_recipe("benchmarks/results/async_vs_sync_h200x1_fixed512.json", "configs/bench_1.5b.yaml",
                              tmp_path)  # fmt: skip
    for argv, message in (
        (["--steps", "12", "--import", f"1.5b={renamed}"],
         r"--import 1.5b=\S+: overrides was \['trainer.total_steps=10'\], now \['trainer.total_steps=12'\]"),
        (["--steps", "10", "--import", f"3b={renamed}"],
         "config was 'configs/bench_1.5b.yaml', now 'configs/bench_3b.yaml'"),
        (["--steps", "10", "--import", f"1.5b={committed}"],
         "config was 'configs/bench_h200x1.yaml', now 'configs/bench_1.5b.yaml'"),
        (["--steps", "10", "--import", f"1.5b={no_commit}"], "it records no commit"),
        (["--import", f"1.5b={fixed512}"], "its sync run measured 20 steps, this point's would measure 18"),
        (["--steps", "10", "--import", "13b=x.json"], "give POINT=FILE with POINT one of 0.5b, 1.5b, 3b, 7b"),
    ):  # fmt: skip
        with pytest.raises(SystemExit, match=message):
            scaling.main([*common, *argv])


def test_no_run_writes_and_plots_the_kept_points(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`--no-run`: nothing is launched; the imported points come out in the axis's order, and
    `--plot` writes the report page (a PNG too where Chromium is found); without points to keep,
    or with --only, it is refused."""
    import json

    import benchmarks.scaling as scaling

    def run_point(*_: object, **__: object) -> None:
        raise AssertionError("--no-run launched a point")

    monkeypatch.setattr(scaling, "run_point", run_point)
    out, plots = tmp_path / "model.json", tmp_path / "plots"
    seven = _as_new_recipe("benchmarks/results/async_vs_sync_h200x1_7b.json", "configs/bench_7b.yaml", tmp_path)
    one_five = _as_new_recipe("benchmarks/results/async_vs_sync_h200x1.json", "configs/bench_1.5b.yaml", tmp_path)
    imports = ["--import", f"7b={seven}", "--import", f"1.5b={one_five}"]
    scaling.main(["--axis", "model", "--steps", "10", "--no-run", *imports, "--out", str(out), "--plot", str(plots)])
    result = json.loads(out.read_text())
    assert [p["point"] for p in result["points"]] == ["1.5b", "7b"]
    assert [p["speedup"] for p in result["points"]] == [1.613, 1.03]
    page = (plots / "scaling_model.html").read_text()
    assert "1.5b" in page and "7b" in page and Path(result["plot"]["html"]) == plots / "scaling_model.html"
    for argv in (["--no-run"], ["--no-run", "--only", "3b", *imports]):
        with pytest.raises(SystemExit, match="--no-run takes no --only, and needs --add-to or --import"):
            scaling.main(["--axis", "model", "--steps", "10", *argv])
