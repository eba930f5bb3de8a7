"""The reward roles: rule functions (`reward.functions`) run in worker processes, and the
reward-model role (a classifier or a generative judge).

Modules:
* `builtin`: Built-in reward functions (`roles.reward.builtin:NAME` in `reward.functions`).
* `classifier`: A sequence-classification reward model: (prompt, response) text in, one scalar
  out.
* `judge`: A generative judge: an LLM on its own vLLM engine reads a filled prompt template and
  its output is parsed into a score.
* `math_verify`: A math reward built on HuggingFace's `math-verify`
  (`roles.reward.math_verify:math_equal`), beside the GSM8K exact match of
  roles/reward/builtin.py (the `math` extra installs it).
* `model_role`: The reward_model role: scores completions with a reward model or a generative
  judge.
* `reasoning_gym`: reasoning-gym's own scorers as a reward (`roles.reward.reasoning_gym:score`),
  for `data.source: reasoning_gym` (runtime/data/task_sources.py puts what they need in each row).
* `role`: The reward role: scores completions with the configured functions (see runner.py).
* `runner`: Runs reward functions named `module:function` with bounded concurrency and a
  timeout.
* `workers`: User reward functions run in worker processes, never in the reward role's own.
"""
