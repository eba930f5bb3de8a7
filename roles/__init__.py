"""What each process of a run does: the role packages (a `role.py` each: controller, rollout,
trainer, critic, reward) and the libraries they share (algo, training, fsdp, megatron,
kernels, weights, generation). A role package imports the libraries, `runtime` and
`transport`, never another role (tests/unit/project/test_layering.py).

Packages:
* `algo`: RL math as pure torch functions: advantages, GAE, KL estimators and PPO-style losses.
* `controller`: The controller role: the run's one CPU process, which admits prompts, dispatches
  them to the rollouts, scores the samples, builds each training step and checkpoints the run.
* `critic`: The critic role: `role` (`CriticRole`, typed against `ValueEngine`) and its two
  value-model engines, `fsdp_engine` (`CriticEngine`, on `roles/fsdp`) and `megatron_engine`
  (`MegatronCriticEngine`, on `roles/megatron`), which share the packed layout of the values
  (`value_rows`).
* `fsdp`: The FSDP2 backend: what the FSDP actor and critic engines are built on.
* `generation`: The vLLM engine the rollout (and the reward model's judge) generates with: its
  engine core in the calling process, per-token policy versions, sleep and wake, LoRA adapters.
* `kernels`: Kernels the FSDP actor's forward and backward may run instead of plain torch ops.
* `megatron`: The Megatron-core backend: what the Megatron actor and critic engines are built
  on.
* `reward`: The reward roles: rule functions (`reward.functions`) run in worker processes, and
  the reward-model role (a classifier or a generative judge).
* `rollout`: The rollout role: generation on one vLLM engine, single-turn samples, multi-turn
  episodes against an environment, and agents that own their loop through the OpenAI-compatible
  endpoint.
* `teacher`: The teacher role of on-policy distillation: a frozen model on vLLM that answers the
  log-probability of every token of finished samples.
* `trainer`: The actor-trainer role: `role` (`TrainerRole`, typed against `PolicyEngine`) and
  its two engines, `fsdp_engine` (`FSDPEngine`, on `roles/fsdp`) and `megatron_engine`
  (`MegatronEngine`, on `roles/megatron`), which share the policy-loss options of `policy_loss`.
* `training`: Training code both torch roles (the actor trainer and the critic) share, whichever
  backend.
* `weights`: The weight path, both sides: trainer rank 0 packs and sends each policy version,
  the rollouts receive and load it into vLLM (ipc, nccl or zmq backends; LoRA adapters).
"""
