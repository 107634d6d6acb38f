"""The fast transport's symmetric heaps: each :meth:`alloc` is collective over the lane's group and gives the local
address and every group rank's copy as mapped here (a :class:`Segment`).

  * ``nvshmem`` (default): nvshmem4py, one runtime per process, bootstrapped over the lane's group only (NVSHMEM
    ranks = group ranks); peers' copies through ``nvshmem_ptr`` (``get_peer_buffer``), i.e. CUDA P2P.
  * ``ipc``: ``cudaMalloc`` + ``cudaIpcGetMemHandle``, handles exchanged over the lane's group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .collective import group_barrier


class _CudaMemory:
    """A raw device allocation seen by torch through ``__cuda_array_interface__`` (no copy)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                         "strides": None}


@dataclass
class Segment:
    """One symmetric allocation: its address here and every group rank's copy as mapped here."""

    local: int
    peers: list
    nbytes: int
    handle: object = None


class NvshmemHeap:
    """NVSHMEM bootstrapped over ``group`` only. The constructor is local; :meth:`start` is collective."""

    name = "nvshmem"
    _initialized = False
    _in_init = False  # an init entered and not returned (stuck in its bootstrap): never start again in this process

    def __init__(self, ext, group: dist.ProcessGroup, device: torch.device):
        import nvshmem.core as nvshmem
        from cuda.core import Device

        self.nvshmem, self.group, self.device = nvshmem, group, device
        self.dev = Device(device.index)
        self.dev.set_current()

    def start(self, stage, exchange) -> None:
        """``stage(name, fn, bounded=False)`` runs ``fn`` on every rank, raising on every rank if any failed
        (:func:`.start.start`); ``exchange(what, obj) -> list``: the start's bounded all-gather."""
        if NvshmemHeap._initialized:
            return
        import numpy as np

        nvshmem, me, n = self.nvshmem, self.group.rank(), self.group.size()
        os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
        os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")  # one node: P2P only, no IB probing
        # a small initial heap: NVSHMEM maps more on demand (CUDA VMM); the pool's ceiling bounds it
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(512 << 20))

        def make_uid():
            if NvshmemHeap._in_init:
                raise RuntimeError("an earlier NVSHMEM init of this process never returned (stuck in its bootstrap); "
                                   "NVSHMEM cannot start again in this process")
            if me != 0:
                return None
            return bytes(nvshmem.get_unique_id()._data.view(np.int8).tobytes())

        payload = stage("NVSHMEM unique-ID creation", make_uid)
        uid_bytes = exchange("NVSHMEM unique-ID exchange", payload)[0]

        def init():  # in a helper thread (bounded): the CUDA device is current per thread
            NvshmemHeap._in_init = True
            try:
                self.dev.set_current()
                uid = nvshmem.get_unique_id(empty=True)
                uid._data.view(np.int8)[:] = np.frombuffer(uid_bytes, dtype=np.int8)
                nvshmem.init(device=self.dev, uid=uid, rank=me, nranks=n, initializer_method="uid")
                NvshmemHeap._initialized = True
            finally:
                NvshmemHeap._in_init = False

        stage("NVSHMEM init (bootstrapped over the CP group)", init, bounded=True)

    def alloc(self, nbytes: int) -> Segment:
        """Collective over the group (NVSHMEM spans exactly the group)."""
        buf = self.nvshmem.buffer(nbytes, release=False, except_on_del=False)
        local = int(buf.handle)
        peers = []
        me = self.group.rank()
        for pe in range(self.group.size()):
            if pe == me:
                peers.append(local)
                continue
            try:
                peers.append(int(self.nvshmem.get_peer_buffer(buf, pe).handle))
            except Exception as e:  # noqa: BLE001
                raise RuntimeError(
                    f"group rank {pe}'s GPU is not P2P-reachable from group rank {me} (nvshmem_ptr gave no mapping: {e})"
                ) from e
        return Segment(local, peers, nbytes, buf)

    def free(self, seg: Segment) -> None:
        self.nvshmem.free(seg.handle)

    def close(self) -> None:
        if NvshmemHeap._initialized:
            self.nvshmem.finalize()
            NvshmemHeap._initialized = False


class IpcHeap:
    """``cudaMalloc`` + CUDA IPC handles exchanged over ``group``."""

    name = "ipc"

    def __init__(self, ext, group: dist.ProcessGroup, device: torch.device):
        self.ext, self.group, self.dev = ext, group, device.index

    def start(self, stage, exchange) -> None:
        pass

    def alloc(self, nbytes: int) -> Segment:
        """Collective over the group; a failure on any rank raises on every rank."""
        local, mine = None, None
        try:
            local = self.ext.ipc_malloc(self.dev, nbytes)
            mine = (self.ext.ipc_handle(self.dev, local), None)
        except Exception as e:  # noqa: BLE001 - every rank must learn it
            mine = (None, f"{type(e).__name__}: {e}")
        handles = [None] * self.group.size()
        dist.all_gather_object(handles, mine, group=self.group)
        bad = [(r, e) for r, (_, e) in enumerate(handles) if e is not None]
        if bad:
            if local is not None:
                self.ext.device_free(self.dev, local)
            raise RuntimeError(f"CUDA IPC allocation of {nbytes} bytes failed on "
                               + "; ".join(f"group rank {r}: {e}" for r, e in bad))
        me = self.group.rank()
        peers = [local if r == me else self.ext.ipc_open(self.dev, h) for r, (h, _) in enumerate(handles)]
        return Segment(local, peers, nbytes, [p for r, p in enumerate(peers) if r != me])  # handle: the opened ones

    def free(self, seg: Segment) -> None:
        for p in seg.handle:
            self.ext.ipc_close(self.dev, p)
        group_barrier(self.group, self.dev)  # every peer closed its mapping before the memory goes
        self.ext.device_free(self.dev, seg.local)

    def close(self) -> None:
        pass


HEAPS = {"nvshmem": NvshmemHeap, "ipc": IpcHeap}
