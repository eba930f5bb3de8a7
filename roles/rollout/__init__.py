"""The rollout role: generation on one vLLM engine, single-turn samples, multi-turn episodes
against an environment, and agents that own their loop through the OpenAI-compatible endpoint.

Modules:
* `agent_episode`: One agent episode's record: every model call the agent made, token in, token
  out.
* `agents`: Agents that own their loop (`rollout.agent: module:function`, or a verifiers
  environment): one episode per sample, driven through the rollout's OpenAI-compatible endpoint.
* `chat_render`: Chat templating and tool-call parsing for the OpenAI-compatible endpoint, done
  with vLLM's own server code so a request renders as `vllm serve` would render it for the
  model.
* `completion`: The one builder of `wire.Completion` (a single-turn sample and a multi-turn
  episode alike): the request's ids, the tokens, behaviour logprobs and per-token versions as
  the tensors the wire carries (int64 / float32 / int32), and, for an episode, its loss mask
  (uint8), the environment's reward and the number of turns.
* `env_thread`: Where an environment's code runs: a thread of its own per sample, never the
  rollout's event loop.
* `environment`: The environment API of multi-turn rollouts (`rollout.env: module:factory`).
* `episode`: The multi-turn loop: one sample's turns against its environment, token in, token
  out.
* `example_agent`: An agent that owns its loop, written against the `openai` client as any agent
  is (`rollout.agent: roles.rollout.example_agent:calculator_agent`, docs/ecosystem.md).
* `http_guard`: Slow clients on the endpoint: a connection holds a descriptor only while it
  makes progress.
* `multiturn`: The rollout's side of `rollout.env`: one environment per sample, its episode run
  on the role's engine, the trajectory sent back as one `wire.Completion`.
* `openai_calls`: `/v1/chat/completions` and `/v1/completions` bodies against one agent episode,
  with vLLM's own request and response models (so validation errors and the reply's shape are
  vLLM's).
* `openai_server`: The rollout's OpenAI-compatible endpoint: agents that own their loop call it
  as they would call `vllm serve`, and every call lands, token-exact, in the episode it names.
* `role`: The rollout role: serves generate requests from the controller on one vLLM engine and
  applies weight updates from the trainer in place.
* `sandbox`: The built-in sandboxed Python executor tool (`rollout.tools:
  [roles.rollout.sandbox:python]`).
* `sandbox_boot`: The sandbox's bootstrap: `python -I -B sandbox_boot.py CPU_S MEM_MB FILE_MB
  FILES PROCS CODE` (standard library only; roles/rollout/sandbox.py runs it).
* `sleepy_tool_env`: The environment of configs/multiturn_tool_sleep_cpu.yaml: a multi-turn task
  whose every observation comes from a slow tool, for the async-vs-sync benchmark
  (BENCHMARKS.md).
* `synthetic_env`: The synthetic multi-turn task of `configs/multiturn_tiny_cpu.yaml`: copy with
  feedback.
* `tool_env`: The built-in tool-using environment (`rollout.env:
  roles.rollout.tool_env:factory`).
* `tools`: Tools for multi-turn environments: Hermes / Qwen2.5 tool-call parsing, a registry of
  Python tools (`rollout.tools: [module:function]`), and the built-in calculator.
* `verifiers_env`: A verifiers environment (`data.source: verifiers`) run unchanged as the
  rollout's agent.
"""
