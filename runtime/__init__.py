"""How a run's processes live: the configuration, the checks before a launch, the launcher,
the Role base, logs, checkpoints, the run directory, and the views a person reads.

Floors, bottom first: a package or root module imports only from floors below its own
(`RUNTIME_FLOORS` in tests/unit/project/test_layering.py, which enforces them):

0. `errors`: the one error root.
1. `config` (the run configuration: it imports nothing of `runtime` but `errors`), `logs`,
   `hf_quiet`, `last_words`, `seeds`, `step_phases`, `user_functions`.
2. `identity`, `data`, `memory`, `tiny`, `gc_pauses`: what the config implies for the run's
   directory, data and memory, and the tiny models.
3. `checkpoints`, `role`: checkpoints, and the base of every role process.
4. `preflight`, `views`: the checks of the machine before a launch, and what a person sees.
5. `launch`, `entry`: the launcher, and the entry point of one role process.
6. `cli`: the `tandem` command.

Modules:
* `cli`: The `tandem` command (`[project.scripts]`); each subcommand imports its heavy modules
  lazily.
* `entry`: Entry point of one role process: `python -m runtime.entry --run-dir D --role R --rank
  N`.
* `errors`: The project's one error root (`TandemError`, `ConfigError`), and how an exception is
  told in one line.
* `gc_pauses`: Garbage-collector pauses in a role process: keep them short, and say when one is
  long.
* `hf_quiet`: transformers without its progress bars: `Writing model shards` and `Loading
  weights` are tqdm bars on stderr, noise around a one-line CLI (`tandem launch` making the tiny
  model, `tandem export --merge`) and in a log file.
* `last_words`: A role's cause of death, told to its launcher through a pipe rather than the
  disk (which may be what failed: a full disk ends a role with nothing in its log).
* `logs`: Structured JSON logs: one file per role process, one JSON object per line.
* `role`: The base every role process subclasses.
* `seeds`: Seeds derived from a run's seed: what a seeded run draws is a pure function of its
  labelled parts, never of timing or order.
* `step_phases`: A training step's phases, from the times the controller saw: when the rollouts
  woke, generated and the batch was scored, when vLLM slept, the trainer trained and pushed the
  new weights, and the glue: the time in the step that no phase covers.
* `user_functions`: User functions named `module:function` (reward functions, multi-turn
  environment factories, tools): loading them and checking that they can be called as the
  roles call them.

Packages:
* `config`: The run configuration: typed msgspec Structs, loaded from YAML plus dotted
  overrides, and the checks across its fields.
* `identity`: The run's identity: its directory and the names inside it, its secret, and where
  its sockets live.
* `data`: The prompt data: its files, its sources, and prompts as the run tokenizes them.
* `memory`: GPU and host memory: estimated from the config before launch, `auto` settled for
  this machine, and explained after an out-of-memory error.
* `checkpoints`: Checkpoints: their directories, what they record, and what a resume or an
  export reads.
* `tiny`: Tiny models made on the fly, so a run needs no download.
* `preflight`: Launch-time checks of the machine and the environment: GPUs, packages, user
  functions, disk space, the teacher's tokenizer, the wandb login.
* `launch`: Launching a run: this node's role processes, where they run, in what order, and how
  the run ends.
* `views`: What a person sees of a run, each read from the run directory (none imports `roles`).
"""
