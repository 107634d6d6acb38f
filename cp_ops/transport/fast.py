"""The fast transport: one Hopper node, direct peer writes over NVLink/P2P into symmetric buffers.

Same contract as :mod:`cp_ops.transport.torch`: ``agkv_start(k, v, group) -> (k_full, v_full, work)``,
``ulysses_start(xs, group) -> (buf, work)``, ``ulysses_inverse_start(x, group) -> (buf, work)``, with the
layouts of :mod:`cp_ops.layout`; ``work.wait()`` makes the current CUDA stream wait (no host block).

Method (this project): each rank writes its own chunk straight into every peer's *final* buffer — for AGKV
its K and V tokens into ``[B, S, H, D]`` at its token block (a pitched copy when B > 1), for Ulysses the
sequence<->head transform folded into pitched copies — then raises a per-source arrival flag on that peer,
so a consumer can wait for one source's chunk (:func:`wait_source`). Two data paths: the copy engine
(``cudaMemcpyAsync``/``cudaMemcpy2DAsync`` on peer pointers) and an SM copy kernel (16-byte vector stores).
The own chunk is copied on its own stream; remote targets are visited ``rank ^ j`` (``(rank + j) % W`` when
W is not a power of two), ``inflight`` of them at once, each split over ``split`` copy-engine streams;
path/inflight/split are measured per shape at its first call, the max over ranks taken so every rank picks
the same, and cached. A shared-egress fabric (a peer link without native atomics, i.e. PCIe-like) uses one
remote stream. Symmetric memory comes from NVSHMEM (nvshmem4py) or CUDA IPC; see
:mod:`cp_ops.transport._fast_runtime` for the heap, the pool and the safety protocol; kernels in
``csrc/cp_fast.cu``.

Settings (environment, or :func:`configure` before the first fast call):
    ``CP_OPS_FAST_POOL_GB``     symmetric pool size per GPU in GiB (default 8)
    ``CP_OPS_FAST_HEAP``        ``nvshmem`` (default) or ``ipc``
    ``CP_OPS_FAST_PATH``        ``auto`` (measure both), ``ce`` (copy engine) or ``sm`` (copy kernel)
    ``CP_OPS_FAST_LANE_WIDTH``  the one group width that uses the fast lane (default: the first CP group
                                used); calls on a group of another width use the torch transport
    ``CP_OPS_FAST_TUNE``        ``0`` disables the per-shape measurement (then: CE, all targets in flight)

Outputs are views of pooled buffers: valid until the second-next fast call of the same role and shape.

Group-level requirements (one node, every peer P2P-reachable, the extension built) are checked
collectively when a group first uses the transport: with ``transport='fast'`` they raise RuntimeError
there, with ``transport='auto'`` that group uses the torch transport (logged once). The first fast call is collective over the lane's group, and with the
NVSHMEM heap over the whole job (NVSHMEM bootstrap and the symmetric allocation).

Measured on 2x H200 (NV18), bf16 K+V of a CP2 shard, S = 4K..75.6K: AGKV 280-373 GB/s per rank
(0.69-0.78x the NCCL all-gather time), Ulysses 260-344 GB/s (0.49-0.52x the torch transport's
pack + all_to_all_single); every output bitwise equal to the torch transport
(``benchmarks/results/transfer_2026-11-29_h200x2.md``).
"""

from __future__ import annotations

import importlib.util
import logging
import weakref

import torch

from .. import config
from .base import register

log = logging.getLogger("cp_ops")

_lane = None  # the process's one fast lane (cp_ops.transport._fast_runtime.Lane)
_logged: set = set()
_reason_cache: dict = {}
_works: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def unavailable_reason(device_type: str, device_index: int | None = None) -> str | None:
    """Why the fast transport cannot run for tensors on ``device_type``; ``None`` when it can.

    Checked in order: CUDA tensors; a CUDA build of torch with a GPU; compute capability 9.0 (Hopper);
    nvshmem4py importable (unless ``CP_OPS_FAST_HEAP=ipc``); the CUDA extension built (it is built here on
    the first call, ~1 min, then cached; a failure names its build log). Group-level requirements (every
    peer P2P-reachable, one node) are checked when a group first uses the transport and raise there.
    """
    if device_type != "cuda":
        return (
            f"the tensors are on '{device_type}', and the fast transport moves CUDA tensors between "
            "Hopper (sm_90) GPUs of one node over NVLink/P2P; on this device use transport='torch' "
            "(transport='auto' picks it)"
        )
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False (no GPU, or a CPU-only build of torch)"
    idx = torch.cuda.current_device() if device_index is None else device_index
    if idx in _reason_cache:
        return _reason_cache[idx]
    reason = _device_reason(idx)
    _reason_cache[idx] = reason
    return reason


def _device_reason(idx: int) -> str | None:
    cap = torch.cuda.get_device_capability(idx)
    if cap != (9, 0):
        name = torch.cuda.get_device_name(idx)
        return f"GPU {idx} ({name}) has compute capability {cap[0]}.{cap[1]}; the fast transport needs 9.0 (Hopper)"
    if config.settings.fast_heap == "nvshmem" and importlib.util.find_spec("nvshmem") is None:
        return (
            "nvshmem4py is not installed: pip install 'cp_ops[fast]' (nvshmem4py-cu13), "
            "or set CP_OPS_FAST_HEAP=ipc to use CUDA IPC symmetric buffers"
        )
    from . import _fast_build

    _, why = _fast_build.load()
    return why


def configure(*, pool_gb: float | None = None, heap: str | None = None, path: str | None = None,
              lane_width: int | None = None, tune: bool | None = None, fast_lane_width: int | None = None) -> None:
    """Change the fast transport's settings (fields ``fast_*`` of :data:`cp_ops.config.settings`).
    ``pool_gb``/``heap``/``lane_width`` (alias ``fast_lane_width``) only before the lane exists (first fast
    call) or after :func:`shutdown`; ``path``/``tune`` any time (decisions are cached per path).

    Raises:
        RuntimeError: a heap setting is changed while the lane is live.
        cp_ops.config.ConfigError: an unknown heap or path name (a ValueError).
    """
    if fast_lane_width is not None:
        lane_width = fast_lane_width
    if _lane is not None and (pool_gb is not None or heap is not None or lane_width is not None):
        raise RuntimeError("pool_gb, heap and lane_width are fixed while the fast lane is live; call fast.shutdown() first")
    changes = {"fast_pool_gb": pool_gb, "fast_heap": heap, "fast_path": path, "fast_lane_width": lane_width,
               "fast_tune": tune}
    config.configure(**{k: v for k, v in changes.items() if v is not None})


def describe() -> dict:
    """What ``cp-ops env`` prints: availability (and why not), settings, the lane, pool use, tuned decisions.

    Never builds the extension or touches the GPU beyond what was already done in this process.
    """
    import os

    s = config.settings
    out = {
        "settings": {"pool_gb": s.fast_pool_gb, "heap": s.fast_heap, "path": s.fast_path,
                     "lane_width": s.fast_lane_width or "first CP group used", "tune": s.fast_tune},
        "nvshmem4py": importlib.util.find_spec("nvshmem") is not None,
    }
    if torch.cuda.is_available():
        idx = torch.cuda.current_device()
        out["unavailable_reason"] = _reason_cache.get(idx, "not checked yet in this process")
    else:
        out["unavailable_reason"] = unavailable_reason("cpu")
    out["lane"] = _lane.describe() if _lane is not None else None
    return out


def shutdown() -> None:
    """Release the lane, the pool and the NVSHMEM runtime (collective over the lane's group, and for NVSHMEM
    over the job). A later fast call starts a new runtime. Exiting without calling it is safe: nothing
    collective runs at exit."""
    global _lane
    if _lane is None:
        return
    lane, _lane = _lane, None
    _unfit.clear()
    from .base import forget_groups

    forget_groups()
    lane.close()


def wait_source(t: torch.Tensor, src: int) -> torch.Tensor:
    """Make the current stream wait only for the chunk of group rank ``src`` in the fast output ``t``
    (``k_full``/``v_full`` of :func:`agkv_start`, or a Ulysses buffer); returns ``t``.

    Raises:
        KeyError: ``t`` is not the output of a pending fast call.
    """
    _works[t.data_ptr()].wait_source(src)
    return t


_unfit: dict = {}  # group ranks -> why the group cannot host a lane


def group_reason(group, device: torch.device) -> str | None:
    """Why ``group`` cannot use the fast transport, or None (then the lane exists for it).

    The process has one fast lane: the first group (of width ``settings.fast_lane_width`` when set) that
    passes the collective probe (one node, every peer P2P-reachable, the extension built). Every other group
    gets a reason naming the lane and its width."""
    global _lane
    reason = unavailable_reason(device.type, device.index)
    if reason is not None:
        return reason
    import torch.distributed as dist

    from . import _fast_runtime

    s = config.settings
    width = group.size()
    ranks = dist.get_process_group_ranks(group)
    if _lane is not None:
        if _lane.ranks == ranks:
            return None
        return (f"the process's one fast lane is CP group {list(_lane.ranks)} (width {_lane.world}); this group "
                f"{ranks} (width {width}) is not it (set CP_OPS_FAST_LANE_WIDTH to pick the width that uses the lane)")
    if s.fast_lane_width is not None and width != s.fast_lane_width:
        return f"this group's width {width} != CP_OPS_FAST_LANE_WIDTH={s.fast_lane_width}, the width that uses the fast lane"
    key = tuple(ranks)
    if key not in _unfit:
        try:
            _lane = _fast_runtime.create_lane(group, device)
            return None
        except _fast_runtime.GroupUnfit as e:
            _unfit[key] = str(e).removeprefix("transport='fast' cannot run: ")
    return _unfit[key]


def _lane_for(group):
    if _lane is None or _lane.ranks != __import__("torch.distributed").distributed.get_process_group_ranks(group):
        raise RuntimeError("cp_ops fast transport: no lane for this group (the selector must call group_reason first)")
    return _lane


def _log_once(key, why: str) -> None:
    if key not in _logged:
        _logged.add(key)
        log.info("cp_ops: transport='fast' uses the torch transport for this group: %s", why)


def _prep(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    if t.data_ptr() % 16:
        t = t.clone()
    return t


def _register(work, *outs):
    for o in outs:
        _works[o.data_ptr()] = work


def agkv_start(k: torch.Tensor, v: torch.Tensor, group):
    """All-gather K and V ``[B, S_local, H, D]`` into ``[B, W*S_local, H, D]`` each (tokens in rank order).

    Returns ``(k_full, v_full, work)``; the outputs are pooled (see module docstring). Bitwise equal to the
    torch transport (pure copies). Raises RuntimeError when the fast transport cannot run (reason given).
    """
    lane = _lane_for(group)
    w, r = lane.world, lane.rank
    b, s, h, d = k.shape
    k, v = _prep(k), _prep(v)
    kf, koff = lane.pool.get("agkv.k", (b, w * s, h, d), k.dtype)
    vf, voff = lane.pool.get("agkv.v", (b, w * s, h, d), v.dtype)
    row = s * h * d * k.element_size()
    pitch = w * row
    mine = [(koff + r * row, k.data_ptr(), row, b, pitch, row), (voff + r * row, v.data_ptr(), row, b, pitch, row)]
    descs = [mine] * w  # every rank's copy of my block sits at the same symmetric offset
    work = lane.launch(("agkv", b, s, h, d, str(k.dtype)), descs, [k, v])
    _register(work, kf, vf)
    return kf, vf, work


def ulysses_start(xs: list[torch.Tensor], group):
    """Sequence -> heads all-to-all of n tensors ``[B, S_local, H, D]`` into ``[W, B, S_local, n, H/W, D]``
    (index 0 = source rank), the layout of :func:`cp_ops.layout.ulysses_pack` after the all-to-all.

    Returns ``(buf, work)``. Raises RuntimeError when the fast transport cannot run (reason given).
    """
    lane = _lane_for(group)
    w, r = lane.world, lane.rank
    xs = [_prep(x) for x in xs]
    b, s, h, d = xs[0].shape
    n, hl, es = len(xs), h // w, xs[0].element_size()
    buf, off = lane.pool.get("ulysses", (w, b, s, n, hl, d), xs[0].dtype)
    slab = b * s * n * hl * d * es
    hb = hl * d * es
    descs = [
        [(off + r * slab + i * hb, x.data_ptr() + t * hb, hb, b * s, n * hb, h * d * es) for i, x in enumerate(xs)]
        for t in range(w)
    ]
    work = lane.launch(("ulysses", b, s, h, d, n, str(xs[0].dtype)), descs, xs)
    _register(work, buf)
    return buf, work


def ulysses_inverse_start(x: torch.Tensor, group):
    """Heads -> sequence all-to-all of ``[B, S, H/W, D]`` into ``[W, B, S/W, H/W, D]`` (index 0 = source
    rank = head group), the layout of :func:`cp_ops.layout.ulysses_inverse_pack` after the all-to-all.

    Returns ``(buf, work)``. Raises RuntimeError when the fast transport cannot run (reason given).
    """
    lane = _lane_for(group)
    w, r = lane.world, lane.rank
    x = _prep(x)
    b, s, hl, d = x.shape
    sl, es = s // w, x.element_size()
    buf, off = lane.pool.get("ulysses_inv", (w, b, sl, hl, d), x.dtype)
    blk = sl * hl * d * es
    slab = b * blk
    descs = [[(off + r * slab, x.data_ptr() + t * blk, blk, b, blk, s * hl * d * es)] for t in range(w)]
    work = lane.launch(("ulysses_inv", b, s, hl, d, str(x.dtype)), descs, [x])
    _register(work, buf)
    return buf, work


class FastTransport:
    """The fast transport as a registered :class:`cp_ops.transport.base.Transport`."""

    name = "fast"
    slots_per_key = 2
    pooled_outputs = True

    def unavailable_reason(self, device: torch.device) -> str | None:
        return unavailable_reason(device.type, device.index)

    def group_reason(self, group, device: torch.device) -> str | None:
        return group_reason(group, device)

    def agkv_start(self, k, v, group):
        return agkv_start(k, v, group)

    def ulysses_start(self, xs, group):
        return ulysses_start(xs, group)

    def ulysses_inverse_start(self, x, group):
        return ulysses_inverse_start(x, group)


transport = register(FastTransport(), auto_rank=0)
