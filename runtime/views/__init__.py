"""What a person sees of a run: the launcher's console and the `tandem` views, each read from
the run directory (none imports `roles`).

  console.py        the launcher's console: readiness, warnings, errors, progress
  progress_line.py  the per-step progress line, fitted to the terminal
  startup.py        start-up progress: a line every 10 s while a vLLM engine starts
  summary.py        the end-of-run summary
  watch.py          `tandem watch`: a live terminal view of a run
  watch_state.py    what `tandem watch` shows, read incrementally from the run directory
  tail.py           `tandem tail`: every role's log merged by time
  logfollow.py      incremental reading of a run's JSON log files
  records.py        the boundary check of metrics.jsonl and schedule.jsonl records as the views read them
  wall_clock.py     the run's one wall clock, as the launcher, `tandem watch` and `tandem report` show it
  `report`          `tandem report`: one HTML page of a run's curves and schedule
"""
