"""The teacher role of on-policy distillation: a frozen model on vLLM that answers the
log-probability of every token of finished samples (roles/teacher/role.py)."""
