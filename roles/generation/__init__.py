"""The vLLM engine the rollout (and the reward model's judge) generates with: its engine core
in the calling process, per-token policy versions, sleep and wake, LoRA adapters.

Modules:
* `engine`: The rollout's vLLM engine for RL rollouts: vLLM's engine core in this process,
  stepped by one thread (roles/generation/inproc.py), as vLLM's offline `LLM.generate` drives
  it.
* `errors`: The errors of the vLLM engine, one name per event: `EngineDeadError` (and
  `OutOfGpuMemory`, one of its causes), raised by the in-process engine core and the rollout's
  wrapper alike.
* `inproc`: vLLM's engine core in the rollout's own process, stepped by one thread, as vLLM's
  offline `LLM.generate` runs it with `VLLM_ENABLE_V1_MULTIPROCESSING=0`: no engine-core process
  between the role and the model, and one output per request (FINAL_ONLY) instead of one message
  per token.
"""
