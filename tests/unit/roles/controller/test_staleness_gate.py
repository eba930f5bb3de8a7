"""StalenessGate: hand cases of admission and freshness, and a simulated controller that
checks the staleness bound, the sample accounting and progress under random interleavings."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from roles.controller.staleness_gate import StalenessGate


def test_synchronous_gate_admits_exactly_one_batch_per_version() -> None:
    gate = StalenessGate(batch_size=4, max_staleness=0)
    assert gate.capacity() == 4
    gate.admit(4)
    assert not gate.can_admit(1)
    with pytest.raises(ValueError, match="exceed the capacity 0 at version 0"):
        gate.admit(1)
    gate.train(4)
    assert not gate.can_admit(1)  # training alone frees nothing: the version must move
    gate.advance(1)
    assert gate.capacity() == 4
    gate.admit(4)
    assert gate.capacity() == 0


def test_staleness_one_admits_two_batches_at_version_zero() -> None:
    gate = StalenessGate(batch_size=3, max_staleness=1)
    assert gate.capacity() == 6
    gate.admit(2)
    gate.admit(4)
    assert gate.capacity() == 0
    assert not gate.can_admit(1)
    gate.advance(1)
    assert gate.capacity() == 3


def test_drops_give_their_slots_back() -> None:
    gate = StalenessGate(batch_size=4, max_staleness=1)
    gate.admit(8)
    gate.drop(3)
    assert gate.capacity() == 3
    assert gate.in_flight() == 5
    gate.train(4)
    assert gate.in_flight() == 1
    assert gate.capacity() == 3
    assert gate.state() == {"version": 0, "admitted": 8, "dropped": 3, "trained": 4}


def test_advance_refuses_going_backwards() -> None:
    gate = StalenessGate(batch_size=2, max_staleness=1)
    gate.advance(3)
    gate.advance(3)  # republishing the same version is allowed
    with pytest.raises(ValueError, match="from 3 to 2"):
        gate.advance(2)
    assert gate.version == 3


@pytest.mark.parametrize("k", [0, 1, 3])
def test_is_fresh_boundary(k: int) -> None:
    gate = StalenessGate(batch_size=1, max_staleness=k, version=5)
    assert gate.is_fresh(5 - k)
    assert gate.staleness(5 - k) == k
    assert not gate.is_fresh(5 - k - 1)
    assert gate.staleness(5 - k - 1) == k + 1
    assert gate.is_fresh(5)


@dataclass
class SimGroup:
    n: int
    admitted_at: int
    version: int = -1  # the rollout's weight version when it was generated


@dataclass
class ControllerSim:
    """A controller driving the gate: admit → generate → complete (any order) → train FIFO."""

    gate: StalenessGate
    n: int
    groups_per_step: int
    lag: int  # the rollout lags the trainer by at most this many versions
    rollout_version: int = 0
    pending: list[SimGroup] = field(default_factory=list)
    running: list[SimGroup] = field(default_factory=list)
    ready: deque[SimGroup] = field(default_factory=deque)
    num_trained: int = 0
    num_dropped: int = 0
    trained_staleness: list[int] = field(default_factory=list)

    @property
    def version(self) -> int:
        return self.gate.version

    def admit(self) -> bool:
        if not self.gate.can_admit(self.n):
            return False
        self.gate.admit(self.n)
        self.pending.append(SimGroup(self.n, admitted_at=self.version))
        return True

    def generate(self, choice: int) -> None:
        if not self.pending:
            return
        # Rollout workers may hold different versions: each group lags by 0..lag, never below 0.
        self.rollout_version = max(0, self.version - choice % (self.lag + 1))
        group = self.pending.pop(0)
        group.version = self.rollout_version
        self.running.append(group)

    def complete(self, choice: int) -> None:
        if self.running:
            self.ready.append(self.running.pop(choice % len(self.running)))

    def train(self) -> bool:
        """One training step if a full batch of fresh groups is ready; stale groups are dropped."""
        if sum(g.n for g in self.ready) < self.gate.batch_size:
            return False
        batch: list[SimGroup] = []
        while self.ready and len(batch) < self.groups_per_step:
            group = self.ready.popleft()
            if self.gate.is_fresh(group.version):
                batch.append(group)
            else:
                self.gate.drop(group.n)
                self.num_dropped += group.n
        if len(batch) < self.groups_per_step:
            self.ready.extendleft(reversed(batch))
            return False
        for group in batch:
            self.trained_staleness.append(self.version - group.version)
            self.gate.train(group.n)
            self.num_trained += group.n
        self.gate.advance(self.version + 1)
        return True

    def in_flight(self) -> int:
        return sum(g.n for g in (*self.pending, *self.running, *self.ready))

    def check(self) -> None:
        gate = self.gate
        assert all(s <= gate.max_staleness for s in self.trained_staleness)
        assert gate.in_flight() == self.in_flight()
        assert gate.admitted == self.num_trained + self.num_dropped + self.in_flight()
        assert (gate.trained, gate.dropped) == (self.num_trained, self.num_dropped)
        assert gate.admitted - gate.dropped <= (self.version + gate.max_staleness + 1) * gate.batch_size
        assert self.rollout_version <= self.version

    def step(self, op: str, choice: int) -> None:
        if op == "admit":
            self.admit()
        elif op == "generate":
            self.generate(choice)
        elif op == "complete":
            self.complete(choice)
        else:
            self.train()
        self.check()

    def drain_round(self, rng: random.Random) -> None:
        """A fair scheduler: fill the gate, generate and complete everything, train while possible."""
        while self.admit():
            self.check()
        while self.pending:
            self.step("generate", rng.randrange(1 << 20))
        while self.running:
            self.step("complete", rng.randrange(1 << 20))
        while self.train():
            self.check()


# Each op runs 1..4 times in a row (the third field), so short lists reach training steps.
OPS = st.lists(
    st.tuples(st.sampled_from(["admit", "generate", "complete", "train"]), st.integers(0, 1 << 20), st.integers(1, 6)),
    min_size=10,
    max_size=60,
)


def test_drops_free_slots_so_a_lagging_rollout_cannot_stall_the_run() -> None:
    gate = StalenessGate(batch_size=1, max_staleness=0)
    sim = ControllerSim(gate, n=1, groups_per_step=1, lag=1)
    for op, choice in [("admit", 0), ("generate", 0), ("complete", 0), ("train", 0)]:
        sim.step(op, choice)
    for op, choice in [("admit", 0), ("generate", 1), ("complete", 0), ("train", 0)]:
        sim.step(op, choice)  # generated one version behind: stale at version 1, dropped
    assert gate.state() == {"version": 1, "admitted": 2, "dropped": 1, "trained": 1}
    sim.lag = 0
    sim.drain_round(random.Random(0))
    assert gate.state() == {"version": 2, "admitted": 3, "dropped": 1, "trained": 2}


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 3),
    groups_per_step=st.integers(1, 3),
    max_staleness=st.integers(0, 3),
    lag=st.integers(0, 3),
    ops=OPS,
    rng=st.randoms(use_true_random=False),
)
def test_gate_bounds_staleness_and_accounts_every_sample(
    n: int, groups_per_step: int, max_staleness: int, lag: int, ops: list[tuple[str, int, int]], rng: random.Random
) -> None:
    gate = StalenessGate(batch_size=groups_per_step * n, max_staleness=max_staleness)
    sim = ControllerSim(gate, n=n, groups_per_step=groups_per_step, lag=lag)
    for op, choice, repeat in ops:
        for i in range(repeat):
            sim.step(op, choice + i)
    # Progress: once the rollout lags by no more than max_staleness, a fair schedule reaches
    # `target` steps whatever the prefix left behind (stale groups in flight, slots dropped).
    sim.lag = min(lag, max_staleness)
    target = sim.version + 5
    for _ in range(4 * (5 + max_staleness + 2)):
        if sim.version >= target:
            break
        sim.drain_round(rng)
    assert sim.version >= target, f"stalled at version {sim.version} with {gate.state()}"
    assert len(sim.trained_staleness) == sim.version * groups_per_step
