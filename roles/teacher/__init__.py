"""The teacher role of on-policy distillation: a frozen model on vLLM that answers the
log-probability of every token of finished samples.

Modules:
* `role`: `TeacherRole`, the process: serves scoring requests from the controller.
* `scorer`: Teacher log-probabilities of given tokens on vLLM (`prompt_logprobs` of one prefill
  per sample; the teacher never samples).
"""
