"""A role's cause of death, told to its launcher through a pipe rather than the disk
(which may be what failed: a full disk ends a role with nothing in its log).

The launcher opens a pipe per role (`LastWords`) and passes its write end in the role's
environment (`ENV`); `say(cause)` writes one line to it and never raises. The launcher
reads the first line a role said once the role has exited: the first cause wins, as
with `Role.fail`.
"""

from __future__ import annotations

import os

ENV = "TANDEM_LAST_WORDS_FD"
MAX_CHARS = 1000  # one line, well within a pipe's atomic write


def say(cause: str) -> None:
    """Tell the launcher why this role is dying (no-op outside a launched role)."""
    fd = os.environ.get(ENV, "")
    if not fd.isdigit():
        return
    try:
        os.write(int(fd), (" ".join(cause.split())[:MAX_CHARS] + "\n").encode(errors="replace"))
    except OSError:
        pass


class LastWords:
    """The launcher's end of one role's pipe."""

    def __init__(self) -> None:
        self._read, self.write_fd = os.pipe()
        os.set_blocking(self._read, False)
        self._said = b""

    def child_started(self) -> None:
        """The role has its copy of the write end: close ours."""
        os.close(self.write_fd)

    def first_line(self) -> str:
        """The first line the role said, or ""."""
        while True:
            try:
                chunk = os.read(self._read, 65536)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            self._said += chunk
        return self._said.split(b"\n", 1)[0].decode(errors="replace").strip()

    def close(self) -> None:
        try:
            os.close(self._read)
        except OSError:
            pass
