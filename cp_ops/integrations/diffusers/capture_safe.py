"""diffusers code that a CUDA graph capture of the whole forward refuses, replaced by equivalents before a capture
(``parallelize(..., cuda_graphs="forward")``, ``cp-ops run`` / ``--bound``). One fix per function, applied only where
diffusers' source still has the construct it replaces, to the function's module global (the replacement returns what
the original does, bitwise).

* Qwen-Image (``compute_text_seq_len_from_mask``, diffusers 0.42.1): with a text mask every forward makes
  ``torch.as_tensor(text_seq_len, device=cuda)``, a pageable host copy a capture refuses; the replacement gives
  ``torch.where`` the Python int itself.
"""

from __future__ import annotations

import inspect
import sys

import torch

_APPLIED: dict[str, object] = {}  # "module:function" -> the original


def _text_seq_len_from_mask(encoder_hidden_states: torch.Tensor, encoder_hidden_states_mask: torch.Tensor | None):
    """diffusers 0.42.1's ``compute_text_seq_len_from_mask`` without its host-to-device copy: ``(text_seq_len,
    per_sample_len [B] int64 | None, bool mask | None)``; ValueError (diffusers' words): a mask not ``(B, S_text)``.
    """
    batch_size, text_seq_len = encoder_hidden_states.shape[:2]
    if encoder_hidden_states_mask is None:
        return text_seq_len, None, None
    if encoder_hidden_states_mask.shape[:2] != (batch_size, text_seq_len):
        raise ValueError(f"`encoder_hidden_states_mask` shape {encoder_hidden_states_mask.shape} must match "
                         f"(batch_size, text_seq_len)=({batch_size}, {text_seq_len}).")
    mask = encoder_hidden_states_mask
    if mask.dtype != torch.bool:
        mask = mask.to(torch.bool)
    position_ids = torch.arange(text_seq_len, device=encoder_hidden_states.device, dtype=torch.long)
    last = torch.where(mask, position_ids, position_ids.new_zeros(())).max(dim=1).values + 1
    return text_seq_len, torch.where(mask.any(dim=1), last, text_seq_len), mask


#: (module, function name, a construct of the original's source the fix removes, the replacement)
FIXES = (
    ("diffusers.models.transformers.transformer_qwenimage", "compute_text_seq_len_from_mask",
     "torch.as_tensor(text_seq_len", _text_seq_len_from_mask),
)


def _class_modules(model: torch.nn.Module) -> set[str]:
    """The modules ``model``'s class and its bases come from, seen through ``torch.compile``'s wrapper
    (``OptimizedModule._orig_mod``): a compiled or subclassed diffusers model runs its module's functions too."""
    model = getattr(model, "_orig_mod", model)
    return {c.__module__ for c in type(model).__mro__}


def apply(model: torch.nn.Module | None = None) -> list[str]:
    """Apply every fix whose module ``model``'s class (or a base; a compiled model's original) comes from (``None``:
    every imported one), also where a module of its class imported the function by name (xDiT's Qwen-Image wrapper).
    Idempotent. Returns the fixes in force, as ``"module:function"``."""
    done = []
    mods = None if model is None else _class_modules(model)
    for mod_name, fn_name, construct, fix in FIXES:
        if mods is not None and mod_name not in mods:
            continue
        mod = sys.modules.get(mod_name)
        key = f"{mod_name}:{fn_name}"
        if mod is None or not hasattr(mod, fn_name):
            continue
        current = getattr(mod, fn_name)
        if current is not fix:  # not applied, or put back since (the module reloaded, a test's monkeypatch undone)
            try:
                source = inspect.getsource(current)
            except (OSError, TypeError):
                continue
            if construct not in source:
                continue  # this diffusers release changed the function: left as it is
            _APPLIED[key] = current
            setattr(mod, fn_name, fix)
        done.append(key)
        orig = _APPLIED.get(key)
        for other in sorted(mods or ()):  # the model's class from a module that imported the function by name
            other_mod = sys.modules.get(other)
            if other != mod_name and orig is not None and getattr(other_mod, fn_name, None) is orig:
                _APPLIED[f"{other}:{fn_name}"] = orig
                setattr(other_mod, fn_name, fix)
                done.append(f"{other}:{fn_name}")
    return done


def undo() -> None:
    """Put every replaced function back (tests)."""
    for key, orig in _APPLIED.items():
        mod_name, fn_name = key.split(":")
        setattr(sys.modules[mod_name], fn_name, orig)
    _APPLIED.clear()
