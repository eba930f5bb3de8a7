"""Environment tokens of a multi-turn sample contribute zero gradient: a multi-turn group
goes through the controller's packing (roles/controller/batching.py) into the real FSDP2
actor's loss (one gloo rank, tiny Qwen2), and a hook on the logits' gradient shows that
every position predicting an observation token gets exactly zero, while the positions
predicting sampled tokens do not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from roles.controller.batching import build_train_batches
from roles.controller.dataset import Prompt
from roles.controller.groups import Group, SampleRec
from roles.trainer.fsdp_engine import FSDPEngine
from runtime.config.load import load_config
from tests.helpers.one_rank import one_rank_world
from transport.wire import FinishReason

PROMPT = [5, 6, 7]
# Sampled, observation, sampled, observation, sampled.
MASKS = [[1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 1], [1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1]]


@pytest.fixture(scope="module", autouse=True)
def _one_rank_world() -> None:
    one_rank_world()


def _group() -> Group:
    g = torch.Generator().manual_seed(0)
    group = Group(
        gid=0, prompt=Prompt(uid=0, row=0, prompt_ids=PROMPT, text="abc"), n=2, request_id="r", admitted_version=0
    )
    for i, mask in enumerate(MASKS):
        m = torch.tensor(mask, dtype=torch.uint8)
        group.samples[i] = SampleRec(
            index=i, token_ids=torch.randint(3, 200, (len(mask),), generator=g),
            logprobs=torch.where(m.bool(), -torch.rand(len(mask), generator=g), 0.0),
            versions=torch.zeros(len(mask), dtype=torch.int32), finish_reason=FinishReason.STOP,
            reward=float(i), loss_mask=m,
        )  # fmt: skip
    return group


def test_observation_tokens_get_zero_gradient(tiny_model_dir: Path) -> None:
    # The padded path with full logits, whose gradient the hook can see per position; the
    # packed and chunked paths equal it in gradient (tests/integration/test_packing.py).
    overrides = [
        "trainer.device=cpu", "fsdp.param_dtype=float32", "trainer.loss.entropy_coef=0.01",
        "trainer.packing=false", "trainer.logprob_chunk_tokens=0",
    ]  # fmt: skip
    engine = FSDPEngine(load_config(None, overrides), tiny_model_dir)
    (batch,), stats = build_train_batches([_group()], step=0, advantage="grpo", norm_by_std=True, num_shards=1)
    assert batch.global_num_tokens == stats.num_response_tokens == sum(map(sum, MASKS))
    assert batch.loss_mask.tolist() == [float(x) for x in [0, 0, 0, *MASKS[0], 0, 0, 0, *MASKS[1]]]
    assert (batch.advantages != 0).sum() > batch.loss_mask.sum()  # observation tokens carry advantages too

    grads: list[torch.Tensor] = []

    def keep_grad(module: Any, inputs: Any, logits: torch.Tensor) -> None:
        logits.register_hook(lambda g: grads.append(g.detach().clone()))

    hook = engine.model.get_output_embeddings().register_forward_hook(keep_grad)
    (mb,) = engine.micro_batches(batch, 4096)
    loss, _ = engine.loss(mb, batch, engine.forward(engine.model, mb))
    loss.backward()
    hook.remove()

    (grad_BTV,) = grads
    per_position_BT = grad_BTV.abs().sum(-1)[:, :-1]  # position t predicts token t+1
    target_mask_BT = mb.fields["loss_mask"][:, 1:]
    assert torch.all(per_position_BT[target_mask_BT == 0] == 0)
    assert torch.all(per_position_BT[target_mask_BT == 1] > 0)
