"""``cp-ops env``: what this machine offers cp_ops — devices, P2P matrix, backends, transports and why not."""

from __future__ import annotations

import importlib.util

import torch
import torch.distributed as dist

from cp_ops.transport import fast


def collect() -> dict:
    info: dict = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "devices": [], "p2p": []}
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        info["devices"].append(f"cuda:{i} {p.name} sm_{p.major}{p.minor} {p.total_memory / 2**30:.0f} GiB")
    info["p2p"] = [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n)] for i in range(n)]
    info["backends"] = {
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl": dist.is_available() and dist.is_nccl_available() and n > 0,
    }
    if n:
        info["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
    info["nvshmem4py"] = importlib.util.find_spec("nvshmem") is not None
    device_type = "cuda" if n else "cpu"
    reason = fast.unavailable_reason(device_type)
    info["transports"] = {"torch": None, "fast": reason}
    describe = getattr(fast, "describe", None)
    if describe is not None:
        info["fast_runtime"] = describe()
    return info


def print_env() -> None:
    info = collect()
    print(f"torch {info['torch']} (CUDA build: {info['cuda_build'] or 'none'})")
    print(f"devices: {len(info['devices']) or 'no CUDA GPU'}")
    for d in info["devices"]:
        print(f"  {d}")
    if info["p2p"]:
        print("P2P access (row → column):")
        n = len(info["p2p"])
        print("      " + " ".join(f"{j:>3}" for j in range(n)))
        for i, row in enumerate(info["p2p"]):
            print(f"  {i:>3} " + " ".join(f"{'yes' if ok else ' no':>3}" for ok in row))
    b = info["backends"]
    print(f"backends: gloo={'yes' if b['gloo'] else 'no'}  nccl={'yes ' + info.get('nccl_version', '') if b['nccl'] else 'no'}")
    print(f"nvshmem4py: {'installed' if info['nvshmem4py'] else 'not installed'}")
    print("transports:")
    for name, why in info["transports"].items():
        print(f"  {name:<6} {'would run' if why is None else 'would not run: ' + why}")
    print(f"  auto   → {'fast' if info['transports']['fast'] is None else 'torch'}")
    runtime = info.get("fast_runtime") or {}
    if runtime.get("settings"):
        print("fast transport settings: " + ", ".join(f"{k}={v}" for k, v in runtime["settings"].items()))
    if runtime.get("lane"):
        print(f"fast lane: {runtime['lane']}")
