"""An inter-process lock on a file (``fcntl.flock``: the kernel releases it when the holder exits, SIGKILL included)
with a bounded wait for a live holder; used by the CUDA extension build. Linux/macOS, a local filesystem only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path
from typing import Iterator


class LockTimeout(TimeoutError):
    """A live process held the lock for longer than the wait allowed; the message names the lock and the holder."""


def _holder(fd: int) -> str:
    """The pid the holder wrote into the lock file ('unknown' when it wrote none yet)."""
    try:
        text = os.pread(fd, 64, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "unknown"


@contextlib.contextmanager
def file_lock(path: str | os.PathLike, timeout_s: float, purpose: str = "the lock",
              hint: str = "") -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing, never deleted; its folder must exist) for the
    ``with`` body, waiting at most ``timeout_s`` (> 0) for a live holder. ``purpose``, ``hint``: for the message.
    Raises LockTimeout (naming ``path``, the holder's pid and ``hint``), or OSError (cannot open the file)."""
    path = Path(path)
    if not timeout_s > 0:
        raise ValueError(f"file_lock: timeout_s must be > 0 seconds; got {timeout_s!r}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        pause = 0.01
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LockTimeout(
                        f"cp_ops: waited {timeout_s:g} s for {purpose}: the lock file {path} is held by a live process "
                        f"(pid {_holder(fd)}; a dead holder's lock is released by the OS, so it is still running or "
                        f"hung). {hint}".rstrip()
                    ) from None
                time.sleep(min(pause, left))
                pause = min(pause * 2, 0.5)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # who holds it, for a waiter's message
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the lock
