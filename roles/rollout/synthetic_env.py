"""The synthetic multi-turn task of `configs/multiturn_tiny_cpu.yaml`: copy with feedback.

The prompt is the copy task's (random distinct letters, `answer` = those letters). After
every turn but the last the environment answers with feedback: how many of the turn's
tokens were letters of the prompt, and the letters again (`\\nscore N/M, copy: abcdefgh\\n`),
so the next turn has them in the recent context. Only the last turn is rewarded: the
fraction of its tokens that are prompt letters (roles.reward.builtin.copy_task's rule;
the tiny tokenizer's ids are bytes). A random tiny model starts near 0.04 and learns it.
"""

from __future__ import annotations

from roles.rollout.environment import EnvPrompt, Step, Turn

TURNS = 2  # the turn after which the sample ends (rollout.max_turns should be at least this)


class CopyWithFeedback:
    def __init__(self, turns: int = TURNS) -> None:
        self.turns = turns
        self.letters = ""

    async def reset(self, prompt: EnvPrompt) -> None:
        self.letters = str(prompt.answer or "")

    async def step(self, turn: Turn) -> Step:
        allowed = {ord(c) for c in self.letters}
        hits = sum(1 for t in turn.token_ids if t in allowed)
        if turn.index + 1 >= self.turns:
            return Step(reward=hits / max(1, len(turn.token_ids)), done=True)
        return Step(observation=f"\nscore {hits}/{len(turn.token_ids)}, copy: {self.letters}\n")


def factory() -> CopyWithFeedback:
    return CopyWithFeedback()
