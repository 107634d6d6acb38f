"""Input rules, each raising ValueError (TypeError for a non-tensor) that names the rule and the values seen. They run
in the public API, the ops' fake kernels (a symbolic size through ``torch._check_value``) and real kernels, on this
rank's inputs only (what the ranks must agree on: :mod:`cp_ops.contract`).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from .group import backend_name

#: The dtypes cp_ops moves and attends (the backends' kernels and the fast transport support these).
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BACKEND_DEVICES = {"gloo": ("cpu",), "nccl": ("cuda",), "mpi": ("cpu", "cuda"), "fake": None}


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as messages, variant tags and JSON name it: ``torch.bfloat16`` -> ``'bfloat16'``."""
    return str(dtype).replace("torch.", "")


def _require(cond, message: Callable[[], str]) -> None:
    """``ValueError(message())`` unless ``cond``; in a fake kernel a symbolic condition goes through
    ``torch._check_value`` (a guard, or a runtime assert for an unbacked size)."""
    if isinstance(cond, bool) or torch.compiler.is_dynamo_compiling():
        if not cond:
            raise ValueError(message())
    else:
        torch._check_value(cond, message)


# ---- input rules ---------------------------------------------------------------------------------
def check_bshd(name: str, t: torch.Tensor) -> None:
    """``t`` must be a 4-D tensor laid out [batch, seq, heads, head_dim] (BSHD)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    _require(t.dim() == 4, lambda: f"{name} must be 4-D [batch, seq, heads, head_dim] (BSHD); got {t.dim()}-D "
                                   f"shape {tuple(t.shape)}")


def check_dtype(name: str, t: torch.Tensor) -> None:
    """``t`` must have a dtype of :data:`SUPPORTED_DTYPES` (float32, float16, bfloat16)."""
    _require(t.dtype in SUPPORTED_DTYPES, lambda: (
        f"{name} must be float32, float16 or bfloat16 (the dtypes cp_ops supports); got {t.dtype}: convert it with "
        ".to(torch.float32) or .to(torch.bfloat16)"))


def check_same(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...], wire: bool = False) -> None:
    """Tensors that go through one collective: BSHD, a supported dtype, and the same shape, dtype and device.
    ``wire``: the launch ops, which also move uint8 ``[B, S, H, D + 4]`` (FP8 encoded: :mod:`cp_ops.kernels.fp8`)."""
    _require(len(tensors) > 0, lambda: "at least one tensor is needed; got none")
    for n, t in zip(names, tensors):
        check_bshd(n, t)
    first, t0 = names[0], tensors[0]
    if not (wire and t0.dtype == torch.uint8):
        check_dtype(first, t0)
    for n, t in zip(names[1:], tensors[1:]):
        _require(t.shape == t0.shape, lambda: f"{first} and {n} must have the same BSHD shape (local tokens of one "
                                              f"CP shard, equal heads); got {first} {tuple(t0.shape)} and {n} "
                                              f"{tuple(t.shape)}")
        _require(t.dtype == t0.dtype, lambda: f"{first} and {n} must have the same dtype; got {t0.dtype} and {t.dtype}")
        _require(t.device == t0.device, lambda: f"{first} and {n} must be on the same device; got {t0.device} and "
                                                f"{t.device}")


def check_heads_divisible(heads: int, world_size: int, mode: str = "ulysses", other: str | None = "agkv") -> None:
    """A mode that splits heads over the CP group (Ulysses): W must divide H. The one message of the rule;
    ``other``: a mode to suggest instead (None: none)."""
    _require(heads % world_size == 0, lambda: (
        f"mode={mode!r} needs the head count divisible by the CP world size; got heads={heads}, "
        f"world_size={world_size} (use " + (f"mode={other!r}, or " if other else "")
        + f"a CP group whose size divides {heads})"))


def check_seq_divisible(seq: int, world_size: int) -> None:
    """Tokens are split evenly: rank r holds the r-th of W equal contiguous blocks."""
    _require(seq % world_size == 0, lambda: (
        f"the sequence length must be divisible by the CP world size to split tokens evenly; got sequence "
        f"length={seq}, world_size={world_size}"))


def check_device_for_group(t: torch.Tensor, group: dist.ProcessGroup) -> None:
    """The group's backend must be able to move tensors of ``t``'s device (NCCL: CUDA, gloo: CPU)."""
    check_device_for_backend(t, backend_name(group))


def check_device_for_backend(t: torch.Tensor, backend: str) -> None:
    """:func:`check_device_for_group` given the group's backend string (``'gloo'``, ``'cpu:gloo,cuda:nccl'``, ...)."""
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
