"""Launch-time checks of the machine and the environment, run by `tandem launch` (and its
`--plan`) after the config's own checks and before any role process starts.

  environment.py       `check_launch`: the config's checks, then packages, user functions, model
                       directories, GPUs present, the metrics loggers
  gpus.py              the GPUs a placement names exist on this node
  ecosystem.py         what comes from other projects: reasoning-gym, verifiers, math-verify, agents
  teacher.py           on-policy distillation's teacher: its tokenizer maps every id as the policy's does
  wandb_login.py       whether `metrics.wandb=true` can log in
  checkpoint_space.py  room for a checkpoint on the run directory's file system
"""
