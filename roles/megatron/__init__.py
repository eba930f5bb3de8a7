"""The Megatron-core backend: what the Megatron actor and critic engines are built on.

Library (not a role). It holds the engine base with parallel state, DDP, optimizer, the
pipeline schedule and the one `train_step` both Megatron engines run (`engine_base`:
`MegatronEngineBase`, `gather_shards`); the GPTModel stages, value head and
vocabulary-parallel logprob / entropy math (`model`); the HF <-> Megatron weight mapping
and model dimensions (`convert`); a mixture of experts' routers routed as transformers'
with routing replay (`moe`); and per-rank checkpoints (`checkpoint`). megatron-core
itself is imported inside functions, so these modules import without it. It imports
`roles.training`, never a role. Modules are imported by name; this package re-exports nothing.
"""
