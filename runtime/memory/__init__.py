"""GPU and host memory: estimated from the config before launch, and explained after an
out-of-memory error.

  estimate.py  what one role process holds in GPU and host memory, from the config alone
  plan.py      the launch-time plan: what every GPU and host will hold, and whether it fits
  auto.py      `auto` settings: the fastest combination that fits this machine's GPUs
  step_time.py the trainer's step time the plan prints, from the config and named assumptions
  gpu.py       one-line causes for running out of GPU memory, and what the GPUs hold now
"""
