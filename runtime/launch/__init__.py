"""Launching a run: this node's role processes, where they run, in what order, and how the
run ends.

  launcher.py        `tandem launch`: checks, spawn, watch, tear down
  supervisor.py      the watch over the role processes, and how a run ends
  placement.py       which role processes a node runs, with their environment
  start_order.py     who builds first on a shared GPU
  multinode.py       node topology: torchrun-style flags, else Slurm, else one node
  options.py         the node topology a launcher runs with
  rendezvous.py      the ports a single-node launcher picks, held from its bind on
  env.py             the environment every role process starts with
  process_groups.py  which processes of a process group are still alive
  interruption.py    what the launcher says when a run is stopped from outside
"""
