"""Starting the fast lane on a group (collective over the group only): probe the group (one node, P2P reach,
fabric), start the heap, allocate the control block, create the lane. Each stage's outcome is exchanged through a
bounded :class:`~.collective.Exchange`, so a failure or a rank stuck past ``CP_OPS_TIMEOUT_S`` gives every rank the
same :class:`~.collective.StartFailed`."""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import torch
import torch.distributed as dist

from ... import config
from ..._peers import node_id
from .collective import Exchange, StartFailed, agree_outcome, group_barrier
from .heap import HEAPS, _CudaMemory
from .lane import N_SLOTS, Lane
from .pool import Pool
from .slots import CallSlots

_GB = 1 << 30


def probe_group(group: dist.ProcessGroup, device: torch.device, ext, exchange=None) -> tuple[str | None, str]:
    """(reason the group cannot host a fast lane or None, fabric), agreed by all ranks. Fabric: ``'same-device'``
    when every rank runs on this one GPU (no P2P needed), ``'shared-egress'`` when a peer link has no native atomics
    (PCIe-like), else ``'nvlink'``; a peer on another GPU needs P2P access. ``exchange``: the start's
    :class:`~.collective.Exchange` (a new one when None). Raises :class:`~.collective.PeerTimeout` (the same on
    every rank) when a rank does not take part in time."""
    exchange = exchange or Exchange(group, "probe")
    props = torch.cuda.get_device_properties(device)
    me = (node_id(), str(getattr(props, "uuid", device.index)), device.index)
    infos = exchange("the fast transport's group probe (host, GPU)", me)
    reason, fabric = None, "nvlink"
    hosts = sorted({i[0] for i in infos})
    if len(hosts) > 1:
        reason = (f"the CP group spans more than one node (node identities {hosts}: CP_OPS_NODE_ID or the host name, "
                  "cp_ops.node); the fast transport is single-node")
    else:
        local_by_uuid = {str(getattr(torch.cuda.get_device_properties(i), "uuid", i)): i
                         for i in range(torch.cuda.device_count())}
        if all(uuid == me[1] for _, uuid, _ in infos):
            fabric = "same-device"
        for r, (_, uuid, _) in enumerate(infos):
            if uuid == me[1]:  # the same GPU: copies within the device, no P2P access needed
                continue
            idx = local_by_uuid.get(uuid)
            if idx is None:
                reason = (
                    f"group rank {r}'s GPU {uuid} is not visible to this process (CUDA_VISIBLE_DEVICES?), so it is "
                    "not P2P-reachable; the fast transport needs every GPU of the group visible to every rank")
                break
            access, atomics, _perf = ext.p2p_attributes(device.index, idx)
            if not access:
                reason = (f"no P2P: GPU {device.index} cannot access peer GPU {idx} (group rank {r}) over CUDA P2P (ranks "
                          "sharing one GPU need none; ranks on different GPUs do)")
                break
            if not atomics:
                fabric = "shared-egress"
    reasons = exchange("the fast transport's group probe (P2P reach)", (reason, fabric))
    for r, f in reasons:
        if r is not None:
            return r, fabric
    fabrics = {f for _, f in reasons}
    return None, ("shared-egress" if "shared-egress" in fabrics else "same-device" if fabrics == {"same-device"}
                  else "nvlink")


def _hint(heap: str) -> str:
    if heap == "nvshmem":
        return ("hint: check that nvshmem4py matches the CUDA driver and that every GPU of the group is P2P-reachable, "
                "or set CP_OPS_FAST_HEAP=ipc (CUDA IPC symmetric buffers), or use transport='torch'")
    return "hint: check that every GPU of the group is P2P-reachable (cp-ops env), or use transport='torch'"


def start(group: dist.ProcessGroup, device: torch.device, ext, fabric: str | None = None,
          slots_per_key: int = 2, exchange=None, lane_exchange=None) -> Lane:
    """Start the fast lane on ``group`` (collective over the group only): each stage (heap start-up, control block,
    lane creation) is tried on every rank and its outcome exchanged (``exchange``; a new one when None). A heap's
    ``stage(name, fn, bounded=True)`` (NVSHMEM init, which a stuck peer can block) runs in a helper thread and fails
    after ``CP_OPS_TIMEOUT_S``. ``lane_exchange``: the lane's own (pool growth, flag-slot reclaim; new when None).

    Raises:
        StartFailed: on every rank when any rank failed or did not take part in time (naming the ranks, the
            library's message and a hint).
    """
    s = config.settings
    heap_cls = HEAPS[s.fast_heap]
    hint = _hint(s.fast_heap)
    w, me = group.size(), group.rank()
    heap = ctrl = ext_lane = None
    exchange = exchange or Exchange(group, "start")

    def stage(name, fn, bounded=False):
        err, out = None, None
        try:
            out = _bounded(name, fn, s.timeout_s) if bounded else fn()
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            err = f"{type(e).__name__}: {e}"
        try:
            # a bounded stage's own bound runs first: its "did not finish" report, not a missing rank, decides
            agree_outcome(exchange, name, err, 2 * s.timeout_s if bounded else None)
        except StartFailed as e:
            # NVSHMEM finalize is collective: only once every rank got past its init
            _teardown(heap, ctrl, ext_lane, finalize=not name.startswith("NVSHMEM") and "import" not in name)
            raise StartFailed(f"cp_ops: transport='fast' could not start for CP group {dist.get_process_group_ranks(group)}: "
                              f"{e}; {hint}") from None
        return out

    n_send = max(1, w - 1) * 2
    heap = stage(f"{s.fast_heap} import", lambda: heap_cls(ext, group, device))
    heap.start(stage, exchange)
    ctrl_bytes = ext.Lane.ctrl_bytes(w, N_SLOTS, n_send)
    ctrl = stage("symmetric control block allocation", lambda: heap.alloc(ctrl_bytes))
    ext_lane = stage("lane creation", lambda: ext.Lane(me, w, device.index, ctrl.local, ctrl.peers, n_send, N_SLOTS,
                                                       s.timeout_s))
    group_barrier(group, device)  # every control block is zeroed before any peer writes a flag
    streams = [torch.cuda.ExternalStream(x, device=device) for x in ext_lane.streams()]

    lane_exchange = lane_exchange or Exchange(group, "lane")
    agree = functools.partial(lane_exchange, "the pool allocation")
    agree_slots = functools.partial(lane_exchange, "the reclaim of flag slots freed with their CUDA graphs")
    quiesce = functools.partial(group_barrier, group, device)

    def make(ptr, n):
        return torch.as_tensor(_CudaMemory(ptr, n), device=device)

    def room(nbytes):
        """Why this GPU cannot give ``nbytes`` more to the pool now (checked and agreed before each growth)."""
        # NVSHMEM maps its initial symmetric heap (NVSHMEM_SYMMETRIC_SIZE) at init: the pool fills that first
        reserved = max(0, _parse_bytes(os.environ.get("NVSHMEM_SYMMETRIC_SIZE", "0")) - pool.used) \
            if heap.name == "nvshmem" else 0
        free = torch.cuda.mem_get_info(device)[0]
        if free + reserved < nbytes:
            torch.cuda.empty_cache()  # hand back the blocks torch's allocator caches but does not use
            free = torch.cuda.mem_get_info(device)[0]
        if free + reserved < nbytes:
            return f"{free / 2**20:.0f} MiB free on GPU {device.index}, {nbytes / 2**20:.0f} MiB needed"
        return None

    pool = Pool(heap.alloc, heap.free, make, agree, quiesce, int(s.fast_pool_gb * _GB), s.fast_pool_gb,
                slots=slots_per_key, room=room if isinstance(device, torch.device) and device.type == "cuda" else None)
    return Lane(group, dist.get_process_group_ranks(group), device, ext, ext_lane, heap, ctrl, pool,
                fabric or "nvlink", streams, CallSlots(N_SLOTS, agree_slots, getattr(ext_lane, "freed_slots", None)))


def _parse_bytes(text: str) -> int:
    """NVSHMEM's size syntax (``536870912``, ``512M``, ``2G``) in bytes; 0 when it does not parse."""
    t = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        return int(float(t[:-1]) * mult[t[-1]]) if t and t[-1] in mult else int(t or 0)
    except ValueError:
        return 0


class StageStuck(RuntimeError):
    """A bounded start-up stage did not return within ``CP_OPS_TIMEOUT_S`` on this rank."""


def _bounded(name: str, fn, seconds: float):
    """``fn()`` in a daemon thread, waited at most ``seconds``, else :class:`StageStuck`; the thread cannot be
    interrupted and is left behind (the heap refuses to start again in this process: ``NvshmemHeap.start``)."""
    box: dict = {}

    def run():
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["err"] = e

    th = threading.Thread(target=run, name=f"cp_ops fast: {name}", daemon=True)
    th.start()
    th.join(seconds)
    if th.is_alive():
        box["stuck"] = True
        raise StageStuck(f"cp_ops fast transport: {name} did not finish within {seconds:g} s (CP_OPS_TIMEOUT_S) on "
                         "this rank (it cannot be interrupted: the fast transport stays off in this process)")
    if "err" in box:
        raise box["err"]
    return box.get("out")


def _teardown(heap, ctrl, ext_lane, finalize: bool) -> None:
    """Best effort after a failed start (no collectives: a peer may be gone); each step's errors are dropped."""
    with contextlib.suppress(Exception):
        if ext_lane is not None:
            ext_lane.release()
    with contextlib.suppress(Exception):
        if heap is not None and ctrl is not None and getattr(heap, "name", "") == "ipc":
            heap.ext.device_free(heap.dev, ctrl.local)
    if finalize and heap is not None and getattr(heap, "name", "") == "nvshmem":
        with contextlib.suppress(Exception):
            heap.close()
