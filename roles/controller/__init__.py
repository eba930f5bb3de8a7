"""The controller role: the run's one CPU process, which admits prompts, dispatches them to
the rollouts, scores the samples, builds each training step and checkpoints the run.

Modules:
* `batching`: Training batches from rewarded groups: advantages, packing, and sharding over
  ranks.
* `budgets`: Response budgets: the `max_tokens` each training group is sampled with.
* `checkpointing`: Checkpoints, controller side: every trainer and critic rank saves its shards,
  the controller its state (`ControllerState`); then the folder is committed
  (runtime/checkpoints/checkpoint.py).
* `dataset`: Prompt datasets: JSONL / Parquet files or the synthetic copy task, with a resumable
  cursor.
* `dispatch`: Dispatch: admit prompts through the ledger, send them to rollouts, collect their
  samples.
* `error_rate`: The run's bound on failed sampling: the environment's (and the agent's, and the
  generation's) equivalent of `reward.max_failure_fraction`.
* `groups`: Prompt groups (n completions of one prompt) from dispatch to training.
* `ledger`: The ledger: the one owner of "every admitted group is trained or dropped exactly
  once".
* `membership`: Who is in the run: registration, rollouts that join or are lost, and what the
  trainers and the dispatcher are told when that changes.
* `metric_groups`: Grouped metric names for the dashboards (TensorBoard, wandb), as verl and TRL
  users expect them: `actor/`, `critic/`, `rollout/`, `timing/`, `weights/`, `val/`.
* `metrics`: Per-step metrics: one JSON object per trainer step appended to
  RUN_DIR/metrics.jsonl, and optionally mirrored to TensorBoard and wandb (both off by default)
  under grouped names (`actor/loss`, `rollout/reward_mean`: roles/controller/metric_groups.py).
* `mismatch`: The behaviour / proximal mismatch guard (`algorithm.mismatch_warn`,
  `algorithm.mismatch_stop`).
* `peer_access`: Who may join the run and speak for a role: the controller's checks of control
  messages.
* `peers`: The controller's view of registered roles: identity, info, version, load, busy time.
* `ppo`: PPO with a critic, controller side: value requests, token rewards (with the optional KL
  penalty) and GAE per sample, as plain functions over groups.
* `ranks`: The ranks of one SPMD role (trainer or critic), addressed as one.
* `role`: The controller: one per run, on CPU.
* `schedule`: The schedule log: RUN_DIR/schedule.jsonl, one compact JSON object per event the
  controller sees, so a person (or `tandem report`) can see *when* things happened.
* `scoring`: Scoring: complete groups in, rewarded groups out.
* `sleep_before_step`: SleepBeforeStep: in a synchronous run, rollouts that share a GPU with a
  trainer rank sleep before each training step, so the trainer steps with their memory.
* `stale_drops`: A warning when stale drops take a run's long responses (`stale_drops`).
* `staleness_gate`: The staleness gate of async PPO (as in AReaL), as pure bookkeeping.
* `state`: The controller's part of a checkpoint, as JSON (msgspec): the ledger (step, gate
  counters, totals, the samples accepted but not trained yet, and the prompts that were in
  flight, generated again on resume so no prompt is skipped), the dataset cursor and the
  adaptive KL coefficient.
* `step_metrics`: One metrics record per training step (see docs/metrics.md): the
  batch's rewards, lengths and staleness, drops, throughput and idle ratios over the window
  since the previous step, and the trainer's (and critic's) own numbers.
* `step_runner`: The training stage: one step at a time, the ledger's next fresh batch through the
  trainer (and critic) ranks.
* `teaching`: The controller's side of on-policy distillation: the teacher's log-probabilities
  of every finished sample, asked beside its rewards, and the step's distillation metrics.
* `validation`: Validation: held-out prompts generated and scored between training requests.
* `values`: The value stage of PPO with GAE: rewarded groups in, groups with advantages out.
* `wandb_run`: The wandb run a Tandem run logs to (`metrics.wandb: true`).
"""
