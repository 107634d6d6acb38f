"""Runtime of the fast transport: symmetric heap (NVSHMEM or CUDA IPC), buffer pool, the lane, the tuner.

Imported only when a fast call runs on CUDA (never on CPU machines). See :mod:`cp_ops.transport.fast` for
the public functions and the settings.

Heap. One per process, allocated once at the first fast call and split by a bump allocator:
  * ``nvshmem`` (default): NVSHMEM through nvshmem4py, one runtime per process, bootstrapped by a unique-ID
    broadcast over the default torch.distributed group (collective over *all* ranks of the job: every
    process makes its first fast call together, as SPMD programs do). One symmetric ``nvshmem.core.buffer``
    holds the control block and the pool; peers' copies are reached through ``nvshmem_ptr``
    (``get_peer_buffer``), i.e. CUDA P2P loads/stores and copy-engine copies.
  * ``ipc``: ``cudaMalloc`` + ``cudaIpcGetMemHandle``, handles exchanged over the lane's group.
Both give the same thing to the data path: a local base and the peers' bases, with symmetric offsets.

Pool. Buffers keyed by (role, shape, dtype), two slots each (double buffering), allocated once and reused;
the pool is bounded by ``pool_gb``; overflow raises a RuntimeError naming ``CP_OPS_FAST_POOL_GB``. An output
tensor of a fast call is a view of a pool slot: it stays valid until the second-next call with the same key
(every layer of a DiT reuses the same two slots), so clone it to keep it longer.

Safety. A peer writes into our slot only after our *ready* flag reached the call's epoch, and our begin
kernel raises it only when our stream reaches that call, i.e. after every consumer of earlier calls that
was enqueued before it. Epochs are uint64 device counters (no wrap), read by the kernels from device
memory, so a captured CUDA graph advances them on replay.
"""

from __future__ import annotations

import logging
import os
import socket
import statistics
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import config
from . import _fast_build

log = logging.getLogger("cp_ops")

_ALIGN = 256
_GB = 1 << 30


class _CudaMemory:
    """A raw device allocation seen by torch through ``__cuda_array_interface__`` (no copy)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


# ---- heaps --------------------------------------------------------------------------------------
class _NvshmemHeap:
    name = "nvshmem"
    _initialized = False

    def __init__(self, ext, group: dist.ProcessGroup, device: torch.device, nbytes: int):
        import numpy as np
        import nvshmem.core as nvshmem
        from cuda.core import Device

        self.nvshmem = nvshmem
        world_rank, world_size = dist.get_rank(), dist.get_world_size()
        if not _NvshmemHeap._initialized:
            os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
            os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")  # one node: P2P only, no IB probing
            want = nbytes + 256 * (1 << 20)
            if int(_parse_size(os.environ.get("NVSHMEM_SYMMETRIC_SIZE", "0"))) < want:
                os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(want)
            dev = Device(device.index)
            dev.set_current()
            uid = nvshmem.get_unique_id(empty=(world_rank != 0))
            obj = [bytes(uid._data.view(np.int8).tobytes()) if world_rank == 0 else None]
            dist.broadcast_object_list(obj, src=0)  # over the default group: NVSHMEM spans the job
            uid._data.view(np.int8)[:] = np.frombuffer(obj[0], dtype=np.int8)
            nvshmem.init(device=dev, uid=uid, rank=world_rank, nranks=world_size, initializer_method="uid")
            _NvshmemHeap._initialized = True
        self.buf = nvshmem.buffer(nbytes, release=False, except_on_del=False)  # collective over the job
        self.local = int(self.buf.handle)
        ranks = dist.get_process_group_ranks(group)
        self.peers = []
        for pe in ranks:
            if pe == world_rank:
                self.peers.append(self.local)
                continue
            try:
                self.peers.append(int(nvshmem.get_peer_buffer(self.buf, pe).handle))
            except Exception as e:  # noqa: BLE001
                raise RuntimeError(
                    f"transport='fast' cannot run: rank {pe}'s GPU is not P2P-reachable from rank {world_rank} "
                    f"(nvshmem_ptr returned no mapping: {e})"
                ) from e
        self.nbytes = nbytes

    def close(self, group):
        torch.cuda.synchronize()
        dist.barrier(group=group)
        self.nvshmem.free(self.buf)
        self.nvshmem.finalize()
        _NvshmemHeap._initialized = False


class _IpcHeap:
    name = "ipc"

    def __init__(self, ext, group: dist.ProcessGroup, device: torch.device, nbytes: int):
        self.ext, self.dev = ext, device.index
        self.local = ext.ipc_malloc(self.dev, nbytes)
        handles = [None] * group.size()
        dist.all_gather_object(handles, ext.ipc_handle(self.dev, self.local), group=group)
        me = group.rank()
        self.opened = []
        self.peers = []
        for r, h in enumerate(handles):
            if r == me:
                self.peers.append(self.local)
            else:
                p = ext.ipc_open(self.dev, h)
                self.opened.append(p)
                self.peers.append(p)
        self.nbytes = nbytes

    def close(self, group):
        torch.cuda.synchronize()
        dist.barrier(group=group)
        for p in self.opened:
            self.ext.ipc_close(self.dev, p)
        dist.barrier(group=group)
        self.ext.device_free(self.dev, self.local)


def _parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    if s.endswith("B") and len(s) > 1 and s[-2] in mult:
        return int(float(s[:-2]) * mult[s[-2]])
    return int(s or 0)


# ---- pool ---------------------------------------------------------------------------------------
class Pool:
    """Bump allocator over the symmetric heap; buffers keyed by (role, shape, dtype), two slots each."""

    def __init__(self, heap_tensor: torch.Tensor, start: int, capacity: int, cap_gb: float, make=None):
        # make(offset, nbytes) -> uint8 tensor over that range. Each slot gets its own storage, so two
        # outputs of one op (k_full, v_full) do not alias in torch.library's eyes.
        self.heap = heap_tensor
        self.make = make or (lambda off, n: heap_tensor[off : off + n])
        self.start, self.capacity, self.cap_gb = start, capacity, cap_gb
        self.used = 0
        self.buffers: dict[tuple, list[torch.Tensor]] = {}
        self.turn: dict[tuple, int] = {}

    def get(self, role: str, shape: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        """Next slot for the key, and its byte offset in the heap (same on every rank)."""
        key = (role, tuple(shape), dtype)
        if key not in self.buffers:
            n = 1
            for s in shape:
                n *= s
            nbytes = n * torch.empty((), dtype=dtype).element_size()
            size = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
            if self.used + 2 * size > self.capacity:
                raise RuntimeError(
                    f"cp_ops fast transport pool is full: {role} {tuple(shape)} {dtype} needs 2 x {nbytes / 2**20:.1f} MiB "
                    f"(double-buffered); {self.used / 2**20:.1f} of {self.capacity / 2**20:.1f} MiB already hold "
                    f"{2 * len(self.buffers)} buffers. Raise CP_OPS_FAST_POOL_GB (now {self.cap_gb:g}) or call "
                    "cp_ops.transport.fast.configure(pool_gb=...) before the first fast call (after fast.shutdown())"
                )
            slots = []
            for _ in range(2):
                off = self.start + self.used
                t = self.make(off, nbytes).view(dtype).view(shape)
                slots.append((t, off))
                self.used += size
            self.buffers[key] = slots
            self.turn[key] = 0
        i = self.turn[key]
        self.turn[key] = 1 - i
        return self.buffers[key][i]

    def describe(self) -> dict:
        return {
            "capacity_bytes": self.capacity,
            "used_bytes": self.used,
            "buffers": [
                {"role": k[0], "shape": list(k[1]), "dtype": str(k[2]).replace("torch.", ""), "slots": 2}
                for k in self.buffers
            ],
        }


# ---- work ---------------------------------------------------------------------------------------
class FastWork(dist.Work):
    """Completion of one fast call. ``wait()`` makes the current CUDA stream wait for every chunk (it does
    not block the host; a spin kernel on that stream watches the peers' arrival flags); ``wait_source(src)``
    for the chunk of group rank ``src`` only; ``is_completed()`` reports this rank's own copies only."""

    def __init__(self, lane: "Lane", call: int):
        super().__init__()
        self.lane, self.call = lane, call
        self._waited: set = set()  # streams already made to wait (k_full and v_full share one work)

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - c10d signature
        s = torch.cuda.current_stream(self.lane.device).cuda_stream
        if s not in self._waited:
            self.lane.ext_lane.wait(s, self.call)
            self._waited.add(s)
        return True

    def wait_source(self, src: int) -> None:
        self.lane.ext_lane.wait_source(torch.cuda.current_stream(self.lane.device).cuda_stream, self.call, src)

    def is_completed(self) -> bool:
        return self.lane.ext_lane.query(self.call)


# ---- lane ---------------------------------------------------------------------------------------
@dataclass
class Decision:
    path: int  # 0 = copy engine, 1 = SM kernel
    inflight: int
    split: int
    sm_blocks: int
    ms: float | None = None

    def label(self) -> str:
        if self.path == 0:
            return f"ce(inflight={self.inflight},split={self.split})"
        return f"sm(inflight={self.inflight},blocks={self.sm_blocks})"


@dataclass
class Lane:
    group: dist.ProcessGroup
    ranks: list
    device: torch.device
    ext: object
    ext_lane: object
    heap: object
    pool: Pool
    fabric: str
    streams: list
    calls: int = 0
    decisions: dict = field(default_factory=dict)

    @property
    def world(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        return self.group.rank()

    # -- one call -----------------------------------------------------------------------------
    def launch(self, key: tuple, descs: list, inputs: list, force: Decision | None = None) -> FastWork:
        d = force or self.decide(key, descs, inputs)
        cur = torch.cuda.current_stream(self.device)
        # the caching allocator must not hand the inputs out while the side streams (local + send) read them
        readers = self.streams[:1] + self.streams[2 : 2 + min(d.inflight, max(1, self.world - 1)) * max(1, d.split)]
        for t in inputs:
            for s in readers:
                t.record_stream(s)
        call = self.calls
        self.calls += 1
        self.ext_lane.launch(cur.cuda_stream, call, descs, d.path, d.inflight, d.split, d.sm_blocks)
        return FastWork(self, call)

    def candidates(self, aligned: bool) -> list[Decision]:
        w = self.world
        remote = max(1, w - 1)
        infl = [1] if self.fabric != "nvlink" else sorted({1, remote})
        out = []
        if config.settings.fast_path in ("auto", "ce") or not aligned:
            for i in infl:
                for s in (1, 2):
                    out.append(Decision(0, i, s, 0))
        if config.settings.fast_path in ("auto", "sm") and aligned:
            for b in (32, 64, 128):
                out.append(Decision(1, infl[-1], 1, b))
        return out

    def default(self, aligned: bool) -> Decision:
        remote = max(1, self.world - 1)
        if config.settings.fast_path == "sm" and aligned:
            return Decision(1, remote if self.fabric == "nvlink" else 1, 1, 64)
        return Decision(0, remote if self.fabric == "nvlink" else 1, 1, 0)

    def decide(self, key: tuple, descs: list, inputs: list) -> Decision:
        """Fan-out for this shape: measured once (max over ranks, so every rank picks the same), cached."""
        full_key = (config.settings.fast_path,) + key
        if full_key in self.decisions:
            return self.decisions[full_key]
        aligned = _aligned(descs)
        if not config.settings.fast_tune or torch.cuda.is_current_stream_capturing():
            return self.default(aligned)  # deterministic on every rank; not cached, so eager calls still tune
        cands = self.candidates(aligned)
        times = []
        for c in cands:
            times.append(self._time(descs, inputs, c))
        t = torch.tensor(times, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        times = t.tolist()
        best = min(range(len(cands)), key=lambda i: times[i])
        d = cands[best]
        d.ms = times[best]
        self.decisions[full_key] = d
        log.info("cp_ops fast: %s -> %s (%.3f ms; tried %s)", key, d.label(), d.ms,
                 ", ".join(f"{c.label()}={x:.3f}" for c, x in zip(cands, times)))
        return d

    def _time(self, descs, inputs, c: Decision, warmup: int = 2, reps: int = 5) -> float:
        ms = []
        for i in range(warmup + reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            self.launch(None, descs, inputs, force=c).wait()
            b.record()
            b.synchronize()
            if i >= warmup:
                ms.append(a.elapsed_time(b))
        return statistics.median(ms)

    def describe(self) -> dict:
        return {
            "group_ranks": list(self.ranks),
            "width": self.world,
            "device": str(self.device),
            "fabric": self.fabric,
            "heap": self.heap.name,
            "calls": self.calls,
            "pool": self.pool.describe(),
            "decisions": {"/".join(map(str, k)): d.label() for k, d in self.decisions.items()},
        }

    def close(self):
        torch.cuda.synchronize(self.device)
        self.ext_lane.release()
        self.heap.close(self.group)


def _aligned(descs: list) -> bool:
    for ds in descs:
        for dst_off, src, width, height, dpitch, spitch in ds:
            if (dst_off | src | width | dpitch | spitch) & 15:
                return False
    return True


# ---- lane creation (collective over the group) ---------------------------------------------------
def probe_group(group: dist.ProcessGroup, device: torch.device, ext) -> tuple[str | None, str]:
    """(reason the group cannot host a fast lane or None, fabric 'nvlink' | 'shared-egress'); agreed by all ranks."""
    props = torch.cuda.get_device_properties(device)
    me = (socket.gethostname(), str(getattr(props, "uuid", device.index)), device.index)
    infos = [None] * group.size()
    dist.all_gather_object(infos, me, group=group)
    reason, fabric = None, "nvlink"
    hosts = sorted({i[0] for i in infos})
    if len(hosts) > 1:
        reason = f"the CP group spans more than one node (hosts {hosts}); the fast transport is single-node"
    else:
        local_by_uuid = {}
        for i in range(torch.cuda.device_count()):
            local_by_uuid[str(getattr(torch.cuda.get_device_properties(i), "uuid", i))] = i
        for r, (_, uuid, _) in enumerate(infos):
            if uuid == me[1]:
                continue
            idx = local_by_uuid.get(uuid)
            if idx is None:
                reason = (
                    f"group rank {r}'s GPU {uuid} is not visible to this process (CUDA_VISIBLE_DEVICES?), so it is "
                    "not P2P-reachable; the fast transport needs every GPU of the group visible to every rank"
                )
                break
            access, atomics, _perf = ext.p2p_attributes(device.index, idx)
            if not access:
                reason = f"GPU {device.index} cannot access peer GPU {idx} (group rank {r}) over CUDA P2P"
                break
            if not atomics:
                fabric = "shared-egress"
    reasons = [None] * group.size()
    dist.all_gather_object(reasons, (reason, fabric), group=group)
    for r, f in reasons:
        if r is not None:
            return r, fabric
    return None, ("shared-egress" if any(f != "nvlink" for _, f in reasons) else "nvlink")


class GroupUnfit(RuntimeError):
    """The group cannot host a fast lane (extension build, node span, P2P reach); raised before any symmetric
    memory exists, so ``transport='auto'`` can fall back to the torch transport cleanly."""


def create_lane(group: dist.ProcessGroup, device: torch.device) -> Lane:
    ext, why = _fast_build.load()
    if ext is None:
        raise GroupUnfit(f"transport='fast' cannot run: {why}")
    reason, fabric = probe_group(group, device, ext)
    if reason is not None:
        raise GroupUnfit(f"transport='fast' cannot run: {reason}")
    ctrl = ext.Lane.ctrl_bytes()
    cap = int(config.settings.fast_pool_gb * _GB)
    nbytes = ctrl + cap
    heap_cls = {"nvshmem": _NvshmemHeap, "ipc": _IpcHeap}.get(config.settings.fast_heap)
    if heap_cls is None:
        raise ValueError(f"CP_OPS_FAST_HEAP must be 'nvshmem' or 'ipc'; got {config.settings.fast_heap!r}")
    heap = heap_cls(ext, group, device, nbytes)
    w = group.size()
    n_send = max(1, w - 1) * 2
    ext_lane = ext.Lane(group.rank(), w, device.index, heap.local, heap.peers, n_send)
    dist.barrier(group=group)  # every control block is zeroed before any peer writes a flag
    heap_tensor = torch.as_tensor(_CudaMemory(heap.local, nbytes), device=device)
    streams = [torch.cuda.ExternalStream(s, device=device) for s in ext_lane.streams()]
    pool = Pool(heap_tensor, ctrl, cap, config.settings.fast_pool_gb,
                make=lambda off, n: torch.as_tensor(_CudaMemory(heap.local + off, n), device=device))
    return Lane(group, dist.get_process_group_ranks(group), device, ext, ext_lane, heap, pool, fabric, streams)
