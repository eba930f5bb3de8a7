"""Reward functions, the reward model and the judge: `reward.*`."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from runtime.config.algorithm import OverlongConfig
from runtime.config.base import STRUCT, Doc
from runtime.config.rollout import EngineConfig


class RewardModelConfig(msgspec.Struct, **STRUCT):
    """A sequence-classification reward model served by the `reward_model` role."""

    path: Annotated[
        str,
        Doc(
            description="HF `AutoModelForSequenceClassification` directory scoring (prompt, response); `tiny`: a "
            "random tiny classifier made under the run directory (tests, the CPU example); empty = none."
        ),
    ] = ""
    dtype: Annotated[Literal["bfloat16", "float16", "float32"], Doc(description="Dtype the model runs in.")] = (
        "bfloat16"
    )
    max_length: Annotated[
        int, Doc(description="Longest (prompt, response) in tokens; longer ones lose their start.", ge=2)
    ] = 1024
    batch_size: Annotated[int, Doc(description="Samples per forward pass.", ge=1)] = 8
    timeout_s: Annotated[
        float,
        Doc(description="Bound on scoring one request (a group); one over it scores its samples 0, as failed.", gt=0),
    ] = 60.0


DEFAULT_JUDGE_TEMPLATE = (  # one line, so docs/config.md's table holds it; YAML block scalars may span lines
    "Question: {prompt} -- Response: {response} -- Reference answer: {answer} -- "
    "Rate the response from 0 to 10; reply with the number only. Score:"
)


class JudgeConfig(msgspec.Struct, **STRUCT):
    """A generative judge: an LLM served by its own vLLM engine in the `reward_model` role."""

    model: Annotated[
        str, Doc(description="HF causal LM directory of the judge; empty = no judge (the classifier, if any).")
    ] = ""
    template: Annotated[
        str,
        Doc(
            description="The judge's prompt, with placeholders {prompt}, {response} and {answer} (str.format: write "
            "literal braces as {{ and }})."
        ),
    ] = DEFAULT_JUDGE_TEMPLATE
    chat_template: Annotated[
        bool, Doc(description="Send the filled template as a user message through the judge's chat template.")
    ] = True
    parser: Annotated[
        str,
        Doc(
            description="`module:function(text) -> float` reading the score from the judge's output (raise "
            "ValueError when there is none); the built-in reads a number, else yes (1) / no (0)."
        ),
    ] = "roles.reward.judge:parse_score"
    max_tokens: Annotated[int, Doc(description="Longest judge output in tokens.", ge=1)] = 16
    temperature: Annotated[float, Doc(description="Judge sampling temperature; 0 = greedy.", ge=0)] = 0.0
    top_p: Annotated[float, Doc(description="Judge nucleus sampling mass.", gt=0, le=1)] = 1.0
    timeout_s: Annotated[
        float, Doc(description="Bound on each judge generation; one over it scores 0, as failed.", gt=0)
    ] = 60.0
    engine: Annotated[EngineConfig, Doc(description="The judge's vLLM engine options.")] = msgspec.field(
        default_factory=EngineConfig
    )


class RewardConfig(msgspec.Struct, **STRUCT):
    functions: Annotated[
        list[str], Doc(description="Reward functions as `module:function`; the sample's reward is their sum.")
    ] = msgspec.field(default_factory=lambda: ["roles.reward.builtin:copy_task"])
    timeout_s: Annotated[
        float, Doc(description="Per-call timeout; a call that times out or raises scores 0.", gt=0)
    ] = 10.0
    concurrency: Annotated[
        int, Doc(description="Reward calls running at once per reward role (each in a worker process).", ge=1)
    ] = 16
    max_failure_fraction: Annotated[
        float,
        Doc(
            description="More than this fraction of a step's samples without a reward (a function raised, timed "
            "out or returned no number) ends the run, naming the function and the first error.",
            ge=0,
            le=1,
        ),
    ] = 0.5
    max_magnitude: Annotated[
        float,
        Doc(
            description="Largest |reward| a sample may get from one source (a reward function, the environment's "
            "sum, an agent's report); a larger one, or a NaN or infinity, scores 0 and counts as that source's "
            "failure (reason `out_of_range`, `env_out_of_range`), toward max_failure_fraction.",
            gt=0,
        ),
    ] = 1e6
    overlong: Annotated[OverlongConfig, Doc(description="Overlong reward shaping (DAPO).")] = msgspec.field(
        default_factory=OverlongConfig
    )
    function_weight: Annotated[
        float, Doc(description="Weight of the reward functions' sum in a sample's reward (the reward role).")
    ] = 1.0
    model_weight: Annotated[
        float, Doc(description="Weight of the reward model's (or judge's) score in a sample's reward.")
    ] = 1.0
    model: Annotated[
        RewardModelConfig, Doc(description="Sequence-classification reward model (the reward_model role).")
    ] = msgspec.field(default_factory=RewardModelConfig)
    judge: Annotated[JudgeConfig, Doc(description="Generative judge (the reward_model role).")] = msgspec.field(
        default_factory=JudgeConfig
    )
