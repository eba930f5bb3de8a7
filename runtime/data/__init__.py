"""The prompt data: its files, its sources, and prompts as the run tokenizes them.

data_files.py       prompt data files (JSONL or Parquet): reading, and checking every row
task_sources.py     prompt rows of every `data.source` (file, synthetic, reasoning-gym, verifiers)
prompts.py          prompts as the run tokenizes them (one encoding for the dataset and the check)
verifiers_tasks.py  a verifiers environment as Tandem sees it
inputs.py           the model directory and prompt data, checked before any process starts
"""
