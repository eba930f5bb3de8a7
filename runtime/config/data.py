"""The prompt dataset: `data.*`, with its Reasoning Gym and verifiers sources."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from runtime.config.base import STRUCT, Doc


class ReasoningGymConfig(msgspec.Struct, **STRUCT):
    """`data.source: reasoning_gym`: prompts drawn from a reasoning-gym task (docs/ecosystem.md)."""

    task: Annotated[
        str, Doc(description="The reasoning-gym dataset name (`basic_arithmetic`, `leg_counting`, `composite`, ...).")
    ] = ""
    config: Annotated[
        dict[str, Any], Doc(description="The task's own config fields (reasoning-gym's `create_dataset` keywords).")
    ] = {}
    size: Annotated[
        int, Doc(description="Rows of the task, made from the run's `seed`; epochs reshuffle them.", ge=1)
    ] = 10000
    system_prompt: Annotated[
        str,
        Doc(
            description="A reasoning-gym system prompt by name (`default` asks for `<answer>` tags, which its scorer "
            "reads), or empty for none."
        ),
    ] = "default"


class VerifiersConfig(msgspec.Struct, **STRUCT):
    """`data.source: verifiers`: an installed verifiers environment as data, episodes and rubric."""

    id: Annotated[
        str, Doc(description="The verifiers environment: the id of an installed taskset (`my-env`, `owner/my-env`).")
    ] = ""
    args: Annotated[dict[str, Any], Doc(description="The taskset's config fields (verifiers' `--env.taskset.*`).")] = {}
    env: Annotated[
        dict[str, Any],
        Doc(
            description="The rest of verifiers' env config (`--env.*`: `id` of a paired Env, the `agent` seat's "
            "`harness` and `runtime`, `timeout`, ...)."
        ),
    ] = {}


class DataConfig(msgspec.Struct, **STRUCT):
    source: Annotated[
        Literal["synthetic", "file", "reasoning_gym", "verifiers"],
        Doc(
            description="`synthetic`: the built-in copy task; `file`: JSONL or Parquet at `path`; `reasoning_gym`: "
            "a reasoning-gym task (`data.reasoning_gym`); `verifiers`: a verifiers environment's taskset, its "
            "episodes and rubric (`data.verifiers`, docs/ecosystem.md)."
        ),
    ] = "synthetic"
    path: Annotated[str, Doc(description="Prompt file (JSONL or Parquet) when `source: file`.")] = ""
    prompt_key: Annotated[str, Doc(description="Field holding the prompt text (or a list of chat messages).")] = (
        "prompt"
    )
    answer_key: Annotated[str, Doc(description="Field holding the reference answer given to reward functions.")] = (
        "answer"
    )
    chat_template: Annotated[bool, Doc(description="Apply the tokenizer's chat template when it has one.")] = True
    system_prompt: Annotated[
        str, Doc(description="Optional system message put before each prompt (chat template only).")
    ] = ""
    max_prompt_tokens: Annotated[int, Doc(description="Prompts longer than this are skipped (counted in metrics).")] = (
        512
    )
    max_row_bytes: Annotated[
        int,
        Doc(
            description="Longest row of a data file in bytes (a JSONL line, a Parquet row's text): a longer one "
            "is refused at launch naming the file and line, without reading more of it than this.",
            ge=1024,
        ),
    ] = 1048576
    shuffle: Annotated[bool, Doc(description="Shuffle the dataset each epoch (seeded by `seed`).")] = True
    synthetic_num_prompts: Annotated[int, Doc(description="Size of the synthetic dataset.")] = 4096
    synthetic_prompt_len: Annotated[int, Doc(description="Letters per synthetic prompt.")] = 8
    render_prompt: Annotated[
        bool,
        Doc(
            description="false: the controller sends no prompt tokens and the prompt's messages go to the rollout's "
            "agent (`rollout.agent`, a verifiers environment), which renders its own; the sample then begins with "
            "the agent's first request (loss mask 0)."
        ),
    ] = True
    reasoning_gym: Annotated[ReasoningGymConfig, Doc(description="The reasoning-gym task.")] = msgspec.field(
        default_factory=ReasoningGymConfig
    )
    verifiers: Annotated[VerifiersConfig, Doc(description="The verifiers environment.")] = msgspec.field(
        default_factory=VerifiersConfig
    )
