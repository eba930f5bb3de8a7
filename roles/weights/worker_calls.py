"""The calls the rollout's engine wrapper (roles/generation/engine.py) and the weight
receiver (roles/weights/receiver.py) make into vLLM's workers, by name, through
`collective_rpc`: each is a method of `TandemWorkerExtension` (roles/weights/worker_ext.py),
which vLLM mixes into its worker class. One table, so a renamed method is a failing test
(tests/unit/roles/weights/test_worker_calls.py), not a call that fails inside a running engine."""

from __future__ import annotations

from enum import StrEnum


class WorkerCall(StrEnum):
    BEGIN_UPDATE = "tandem_begin_update"
    FINISH_UPDATE = "tandem_finish_update"
    LOAD_STAGED = "tandem_load_staged"
    LOAD_IPC = "tandem_load_ipc"
    RECEIVE_BUCKET = "tandem_receive_bucket"
    LOAD_WEIGHTS = "tandem_load_weights"
    INIT_WEIGHT_GROUP = "tandem_init_weight_group"
    CLOSE_WEIGHT_GROUP = "tandem_close_weight_group"
    DEVICE = "tandem_device"
    CHECKSUM = "tandem_checksum"
    CHECKSUMS = "tandem_checksums"
    MEMORY = "tandem_memory"


# Calls that wait on a peer (the trainer's broadcast), so the stall watchdog does not count them.
PEER_WAITING_CALLS = frozenset({WorkerCall.RECEIVE_BUCKET, WorkerCall.INIT_WEIGHT_GROUP})
# The calls that load one bucket inside an open update (`RolloutEngine.load_bucket`).
BUCKET_LOADS = frozenset({WorkerCall.LOAD_STAGED, WorkerCall.LOAD_IPC, WorkerCall.RECEIVE_BUCKET})
