"""Host-memory all-gather of the rank contract's fixed-size signature among the ranks of one node: a few µs per call
where gloo (localhost TCP) costs ~0.4 ms. Each rank writes its row to a shared file, then reads the peers' rows until
they carry this call's number.

Layout: per rank two slots (call-number parity), each ``[call number, crc, word_0 .. word_{n-1}]`` (int64): a rank is
at most one call ahead of a peer that has not read its row, so no unread row is overwritten; the crc makes a torn
read look "not yet written". The pages are reserved at creation (a full ``/dev/shm`` is an OSError then, never a
SIGBUS later) and :meth:`ShmExchange.attach` checks the size before mapping.
"""

from __future__ import annotations

import errno
import functools
import mmap
import os
import struct
import tempfile
import time
import uuid
import zlib

from ._waits import poll

_HEAD = struct.Struct("<2q")  # a slot's call number and crc


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _reserve(fd: int, size: int) -> None:
    """Allocate ``size`` bytes of the file ``fd`` now (``posix_fallocate``, else zeros written); OSError: no room."""
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
    """All-gather of ``n`` int64 words among ``world`` local ranks through one shared file: :meth:`create` on one
    rank, :meth:`attach` on the others, :meth:`unlink` once every rank has attached."""

    def __init__(self, path: str, world: int, rank: int, n: int, create: bool):
        self.path, self.world, self.rank, self.n = path, world, rank, n
        self.row = struct.Struct(f"<{n + 2}q")
        self.slot_bytes = self.row.size
        #: the byte offset of rank r's slot for an even call (``offsets[0][r]``) and an odd one (``offsets[1][r]``)
        self.offsets = tuple([(2 * r + parity) * self.slot_bytes for r in range(world)] for parity in (0, 1))
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
        #: the peers whose rows this rank reads (:attr:`pending`: those not read yet in the current call)
        self.others = [r for r in range(world) if r != rank]
        self.pending = self.others

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

    def allgather(self, call: int, words: bytes, out: bytearray) -> bool:
        """Publish this rank's ``words`` for call number ``call`` (>= 1, +1 per call) and fill ``out`` with the rows
        of every rank that published it already: True when that is every rank, else :meth:`wait` for the rest."""
        vals = self.words.unpack(words)
        crc = zlib.crc32(words, call & 0xFFFFFFFF)
        self.row.pack_into(self.mm, self.offsets[call & 1][self.rank], call, crc, *vals)
        step = self.words.size
        out[self.rank * step:(self.rank + 1) * step] = words
        self.pending = self.others
        return self._read(call, out)

    def wait(self, call: int, out: bytearray, timeout_s: float, on_wait=None) -> bool:
        """After :meth:`allgather` returned False: the rows of the :attr:`pending` ranks into ``out`` as they come.
        False when some rank did not publish within ``timeout_s`` (:attr:`pending`: those ranks). ``on_wait(pending
        ranks)`` is called every ``CHECK_EVERY_S`` s of waiting and may raise."""
        deadline = None

        def check() -> bool:
            nonlocal deadline
            if deadline is None:
                deadline = time.monotonic() + timeout_s
            elif time.monotonic() > deadline:
                return True
            elif on_wait is not None:
                on_wait(self.pending)
            return False

        return poll(functools.partial(self._read, call, out), check)

    def _read(self, call: int, out: bytearray) -> bool:
        """Copy into ``out`` the rows of the :attr:`pending` ranks that carry call ``call`` (whole: the crc matches);
        :attr:`pending` keeps the others. True when none is left."""
        still, step, offsets = [], self.words.size, self.offsets[call & 1]
        for r in self.pending:
            off = offsets[r]
            got_call, got_crc = _HEAD.unpack_from(self.mm, off)
            if got_call == call:
                body = self.mm[off + 16: off + 16 + step]
                if zlib.crc32(body, call & 0xFFFFFFFF) == got_crc:
                    out[r * step:(r + 1) * step] = body
                    continue
            still.append(r)
        self.pending = still
        return not still
