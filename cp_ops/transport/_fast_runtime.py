"""Runtime of the fast transport: symmetric heap (NVSHMEM or CUDA IPC), call slots, buffer pool, lane, tuner.

Imported only when a fast call runs on CUDA (never on CPU machines), except the pure-Python parts the CPU
tests drive (:class:`CallSlots`, :class:`Pool`, :func:`start`). See :mod:`cp_ops.transport.fast`.

Heap. Symmetric allocations made collectively over the lane's group, on demand:
  * ``nvshmem`` (default): NVSHMEM through nvshmem4py, one runtime per process, bootstrapped by a unique-ID
    broadcast over the *lane's group* (NVSHMEM ranks = group ranks), so start-up is collective over that group
    only. Each allocation is an ``nvshmem.core.buffer``; peers' copies are reached through ``nvshmem_ptr``
    (``get_peer_buffer``), i.e. CUDA P2P loads/stores and copy-engine copies.
  * ``ipc``: ``cudaMalloc`` + ``cudaIpcGetMemHandle``, handles exchanged over the lane's group.
Both give the data path a local address and every peer's address of each allocation.

Pool. Buffers keyed by (role, shape, dtype), ``slots_per_key`` slots each, each key one symmetric allocation
made at its first use. Bounded by ``settings.fast_pool_gb`` (a ceiling, not a reservation): a new key that
does not fit evicts least-recently-used keys that no rank still needs (no slot in flight, no output tensor
referenced outside the pool; agreed over the group), else raises naming ``CP_OPS_FAST_POOL_GB``. A launch
that would overwrite a slot whose previous output was not waited yet raises (it never overwrites). Every
rank makes the same allocation decisions (the same call sequence); each new allocation compares its number,
key and size over the group and raises on a mismatch.

Call slots. Each call owns one of ``n_slots`` device flag slots until it is waited (``csrc/cp_fast.cu`` has
the protocol); slots are given round-robin (the same sequence on every rank); a launch whose slot still
holds an un-waited call raises naming the bound (no silent reuse). Slots used inside a CUDA-graph capture
stay with that graph (never reused by eager calls) until :meth:`Lane.close`.

CUDA graphs. Everything a replay needs is on the device: a slot's generation is raised by the begin kernel
(``gen[s] + 1`` read on the device), every wait compares against it, timeouts use ``%globaltimer``, events are
made when the lane starts, per-shape decisions fall back to the deterministic default while capturing. What
cannot be captured raises a named error at capture time: the lane's start and a pool key's first allocation
(collective, synchronizing). Pool keys used inside a capture are never evicted (the graph writes them at every
replay) until :meth:`Lane.close`.

Bounded waits. Every device spin gives up after ``settings.timeout_s`` and records what it waited for in
mapped host memory; :meth:`Lane.check` (called at every launch and wait, and by ``FastTransport.check``)
raises it as a RuntimeError naming the call, the peer, the flag and the values.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import statistics
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import config

log = logging.getLogger("cp_ops")

_ALIGN = 256
_GB = 1 << 30
N_SLOTS = 256  # device flag slots: the most un-waited fast calls in flight at once
_SPARE_WORKS = 8  # finished works a lane keeps for reuse (Lane._work)
_FLAGS = {1: "ready", 2: "arrived", 3: "arrived (wait_source)"}


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


def _parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    if s.endswith("B") and len(s) > 1 and s[-2] in mult:
        return int(float(s[:-2]) * mult[s[-2]])
    return int(s or 0)


# ---- heaps --------------------------------------------------------------------------------------
@dataclass
class Segment:
    """One symmetric allocation: its address here and every group rank's copy as mapped here."""

    local: int
    peers: list
    nbytes: int
    handle: object = None


class NvshmemHeap:
    """NVSHMEM bootstrapped over ``group`` only (UID broadcast over the group; NVSHMEM rank = group rank).
    The constructor is local (imports, device); :meth:`start` is collective over the group."""

    name = "nvshmem"
    _initialized = False

    def __init__(self, ext, group: dist.ProcessGroup, device: torch.device):
        import nvshmem.core as nvshmem
        from cuda.core import Device

        self.nvshmem, self.group, self.device = nvshmem, group, device
        self.dev = Device(device.index)
        self.dev.set_current()

    def start(self, stage) -> None:
        """``stage(name, fn)`` runs ``fn`` on every rank and raises on every rank if any rank failed."""
        if NvshmemHeap._initialized:
            return
        import numpy as np

        nvshmem, me, n = self.nvshmem, self.group.rank(), self.group.size()
        os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
        os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")  # one node: P2P only, no IB probing
        # a small initial heap: NVSHMEM maps more on demand (CUDA VMM); the pool's ceiling bounds it
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(512 << 20))

        def make_uid():
            if me != 0:
                return None
            return bytes(nvshmem.get_unique_id()._data.view(np.int8).tobytes())

        payload = stage("NVSHMEM unique-ID creation", make_uid)
        obj = [payload]
        dist.broadcast_object_list(obj, src=dist.get_global_rank(self.group, 0), group=self.group)

        def init():
            uid = nvshmem.get_unique_id(empty=True)
            uid._data.view(np.int8)[:] = np.frombuffer(obj[0], dtype=np.int8)
            nvshmem.init(device=self.dev, uid=uid, rank=me, nranks=n, initializer_method="uid")
            NvshmemHeap._initialized = True

        stage("NVSHMEM init (bootstrapped over the CP group)", init)

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

    def start(self, stage) -> None:
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
        peers, opened = [], []
        for r, (h, _) in enumerate(handles):
            if r == me:
                peers.append(local)
            else:
                p = self.ext.ipc_open(self.dev, h)
                opened.append(p)
                peers.append(p)
        return Segment(local, peers, nbytes, opened)

    def free(self, seg: Segment) -> None:
        for p in seg.handle:
            self.ext.ipc_close(self.dev, p)
        group_barrier(self.group, self.dev)  # every peer closed its mapping before the memory goes
        self.ext.device_free(self.dev, seg.local)

    def close(self) -> None:
        pass


HEAPS = {"nvshmem": NvshmemHeap, "ipc": IpcHeap}


# ---- call slots ---------------------------------------------------------------------------------
class CallSlots:
    """Device flag slots for calls in flight: round-robin, never reused before their call was waited."""

    def __init__(self, n: int):
        self.n = n
        self.owner: list = [None] * n  # call index holding the slot (launched, not waited), or None
        self.pinned: set = set()  # slots captured into a CUDA graph
        self.next = 0

    def acquire(self, call: int, capturing: bool = False) -> int:
        s = self.next
        for _ in range(self.n):
            if s in self.pinned:
                s = (s + 1) % self.n
                continue
            if self.owner[s] is not None:
                inflight = sorted(c for c in self.owner if c is not None)
                raise RuntimeError(
                    f"cp_ops fast transport: call {call} needs a flag slot but slot {s} still holds call {self.owner[s]}, "
                    f"launched and not waited; {len(inflight)} fast calls are in flight (calls {inflight[:8]}"
                    f"{'...' if len(inflight) > 8 else ''}), the most the lane allows is {self.n - len(self.pinned)}. "
                    "Wait each launch (torch.ops._c10d_functional.wait_tensor / work.wait()) before launching more"
                )
            self.owner[s] = call
            self.next = (s + 1) % self.n
            if capturing:
                self.pinned.add(s)
            return s
        raise RuntimeError(
            f"cp_ops fast transport: every one of the {self.n} flag slots is held by a captured CUDA graph; "
            "release the lane (FastTransport.shutdown()) to free them"
        )

    def release(self, slot: int, call: int) -> None:
        if self.owner[slot] == call:
            self.owner[slot] = None

    def in_flight(self) -> list:
        return sorted(c for c in self.owner if c is not None)


# ---- pool ---------------------------------------------------------------------------------------
@dataclass
class _Entry:
    key: tuple
    seg: Segment
    size: int  # bytes per slot (aligned)
    slots: list  # tensors
    baselines: list  # storage use count of each slot tensor with only the pool holding it
    pending: list  # call index per slot whose output is not waited yet, or None
    turn: int = 0
    last_use: int = 0
    captured: bool = False  # used inside a CUDA-graph capture: the graph writes it on replay, never evicted
    addrs: list = field(default_factory=list)  # per slot: [its address on each rank as mapped here] (made once)


def _holders(slots: list) -> list:
    """Per slot tensor: (Python references, storage users). Larger than at creation = a caller still holds the
    output or a view of it (the same code path measures both, so the counts compare)."""
    out = []
    for i in range(len(slots)):
        t = slots[i]
        out.append((sys.getrefcount(t), torch._C._storage_Use_Count(t.untyped_storage()._cdata)))
    return out


class Pool:
    """Symmetric buffers keyed by (role, shape, dtype), ``slots`` each; grows on demand up to ``cap_bytes``.

    ``alloc(nbytes) -> Segment`` and ``free(segment)`` are collective over the group; ``make(ptr, nbytes)``
    gives a uint8 tensor over local memory; ``agree(obj) -> list`` all-gathers a small object over the group;
    ``quiesce()`` waits until no rank's device touches the pool (before a free)."""

    def __init__(self, alloc, free, make, agree, quiesce, cap_bytes: int, cap_gb: float, slots: int = 2):
        self.alloc_fn, self.free_fn, self.make, self.agree, self.quiesce = alloc, free, make, agree, quiesce
        self.capacity, self.cap_gb, self.slots = cap_bytes, cap_gb, slots
        self.used = 0
        self.allocs = 0  # allocations made so far (compared over the group at each new one)
        self.evictions = 0
        self.entries: dict[tuple, _Entry] = {}
        self.clock = 0

    def get(self, role: str, shape: tuple, dtype: torch.dtype, call: int,
            capturing: bool = False) -> tuple[torch.Tensor, list, tuple]:
        """Next slot of the key for ``call``: (tensor, [slot address on each rank as mapped here], ticket); the
        address list is the pool's own (made once per key): read it, do not change it.
        ``capturing``: the launch is being captured into a CUDA graph (the key must exist; it is then kept until
        :meth:`release_all`, since the graph writes its slots at every replay).

        Raises:
            RuntimeError: the slot still holds an output that was not waited (more launches of this key in
                flight than ``slots``); the key does not fit under the ceiling; ranks disagree on the allocation;
                a new key while capturing (allocation is collective and synchronizes: not capturable).
        """
        key = (role, tuple(shape), dtype)
        e = self.entries.get(key)
        if e is None:
            if capturing:
                raise RuntimeError(
                    f"cp_ops fast transport: the first call of {role} {tuple(shape)} {str(dtype).replace('torch.', '')} "
                    "is being captured into a CUDA graph, but its symmetric buffer is allocated collectively by that "
                    "first call (a group-wide exchange and a device synchronization, which a capture cannot contain): "
                    "run the captured code once eagerly before capturing (torch.cuda.graph warm-up; "
                    "torch.compile(mode='reduce-overhead') does this)")
            e = self._allocate(key, shape, dtype)
        if capturing:
            e.captured = True
        i = e.turn
        if e.pending[i] is not None:
            raise RuntimeError(
                f"cp_ops fast transport: call {call} would overwrite pool slot {i} of {role} {tuple(shape)} "
                f"{str(dtype).replace('torch.', '')}, which still holds the output of call {e.pending[i]} (launched, "
                f"not waited); at most {self.slots} launches of one shape may be in flight (slots_per_key="
                f"{self.slots}): wait an output before launching the next one of the same shape"
            )
        e.turn = (i + 1) % self.slots
        self.clock += 1
        e.last_use = self.clock
        e.pending[i] = call
        return e.slots[i], e.addrs[i], (key, i, call)

    def consumed(self, ticket: tuple) -> None:
        """The output of ``ticket`` (from :meth:`get`) was waited: its slot may be written again."""
        key, i, call = ticket
        e = self.entries.get(key)
        if e is not None and e.pending[i] == call:
            e.pending[i] = None

    def _evictable(self, e: _Entry) -> bool:
        if e.captured or any(p is not None for p in e.pending):
            return False
        now = _holders(e.slots)
        return all(a[0] <= b[0] and a[1] <= b[1] for a, b in zip(now, e.baselines))

    def _why_held(self, e: _Entry) -> str:
        if e.captured:
            return "captured by a CUDA graph (kept until FastTransport.shutdown())"
        calls = [p for p in e.pending if p is not None]
        if calls:
            return f"in flight: call {calls[0]}"
        now = _holders(e.slots)
        refs = [f"slot {i}: refs {a[0]}>{b[0]} or storage users {a[1]}>{b[1]}"
                for i, (a, b) in enumerate(zip(now, e.baselines)) if a[0] > b[0] or a[1] > b[1]]
        return "referenced, " + "; ".join(refs) if refs else "held on another rank"

    def _allocate(self, key, shape, dtype) -> _Entry:
        n = 1
        for s in shape:
            n *= s
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        size = max(_ALIGN, (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN)
        need = self.slots * size
        desc = f"{key[0]} {tuple(shape)} {str(dtype).replace('torch.', '')}"
        lru = sorted(self.entries.values(), key=lambda x: x.last_use)
        if self.used + need > self.capacity:
            gc.collect()  # outputs dropped in reference cycles must not look held (rare path: the pool is full)
        mine = (self.allocs, desc, need, [str(x.key) for x in lru if self._evictable(x)])
        views = self.agree(mine)
        if any(v[:3] != mine[:3] for v in views):
            raise RuntimeError(
                "cp_ops fast transport: ranks disagree on the pool allocation (number, buffer, bytes): "
                + "; ".join(f"rank {r}: {v[:3]}" for r, v in enumerate(views))
                + ". Every rank must make the same fast calls in the same order"
            )
        agreed = set(views[0][3]).intersection(*[set(v[3]) for v in views[1:]])
        victims, free_after = [], self.capacity - self.used
        for x in lru:
            if free_after >= need:
                break
            if str(x.key) in agreed:
                victims.append(x)
                free_after += self.slots * x.size
        if free_after < need:
            held = [f"{x.key[0]} {x.key[1]} ({self._why_held(x)})" for x in lru if str(x.key) not in agreed]
            raise RuntimeError(
                f"cp_ops fast transport pool is full: {desc} needs {self.slots} x {nbytes / 2**20:.1f} MiB; "
                f"{self.used / 2**20:.1f} of {self.capacity / 2**20:.1f} MiB hold {len(self.entries)} buffers, of which "
                f"{len(held)} are in use (in flight or referenced: {held[:6]}). Raise CP_OPS_FAST_POOL_GB "
                f"(now {self.cap_gb:g}) or fast.configure(pool_gb=...) after fast.shutdown()"
            )
        if victims:
            self.quiesce()
            for x in victims:
                del self.entries[x.key]
                self.used -= self.slots * x.size
                x.slots.clear()
                self.free_fn(x.seg)
                self.evictions += 1
                log.info("cp_ops fast: pool evicted %s %s (least recently used) for %s", x.key[0], x.key[1], desc)
        seg = self.alloc_fn(need)
        self.allocs += 1
        self.used += need
        slots = [self.make(seg.local + i * size, nbytes).view(dtype).view(shape) for i in range(self.slots)]
        base = _holders(slots)  # only the pool holds them now
        e = _Entry(key, seg, size, slots, base, [None] * self.slots,
                   addrs=[[p + i * size for p in seg.peers] for i in range(self.slots)])
        self.entries[key] = e
        return e

    def release_all(self) -> None:
        for e in list(self.entries.values()):
            e.slots.clear()
            self.free_fn(e.seg)
        self.entries.clear()
        self.used = 0

    def describe(self) -> dict:
        return {
            "capacity_bytes": self.capacity,
            "used_bytes": self.used,
            "allocations": self.allocs,
            "evictions": self.evictions,
            "buffers": [
                {"role": k[0], "shape": list(k[1]), "dtype": str(k[2]).replace("torch.", ""), "slots": self.slots}
                for k in self.entries
            ],
        }


# ---- work ---------------------------------------------------------------------------------------
def _current_stream(device: torch.device) -> int:
    """The current CUDA stream of ``device`` as its ``cudaStream_t`` (``torch.cuda.current_stream(device)
    .cuda_stream``, without building a Stream object: one C call, as Inductor's ``get_raw_stream``)."""
    idx = torch.cuda.current_device() if device.index is None else device.index
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # CUDA builds of torch have it
    return raw(idx) if raw is not None else torch.cuda.current_stream(idx).cuda_stream


class FastWork(dist.Work):
    """Completion of one fast call. ``wait()`` makes the current CUDA stream wait for every chunk (it does
    not block the host; a bounded spin kernel on that stream watches the peers' arrival flags);
    ``wait_source(src)`` for the chunk of group rank ``src`` only; ``is_completed()`` reports this rank's own
    copies only. Raises RuntimeError when a device wait of the lane timed out (see :meth:`Lane.check`)."""

    def __init__(self, lane: "Lane", call: int, slot: int, tickets: list):
        super().__init__()
        self.lane, self.call, self.slot, self.tickets = lane, call, slot, tickets
        self._waited: set = set()  # streams already made to wait (k_full and v_full share one work)
        self.ptrs: tuple = ()  # addresses of its outputs (FastTransport's wait_source map)

    def _reset(self, call: int, slot: int, tickets: list) -> None:
        """Reuse for a new launch (see :meth:`Lane._work`): only when waited and referenced by nobody."""
        self.call, self.slot, self.tickets = call, slot, tickets
        self._waited = set()

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - c10d signature
        lane = self.lane
        lane.check()
        s = _current_stream(lane.device)
        if s in self._waited:
            return True
        if lane.slots.owner[self.slot] != self.call:
            if not self._waited:
                raise RuntimeError(f"cp_ops fast transport: call {self.call} was already released (its lane was shut down)")
            raise RuntimeError(
                f"cp_ops fast transport: an output of call {self.call} is waited on a second stream after its flag slot "
                f"{self.slot} went to call {lane.slots.owner[self.slot]}; wait every output of one launch before "
                f"{lane.slots.n} more launches (or on the stream that waited first)")
        lane.ext_lane.wait(s, self.slot, not self._waited)
        if not self._waited:
            lane.slots.release(self.slot, self.call)
            for t in self.tickets:
                lane.pool.consumed(t)
        self._waited.add(s)
        return True

    def wait_source(self, src: int) -> None:
        self.lane.check()
        self.lane.ext_lane.wait_source(_current_stream(self.lane.device), self.slot, src)

    def is_completed(self) -> bool:
        self.lane.check()
        return self.lane.ext_lane.query(self.slot)


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


def format_error(err: list, ranks: list) -> str:
    flag, call, slot, peer, seen, want, ns = err
    what = _FLAGS.get(flag, f"flag {flag}")
    peer_txt = f"group rank {peer} (global rank {ranks[peer]})" if 0 <= peer < len(ranks) else f"rank {peer}"
    side = ("its begin (ready to receive)" if flag == 1 else "its data for this call")
    return (f"cp_ops fast transport: a device wait timed out after {ns / 1e9:.1f} s (CP_OPS_TIMEOUT_S): call {call} "
            f"(slot {slot}) waited for {peer_txt}'s {what} flag = {want}, saw {seen}; that peer never sent {side} "
            "(did it stop, crash, or skip this call?). The lane is unusable: call FastTransport.shutdown()")


@dataclass
class Lane:
    group: dist.ProcessGroup
    ranks: list
    device: torch.device
    ext: object
    ext_lane: object
    heap: object
    ctrl: Segment
    pool: Pool
    fabric: str
    streams: list
    slots: CallSlots
    calls: int = 0
    decisions: dict = field(default_factory=dict)
    # works kept for reuse (see _work); entry 0 is a sentinel only this list references
    spare: list = field(default_factory=lambda: [object()])

    @property
    def world(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        return self.group.rank()

    def check(self) -> None:
        """Raise the first device-wait timeout recorded on this lane (RuntimeError naming call, peer, flag)."""
        err = self.ext_lane.error()
        if err:
            raise RuntimeError(format_error(list(err), self.ranks))

    # -- one call -----------------------------------------------------------------------------
    def next_call(self) -> int:
        return self.calls

    def capturing(self) -> bool:
        """True while the current stream is capturing a CUDA graph (a launch then stays with the graph)."""
        return torch.cuda.is_current_stream_capturing()

    def launch(self, key: tuple, descs: list, inputs: list, tickets: list, force: Decision | None = None) -> FastWork:
        self.check()
        d = force or self.decide(key, descs, inputs)
        cur = _current_stream(self.device)
        # the caching allocator must not hand the inputs out while the side streams (local + send) read them
        readers = self.streams[: 1 + min(d.inflight, max(1, self.world - 1)) * max(1, d.split)]
        for t in inputs:
            for s in readers:
                t.record_stream(s)
        call = self.calls
        slot = self.slots.acquire(call, torch.cuda.is_current_stream_capturing())
        self.calls += 1
        try:
            self.ext_lane.launch(cur, call, slot, descs, d.path, d.inflight, d.split, d.sm_blocks)
        except Exception:
            self.slots.release(slot, call)
            raise
        return self._work(call, slot, tickets)

    def _work(self, call: int, slot: int, tickets: list) -> FastWork:
        """The work of a launch: a kept one that was waited and that nobody references any more (no Python
        name, no c10d registration: ``_register_work`` holds a Python reference until ``wait_tensor``), reset;
        else a new one (kept when there is room). A ``dist.Work`` subclass is built through pybind11 (measured as
        the largest single host cost of a fast launch on the GPU host), so the eager paths reuse a handful."""
        spare = self.spare
        base = -1
        for w in spare:  # the sentinel first: its count is the count of an object only this list holds
            n = sys.getrefcount(w)
            if base < 0:
                base = n
            elif n == base and w._waited:
                w._reset(call, slot, tickets)
                return w
        w = FastWork(self, call, slot, tickets)
        if len(spare) <= _SPARE_WORKS:
            spare.append(w)
        return w

    def candidates(self, aligned: bool, ce_only: bool = False) -> list[Decision]:
        """The fan-outs measured for one shape; ``ce_only``: copy-engine ones only (a transfer meant to run
        under compute, whose SMs an SM copy kernel would take), unless ``CP_OPS_FAST_PATH=sm`` asks for SM."""
        w = self.world
        remote = max(1, w - 1)
        infl = [1] if self.fabric != "nvlink" else sorted({1, remote})
        out = []
        sm_ok = aligned and (config.settings.fast_path == "sm" or (config.settings.fast_path == "auto" and not ce_only))
        if config.settings.fast_path in ("auto", "ce") or not aligned:
            for i in infl:
                for s in (1, 2):
                    out.append(Decision(0, i, s, 0))
        if sm_ok:
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
        ce_only = key[-1] == "under_compute"
        if not config.settings.fast_tune or torch.cuda.is_current_stream_capturing():
            return self.default(aligned)  # deterministic on every rank; not cached, so eager calls still tune
        cands = self.candidates(aligned, ce_only)
        times = [self._time(descs, inputs, c) for c in cands]
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
            self.launch(None, descs, inputs, [], force=c).wait()
            b.record()
            b.synchronize()
            if i >= warmup:
                ms.append(a.elapsed_time(b))
        self.check()
        return statistics.median(ms)

    def describe(self) -> dict:
        return {
            "group_ranks": list(self.ranks),
            "width": self.world,
            "device": str(self.device),
            "fabric": self.fabric,
            "heap": self.heap.name,
            "calls": self.calls,
            "call_slots": self.slots.n,
            "in_flight": len(self.slots.in_flight()),
            "pool": self.pool.describe(),
            "decisions": {"/".join(map(str, k)): d.label() for k, d in self.decisions.items()},
        }

    def close(self):
        del self.spare[1:]
        group_barrier(self.group, self.device)
        self.ext_lane.release()
        self.pool.release_all()
        self.heap.free(self.ctrl)
        group_barrier(self.group, self.device)
        self.heap.close()


def group_barrier(group: dist.ProcessGroup, device) -> None:
    """Host-side barrier over ``group``: every rank's host reaches it, and the device's prior work is done.

    Not ``dist.barrier``: ProcessGroupNCCL keeps the tensor its barrier reduces alive between calls, so a first
    barrier inside ``torch.compile(mode="reduce-overhead")``'s warm-up (which runs in the CUDA-graph pool) leaves
    a tensor there that no graph output tracks, and the CUDA-graph trees refuse to go on ("Detected 1 tensor(s)
    in the cudagraph pool not tracked as outputs"). A temporary all-reduced and synchronized does the same work.
    """
    if dist.get_backend(group) != "nccl":  # the protocol tests' lanes on CPU ranks (gloo): no device memory
        dist.barrier(group=group)
        return
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    t = torch.ones(1, device=dev)
    dist.all_reduce(t, group=group)
    torch.cuda.synchronize(dev)
    del t


def _aligned(descs: list) -> bool:
    for ds in descs:
        for dst, src, width, height, dpitch, spitch in ds:
            if (dst | src | width | dpitch | spitch) & 15:
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


class StartFailed(RuntimeError):
    """The lane could not start on some rank of the group; every rank raises this with the same message."""


def agree_outcome(group: dist.ProcessGroup, stage: str, error: str | None) -> None:
    """All-gather one start-up stage's outcome over the group (bounded by the group's timeout); raise
    :class:`StartFailed` on every rank, naming the failing ranks and their messages, if any rank failed."""
    outs = [None] * group.size()
    dist.all_gather_object(outs, error, group=group)
    bad = [(r, e) for r, e in enumerate(outs) if e is not None]
    if bad:
        raise StartFailed(f"{stage} failed on " + "; ".join(f"group rank {r}: {e}" for r, e in bad))


def _hint(heap: str) -> str:
    if heap == "nvshmem":
        return ("hint: check that nvshmem4py matches the CUDA driver and that every GPU of the group is P2P-reachable, "
                "or set CP_OPS_FAST_HEAP=ipc (CUDA IPC symmetric buffers), or use transport='torch'")
    return "hint: check that every GPU of the group is P2P-reachable (cp-ops env), or use transport='torch'"


def start(group: dist.ProcessGroup, device: torch.device, ext, heap_cls=None, fabric: str | None = None,
          slots_per_key: int = 2) -> Lane:
    """Start the fast lane on ``group`` (collective over the group, and only the group).

    Each stage (heap start-up, control-block allocation, lane creation) is tried on every rank and its outcome
    exchanged at once, so a failure on one rank reaches every rank within the group's timeout.

    Raises:
        StartFailed: on every rank when any rank failed; the message names the ranks, the library's message
            and a hint.
    """
    s = config.settings
    heap_cls = heap_cls or HEAPS[s.fast_heap]
    hint = _hint(s.fast_heap)
    w, me = group.size(), group.rank()
    heap = ctrl = ext_lane = None

    def stage(name, fn):
        err, out = None, None
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            err = f"{type(e).__name__}: {e}"
        try:
            agree_outcome(group, name, err)
        except StartFailed as e:
            # NVSHMEM finalize is collective: only once every rank got past its init
            _teardown(heap, ctrl, ext_lane, finalize=not name.startswith("NVSHMEM") and "import" not in name)
            raise StartFailed(f"transport='fast' could not start for CP group {dist.get_process_group_ranks(group)}: "
                              f"{e}; {hint}") from None
        return out

    n_send = max(1, w - 1) * 2
    heap = stage(f"{s.fast_heap} import", lambda: heap_cls(ext, group, device))
    heap.start(stage)
    ctrl_bytes = ext.Lane.ctrl_bytes(w, N_SLOTS, n_send)
    ctrl = stage("symmetric control block allocation", lambda: heap.alloc(ctrl_bytes))
    ext_lane = stage("lane creation", lambda: ext.Lane(me, w, device.index, ctrl.local, ctrl.peers, n_send, N_SLOTS,
                                                       s.timeout_s))
    group_barrier(group, device)  # every control block is zeroed before any peer writes a flag
    streams = [torch.cuda.ExternalStream(x, device=device) for x in ext_lane.streams()]

    def agree(obj):
        out = [None] * w
        dist.all_gather_object(out, obj, group=group)
        return out

    def quiesce():
        group_barrier(group, device)

    def make(ptr, n):
        return torch.as_tensor(_CudaMemory(ptr, n), device=device)

    pool = Pool(heap.alloc, heap.free, make, agree, quiesce, int(s.fast_pool_gb * _GB), s.fast_pool_gb,
                slots=slots_per_key)
    return Lane(group, dist.get_process_group_ranks(group), device, ext, ext_lane, heap, ctrl, pool,
                fabric or "nvlink", streams, CallSlots(N_SLOTS))


def _teardown(heap, ctrl, ext_lane, finalize: bool) -> None:
    """Best effort after a failed start (no collectives: a peer may be gone)."""
    try:
        if ext_lane is not None:
            ext_lane.release()
    except Exception:  # noqa: BLE001
        pass
    try:
        if heap is not None and ctrl is not None and getattr(heap, "name", "") == "ipc":
            heap.ext.device_free(heap.dev, ctrl.local)
    except Exception:  # noqa: BLE001
        pass
    if finalize and heap is not None and getattr(heap, "name", "") == "nvshmem":
        try:
            heap.close()
        except Exception:  # noqa: BLE001
            pass

