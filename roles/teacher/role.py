"""The teacher role: serves the controller's `TeacherRequest` with the teacher model's
log-probability of every response token of each sample (roles/teacher/scorer.py), on the
GPU its placement `devices` name, else on CPU.

A sample it cannot score comes back with an error; the controller counts it as a reward
model's failure (`reward.max_failure_fraction`). A dead vLLM engine ends the role (and so
the run, the launcher naming `teacher-N`).
"""

from __future__ import annotations

import time

from roles.generation.errors import EngineDeadError
from roles.teacher.scorer import TeacherScorer
from runtime.identity.paths import teacher_dir
from runtime.launch.start_order import engines_before, mark_started, wait_for_engines
from runtime.logs import get_logger
from runtime.role import FatalError, Role
from transport import wire
from transport.endpoint import Envelope

log = get_logger("teacher")


class TeacherRole(Role):
    kind = "teacher"

    async def setup(self) -> None:
        d = self.cfg.algorithm.distill
        path = str(teacher_dir(self.cfg))
        started = time.perf_counter()
        self.scorer = TeacherScorer(d.engine, path, timeout_s=d.timeout_s, max_batched_tokens=d.max_batched_tokens)
        before = engines_before(self.cfg, self.kind, self.ctx.rank)  # one vLLM profiling a GPU at a time
        await wait_for_engines(self.ctx.run_dir, self.ctx.name, self.kind, before, self.cfg.startup_timeout_s)
        log.info("engine_starting", model=path)
        try:
            await self.scorer.start()
        except FileNotFoundError as exc:
            raise FatalError(str(exc)) from None
        mark_started(self.ctx.run_dir, self.ctx.name)  # a torch role on this GPU may build now
        log.info("teacher_loaded", model=path, seconds=round(time.perf_counter() - started, 2))

    async def handle(self, env: Envelope) -> wire.Message | None:
        msg = env.msg
        if isinstance(msg, wire.TeacherRequest):
            return await self._score(msg)
        return self.unserved(msg)

    async def _score(self, msg: wire.TeacherRequest) -> wire.TeacherResult:
        started = time.perf_counter()
        try:
            scores = await self.scorer.score(msg.items)
        except EngineDeadError as exc:
            self.fail(f"teacher vLLM engine died: {exc}")
            raise
        ms = round(1e3 * (time.perf_counter() - started))
        tokens = sum(len(s.logprobs) for s in scores)
        log.debug("scored", samples=len(scores), tokens=tokens, failed=sum(1 for s in scores if s.error), ms=ms)
        return wire.TeacherResult(scores=scores)

    async def close(self) -> None:
        scorer = getattr(self, "scorer", None)
        if scorer is not None:
            scorer.close()
