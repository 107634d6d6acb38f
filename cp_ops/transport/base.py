"""The transport protocol, the registry of transports (a new one: one file defining a :class:`Transport` that calls
:func:`register`; :func:`names` derives from it), and the one selector: :func:`resolve` at the public API ('auto'
stays 'auto' where a preferred transport may run) and :func:`for_group` in an op's kernel (the group's agreed choice).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from .. import contract

log = logging.getLogger("cp_ops")


@runtime_checkable
class Transport(Protocol):
    """What every transport provides. Launches return at once; ``work.wait()`` makes the current stream
    (CPU: the caller) wait for the data.

    Attributes:
        name: the registry name ('torch', 'fast', ...).
        pooled_outputs: True when outputs are views of buffers the transport reuses (they must not reach users).
        slots_per_key: launches of one (op, shape, dtype) that may be in flight at once; None = unbounded.
    """

    name: str
    pooled_outputs: bool
    slots_per_key: int | None

    def unavailable_reason(self, device: torch.device) -> str | None:
        """Why this transport cannot run for tensors on ``device`` in this process (cheap, cached); None if it can."""

    def group_reason(self, group: dist.ProcessGroup, device: torch.device) -> str | None:
        """Why ``group`` cannot use this transport (this process's :meth:`unavailable_reason` included), or None.
        Collective on its first call (every rank gets the same verdict, within ``settings.timeout_s``), cached
        after; prepares the per-group state (lane, pool) when fit."""

    def agkv_start(self, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup):
        """``[B, S_local, H, D]`` × 2 → ``(k_full, v_full, work)``, each ``[B, W*S_local, H, D]`` in rank order."""

    def ulysses_start(self, xs: list[torch.Tensor], group: dist.ProcessGroup):
        """n × ``[B, S_local, H, D]`` → ``(buf [W, B, S_local, n, H/W, D], work)``; index 0 = source rank."""

    def ulysses_inverse_start(self, x: torch.Tensor, group: dist.ProcessGroup):
        """``[B, S, H/W, D]`` → ``(buf [W, B, S/W, H/W, D], work)``; index 0 = source rank (head group)."""

    # Optional (not protocol members): ``single_node = True`` ('auto' does not try it for a group on several nodes,
    # :mod:`cp_ops.node`); ``device_types``, the device types it ever moves (absent: any; :func:`resolve`);
    # ``ulysses_packed_start`` and ``agkv_start_sources`` (the module functions of those names fall back without).


# ---- optional capability: AGKV with per-source arrival (pipelined AGKV) ----------------------------
@dataclass
class Arrival:
    """One piece of a peer's K/V that lands by itself: tokens ``[lo, hi)`` of ``k_full``/``v_full`` (inside source
    rank ``src``'s block); ``work.wait()`` waits for this piece (or more)."""

    src: int
    lo: int
    hi: int
    work: object


class Works:
    """Several works as one: ``wait()`` waits for each (CUDA: the current stream waits; CPU: the host)."""

    __slots__ = ("works",)

    def __init__(self, works):
        self.works = list(works)

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - Work signature
        for w in self.works:
            w.wait()
        self.works = []
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


class _SourceWait:
    """Waits for one source of a work that signals per source (``work.wait_source(src)``: the fast transport's)."""

    def __init__(self, work, src: int):
        self.work, self.src = work, src

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - Work signature
        self.work.wait_source(self.src)
        return True


def agkv_start_sources(t: "Transport", k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                       pieces: int = 1):
    """Start an AGKV gather of ``k, v [B, S_local, H, D]`` whose peers' chunks can be waited as they land: the
    transport's own ``agkv_start_sources`` where it has one, else its :meth:`Transport.agkv_start` (waited per
    source where the work offers ``wait_source(src)``). ``pieces``: arrivals per peer block (a hint).

    Returns ``(k_full, v_full, arrivals, work)``: ``[B, W*S_local, H, D]`` each in rank order (this rank's own block
    may be left unwritten: read ``k``/``v``); the :class:`Arrival` list, in expected landing order, covering every
    peer token once; ``work`` waits for everything (call it last: it orders the reads of ``k``/``v``).
    """
    own = getattr(t, "agkv_start_sources", None)
    if own is not None:
        return own(k, v, group, pieces)
    k_full, v_full, work = t.agkv_start(k, v, group)
    return k_full, v_full, source_arrivals(work, group.size(), group.rank(), k.shape[1]), work


def ulysses_packed_start(t: "Transport", send: torch.Tensor, group: dist.ProcessGroup):
    """All-to-all of a caller-packed Ulysses send buffer ``[W, B, S_local, n, hs, D]`` (slab w to rank w; any dtype)
    into ``buf`` of the same shape: the transport's ``ulysses_packed_start`` where it has one, else its
    :meth:`Transport.ulysses_inverse_start` of the ``[1, W*B*S_local*n, hs, D]`` view. Returns ``(buf, work)``."""
    own = getattr(t, "ulysses_packed_start", None)
    if own is not None:
        return own(send, group)
    w, b, s, n, hs, d = send.shape
    buf, work = t.ulysses_inverse_start(send.contiguous().view(1, w * b * s * n, hs, d), group)
    return buf.view(w, b, s, n, hs, d), work


def mask_all_gather(mask: torch.Tensor, group: dist.ProcessGroup):
    """A key mask beside its keys: uint8 ``[B, S]`` → ``([W*B, S] rank-major, work)``, one ``_allgather_base``."""
    out = mask.new_empty(group.size() * mask.shape[0], mask.shape[1])
    return out, group._allgather_base(out, mask.contiguous())


def source_arrivals(work, world: int, rank: int, s_local: int) -> list[Arrival]:
    """One :class:`Arrival` per peer block of an AGKV gather, nearest peer first (``rank − 1``, ``rank − 2``, ...):
    waited per source where ``work`` offers ``wait_source(src)``, else each waits for the whole ``work``."""
    per_source = hasattr(work, "wait_source")
    return [Arrival(src, src * s_local, (src + 1) * s_local, _SourceWait(work, src) if per_source else work)
            for src in ((rank - j) % world for j in range(1, world))]


_REGISTRY: dict[str, Transport] = {}
#: Preference of ``transport='auto'``: the first that can run wins; 'torch' always can.
AUTO_ORDER: list[str] = []
_logged: set = set()
#: (requested name, the group object, device type) -> the transport :func:`for_group` chose (keyed by the group object:
#: torch reuses a destroyed group's name; :func:`cp_ops.contract.drop_destroyed`).
_group_choice: dict[tuple, str] = {}
#: Bumped by :func:`forget_groups`: a cached :func:`for_group` result (cp_ops.plan's plans) is stale when it moved.
epoch = 0


def register(t: Transport, *, auto_rank: int | None = None) -> Transport:
    """Add ``t`` to the registry; ``auto_rank`` (lower first) puts it in ``'auto'``'s preference order."""
    _REGISTRY[t.name] = t
    if auto_rank is not None:
        AUTO_ORDER.insert(min(auto_rank, len(AUTO_ORDER)), t.name)
    return t


def names() -> tuple[str, ...]:
    """Every name a caller may pass: 'auto' and each registered transport."""
    return ("auto", *_REGISTRY)


def get(name: str) -> Transport:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"transport must be one of {names()}; got {name!r}") from None


def _log_once(key, msg: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        log.info(msg, *args)


def resolve(requested: str = "auto", device_type: str = "cuda") -> str:
    """Resolve a public ``transport=`` argument for tensors of ``device_type``: 'auto' (a preferred transport
    moves this device type; whether it runs may differ by rank, so the group decides in the op), or a registered name.

    Raises:
        ValueError: ``requested`` is not one of :func:`names`.
        RuntimeError: an explicit transport cannot run on this device; the message says why.
    """
    valid = names()
    if requested not in valid:
        raise ValueError(f"transport must be one of {valid}; got {requested!r}")
    device = torch.device(device_type)
    if requested != "auto":
        reason = _REGISTRY[requested].unavailable_reason(device)
        if reason is not None:
            raise RuntimeError(f"transport={requested!r} cannot run: {reason}")
        return requested
    for name in AUTO_ORDER:
        if name == "torch":
            break
        if _moves(_REGISTRY[name], device_type):
            return "auto"  # whether it runs here is agreed with the group's other ranks (for_group)
        _log_once((name, device_type), "cp_ops: transport='auto' uses 'torch' on %s: %s unavailable: %s",
                  device_type, name, _REGISTRY[name].unavailable_reason(device))
    return "torch"


def _moves(t: Transport, device_type: str) -> bool:
    """Whether ``t`` ever moves tensors of ``device_type`` (its optional ``device_types``; absent: any)."""
    types = getattr(t, "device_types", None)
    return types is None or device_type in types


# What torch.compiler.assume_constant_result(resolve) does, without importing torch._dynamo when cp_ops is
# imported (that costs ~1 s and sets TORCHINDUCTOR_CACHE_DIR); tests/test_cli_startup.py checks the equivalence.
resolve._dynamo_marked_constant = True  # type: ignore[attr-defined]


def select_transport(requested: str = "auto", device_type: str = "cuda") -> str:
    """The transport a call will use on this device, never 'auto' (for reports and the CLI): for 'auto' the first of
    :data:`AUTO_ORDER` that can run here (a group that cannot host it still falls back). Raises as :func:`resolve`."""
    r = resolve(requested, device_type)
    if r != "auto":
        return r
    return next((n for n in AUTO_ORDER if _REGISTRY[n].unavailable_reason(torch.device(device_type)) is None), "torch")


def concrete_name(name: str, group_name: str, device) -> str:
    """The transport a call with resolved transport ``name`` runs on the CP group named ``group_name``, never 'auto'
    (what :func:`cp_ops.plan.rules.chunks_rule` reads): an explicit name as is; for 'auto' :func:`for_group`'s choice
    (collective the first time), or for a 'fake' group :func:`select_transport`'s. A constant for the compiler."""
    known = agreed_name(name, group_name, device)
    if known is not None:
        return known
    from torch.distributed.distributed_c10d import _resolve_process_group

    return for_group(name, _resolve_process_group(group_name), torch.device(device)).name


concrete_name._dynamo_marked_constant = True  # type: ignore[attr-defined]


def agreed_name(name: str, group_name: str, device) -> str | None:
    """:func:`concrete_name` without a collective (for reports): known for an explicit name, a 'fake' group, or
    'auto' once the group agreed (its first call did); else None."""
    if name != "auto":
        return name
    from ..group import backend_name
    from torch.distributed.distributed_c10d import _resolve_process_group

    device = torch.device(device)
    pg = _resolve_process_group(group_name)
    if backend_name(pg) == "fake":
        return select_transport(name, device.type)
    return _group_choice.get((name, pg, device.type))


def for_group(name: str, group: dist.ProcessGroup, device: torch.device) -> Transport:
    """The transport an op uses for ``group`` (inside the op's real kernel): an explicit name if it suits the
    group; for 'auto' the first of :data:`AUTO_ORDER` every rank can run (agreed once per group), else torch.
    Raises RuntimeError naming why (on every rank alike) when an explicit transport cannot run for this group."""
    if name == "torch":
        return _REGISTRY["torch"]
    key = (name, group, device.type)
    chosen = _group_choice.get(key)
    if chosen is not None:
        return _REGISTRY[chosen]
    if name != "auto":
        t = get(name)
        reason = t.group_reason(group, device)
        if reason is not None:
            raise RuntimeError(
                f"transport={name!r} cannot run for CP group '{group.group_name}' "
                f"(ranks {dist.get_process_group_ranks(group)}): {reason}")
        _group_choice[key] = name
        return t
    chosen = _agree_auto(group, device)
    _group_choice[key] = chosen
    return _REGISTRY[chosen]


def _agree_auto(group: dist.ProcessGroup, device: torch.device) -> str:
    """``'auto'``'s choice for ``group``, the same on every rank (:func:`cp_ops.contract.agree`): the first of
    :data:`AUTO_ORDER` every rank can run and whose :meth:`Transport.group_reason` every rank accepts, else 'torch'."""
    import json

    from .._peers import node_id
    from ..contract import agree

    cands = [c for c in AUTO_ORDER if c != "torch" and _moves(_REGISTRY[c], device.type)]
    if not cands:
        return "torch"
    base = f"transport auto/{device.type}"
    local = [_REGISTRY[c].unavailable_reason(device) or "" for c in cands] + [node_id()]
    rows = [json.loads(r) for r in agree(group, base, json.dumps(local), "transport='auto' (each rank's transports)")]
    nodes = sorted({row[-1] for row in rows})
    for i, cand in enumerate(cands):
        refused = [(r, row[i]) for r, row in enumerate(rows) if row[i]]
        if not refused and len(nodes) > 1 and getattr(_REGISTRY[cand], "single_node", False):
            refused = [(r, f"the group spans {len(nodes)} nodes ({nodes}; cp_ops.node) and {cand} is single-node")
                       for r in range(len(rows))]
        if not refused:
            reason = _REGISTRY[cand].group_reason(group, device) or ""  # collective: every rank calls it
            verdicts = agree(group, f"{base}/{cand}", reason, f"transport='auto' (the group's verdict on {cand!r})")
            refused = [(r, v) for r, v in enumerate(verdicts) if v]
            if not refused:
                return cand
        _log_once(("group", cand, group.group_name),
                  "cp_ops: transport='auto' uses the next transport for CP group '%s' on every rank: %s cannot run "
                  "on rank(s) %s: %s", group.group_name, cand, [r for r, _ in refused], refused[0][1])
    return "torch"


def inflight_limit() -> int | None:
    """The fewest ``slots_per_key`` over the transports (the most launches of one key a compiler pass may keep in
    flight when it reorders them); None when every transport is unbounded."""
    limits = [t.slots_per_key for t in _REGISTRY.values() if t.slots_per_key is not None]
    return min(limits) if limits else None


def check_all() -> None:
    """Raise a device-side failure a transport recorded (each one's ``check()``; no device sync): called at the
    ``parallelize`` output gather and after a captured forward's replay."""
    for t in _REGISTRY.values():
        check = getattr(t, "check", None)
        if check is not None:
            check()


def _drop_destroyed(_pg=None) -> None:
    """Drop the choices of every group torch no longer knows (called when cp_ops notices a destroyed group)."""
    contract.drop_destroyed(_group_choice, 1)


def forget_groups() -> None:
    """Drop the per-group choices (after a transport is shut down and may be started again)."""
    global epoch
    _group_choice.clear()
    epoch += 1


contract.on_group_destroyed(_drop_destroyed)
