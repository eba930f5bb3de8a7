"""The FSDP2 backend: what the FSDP actor and critic engines are built on.

Library (not a role). It holds the engine base with the one `train_step` every FSDP
engine runs, its AdamW, micro-batches kept in step across ranks and sharded checkpoints
(`engine_base`: `FSDPEngineBase`); FSDP2 wrapping, gradient sync and the loss-scaling rule
(`wrap`); host offload of the optimizer's moments and of parameters between steps
(`offload`); and the HF actor's forward to per-token logprobs and entropy, with its
attention and block kernels put in (`actor_forward`). It imports `roles.training`,
`roles.kernels` and `roles.algo`, never a role. Modules are imported by name; this package re-exports nothing.
"""
