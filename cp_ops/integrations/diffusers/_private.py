"""Every private diffusers API cp_ops touches, in one place (diffusers 0.42.x), so an upgrade that renames one breaks
only this file: ``attention_dispatch``'s ``AttentionBackendName`` (cp_ops adds the member ``cp_ops``) and
``_AttentionBackendRegistry``; ``_modeling_parallel``'s ``ContextParallelInput`` / ``ContextParallelOutput`` (the
``_cp_plan`` entries); processors' ``_attention_backend`` / ``_parallel_config``; the attention module classes.
"""

from __future__ import annotations

import copy
import enum
from typing import Any, Callable

import torch

BACKEND_VALUE = "cp_ops"


def _dispatch():
    from diffusers.models import attention_dispatch

    return attention_dispatch


def cp_plan_classes():
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    return ContextParallelInput, ContextParallelOutput


def class_cp_plan(model_cls: type) -> dict | None:
    return getattr(model_cls, "_cp_plan", None)


def _backend_member():
    """The ``AttentionBackendName`` member ``cp_ops``, added to diffusers' Enum once (the registry is keyed by
    members, and ``dispatch_attention_fn`` accepts only members)."""
    names = _dispatch().AttentionBackendName
    if BACKEND_VALUE in names._value2member_map_:
        return names._value2member_map_[BACKEND_VALUE]
    member = str.__new__(names, BACKEND_VALUE)
    member._name_, member._value_ = "CP_OPS", BACKEND_VALUE
    member.__objclass__ = names
    names._member_map_["CP_OPS"] = member
    names._value2member_map_[BACKEND_VALUE] = member
    names._member_names_.append("CP_OPS")
    assert isinstance(member, enum.Enum) and names(BACKEND_VALUE) is member
    return member


_REGISTERED: dict[str, Any] = {}


def register_backend(fn: Callable) -> Any:
    """Register ``fn`` as diffusers attention backend ``cp_ops`` (once per process); returns its member."""
    if "member" not in _REGISTERED:
        member = _backend_member()
        _dispatch()._AttentionBackendRegistry.register(member, constraints=[], supports_context_parallel=True)(fn)
        _REGISTERED["member"] = member
    return _REGISTERED["member"]


def route_processor(module: torch.nn.Module, backend_member: Any, parallel_config: Any) -> None:
    """Give ``module`` its own copy of its processor, whose dispatch calls go to ``backend_member`` with
    ``parallel_config`` (processors may be shared between modules; the copy keeps the others untouched)."""
    proc = copy.copy(module.processor)
    if not hasattr(type(proc), "_parallel_config") and not hasattr(proc, "_parallel_config"):
        raise ValueError(f"{type(module).__name__}'s processor {type(proc).__name__} does not route attention "
                         "through diffusers' dispatch (no _parallel_config); cp_ops cannot plug into it")
    proc._attention_backend = backend_member
    proc._parallel_config = parallel_config
    module.set_processor(proc)


def attention_module_classes() -> tuple[type, ...]:
    """The classes of diffusers attention modules (the ones whose processors take ``_parallel_config``)."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    return (AttentionModuleMixin, Attention)


def local_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, backend) -> torch.Tensor:
    """diffusers' ``dispatch_attention_fn`` on ``backend`` (None: the active backend), without CP."""
    return _dispatch().dispatch_attention_fn(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                             is_causal=is_causal, scale=scale, backend=backend, parallel_config=None)
