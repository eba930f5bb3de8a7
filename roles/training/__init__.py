"""Training code shared by the torch roles (the actor trainer and the critic).

Not a role: a library that `roles/trainer` and `roles/critic` both import, so neither
imports the other's internals. It holds FSDP2 wrapping (`fsdp`), the FSDP engine base
with its one `train_step` (`engine`), micro-batching (`microbatch`), metric reduction and
each engine kind's metric names (`metrics`), model loading (`models`), HF export and
weight buckets (`hf_export`), device / process-group set-up (`distributed`), checkpointed
RNG state (`rng`), and the base of the roles that run an engine on one torch thread
(`torch_role`). Modules are imported by name; this package re-exports nothing.
"""
