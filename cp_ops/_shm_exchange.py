"""Host-memory all-gather of the rank contract's fixed-size signature among the ranks of one node.

The rank contract (:mod:`cp_ops.contract`) exchanges a few int64 words on every cp_ops call; over gloo (localhost
TCP, a worker thread per call) that costs ~0.4 ms per call, more than the whole attention of a 4K-token CP2 layer.
When every rank of the group runs on one host, the words go through a small shared-memory file instead: each rank
writes its row, then reads the peers' rows until they carry this call's number (:func:`cp_ops._waits.poll`); a few µs
when the ranks are in step.

Layout: for each rank, two slots (call-number parity), each ``[call number, crc, word_0 .. word_{n-1}]``
(int64). A rank can be at most one call ahead of the slowest peer that has not yet read its row (it must
first see that peer's row of the previous call), so two slots per rank never overwrite an unread row. The crc
(over the call number and the words) makes a torn read look like "not yet written" on any memory model.

The file's pages are reserved when it is made (``posix_fallocate``; where a file system lacks it, zeros written):
a full ``/dev/shm`` is an ``OSError`` naming it at :meth:`ShmExchange.create` (the contract then exchanges over
gloo), never a SIGBUS at the first write through the map. :meth:`ShmExchange.attach` checks the file's size
before mapping it, for the same reason.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
import tempfile
import time
import uuid
import zlib

from ._waits import poll


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _reserve(fd: int, size: int) -> None:
    """Allocate ``size`` bytes of the file ``fd`` now (``posix_fallocate``; zeros written where the file system does not
    support it). Raises OSError (ENOSPC: no room) instead of leaving a sparse file whose pages fail later as SIGBUS."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is not None:
        try:
            fallocate(fd, 0, size)
            return
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
    if os.pwrite(fd, bytes(size), 0) != size:
        raise OSError(errno.ENOSPC, "short write")


class ShmExchange:
    """All-gather of ``n`` int64 words among ``world`` local ranks through one shared file.

    Create with :meth:`create` on one rank and :meth:`attach` on the others (the path is passed by the caller's
    own channel); :meth:`unlink` once every rank has attached (the mapping outlives the name).
    """

    def __init__(self, path: str, world: int, rank: int, n: int, create: bool):
        self.path, self.world, self.rank, self.n = path, world, rank, n
        self.row = struct.Struct(f"<{n + 2}q")
        self.slot_bytes = self.row.size
        size = world * 2 * self.slot_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                try:
                    _reserve(fd, size)
                except OSError as e:
                    _unlink(path)
                    raise OSError(e.errno, f"cannot reserve {size} bytes in {os.path.dirname(path)} for the rank "
                                           f"contract's shared-memory exchange ({e.strerror}): {os.path.dirname(path)} "
                                           "is full or too small (docker: --shm-size)") from e
            else:
                got = os.fstat(fd).st_size
                if got < size:
                    raise OSError(errno.EINVAL, f"{path} holds {got} bytes, the exchange of {world} ranks needs {size}")
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.words = struct.Struct(f"<{n}q")

    @classmethod
    def create(cls, world: int, n: int) -> "ShmExchange":
        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        return cls(os.path.join(base, f"cp_ops_rank_check_{uuid.uuid4().hex}"), world, 0, n, create=True)

    @classmethod
    def attach(cls, path: str, world: int, rank: int, n: int) -> "ShmExchange":
        return cls(path, world, rank, n, create=False)

    def unlink(self) -> None:
        """Remove the file's name (every rank keeps its mapping)."""
        _unlink(self.path)

    def close(self) -> None:
        """Unmap the file (the exchange cannot be used after)."""
        self.mm.close()

    def _offset(self, rank: int, call: int) -> int:
        return (rank * 2 + (call & 1)) * self.slot_bytes

    def allgather(self, call: int, words: bytes, out: bytearray, timeout_s: float, on_wait=None) -> bool:
        """Publish this rank's ``words`` (``n`` packed int64) for call number ``call`` (>= 1, +1 per call) and fill
        ``out`` (``world * n`` int64) with every rank's words. Returns False when some rank did not publish within
        ``timeout_s`` seconds (``out`` is then incomplete; :attr:`pending`: the ranks that did not).
        ``on_wait(pending ranks)``, when given, is called about
        every ``_waits.CHECK_EVERY_S`` seconds of waiting (after the first spins) and may raise (a peer has exited)."""
        vals = self.words.unpack(words)
        crc = zlib.crc32(words, call & 0xFFFFFFFF)
        self.row.pack_into(self.mm, self._offset(self.rank, call), call, crc, *vals)
        step = self.words.size
        out[self.rank * step:(self.rank + 1) * step] = words
        self.pending = [r for r in range(self.world) if r != self.rank]
        deadline = None

        def arrived() -> bool:
            still = []
            for r in self.pending:
                off = self._offset(r, call)
                got_call, got_crc = struct.unpack_from("<2q", self.mm, off)
                if got_call == call:
                    body = self.mm[off + 16: off + 16 + step]
                    if zlib.crc32(body, call & 0xFFFFFFFF) == got_crc:
                        out[r * step:(r + 1) * step] = body
                        continue
                still.append(r)
            self.pending = still
            return not still

        def check() -> bool:
            nonlocal deadline
            if deadline is None:
                deadline = time.monotonic() + timeout_s
            elif time.monotonic() > deadline:
                return True
            elif on_wait is not None:
                on_wait(self.pending)
            return False

        return poll(arrived, check)
