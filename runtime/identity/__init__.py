"""The run's identity: its directory and the names inside it, its secret, and where its
sockets live (importable without torch).

  run_dir.py    a run directory belongs to one run: refused, resumed or set aside
  paths.py      paths inside a run directory: the one place their names are spelled
  run_token.py  the run's secret, which every role presents to prove it belongs to the run
  addresses.py  ipc:// paths for one node, tcp:// for several, and socket policy
"""
