"""Starting the fast lane on a group (collective over the group, and only the group): probe the group (one node,
P2P reach, fabric), start the heap, allocate the control block, create the lane; each stage's outcome agreed by
every rank (:class:`StartFailed` on every rank when any rank failed)."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from ... import config
from .collective import StartFailed, agree_outcome, group_barrier
from .heap import HEAPS, _CudaMemory
from .lane import N_SLOTS, Lane
from .pool import Pool
from .slots import CallSlots

_GB = 1 << 30


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
