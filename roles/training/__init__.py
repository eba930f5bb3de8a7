"""Training code both torch roles (the actor trainer and the critic) share, whichever backend.

Not a role, and neither FSDP nor Megatron: a library that `roles/trainer`, `roles/critic`
and the backend libraries `roles/fsdp` and `roles/megatron` import. It holds the engine
protocols the roles are typed against (`train_engine`: `TrainEngine`, `PolicyEngine`,
`ValueEngine`), the base of the roles that run an engine on one torch thread
(`torch_role`), micro-batching (`microbatch`, with length-balanced bins in `balance`),
seeded PPO mini-batches (`minibatch`), metric reduction and each engine kind's metric
names (`metrics`), HF model loading (`hf_loading`), PEFT LoRA adapters (`peft_lora`), HF export
(`hf_export`), mixture-of-experts routing replay and expert weight names (`moe`),
device / process-group set-up (`distributed`) and checkpointed RNG state
(`rng`). It imports no backend library. Modules are imported by name; this package
re-exports nothing.
"""
