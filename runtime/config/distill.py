"""On-policy distillation from a teacher role: `algorithm.distill.*`."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from runtime.config.base import STRUCT, Doc
from runtime.config.model import TinyModelConfig
from runtime.config.rollout import EngineConfig


class DistillConfig(msgspec.Struct, **STRUCT):
    """A teacher scores every sampled token; the student's per-token advantage is
    `coef * (log pi_teacher(t) - log pi_student(t))` (the negative reverse KL), with the
    student's log-probabilities the behaviour policy's the sample carries."""

    teacher: Annotated[
        str,
        Doc(
            description="HF causal LM directory of the teacher (same tokenizer as the policy), served by the `teacher` "
            "role on its own vLLM engine; `tiny`: a tiny teacher made under the run directory (`tiny` below); "
            "empty = no distillation."
        ),
    ] = ""
    coef: Annotated[
        float, Doc(description="Weight of the per-token reverse-KL advantage (verl/TRL's distillation coef).", gt=0)
    ] = 1.0
    reward: Annotated[
        Literal["replace", "add"],
        Doc(
            description="replace: the advantage is the distillation term alone (pure on-policy distillation; the task "
            "reward is still logged); add: it is added to the task reward's advantage (`algorithm.advantage`)."
        ),
    ] = "replace"
    timeout_s: Annotated[
        float,
        Doc(
            description="Bound on the teacher's pass over one request (a group); over it, the group's samples count "
            "as failed (reward.max_failure_fraction).",
            gt=0,
        ),
    ] = 60.0
    max_batched_tokens: Annotated[
        int,
        Doc(
            description="Most tokens the teacher's vLLM reads in one engine step (max_num_batched_tokens; at least "
            "engine.max_model_len + 1): its prompt log-probabilities take about tokens x vocabulary x 8 bytes of GPU "
            "memory beside its share while it scores (2.5 GB at 2048 with Qwen's 151936-token vocabulary).",
            ge=1,
        ),
    ] = 2048
    engine: Annotated[EngineConfig, Doc(description="The teacher's vLLM engine options.")] = msgspec.field(
        default_factory=EngineConfig
    )
    tiny: Annotated[
        TinyModelConfig,
        Doc(description="The tiny teacher's shape and seed (`teacher: tiny`; its vocabulary is the tiny policy's)."),
    ] = msgspec.field(default_factory=lambda: TinyModelConfig(seed=7))
    tiny_train_steps: Annotated[
        int,
        Doc(
            description="`teacher: tiny`: AdamW steps that teach it to prefer lowercase letters "
            "(runtime/tiny/teacher.py) before the run; 0 = a random teacher.",
            ge=0,
        ),
    ] = 30

    @property
    def enabled(self) -> bool:
        return bool(self.teacher)
