"""What a person sees: the `tandem` command and the views of a run, each read from the run
directory (none imports `roles`).

  cli.py            the `tandem` command (subcommands import their heavy modules lazily)
  console.py        the launcher's console: readiness, warnings, errors, progress
  progress_line.py  the per-step progress line, fitted to the terminal
  startup.py        start-up progress: a line every 10 s while a vLLM engine starts
  summary.py        the end-of-run summary
  watch.py          `tandem watch`: a live terminal view of a run
  watch_state.py    what `tandem watch` shows, read incrementally from the run directory
  tail.py           `tandem tail`: every role's log merged by time
  logfollow.py      incremental reading of a run's JSON log files
  `report`          `tandem report`: one HTML page of a run's curves and schedule
"""
