"""How a run's processes live: config, launch, memory plan, the Role base, logs, checkpoints,
the run directory, and the views a person reads (cli, console, watch, tail, report).

Modules:
* `addresses`: Where sockets live: ipc:// paths for one node, tcp:// for several, and socket
  policy.
* `base_model`: The identity of a run's base model, recorded in every checkpoint's manifest.
* `checkpoint`: Checkpoint directories: atomic commit, validation, discovery for `resume=auto`.
* `checkpoint_layout`: The parallel layout a Megatron checkpoint was saved with, checked before
  a resume.
* `checkpoint_space`: Room for a checkpoint, checked before a run starts: a run that can never
  save is refused at launch (one line, exit 2) rather than at its first save.
* `data_files`: Prompt data files (JSONL or Parquet): reading, and checking every row before a
  run starts.
* `ecosystem`: Launch checks of what comes from other projects: reasoning-gym tasks, verifiers
  environments, math-verify rewards and agents with their own loop (docs/ecosystem.md).
* `entry`: Entry point of one role process: `python -m runtime.entry --run-dir D --role R --rank
  N`.
* `errors`: The project's one error root, and how an exception is told in one line.
* `export`: `tandem export RUN_DIR [--step N] [--merge] OUT_DIR`: a checkpoint's policy as an HF
  directory.
* `gc_pauses`: Garbage-collector pauses in a role process: keep them short, and say when one is
  long.
* `gpu_check`: GPU placement checks: requested GPUs exist, and the processes sharing a GPU fit
  in it.
* `hf_quiet`: transformers without its progress bars: `Writing model shards` and `Loading
  weights` are tqdm bars on stderr, noise around a one-line CLI (`tandem launch` making the tiny
  model, `tandem export --merge`) and in a log file.
* `inputs`: The run's inputs, checked before any process starts (in well under 2 s, without
  torch): the model directory and the prompt data.
* `last_words`: A role's cause of death, told to its launcher through a pipe rather than the
  disk (which may be what failed: a full disk ends a role with nothing in its log).
* `logs`: Structured JSON logs: one file per role process, one JSON object per line.
* `lora`: What a run with `trainer.lora` means for its roles' settings (no torch, no vLLM here).
* `paths`: Paths inside a run directory (importable without torch): the one place their names
  are spelled.
* `prompts`: Prompts as the run tokenizes them, shared by the controller's dataset and the
  launcher's check (one encoding, so both count the same tokens).
* `records`: The boundary check of the records a run writes, as `tandem report` and `tandem
  watch` read them back (metrics.jsonl, schedule.jsonl): a record they use has the types its
  writers give it (runtime/views/report, runtime/views/watch_state.py trust what passes).
* `resume_settings`: The settings a checkpoint was saved with, compared with a resume's before
  anything starts.
* `role`: The base every role process subclasses.
* `run_dir`: A run directory belongs to one run.
* `run_token`: The run's secret: what every role presents to prove it belongs to this run.
* `seeds`: Seeds derived from a run's seed: what a seeded run draws is a pure function of its
  labelled parts, never of timing or order.
* `step_phases`: A training step's phases, from the times the controller saw: when the rollouts
  woke, generated and the batch was scored, when vLLM slept, the trainer trained and pushed the
  new weights, and the glue: the time in the step that no phase covers.
* `task_sources`: Prompt rows of every `data.source`, for the controller's dataset and the
  launcher's check.
* `teacher_check`: Launch checks of on-policy distillation's teacher: its tokenizer maps every
  id as the policy's does.
* `tiny_model`: A tiny random-initialised Qwen2 (or Qwen3-MoE) model and byte-level tokenizer, made on the fly.
* `tiny_teacher`: A tiny teacher for on-policy distillation on CPU, made on the fly and briefly
  trained (`algorithm.distill.teacher: tiny`).
* `user_functions`: User functions named `module:function` (reward functions, multi-turn
  environment factories, tools): loading them and checking, before anything starts, that they
  can be called as the roles call them.
* `verifiers_tasks`: A verifiers (>= 0.4, `verifiers.v1`) environment as Tandem sees it, shared
  by the controller (its tasks are the dataset), the rollout (its episodes) and the launch
  check.
* `wandb_login`: Whether `metrics.wandb=true` can log in, asked at launch before any role
  starts.
* `wall_clock`: The run's one wall clock: what `tandem launch` (progress line and end summary),
  `tandem watch` and `tandem report` show as `wall 5m27s`.

Packages:
* `config`: The run configuration: typed msgspec Structs, loaded from YAML plus dotted
  overrides.
* `launch`: Launching a run: this node's role processes, where they run, in what order, and how
  the run ends.
* `memory`: GPU and host memory: estimated from the config before launch, and explained after an
  out-of-memory error.
* `views`: What a person sees: the `tandem` command and the views of a run, each read from the
  run directory (none imports `roles`).
"""
