"""The one builder of `wire.Completion` (a single-turn sample and a multi-turn episode alike):
the request's ids, the tokens, behaviour logprobs and per-token versions as the tensors the
wire carries (int64 / float32 / int32), and, for an episode, its loss mask (uint8), the
environment's reward and the number of turns; an MoE engine's routed experts as uint8
(int16 beyond 256 experts)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from transport import wire


def completion_message(
    req: wire.Generate,
    index: int,
    *,
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    versions: Sequence[int],
    finish_reason: wire.FinishReason,
    prompt_len: int,
    gen_s: float,
    error: str,
    loss_mask: Sequence[int] | None = None,
    env_reward: float | None = None,
    num_turns: int = 0,
    routed_experts: Any = None,
) -> wire.Completion:
    """Sample `index` of `req`; `loss_mask` None means every token was sampled (single turn)."""
    return wire.Completion(
        request_id=req.request_id,
        group_id=req.group_id,
        sample_index=index,
        token_ids=torch.tensor(token_ids, dtype=torch.int64),
        logprobs=torch.tensor(logprobs, dtype=torch.float32),
        versions=torch.tensor(versions, dtype=torch.int32),
        finish_reason=finish_reason,
        prompt_len=prompt_len,
        gen_s=gen_s,
        error=error,
        loss_mask=None if loss_mask is None else torch.tensor(loss_mask, dtype=torch.uint8),
        env_reward=env_reward,
        num_turns=num_turns,
        routed_experts=routing_tensor(routed_experts),
    )


def routing_tensor(routed: Any) -> torch.Tensor | None:
    """vLLM's routed experts ([N, layers, top_k], any integer array) in the wire's compact dtype."""
    if routed is None:
        return None
    t = torch.as_tensor(routed)
    small = t.numel() == 0 or int(t.max()) < 256
    return t.to(torch.uint8 if small else torch.int16).contiguous()
