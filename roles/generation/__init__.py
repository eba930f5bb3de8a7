"""Library: the vLLM engine wrapper shared by the rollout role and the reward model's judge."""
