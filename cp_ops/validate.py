"""Input rules of the public functions, each raising an error that names the rule and the values seen.

Shape/dtype rules run in Python before any op (so they also hold while ``torch.compile`` traces); the
cross-rank agreement check needs a collective, so it runs inside the ops' real kernels (eager and
compiled alike), once per shape by default (``cp_ops.config.check_ranks``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import config
from .group import backend_name

_BACKEND_DEVICES = {"gloo": ("cpu",), "nccl": ("cuda",), "mpi": ("cpu", "cuda"), "fake": None}


def check_bshd(name: str, t: torch.Tensor) -> None:
    """``t`` must be 4-D, laid out [batch, seq, heads, head_dim] (BSHD)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(
            f"{name} must be 4-D [batch, seq, heads, head_dim] (BSHD); got {t.dim()}-D shape {tuple(t.shape)}"
        )


def check_same(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> None:
    """Tensors that go through one collective must share shape, dtype and device."""
    if not tensors:
        raise ValueError("at least one tensor is needed; got none")
    for n, t in zip(names, tensors):
        check_bshd(n, t)
    first, t0 = names[0], tensors[0]
    if not t0.is_floating_point():
        raise ValueError(f"{first} must be a floating-point tensor (fp32/fp16/bf16/fp64); got {t0.dtype}")
    for n, t in zip(names[1:], tensors[1:]):
        if t.shape != t0.shape:
            raise ValueError(
                f"{first} and {n} must have the same BSHD shape (local tokens of one CP shard, equal heads); "
                f"got {first} {tuple(t0.shape)} and {n} {tuple(t.shape)}"
            )
        if t.dtype != t0.dtype:
            raise ValueError(f"{first} and {n} must have the same dtype; got {t0.dtype} and {t.dtype}")
        if t.device != t0.device:
            raise ValueError(f"{first} and {n} must be on the same device; got {t0.device} and {t.device}")


def check_heads_divisible(heads: int, world_size: int) -> None:
    """Ulysses splits heads over the CP group: W must divide H."""
    if heads % world_size != 0:
        raise ValueError(
            f"mode='ulysses' needs the head count divisible by the CP world size; got heads={heads}, "
            f"world_size={world_size} (use mode='agkv', or a CP group whose size divides {heads})"
        )


def check_seq_divisible(seq: int, world_size: int, what: str = "sequence length", hint: str = "") -> None:
    """Tokens are split evenly: rank r holds the r-th of W equal contiguous blocks."""
    if seq % world_size != 0:
        raise ValueError(
            f"the {what} must be divisible by the CP world size to split tokens evenly; got {what}={seq}, "
            f"world_size={world_size}{hint}"
        )


def check_device_for_group(t: torch.Tensor, group: dist.ProcessGroup) -> None:
    """The group's backend must be able to move tensors of ``t``'s device (NCCL: CUDA, gloo: CPU)."""
    backend = backend_name(group)
    if ":" in backend:  # 'cpu:gloo,cuda:nccl' — a device type per backend
        devices = tuple(part.split(":")[0] for part in backend.split(","))
    else:
        devices = _BACKEND_DEVICES.get(backend)
    if devices is not None and t.device.type not in devices:
        raise ValueError(
            f"the CP group's backend '{backend}' cannot move {t.device.type} tensors (it moves "
            f"{'/'.join(devices)}); got a tensor on {t.device}: move the tensors to {devices[0]}"
            + ("" if t.device.type == "meta" else f" or create the group with a backend for {t.device.type}")
        )


# ---- cross-rank agreement ------------------------------------------------------------------------
_checked: set[tuple] = set()
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2]
# every call signature that is exchanged; the index travels, so a message can name what each rank called
OPS = ("agkv_gather", "ulysses", "ulysses_inverse", "attention/auto", "attention/agkv", "attention/ulysses",
       "attention/invalid", "agkv_pipelined")


def _exchange_device(group: dist.ProcessGroup) -> torch.device:
    backend = backend_name(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _shape4(t) -> list[int]:
    shape = list(t.shape) if isinstance(t, torch.Tensor) else []
    return (shape + [-1] * 4)[:4] if len(shape) == 4 else [-1, -1, -1, -1]


def check_ranks_agree(
    group: dist.ProcessGroup, op: str, t, extra: int = 0, local_error: BaseException | None = None
) -> None:
    """Raise on every rank if the ranks called ``op`` with different shapes or dtypes, or if some rank's
    own input checks failed (``local_error``) — so no rank is left waiting in a collective.

    Exchanges (op, B, S_local, H, D, dtype, extra, failed) over ``group`` on the first call per key
    (``config.check_ranks='once'``; ``'always'``: every call; ``'off'``: never). Costs one tiny all-gather
    and a host sync per new shape. With ``'once'``, a rank that switches to *another already-checked* shape
    while its peers keep theirs is not detected (the collective then fails, hangs until the group timeout,
    or returns wrong numbers): debug such code with ``CP_OPS_CHECK_RANKS=always``.

    Raises:
        ValueError: on every rank, naming each rank's call, when they disagree or one failed its checks;
            on the failing rank the caller re-raises its own, more specific, error.
    """
    mode = config.settings.check_ranks
    if mode not in ("once", "always", "off"):
        raise ValueError(f"cp_ops.config.check_ranks must be once/always/off; got {mode!r}")
    if mode == "off" or group.size() == 1:
        return
    dtype = t.dtype if isinstance(t, torch.Tensor) else None
    dtype_id = _DTYPES.index(dtype) if dtype in _DTYPES else 99
    mine = (OPS.index(op), *_shape4(t), dtype_id, extra, int(local_error is not None))
    key = (group.group_name, mine)
    if (mode == "once" and key in _checked) or backend_name(group) == "fake":  # cache first: hot path
        return
    dev = _exchange_device(group)
    local = torch.tensor(mine, dtype=torch.int64, device=dev)
    gathered = torch.empty(group.size() * local.numel(), dtype=torch.int64, device=dev)
    group.allgather_into_tensor_coalesced([gathered], [local]).wait()
    rows = [tuple(r) for r in gathered.view(group.size(), -1).tolist()]
    failed = [i for i, r in enumerate(rows) if r[-1]]
    if failed and local_error is None:
        raise ValueError(
            f"cp_ops.{op}: rank(s) {failed} of CP group '{group.group_name}' rejected their inputs (their error "
            "says why); this rank stops too, so no rank waits in a collective"
        )
    if not failed and any(r != rows[0] for r in rows):
        seen = "; ".join(
            f"rank {i}: {OPS[r[0]]} [B, S_local, H, D]={list(r[1:5])} dtype={_name(r[5])}"
            + (f" tensors={r[6]}" if r[6] else "")
            for i, r in enumerate(rows)
        )
        raise ValueError(
            f"cp_ops.{op}: the ranks of CP group '{group.group_name}' must make the same call with the same "
            f"local shape and dtype (each rank holds an equal block of tokens, all heads); got {seen}"
        )
    if not failed:
        _checked.add(key)


def checked_call(group: dist.ProcessGroup, op: str, t, local_checks, extra: int = 0) -> None:
    """Run this rank's input checks, then (eagerly) agree with the other ranks: every rank raises if any
    rank's checks failed or the calls differ. While ``torch.compile`` traces, only the local checks run
    (the op kernels still exchange shapes at run time)."""
    error = None
    try:
        local_checks()
    except (ValueError, RuntimeError, TypeError) as e:
        error = e
    if not torch.compiler.is_compiling():
        check_ranks_agree(group, op, t, extra, local_error=error)
    if error is not None:
        raise error


def _name(dtype_id: int) -> str:
    return str(_DTYPES[dtype_id]).replace("torch.", "") if dtype_id < len(_DTYPES) else f"id{dtype_id}"
