"""An inter-process lock on a file that the OS releases when its holder dies, with a bounded wait.

``fcntl.flock`` on ``<path>``: held while the file descriptor is open, released by the kernel when the process
exits or is killed (SIGKILL included), so a crashed holder never leaves a stale lock behind. The wait for a live
holder polls (``LOCK_NB``) and is bounded: past ``timeout_s`` it raises :class:`LockTimeout` naming the lock file,
the holder's pid and what to do. Used by the one-per-host CUDA extension build (:mod:`cp_ops._ext`).
Linux/macOS only (``fcntl``); the lock file must be on a local filesystem (``flock`` over NFS is not reliable).
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
    """Hold an exclusive ``flock`` on ``path`` (created if missing, never deleted) for the ``with`` body.

    Args:
        path: the lock file (its folder must exist). timeout_s: longest wait, seconds, for a live holder (> 0).
        purpose, hint: what the lock guards and what to do, for the timeout's message.
    Raises:
        LockTimeout: another live process held the lock for ``timeout_s`` seconds; the message names ``path``,
            the holder's pid (written into the file while held) and ``hint``.
        OSError: the lock file cannot be created or opened.
    """
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
