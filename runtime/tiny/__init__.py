"""Tiny models made on the fly, so a run needs no download (`model.path=tiny`, the default).

model.py    a tiny random-initialised Qwen2 (or Qwen3-MoE) model and byte-level tokenizer
teacher.py  a tiny teacher for on-policy distillation on CPU, briefly trained
"""
