"""The fast transport: one Hopper node, NVSHMEM (nvshmem4py) + CUDA P2P + our copy-engine extension (csrc/).

This module answers *whether* the fast transport can run here and, when it cannot, why. Its data path
(symmetric pool, copy-engine fan-out) is not part of this version: :func:`unavailable_reason` reports that,
so ``transport='fast'`` raises an error naming it and ``transport='auto'`` uses the torch transport.
"""

from __future__ import annotations

import importlib.util

import torch

IMPLEMENTED = False


def unavailable_reason(device_type: str, device_index: int | None = None) -> str | None:
    """Why the fast transport cannot run for tensors on ``device_type``; ``None`` when it can.

    Checked in order: CUDA tensors, a CUDA build of torch with a GPU, compute capability 9.0 (Hopper),
    nvshmem4py importable, the data path present in this build.
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
    cap = torch.cuda.get_device_capability(idx)
    if cap != (9, 0):
        name = torch.cuda.get_device_name(idx)
        return f"GPU {idx} ({name}) has compute capability {cap[0]}.{cap[1]}; the fast transport needs 9.0 (Hopper)"
    if importlib.util.find_spec("nvshmem") is None:
        return "nvshmem4py is not installed: pip install 'cp_ops[fast]' (nvshmem4py-cu13)"
    if not IMPLEMENTED:
        return (
            "this cp_ops build has no fast data path yet (NVSHMEM/copy-engine kernels in csrc/); "
            "use transport='torch' or 'auto'"
        )
    return None
