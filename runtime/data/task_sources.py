"""Prompt rows of every `data.source`, for the controller's dataset and the launcher's check.

`source_rows(cfg, seed)` is a sequence of row dicts (`prompt`, `answer`, other fields go
to reward functions and environments as `metadata`):
* `synthetic`, `file`: the copy task (`synthetic_rows`), a JSONL / Parquet file (data_files.py).
* `reasoning_gym`: row i is item i of the reasoning-gym task made with the run's seed
  (reasoning-gym makes item i from `seed + i` alone), built when first read: the same
  seed gives the same rows, so the dataset's cursor (epoch, position) resumes exactly.
  `prompt` is the question (after the task's system prompt), `answer` the task's, and
  `metadata.reasoning_gym` what its scorer needs (roles/reward/reasoning_gym.py).
* `verifiers`: the tasks of the verifiers environment's taskset, in its order; `prompt`
  is the task's messages and `metadata.verifiers_task` its data, from which the rollout
  rebuilds the task (roles/rollout/verifiers_env.py).
"""

from __future__ import annotations

import itertools
import json
import random
import string
from collections.abc import Sequence
from typing import Any

from runtime.config import DataConfig
from runtime.data.data_files import read_rows

MAX_VERIFIERS_TASKS = 100_000  # an infinite taskset is read this far


def synthetic_rows(cfg: DataConfig, seed: int) -> list[dict[str, Any]]:
    """The copy task: prompts of random distinct lowercase letters; see reward builtin copy_task."""
    rng = random.Random(seed)
    rows = []
    for _ in range(cfg.synthetic_num_prompts):
        letters = "".join(rng.sample(string.ascii_lowercase, cfg.synthetic_prompt_len))
        rows.append({"prompt": letters, "answer": letters, "task": "copy"})
    return rows


def source_rows(cfg: DataConfig, seed: int) -> Sequence[dict[str, Any]]:
    if cfg.source == "synthetic":
        return synthetic_rows(cfg, seed)
    if cfg.source == "reasoning_gym":
        return ReasoningGymRows(cfg, seed)
    if cfg.source == "verifiers":
        return verifiers_rows(cfg)
    return read_rows(cfg.path, cfg.prompt_key, max_row_bytes=cfg.max_row_bytes)


class ReasoningGymRows(Sequence[dict[str, Any]]):
    """The rows of a reasoning-gym task, each made when first read (see the module docs)."""

    def __init__(self, cfg: DataConfig, seed: int) -> None:
        import reasoning_gym
        from reasoning_gym.utils import SYSTEM_PROMPTS

        rg = cfg.reasoning_gym
        if rg.system_prompt and rg.system_prompt not in SYSTEM_PROMPTS:
            raise ValueError(
                f"data.reasoning_gym.system_prompt '{rg.system_prompt}' is not one of reasoning-gym's "
                f"({', '.join(sorted(SYSTEM_PROMPTS))}), or empty"
            )
        self.system = SYSTEM_PROMPTS[rg.system_prompt] if rg.system_prompt else ""
        self.dataset = reasoning_gym.create_dataset(rg.task, seed=seed, size=rg.size, **rg.config)
        self.size = rg.size
        self._rows: dict[int, dict[str, Any]] = {}

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self.size))]
        if i < 0:
            i += self.size
        if i not in self._rows:
            self._rows[i] = self._row(self.dataset[i])
        return self._rows[i]

    def _row(self, entry: dict[str, Any]) -> dict[str, Any]:
        meta = _plain(entry.get("metadata") or {})
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": entry["question"]})
        scorer = {"dataset": meta.get("source_dataset", ""), "question": entry["question"], "entry": meta}
        return {"prompt": messages, "answer": entry["answer"], "reasoning_gym": scorer}


def verifiers_rows(cfg: DataConfig) -> list[dict[str, Any]]:
    """The verifiers taskset's tasks as rows (see the module docs)."""
    from runtime.data.verifiers_tasks import load_taskset, task_messages

    taskset = load_taskset(cfg.verifiers)
    rows = []
    for task in itertools.islice(taskset, MAX_VERIFIERS_TASKS):
        data = task.data.model_dump(mode="json")
        rows.append({"prompt": task_messages(task.data), "answer": data.get("answer"), "verifiers_task": data})
    if not rows:
        raise ValueError(f"data.verifiers.id '{cfg.verifiers.id}': the taskset yields no task")
    return rows


def _plain(value: Any) -> Any:
    """JSON values only (tuples become lists, anything else its text), so the row travels
    on the wire and reaches the scorer as reasoning-gym made it, up to those types."""
    return json.loads(json.dumps(value, default=lambda v: list(v) if isinstance(v, set | frozenset) else str(v)))
