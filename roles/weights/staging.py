"""Staging of one policy version's weight buckets in shared memory.

Buckets are appended, as raw bytes, to one file under /dev/shm (the temp dir where there
is no /dev/shm) while generation goes on; `manifest()` then describes every tensor
(name, dtype, shape, offset, size) so the engine's worker process can map the file and
load without any tensor data passing through vLLM's RPC. A stager holds at most one
version; starting a new one discards the old file.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from transport.wire import WeightBucket


def shm_dir() -> Path:
    return Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())


class WeightStager:
    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.version: int | None = None
        self.path: Path | None = None
        self.entries: list[list[Any]] = []
        self.next_index = 0
        self.num_bytes = 0
        self.started = 0.0
        self._file: Any = None

    def add(self, bucket: WeightBucket) -> None:
        """Append a bucket; index 0 starts a new version. Raises ValueError when out of order."""
        if bucket.index == 0:
            self.discard()
            self.version = bucket.version
            self.path = shm_dir() / f"tandem-{self.tag}-{os.getpid()}-v{bucket.version}.bin"
            self._file = open(self.path, "wb")  # noqa: SIM115 (closed in finish/discard)
            self.started = time.perf_counter()
        elif bucket.version != self.version or bucket.index != self.next_index:
            raise ValueError(
                f"weight bucket {bucket.index} of version {bucket.version} out of order "
                f"(expected bucket {self.next_index} of version {self.version})"
            )
        for name, tensor in bucket.tensors.items():
            self._append(name, tensor)
        self.next_index = bucket.index + 1
        if bucket.last:
            self._file.close()
            self._file = None

    def _append(self, name: str, tensor: torch.Tensor) -> None:
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
        offset = self._file.tell()
        self._file.write(memoryview(raw))  # type: ignore[arg-type]  # numpy arrays are buffers
        dtype = str(tensor.dtype).removeprefix("torch.")
        self.entries.append([name, dtype, list(tensor.shape), offset, raw.nbytes])
        self.num_bytes += raw.nbytes

    def manifest(self) -> dict[str, Any]:
        return {"path": str(self.path), "entries": self.entries, "version": self.version}

    def discard(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.path is not None:
            self.path.unlink(missing_ok=True)
        self.path, self.version, self.entries, self.next_index, self.num_bytes = None, None, [], 0, 0
