"""The errors of the vLLM engine, one name per event (vLLM's v1/engine/exceptions.py is the
model): both the in-process engine core (inproc.py) and the rollout's wrapper around it
(engine.py) raise these, so a caller catches one class whichever layer found the death.

* `EngineDeadError`: the engine is dead (a step raised, a worker process died, it was shut
  down, or its weights are gone for good); every later call raises it too.
* `OutOfGpuMemory`: an `EngineDeadError` whose cause is an engine call that ran out of GPU
  memory (`what` names the call); vLLM is left half-woken or half-loaded.
"""

from __future__ import annotations

from runtime.errors import TandemError, one_line


class EngineDeadError(TandemError, RuntimeError):
    """vLLM's engine died or was shut down; the message carries its cause."""


class OutOfGpuMemory(EngineDeadError):
    """An engine call (`what`: "wake_up (kv_cache)", ...) ran out of GPU memory; vLLM is
    left half-woken or half-loaded, so the rollout cannot go on with it."""

    def __init__(self, what: str, cause: BaseException) -> None:
        self.what = what
        super().__init__(f"vLLM {what}: {one_line(cause)}")
