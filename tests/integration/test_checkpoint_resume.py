"""Crash and resume end to end on CPU: a run is SIGKILLed mid-way, its newest checkpoint is
corrupted, and `resume=auto` continues from the previous one with step, version and the
dataset cursor continuing without gaps; the exported HF directory loads in transformers
and in the rollout engine and gives the trainer's logprobs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from runtime.checkpoints.checkpoint import complete_dirs
from tests.conftest import ROOT
from tests.integration.test_launcher import wait_ready

pytestmark = pytest.mark.slow
STEPS = 16
BASE = ["configs/tiny_cpu.yaml", "checkpoint.every=4", "checkpoint.keep=0", f"trainer.total_steps={STEPS}"]


def tandem(*args: str) -> list[str]:
    return [sys.executable, "-m", "runtime.cli", *args]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def trained_history(run: Path) -> list[dict]:
    """The controller's `trained` events of the training that stands: the first run's up
    to the checkpoint the second resumed from, then all of the second's."""
    log = [json.loads(line) for line in (run / "logs" / "controller-0.jsonl").read_text().splitlines()]
    resumed = next(i for i, r in enumerate(log) if r["event"] == "resumed")
    first = [r for r in log[:resumed] if r["event"] == "trained" and r["step"] <= log[resumed]["step"]]
    return first + [r for r in log[resumed:] if r["event"] == "trained"]


def dropped_uids(run: Path, saved: set[int]) -> dict[int, str]:
    """uid -> drop reason of every prompt the training that stands dropped, from
    schedule.jsonl: the first run's drops before its checkpoint (groups below the resumed
    run's `next_g` and not among the `saved` gids), then every drop of the resumed run."""
    records = [json.loads(line) for line in (run / "schedule.jsonl").read_text().splitlines()]
    starts = [i for i, r in enumerate(records) if r["ev"] == "run"]
    assert len(starts) == 2, "one run record per launch"
    first, second = records[: starts[1]], records[starts[1] :]
    next_g = second[0]["next_g"]
    uid_of = {r["g"]: r["uid"] for r in first if r["ev"] == "admit" and r["g"] < next_g}
    drops = {uid_of[r["g"]]: r["why"] for r in first if r["ev"] == "drop" and r["g"] < next_g and r["g"] not in saved}
    uid_of |= {r["g"]: r["uid"] for r in second if r["ev"] == "admit"}
    return drops | {uid_of[r["g"]]: r["why"] for r in second if r["ev"] == "drop"}


def wait_for(predicate: Callable[[], bool], timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, "run ended early"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def crashed_and_resumed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict]:
    run = tmp_path_factory.mktemp("ckpt") / "run"
    proc = subprocess.Popen(
        tandem("launch", *BASE, f"run_dir={run}"), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        victim = wait_ready(run, "trainer-1", proc)
        wait_for(lambda: (run / "metrics.jsonl").exists() and len(metrics(run)) >= 10, 400, proc)
        os.kill(victim, signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    ckpts = complete_dirs(run / "checkpoints")
    assert [c.name for c in ckpts][:2] == ["step-00000004", "step-00000008"]
    newest, previous = ckpts[-1], ckpts[-2]
    before = json.loads((previous / "controller.json").read_text())
    (newest / "actor" / "extra-rank0.pt").write_bytes(b"torn write")  # the newest is now corrupt
    out = subprocess.run(
        tandem("launch", *BASE, f"run_dir={run}", "resume=auto"), cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return run, out.stdout, {"previous": previous, "newest": newest, "state": before}


def test_corrupt_newest_checkpoint_is_skipped_with_a_warning(crashed_and_resumed: tuple[Path, str, dict]) -> None:
    _, stdout, info = crashed_and_resumed
    assert f"skipping checkpoint {info['newest']}" in stdout
    assert f"resuming from {info['previous']}" in stdout


def test_a_resume_refuses_a_changed_group_size_or_batch_and_names_what_it_accepts(
    crashed_and_resumed: tuple[Path, str, dict],
) -> None:
    """`rollout.n=4` (or a smaller batch) on resume stalled with no log
    line until killed; a changed seed or staleness was taken without a word. The resume
    of the fixture itself (the same config) named no change."""
    run, stdout, _ = crashed_and_resumed
    assert "changed settings" not in stdout
    started = time.monotonic()
    refused = subprocess.run(
        tandem("launch", *BASE, f"run_dir={run}", "resume=auto", "rollout.n=4", "trainer.prompts_per_step=3"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    took = time.monotonic() - started
    line = refused.stderr.strip()
    assert refused.returncode == 2 and "\n" not in line, refused.stdout + refused.stderr
    assert "rollout.n 8 -> 4 (the group size)" in line and "trainer.prompts_per_step" in line and "(the batch)" in line
    assert took < 10, took  # nothing starts: the launcher's own start and the checkpoint's manifest
    accepted = subprocess.run(
        tandem("launch", *BASE, f"run_dir={run}", "resume=auto", "seed=7", "rollout.max_staleness=3"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr  # finished: nothing to train
    notes = [line for line in accepted.stdout.splitlines() if "changed settings" in line]
    assert len(notes) == 1 and "rollout.max_staleness" in notes[0] and "seed 0 -> 7" in notes[0], accepted.stdout


def test_step_version_and_cursor_continue_without_gaps(crashed_and_resumed: tuple[Path, str, dict]) -> None:
    run, _, info = crashed_and_resumed
    m = metrics(run)
    assert [r["step"] for r in m] == list(range(1, STEPS + 1))
    assert [r["policy_version"] for r in m] == list(range(1, STEPS + 1))
    final = json.loads((complete_dirs(run / "checkpoints")[-1] / "controller.json").read_text())
    assert final["ledger"]["step"] == STEPS
    resumed_from = info["state"]
    history = trained_history(run)
    assert [r["step"] for r in history] == list(range(1, STEPS + 1))
    uids = [u for r in history for u in r["uids"]]
    assert len(uids) == len(set(uids)) == STEPS * 8, "a prompt was trained twice"
    ledger = resumed_from["ledger"]
    saved = {g["gid"]: g["prompt"]["uid"] for g in ledger["pending"] + ledger["ready"]}
    assert saved, "the checkpoint was taken with prompts in flight"
    # A saved group leaves the resumed run trained or dropped under a recorded reason; the
    # only reason a tiny run meets is staleness (a saved ready group that waits a step
    # more is as stale as it would have been without the crash).
    drops = dropped_uids(run, set(saved))
    assert set(drops.values()) <= {"stale"}, drops
    accounted = set(uids) | set(drops)
    assert set(saved.values()) <= accounted, "prompts in flight at the checkpoint were lost"
    # Every prompt drawn before the checkpoint is trained or dropped; later ones continue the cursor.
    assert set(range(resumed_from["dataset"]["drawn"])) <= accounted
    assert final["dataset"]["drawn"] >= resumed_from["dataset"]["drawn"]


def test_export_loads_in_transformers_and_vllm_with_the_trainers_logprobs(
    crashed_and_resumed: tuple[Path, str, dict], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from roles.generation.engine import RolloutEngine
    from runtime.checkpoints.export import consolidate
    from runtime.config import EngineConfig
    from transport.wire import SamplingSpec

    run, _, _ = crashed_and_resumed
    out = subprocess.run(
        tandem("export", str(run), "--step", str(STEPS), str(tmp_path / "hf")), cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    trainer_dir = consolidate(
        run / "checkpoints" / f"step-{STEPS:08d}" / "actor", run / "model", tmp_path / "from-shards"
    )
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    trainer = AutoModelForCausalLM.from_pretrained(trainer_dir, dtype=torch.float32)
    ids = torch.tensor([[257, 117, 115, 101, 114, 10, 97, 98, 99, 100, 258, 10, 257, 97, 10, 99, 98, 100]])
    with torch.no_grad():
        lp_export = torch.log_softmax(exported(ids).logits, -1)
        lp_trainer = torch.log_softmax(trainer(ids).logits, -1)
    assert (lp_export - lp_trainer).abs().max() < 0.05  # the export is bf16, the trainer's master weights fp32

    async def vllm_logprobs() -> tuple[list[int], list[float]]:
        engine = RolloutEngine(EngineConfig(max_model_len=128, max_num_seqs=4), str(tmp_path / "hf"))
        await engine.start()
        try:
            s = await engine.generate("x", ids[0].tolist(), SamplingSpec(max_tokens=8, ignore_eos=True, seed=1))
        finally:
            await engine.shutdown()
        return s.token_ids, s.logprobs

    tokens, logprobs = asyncio.run(vllm_logprobs())
    full = torch.tensor([ids[0].tolist() + tokens])
    with torch.no_grad():
        ref = torch.log_softmax(trainer(full).logits[0, ids.shape[1] - 1 : -1].float(), -1)
    ref = ref.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert (torch.tensor(logprobs) - ref).abs().max() < 0.1
