"""Choose the transport by name: ``torch`` always works; ``fast`` runs or raises; ``auto`` = fast, else torch."""

from __future__ import annotations

import logging

import torch

from . import fast

TRANSPORTS = ("auto", "torch", "fast")
log = logging.getLogger("cp_ops")
_logged_fallback: set[str] = set()


@torch.compiler.assume_constant_result
def select_transport(requested: str = "auto", device_type: str = "cuda") -> str:
    """Resolve ``requested`` ∈ {'auto', 'torch', 'fast'} to the transport that will run: 'torch' or 'fast'.

    Args:
        requested: the transport asked for.
        device_type: the device type of the tensors to move ('cpu', 'cuda').

    Returns:
        'torch' or 'fast'.

    Raises:
        ValueError: ``requested`` is not one of the names above.
        RuntimeError: ``requested='fast'`` and the fast transport cannot run here; the message says why.
    """
    if requested not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}; got {requested!r}")
    if requested == "torch":
        return "torch"
    reason = fast.unavailable_reason(device_type)
    if requested == "fast":
        if reason is not None:
            raise RuntimeError(f"transport='fast' cannot run: {reason}")
        return "fast"
    if reason is not None:
        if device_type not in _logged_fallback:
            _logged_fallback.add(device_type)
            log.info("cp_ops: transport='auto' uses 'torch' on %s: fast transport unavailable: %s", device_type, reason)
        return "torch"
    return "fast"


@torch.compiler.assume_constant_result
def op_transport(requested: str = "auto", device_type: str = "cuda") -> str:
    """The transport name the ops get: 'torch'; 'fast' (explicit: raises RuntimeError here when the device
    cannot run it, and in the op when the group cannot host the fast lane); 'auto' when the device could run
    fast (the op then uses fast, or torch for a group that cannot host the lane: more than one node, a peer
    not P2P-reachable, the extension did not build — logged once). Raises as :func:`select_transport`."""
    resolved = select_transport(requested, device_type)
    return "auto" if requested == "auto" and resolved == "fast" else resolved
