"""`tandem report`: one self-contained HTML page (plotly.js inlined) of a run's curves and its
schedule timeline, read from RUN_DIR/metrics.jsonl and RUN_DIR/schedule.jsonl.

load.py reads a run (finished, crashed or still writing), timeline.py turns the schedule
into spans, panels.py and gantt.py make the figures, page.py writes the HTML; build.py is
the command (`tandem report`), browser.py the headless Chromium that renders the page for
its PNGs and for the tests."""
