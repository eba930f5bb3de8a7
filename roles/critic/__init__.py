"""The critic role: `role` (`CriticRole`, typed against `ValueEngine`) and its two value-model
engines, `fsdp_engine` (`CriticEngine`, on `roles/fsdp`) and `megatron_engine`
(`MegatronCriticEngine`, on `roles/megatron`), which share the packed layout of
the values and their loss (`value_rows`)."""
