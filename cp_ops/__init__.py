"""cp_ops — context-parallel (CP) attention for diffusion transformers.

Public API:
    attention(q, k, v, *, group=None, mode="auto", transport="auto", scale=None)  BSHD shards in and out
    agkv_gather / ulysses_all_to_all / ulysses_all_to_all_inverse                  the collectives, eager
    select_transport(requested, device_type)                                       'torch' or 'fast'
    choose_mode(mode, heads, world_size)                                           the mode 'auto' picks
    modes.names() / modes.register(name, fn, ...)                                  the CP attention modes
    local_attention(q, k, v, scale=None)                                           single-device reference
    compile(model, **torch_compile_kwargs)                                         torch.compile + overlap pass
The torch.library ops live under ``torch.ops.cp_ops``; see :mod:`cp_ops._library`.
"""

from . import _library  # noqa: F401  (registers torch.ops.cp_ops.*)
from . import modes
from .attention import attention, local_attention
from .collectives import agkv_gather, ulysses_all_to_all, ulysses_all_to_all_inverse
from .compile import compile  # noqa: A004  (torch.compile + the overlap pass; imports Inductor only when called)
from .modes import choose as choose_mode
from .transport.base import select_transport

__all__ = [
    "attention",
    "agkv_gather",
    "ulysses_all_to_all",
    "ulysses_all_to_all_inverse",
    "select_transport",
    "local_attention",
    "choose_mode",
    "modes",
    "compile",
]
__version__ = "0.1.0"
