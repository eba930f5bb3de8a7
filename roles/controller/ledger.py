"""The ledger: the one owner of "every admitted group is trained or dropped exactly once".

A group is admitted once (`admit`), then lives in exactly one place until it leaves:

    in flight (dispatched, sampling or scoring) ──complete──▶ ready ──take_batch──▶ training ──trained──▶ (gone)
         │  ▲                                       │
         │  └──────── redo (a lost rollout's, or in flight at the checkpoint resumed from)
         └──────drop(reason)──────────────────────┴──▶ (gone, counted under its reason)

What a caller may rely on:
* `accounting()["unaccounted"]` is 0 after any sequence of calls: admitted groups equal
  trained + dropped (every reason) + pending (in flight, redo, ready, training).
* With `filter_groups` (DAPO dynamic sampling), a scored group whose rewards are all
  equal carries no GRPO signal: `complete` drops it as `filtered` instead of queueing it,
  which gives its slots back so admission goes on until a batch is full. At most
  `max_filtered_per_step` groups are filtered between two steps; past that they are kept,
  so a run whose rewards are all equal still trains (slowly) instead of stalling.
* `take_batch` hands out only groups fresh at the current version (`StalenessGate`);
  stale ones it meets are dropped as `stale`. So nothing is trained more than
  `max_staleness` versions after its oldest token was generated. Once the groups dropped
  as stale pass 5 % of those trained or dropped (at least 4), `trained` logs one warning,
  `stale_drops`, with their lengths beside the trained ones' (roles/controller/stale_drops.py:
  with long responses these drops are the long ones).
* Admission never exceeds the gate's capacity, and stops once the groups pending fill
  the steps left (`total_steps`).
* Every transition is also written to the schedule log (`schedule`, see schedule.py):
  `admit`, `requeue`, `scored`, `drop`.
* `state()` between steps and `Ledger.restore(state, ...)` give a ledger whose counters,
  ready queue and pending prompts equal the saved ones; groups that were in flight come
  back in `redo` (their prompts are generated again), so nothing is skipped.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Callable

from roles.controller.dataset import Prompt
from roles.controller.groups import Group
from roles.controller.schedule import NoSchedule, ScheduleLog
from roles.controller.stale_drops import StaleDropWatch
from roles.controller.staleness_gate import StalenessGate
from roles.controller.state import LedgerState, group_state, restore_group
from runtime.logs import get_logger

log = get_logger("controller")

DROP_REASONS = ("stale", "error", "filtered")
ERROR_SOURCES = ("env", "agent", "generation")  # who failed a group dropped as "error"


def error_source(why: str) -> str:
    """Which of `ERROR_SOURCES` a failed sample's one-line error names: the environment
    (roles/rollout/episode.py, multiturn.py), the agent (agents.py), else the generation."""
    if why.startswith(("environment ", "rollout.env ")):
        return "env"
    if why.startswith("the agent "):
        return "agent"
    return "generation"


class Ledger:
    def __init__(
        self,
        *,
        group_size: int,
        prompts_per_step: int,
        max_staleness: int,
        total_steps: int,
        filter_groups: bool = False,
        max_filtered_per_step: int = 0,
        schedule: ScheduleLog | None = None,
    ) -> None:
        self.schedule = schedule if schedule is not None else NoSchedule()
        self.group_size = group_size
        self.filter_groups = filter_groups
        self.max_filtered_per_step = max_filtered_per_step
        self.filtered_this_step = 0
        self.prompts_per_step = prompts_per_step
        self.total_steps = total_steps
        self.gate = StalenessGate(prompts_per_step * group_size, max_staleness)
        self.step = 0
        self.next_gid = 0
        self.in_flight: dict[int, Group] = {}
        self.redo: deque[Group] = deque()
        self.ready: deque[Group] = deque()
        self.training: list[Group] = []
        self.totals: Counter[str] = Counter()
        self.step_drops: Counter[str] = Counter()  # samples dropped since the last `trained`
        self.stale_watch = StaleDropWatch(max_staleness)  # warns when stale drops take the long responses
        self._changed = asyncio.Event()
        self._listeners: list[Callable[[], None]] = []

    # --- views -----------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self.gate.version

    @property
    def max_staleness(self) -> int:
        return self.gate.max_staleness

    def staleness(self, sample_version: int) -> int:
        return self.gate.staleness(sample_version)

    def group(self, gid: int) -> Group | None:
        """The in-flight group `gid`, if it is in flight."""
        return self.in_flight.get(gid)

    def num_pending(self) -> int:
        return len(self.in_flight) + len(self.redo) + len(self.ready) + len(self.training)

    def can_admit(self) -> bool:
        """May one more group be admitted: room in the gate, and steps left that the
        groups already pending do not fill."""
        buffered = self.gate.in_flight() // self.gate.batch_size
        return self.step + buffered < self.total_steps and self.gate.can_admit(self.group_size)

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call `listener` after every change that may let more work start."""
        self._listeners.append(listener)

    # --- transitions -----------------------------------------------------------------
    def admit(self, prompt: Prompt) -> Group:
        """A new group in flight for `prompt` (raises ValueError when `can_admit` is False)."""
        if not self.can_admit():
            raise ValueError(f"ledger: no room for a group at version {self.version} (step {self.step})")
        gid = self.next_gid
        group = Group(gid=gid, prompt=prompt, n=self.group_size, request_id=f"g{gid}", admitted_version=self.version)
        self.gate.admit(self.group_size)
        self.next_gid += 1
        self.totals["admitted_groups"] += 1
        self.in_flight[gid] = group
        self.schedule.admit(gid, self.version, prompt.uid)
        return group

    def next_redo(self) -> Group | None:
        """The oldest group waiting to be generated again, now back in flight."""
        if not self.redo:
            return None
        group = self.redo.popleft()
        group.attempts += 1
        self.in_flight[group.gid] = group
        return group

    @property
    def has_redo(self) -> bool:
        """Whether a group waits to be generated again (`next_redo` returns it)."""
        return bool(self.redo)

    def requeue_lost(self, rollout: bytes) -> list[Group]:
        """Every unfinished in-flight group of the lost rollout `rollout` (its identity) goes
        back to `redo`, in dispatch order; returns them."""
        lost = [g for g in list(self.in_flight.values()) if g.rollout == rollout and not g.complete]
        for group in lost:
            self.requeue(group)
        return lost

    def dropped(self, reason: str) -> int:
        """Samples dropped for `reason` ("stale", "filtered", ...) over the whole run."""
        return self.totals[f"dropped_{reason}"] * self.group_size

    def requeue(self, group: Group) -> None:
        """An in-flight group whose rollout was lost: its samples are discarded and it
        waits in `redo` to be generated again."""
        self._take_in_flight(group)
        group.forget_generation()
        self.redo.append(group)
        self.schedule.requeue(group.gid)
        self._notify()

    def complete(self, group: Group) -> None:
        """An in-flight group is scored: queue it for training (or, with `filter_groups`,
        drop it as `filtered` when its rewards are all equal and the step's bound allows)."""
        self._take_in_flight(group)
        self.schedule.scored(group.gid)
        group.ready_at = time.time()
        if self.filter_groups and group.rewards_equal and self.filtered_this_step < self.max_filtered_per_step:
            self.filtered_this_step += 1
            self._count_drop(group, "filtered", "all rewards equal")
        else:
            self.ready.append(group)
        self._notify()

    def drop(self, group: Group, reason: str, why: str = "") -> None:
        """An in-flight or ready group leaves untrained, counted under `reason` (logged with `why`)."""
        if reason not in DROP_REASONS:
            raise ValueError(f"ledger: unknown drop reason {reason!r} (one of {DROP_REASONS})")
        if self.in_flight.pop(group.gid, None) is None:
            try:
                self.ready.remove(group)
            except ValueError:
                raise ValueError(f"ledger: group {group.gid} is neither in flight nor ready") from None
        self._count_drop(group, reason, why)
        self._notify()

    def take_batch(self) -> list[Group] | None:
        """`prompts_per_step` fresh groups, the oldest ready ones, in admission order, now in
        training; stale groups met on the way are dropped. None (nothing taken) when not enough are ready."""
        batch: list[Group] = []
        dropped = False
        while self.ready and len(batch) < self.prompts_per_step:
            group = self.ready.popleft()
            if self.gate.is_fresh(group.version):
                batch.append(group)
            else:
                self._count_drop(group, "stale", f"version {group.version} at trainer version {self.version}")
                self.stale_watch.dropped(group, self.staleness(group.version))
                dropped = True
        if len(batch) < self.prompts_per_step:
            self.ready.extendleft(reversed(batch))
            if dropped:
                self._notify_listeners()  # the drops gave slots back: more can be admitted
            return None
        batch.sort(key=lambda g: g.gid)  # admission order, not completion order: a seeded run's batches repeat
        self.training = batch
        return batch

    def untake(self) -> None:
        """The batch in training goes back to the front of the ready queue, untrained: its
        step was abandoned before the batch reached the trainer (a preemption)."""
        self.ready.extendleft(reversed(self.training))
        self.training = []

    async def wait_batch(self) -> list[Group]:
        """`take_batch`, waiting for completions until it succeeds."""
        while True:
            self._changed.clear()
            batch = self.take_batch()
            if batch is not None:
                return batch
            await self._changed.wait()

    def trained(self, version: int) -> None:
        """The batch in training was trained and published as `version`: one step more."""
        if not self.training:
            raise ValueError("ledger: no batch in training")
        self.gate.train(sum(g.n for g in self.training))
        self.totals["trained_groups"] += len(self.training)
        self.stale_watch.trained(self.training)
        self.training = []
        self.filtered_this_step = 0
        self.step += 1
        self.gate.advance(version)
        self.stale_watch.check(self.step)
        self._notify()

    def take_step_drops(self) -> dict[str, int]:
        """Samples dropped (by reason) since the last call."""
        drops, self.step_drops = dict(self.step_drops), Counter()
        return drops

    # --- accounting and state ----------------------------------------------------------
    def accounting(self) -> dict[str, int]:
        t = self.totals
        dropped = sum(t[f"dropped_{r}"] for r in DROP_REASONS)
        pending = self.num_pending()
        return {
            "admitted_groups": t["admitted_groups"],
            "trained_groups": t["trained_groups"],
            **{f"dropped_{r}": t[f"dropped_{r}"] for r in DROP_REASONS},
            "pending_groups": pending,
            "unaccounted": t["admitted_groups"] - t["trained_groups"] - dropped - pending,
        }

    def state(self) -> LedgerState:
        if self.training:
            raise ValueError("ledger: state() is taken between steps, not with a batch in training")
        pending = [group_state(g, with_samples=False) for g in [*self.in_flight.values(), *self.redo]]
        return LedgerState(
            step=self.step,
            next_gid=self.next_gid,
            gate=self.gate.state(),
            totals=dict(self.totals),
            ready=[group_state(g) for g in self.ready],
            pending=pending,
        )

    @classmethod
    def restore(
        cls,
        state: LedgerState,
        *,
        group_size: int,
        prompts_per_step: int,
        max_staleness: int,
        total_steps: int,
        filter_groups: bool = False,
        max_filtered_per_step: int = 0,
        schedule: ScheduleLog | None = None,
    ) -> Ledger:
        """The ledger `state()` described, with its pending groups waiting in `redo` (the
        count of groups filtered since the last step starts again at 0)."""
        ledger = cls(
            group_size=group_size,
            prompts_per_step=prompts_per_step,
            max_staleness=max_staleness,
            total_steps=total_steps,
            filter_groups=filter_groups,
            max_filtered_per_step=max_filtered_per_step,
            schedule=schedule,
        )
        ledger.step, ledger.next_gid = state.step, state.next_gid
        ledger.gate.restore(state.gate)
        ledger.totals.update(state.totals)
        ledger.ready.extend(restore_group(g) for g in state.ready)
        ledger.redo.extend(restore_group(g) for g in state.pending)
        unaccounted = ledger.accounting()["unaccounted"]
        if unaccounted:
            raise ValueError(f"ledger: the saved state does not add up ({unaccounted} groups unaccounted)")
        return ledger

    # --- internals -------------------------------------------------------------------
    def _take_in_flight(self, group: Group) -> None:
        if self.in_flight.pop(group.gid, None) is None:
            raise ValueError(f"ledger: group {group.gid} is not in flight")

    def _count_drop(self, group: Group, reason: str, why: str) -> None:
        log.info("group_dropped", group=group.gid, reason=f"dropped_{reason}", why=why)
        self.schedule.drop(group.gid, reason, why)
        self.gate.drop(group.n)
        self.totals[f"dropped_{reason}"] += 1
        self.step_drops[f"dropped_{reason}"] += group.n
        if reason == "error":
            self.step_drops[f"dropped_error_{error_source(why)}"] += group.n

    def _notify(self) -> None:
        self._changed.set()
        self._notify_listeners()

    def _notify_listeners(self) -> None:
        for listener in self._listeners:
            listener()
