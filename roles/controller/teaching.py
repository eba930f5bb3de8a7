"""The controller's side of on-policy distillation: ask a teacher role for the
log-probabilities of every finished sample's tokens, and the step's distillation metrics.

`Teaching.score(group)` runs beside the reward requests of the group (roles/controller/
scoring.py), so the teacher scores while the rollouts generate and the trainer trains. It
leaves each sample's `teacher_logprobs` set (one per response token) or, when the teacher
could not give them (the request failed or timed out, or the answer is garbage: a wrong
count of log-probabilities, a non-finite or positive one), None and the failure in the
sample's `reward_error` with reason `teacher`, which counts against
`reward.max_failure_fraction` as a reward model's failure does. A teacher that dies ends
the run through the launcher like any role.
"""

from __future__ import annotations

import math
import time
from collections import Counter

import torch

from roles.algo.distill import mean_reverse_kl
from roles.controller.groups import Group, SampleRec
from roles.controller.peers import BusyClock, Registry
from roles.controller.schedule import NoSchedule, ScheduleLog
from runtime.logs import get_logger
from transport import wire
from transport.rpc import RemoteError, RequestTimeout, RpcEndpoint
from transport.throttle import Throttled

log = get_logger("controller")
START_SLACK_S = 30.0
KIND = "teacher"


class Teaching:
    def __init__(
        self, server: RpcEndpoint, registry: Registry, *, timeout_s: float, schedule: ScheduleLog | None = None
    ) -> None:
        """`timeout_s`: the teacher's bound on one request (`algorithm.distill.timeout_s`); a
        request's deadline is that bound for each request queued at the role, twice over,
        plus START_SLACK_S: only a wedged teacher misses it."""
        self.server = server
        self.schedule = schedule if schedule is not None else NoSchedule()
        self.registry = registry
        self.timeout_s = timeout_s
        self.clock = BusyClock()  # time with at least one teacher request outstanding
        self.tokens = 0  # tokens scored since the run began
        self._outstanding: Counter[bytes] = Counter()
        self._next = 0
        self.noisy = Throttled(log, first=1)
        self.done_at: dict[int, float] = {}  # gid -> Unix time its teacher reply came

    async def score(self, group: Group) -> None:
        """Set the teacher's log-probabilities on every sample of `group` (module docstring)."""
        peers = self.registry.of(KIND)
        if not peers:
            return
        peer = peers[self._next % len(peers)]
        self._next += 1
        samples = group.ordered()
        items = [wire.TeacherItem(_sid(group, s), list(group.prompt.prompt_ids), s.token_ids.tolist()) for s in samples]
        self._outstanding[peer.identity] += 1
        deadline = 2 * self.timeout_s * (self._outstanding[peer.identity] + 1) + START_SLACK_S
        self.clock.add()
        asked = time.monotonic()
        try:
            reply = await self.server.request(wire.TeacherRequest(items=items), peer=peer.identity, timeout=deadline)
        except (RequestTimeout, RemoteError) as exc:
            reason = "timeout" if isinstance(exc, RequestTimeout) else "request_failed"
            self.noisy.warning(
                "teacher_failed", key=f"{peer.name} {reason}", role=peer.name, group=group.gid, error=str(exc)
            )
            for s in samples:
                _fail(s, f"{peer.name} request failed: {exc}")
            self.schedule.teacher(group.gid, peer.name, time.monotonic() - asked, 0, len(samples))
            return
        finally:
            self._outstanding[peer.identity] -= 1
            self.clock.done()
            self.done_at[group.gid] = time.time()
        assert isinstance(reply, wire.TeacherResult)
        tokens = self._take(group, samples, reply, peer.name)
        failed = sum(1 for s in samples if s.teacher_logprobs is None)
        self.schedule.teacher(group.gid, peer.name, time.monotonic() - asked, tokens, failed)

    def _take(self, group: Group, samples: list[SampleRec], reply: wire.TeacherResult, name: str) -> int:
        """Set the usable answers on the samples; the tokens they cover."""
        by_id = {sc.sample_id: sc for sc in reply.scores}
        tokens = 0
        for s in samples:
            sc = by_id.get(_sid(group, s))
            error = check_score(sc, s.length)
            if error:
                self.noisy.warning(
                    "teacher_garbage", key=f"{name} {error[:40]}", role=name, group=group.gid, error=error
                )
                _fail(s, f"{name}: {error}")
                continue
            assert sc is not None
            s.teacher_logprobs = torch.tensor(sc.logprobs, dtype=torch.float32)
            tokens += s.length
        self.tokens += tokens
        return tokens


def check_score(score: wire.TeacherScore | None, length: int) -> str:
    """Why a teacher's answer for a sample of `length` response tokens is unusable ("" when
    it is usable): missing, an error, a wrong count, or a value that is no log-probability."""
    if score is None:
        return "no answer for the sample"
    if score.error:
        return score.error
    if len(score.logprobs) != length:
        return f"{len(score.logprobs)} log-probabilities for {length} tokens"
    bad = next((x for x in score.logprobs if not (math.isfinite(x) and x <= 1e-4)), None)
    if bad is not None:
        return f"log-probability {bad} is not a finite number <= 0"
    return ""


def _fail(s: SampleRec, error: str) -> None:
    s.teacher_logprobs = None
    s.teacher_error = error[:500]


def _sid(group: Group, s: SampleRec) -> int:
    return group.gid * group.n + s.index


class TeacherMeter:
    """The step's distillation metrics (docs/metrics.md): `distill_kl` (mean per-token reverse
    KL of the sampled tokens the teacher scored), `teacher_failures`, `teacher_tokens_per_s`
    (tokens scored per second the teacher was busy since the last step) and `teacher_wait_s`
    (how long after the batch's last sample its last teacher answer came; 0 when the teacher
    kept up)."""

    def __init__(self, teaching: Teaching) -> None:
        self.teaching = teaching
        self._busy = 0.0
        self._tokens = 0

    def metrics(self, groups: list[Group]) -> dict[str, float]:
        samples = [s for g in groups for s in g.ordered()]
        scored = [s for s in samples if s.teacher_logprobs is not None]
        out = {"teacher_failures": float(len(samples) - len(scored))}
        if scored:
            student = torch.cat([s.logprobs.float() for s in scored])
            teacher = torch.cat([_lp(s) for s in scored])
            out["distill_kl"] = mean_reverse_kl(student, teacher, torch.cat([s.mask() for s in scored]))
        t = self.teaching
        busy, tokens = t.clock.busy_s(), t.tokens
        if busy > self._busy:
            out["teacher_tokens_per_s"] = (tokens - self._tokens) / (busy - self._busy)
        self._busy, self._tokens = busy, tokens
        answered = [t.done_at.pop(g.gid, 0.0) for g in groups]
        if len(t.done_at) > 4096:  # groups dropped after their teacher answer: forget the oldest
            for gid in sorted(t.done_at)[:2048]:
                del t.done_at[gid]
        last_sample = max((g.last_arrival for g in groups), default=0.0)
        out["teacher_wait_s"] = max(0.0, max(answered, default=0.0) - last_sample) if last_sample else 0.0
        return out


def _lp(s: SampleRec) -> torch.Tensor:
    assert s.teacher_logprobs is not None
    return s.teacher_logprobs
