"""``cp-ops env``: what this machine offers cp_ops — settings and where each came from, devices, P2P matrix,
backends, transports and why not. With a bad ``CP_OPS_*`` value it still prints every setting, names the bad
one in one line and exits 2 (the core cannot be imported until it is fixed)."""

from __future__ import annotations

import importlib.util
import os
import sys


def settings_rows() -> tuple[list[dict], list[str]]:
    """``(rows, errors)``: one row per setting (:meth:`cp_ops.config.Settings.describe`) and the one-line error of each
    bad ``CP_OPS_*`` value (``cp_ops.config`` raises on the first at import: here each variable is checked alone)."""
    try:
        from cp_ops import config

        return config.settings.describe(), []
    except ValueError as e:
        if type(e).__name__ != "ConfigError":
            raise
    spec = importlib.util.find_spec("cp_ops.config")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # for the dataclass decorator while it runs; removed again below
    try:
        spec.loader.exec_module(mod)  # defines everything, then fails at `settings = from_env()`
    except mod.ConfigError:
        pass
    finally:
        sys.modules.pop(spec.name, None)
    rows, errors = mod.from_env({}).describe(), []
    for row in rows:
        raw = os.environ.get(row["variable"])
        if raw is None:
            continue
        try:
            one = {r["field"]: r for r in mod.from_env({row["variable"]: raw}).describe()}[row["field"]]
            row.update(value=one["value"], source=one["source"])
        except mod.ConfigError as e:
            row.update(value=raw, source=f"env {row['variable']} (INVALID)")
            errors.append(str(e))
    return rows, errors


def print_settings() -> int:
    """Print every setting with its value and source; returns 2 when a value is bad (after its one line), else 0."""
    rows, errors = settings_rows()
    print("settings (CP_OPS_* environment variables, or cp_ops.config.configure()):")
    width = max(len(r["variable"]) for r in rows)
    for r in rows:
        print(f"  {r['variable']:<{width}}  {r['field']:<16} = {r['value']!s:<10} ({r['source']})")
    for e in errors:
        print(f"cp-ops: {e}", file=sys.stderr)
    return 2 if errors else 0


def collect() -> dict:
    import torch
    import torch.distributed as dist

    from cp_ops.transport import fast

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
    info["transports"] = {"torch": None, "fast": fast.unavailable_reason(device_type)}
    info["fast_runtime"] = fast.describe()
    return info


def print_env() -> int:
    """Print the report; returns the exit code (2 when a ``CP_OPS_*`` value is bad, else 0)."""
    if print_settings():
        print("devices and transports: not checked until the setting above is fixed")
        return 2
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
        print("  (ranks sharing one GPU need no P2P: the fast transport copies within the device; the torch transport "
              "runs them over gloo, --device shared: NCCL refuses two ranks on one device)")
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
    from cp_ops import config
    from cp_ops._ext import build_dir
    from cp_ops.plan import measured as choices

    print(f"measured mode/chunks choice (CP_OPS_TUNE_MODES): {'on' if config.settings.tune_modes else 'off'}; "
          f"its cache file (CP_OPS_TUNE_CACHE): {choices.cache_path() or 'none'}")
    print(f"fast transport's CUDA extension folder (CP_OPS_EXT_DIR): {build_dir()}")
    return 0
