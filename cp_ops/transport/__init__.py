"""Transports move CP tensors between ranks: :mod:`.base` (protocol, registry, the one selector),
:mod:`.torch` (torch.distributed), :mod:`.fast` (NVSHMEM / CUDA P2P on one Hopper node)."""

from .base import Transport, for_group, get, names, resolve, select_transport
from . import torch as _torch_transport, fast as _fast_transport  # noqa: E402,F401  (each registers itself)

__all__ = ["Transport", "for_group", "get", "names", "resolve", "select_transport"]
