"""The actor-trainer role: `role` (`TrainerRole`, typed against `PolicyEngine`) and its two
engines, `fsdp_engine` (`FSDPEngine`, on `roles/fsdp`) and `megatron_engine`
(`MegatronEngine`, on `roles/megatron`), which share the policy-loss options of `policy_loss`."""
