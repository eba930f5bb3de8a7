"""A Megatron checkpoint resumes only with the layout it was saved with: the launcher reads
`actor/megatron-layout.json` (and the critic's) before any process starts and refuses
another TP / PP / world size, or a checkpoint an FSDP engine wrote, in one line (the
`tandem launch` refusal needs a GPU node: tests/gpu/test_megatron_single.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.checkpoints import checkpoint
from runtime.checkpoints.layout import LAYOUT_FILE, check_resume_layout, configured_layouts
from runtime.config.load import load_config
from tests.conftest import ROOT

MEGATRON = ["trainer.backend=megatron", "trainer.device=cuda", "fsdp.use_fsdp=false"]


def fake_checkpoint(run_dir: Path, actor_layout: dict[str, int] | None, step: int = 4) -> Path:
    """A committed checkpoint with every part a run needs; the actor part as a Megatron
    engine writes it (layout file and a rank file) or, with no layout, as FSDP's."""
    tmp = checkpoint.begin(run_dir, step)
    (tmp / "controller.json").write_text("{}")
    (tmp / "actor").mkdir()
    if actor_layout is None:
        (tmp / "actor" / "extra-rank0.pt").write_bytes(b"fsdp")
    else:
        (tmp / "actor" / LAYOUT_FILE).write_text(json.dumps(actor_layout))
        (tmp / "actor" / "megatron-rank0.pt").write_bytes(b"shard")
    (tmp / "hf").mkdir()
    (tmp / "hf" / "config.json").write_text("{}")
    return checkpoint.commit(tmp, step, {"version": step})


def test_the_same_layout_resumes_and_another_is_named(tmp_path: Path) -> None:
    ckpt = fake_checkpoint(tmp_path, {"tp": 2, "pp": 1, "world_size": 2})
    same = load_config(None, [*MEGATRON, "trainer.megatron.tensor_model_parallel_size=2"])
    assert configured_layouts(same) == {"actor": {"tp": 2, "pp": 1, "world_size": 2}}
    check_resume_layout(ckpt, same)
    other = load_config(None, [*MEGATRON, "trainer.megatron.pipeline_model_parallel_size=2"])
    with pytest.raises(ValueError, match=r"saved with TP=2 PP=1 world size 2, this run has TP=1 PP=2 world size 2"):
        check_resume_layout(ckpt, other)


def test_an_fsdp_checkpoint_is_not_resumed_by_megatron_and_fsdp_runs_are_not_checked(tmp_path: Path) -> None:
    ckpt = fake_checkpoint(tmp_path, None)
    with pytest.raises(ValueError, match=r"has no megatron-layout\.json \(not saved by a Megatron engine\)"):
        check_resume_layout(ckpt, load_config(None, MEGATRON))
    check_resume_layout(ckpt, load_config(None, []))  # FSDP2 actor: nothing to check


def test_the_critic_part_is_checked_too(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "configs" / "ppo_hybridflow.yaml", ["critic.backend=megatron", "trainer.device=cuda"])
    assert configured_layouts(cfg) == {"critic": {"tp": 1, "pp": 1, "world_size": 1}}
    ckpt = fake_checkpoint(tmp_path, None)
    with pytest.raises(ValueError, match=r"critic has no megatron-layout\.json"):
        check_resume_layout(ckpt, cfg)


def test_adam_steps_are_set_aside_for_megatrons_parameter_state_load() -> None:
    """megatron's `load_parameter_state` copies every key of each param's optimizer state
    from a file that has no `step` (torch's Adam keeps one): the helper hides the steps for
    the load and puts them back, also when the load fails."""
    from types import SimpleNamespace

    import torch

    from roles.megatron.checkpoint import _steps_set_aside

    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    adam = torch.optim.AdamW(params, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    adam.step()
    adam.step()
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=adam)])
    with _steps_set_aside(chained):
        assert all("step" not in adam.state[p] and "exp_avg" in adam.state[p] for p in params)
    assert [float(adam.state[p]["step"]) for p in params] == [2.0, 2.0]
    try:
        with _steps_set_aside(chained):
            raise RuntimeError("load failed")
    except RuntimeError:
        pass
    assert all(float(adam.state[p]["step"]) == 2.0 for p in params)


def test_a_step_tensor_shared_by_every_parameter_is_split_so_adam_counts_each_once() -> None:
    """megatron's distributed `load_state_dict` hands every parameter one shared step tensor;
    torch's Adam increments each parameter's step in place, so shared it would advance once
    per parameter (and the bias correction would drift): after the helper each has its own."""
    from types import SimpleNamespace

    import torch

    from roles.megatron.checkpoint import _steps_set_aside

    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    adam = torch.optim.AdamW(params, lr=0.1, foreach=False)
    for p in params:
        p.grad = torch.ones_like(p)
    adam.step()
    shared = torch.tensor(1.0)
    for p in params:
        adam.state[p]["step"] = shared  # as megatron's load_state_dict leaves it
    with _steps_set_aside(SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=adam)])):
        pass
    adam.step()
    assert [float(adam.state[p]["step"]) for p in params] == [2.0, 2.0]
