"""The fast transport's pool of symmetric buffers, keyed by (role, shape, dtype), ``slots`` each. Each key is one
symmetric allocation made at its first use, under the ceiling ``settings.fast_pool_gb``: a new key that does not fit
evicts least-recently-used keys no rank still needs (agreed over the group), else raises naming ``CP_OPS_FAST_POOL_GB``.
A launch never overwrites a slot whose output was not waited (it raises). Each new allocation compares its number, key
and size over the group (the ranks must make the same calls). Pure Python: the CPU tests drive it with CPU tensors.
"""

from __future__ import annotations

import gc
import logging
import math
import sys
from dataclasses import dataclass, field

import torch

from ...validate import dtype_name
from .heap import Segment

log = logging.getLogger("cp_ops")

_ALIGN = 256


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
    writers: list = field(default_factory=list)  # per slot: the last call given it (outlives the wait)


def _holders(slots: list) -> list:
    """Per slot tensor: (Python references, storage users). Larger than at creation = a caller still holds the
    output or a view of it (the same code path measures both, so the counts compare)."""
    return [(sys.getrefcount(t), torch._C._storage_Use_Count(t.untyped_storage()._cdata)) for t in slots]


class Pool:
    """Symmetric buffers keyed by (role, shape, dtype), ``slots`` each; grows on demand up to ``cap_bytes``.

    ``alloc(nbytes) -> Segment`` and ``free(segment)`` are collective over the group; ``make(ptr, nbytes)`` gives a
    uint8 tensor over local memory; ``agree(obj) -> list`` all-gathers a small object over the group (bounded);
    ``quiesce()`` waits until no rank's device touches the pool; ``room(nbytes) -> str | None``: why this rank cannot
    allocate ``nbytes`` now, agreed before every allocation (every rank raises the same error, none fails alone)."""

    def __init__(self, alloc, free, make, agree, quiesce, cap_bytes: int, cap_gb: float, slots: int = 2, room=None):
        self.alloc_fn, self.free_fn, self.make, self.agree, self.quiesce = alloc, free, make, agree, quiesce
        self.room = room
        self.reclaim = None  # () -> None: give back what abandoned launches hold (set by the lane)
        self.broken: str | None = None  # an allocation failed on some rank after the agreement: no more growth
        self.capacity, self.cap_gb, self.slots = cap_bytes, cap_gb, slots
        self.used = 0
        self.allocs = 0  # allocations made so far (compared over the group at each new one)
        self.evictions = 0
        self.entries: dict[tuple, _Entry] = {}
        self.clock = 0

    def get(self, role: str, shape: tuple, dtype: torch.dtype, call: int,
            capturing: bool = False) -> tuple[torch.Tensor, list, tuple]:
        """Next slot of the key for ``call``: (tensor, [slot address on each rank as mapped here; the pool's own:
        read only], ticket). ``capturing``: the launch is being captured into a CUDA graph (the key must exist; it
        is then kept until :meth:`release_all`: the graph writes its slots at every replay).

        Raises:
            RuntimeError: the slot holds an output not waited yet (more than ``slots`` launches of the key in
                flight); the key does not fit; ranks disagree on the allocation; a new key while capturing.
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
        if e.pending[i] is not None and self.reclaim is not None:
            self.reclaim()  # works dropped un-waited give their slots back (Lane.reclaim_dropped)
        if e.pending[i] is not None:
            raise RuntimeError(
                f"cp_ops fast transport: call {call} would overwrite pool slot {i} of {role} {tuple(shape)} "
                f"{str(dtype).replace('torch.', '')}, which still holds the output of call {e.pending[i]} (launched, "
                f"not waited); at most {self.slots} launches of one shape may be in flight (slots_per_key="
                f"{self.slots}): wait an output before launching the next one of the same shape, or cancel a launch "
                "that will not be waited (work.cancel(), e.g. after an exception)")
        e.turn = (i + 1) % self.slots
        self.clock += 1
        e.last_use = self.clock
        e.pending[i] = call
        e.writers[i] = call
        return e.slots[i], e.addrs[i], (key, i, call)

    def writer(self, ticket: tuple):
        """The last call given the slot of ``ticket`` (its own call while not recycled), None once evicted."""
        key, i, _call = ticket
        e = self.entries.get(key)
        return e.writers[i] if e is not None else None

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
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        size = max(_ALIGN, (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN)
        need = self.slots * size
        desc = f"{key[0]} {tuple(shape)} {str(dtype).replace('torch.', '')}"
        lru = sorted(self.entries.values(), key=lambda x: x.last_use)
        if self.used + need > self.capacity:
            gc.collect()  # outputs dropped in reference cycles must not look held (rare path: the pool is full)
        if self.broken:
            raise RuntimeError(self.broken)
        mine = (self.allocs, desc, need, [str(x.key) for x in lru if self._evictable(x)])
        views = self.agree(mine + (self.room(need) if self.room is not None else None,))
        if any(v[:3] != mine[:3] for v in views):
            raise RuntimeError(
                "cp_ops fast transport: ranks disagree on the pool allocation (number, buffer, bytes): "
                + "; ".join(f"rank {r}: {v[:3]}" for r, v in enumerate(views))
                + ". Every rank must make the same fast calls in the same order")
        short = [(r, v[4]) for r, v in enumerate(views) if len(v) > 4 and v[4] is not None]
        if short:
            raise RuntimeError(
                f"cp_ops fast transport: the pool cannot grow by {desc} ({need / 2**20:.1f} MiB) on every rank: "
                + "; ".join(f"group rank {r}: {why}" for r, why in short)
                + ". Free GPU memory, lower CP_OPS_FAST_POOL_GB, or use transport='torch'")
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
                f"(now {self.cap_gb:g}) or fast.configure(pool_gb=...) after fast.shutdown()")
        if victims:
            self.quiesce()
            for x in victims:
                del self.entries[x.key]
                self.used -= self.slots * x.size
                x.slots.clear()
                self.free_fn(x.seg)
                self.evictions += 1
                log.info("cp_ops fast: pool evicted %s %s (least recently used) for %s", x.key[0], x.key[1], desc)
        seg, err = None, None
        try:
            seg = self.alloc_fn(need)
        except Exception as e:  # noqa: BLE001 - every rank must learn it
            err = f"{type(e).__name__}: {e}"
        failed = [(r, x) for r, x in enumerate(self.agree((self.allocs, err))) if x[1] is not None]
        if failed:
            # a symmetric allocation made on some ranks only cannot be freed (the free is collective): it stays
            # allocated, and the pool grows no more (every rank raises the same error now and at its next growth)
            self.broken = ("cp_ops fast transport: the pool's symmetric allocation of " f"{need / 2**20:.1f} MiB for {desc}"
                           " failed on " + "; ".join(f"group rank {r}: {x[1]}" for r, x in failed)
                           + ". The pool cannot grow any more: FastTransport.shutdown() on every rank, then retry")
            raise RuntimeError(self.broken)
        self.allocs += 1
        self.used += need
        slots = [self.make(seg.local + i * size, nbytes).view(dtype).view(shape) for i in range(self.slots)]
        base = _holders(slots)  # only the pool holds them now
        e = _Entry(key, seg, size, slots, base, [None] * self.slots,
                   addrs=[[p + i * size for p in seg.peers] for i in range(self.slots)], writers=[None] * self.slots)
        self.entries[key] = e
        return e

    def release_all(self) -> None:
        for e in list(self.entries.values()):
            e.slots.clear()
            self.free_fn(e.seg)
        self.entries.clear()
        self.used = 0

    def describe(self) -> dict:
        buffers = [{"role": k[0], "shape": list(k[1]), "dtype": dtype_name(k[2]), "slots": self.slots}
                   for k in self.entries]
        return {"capacity_bytes": self.capacity, "used_bytes": self.used, "allocations": self.allocs,
                "evictions": self.evictions, "buffers": buffers}
