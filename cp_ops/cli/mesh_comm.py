"""``--mesh OxI`` of ``cp-ops bench`` / ``run``: the 2-D CP mesh, its label, and each dim's communication time, timed
alone with the call's shapes, group and transport (docs/2d.md, "Per-dim communication time")."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..timing import max_over_ranks_each, steady_ms, summary

DIMS = ("agkv", "ulysses")


def build(shape: tuple[int, int], device_type: str, cfg: bool = False):
    """The ``(O, I)`` mesh with ``mesh_dim_names=('agkv', 'ulysses')`` over every rank (row-major: rank r = o·I + i);
    ``cfg=True``: the 3-D ``('cfg', 'agkv', 'ulysses')`` mesh of 2 CFG lanes (parallelize takes either). Collective."""
    from torch.distributed.device_mesh import init_device_mesh

    if cfg:
        return init_device_mesh(device_type, (2, *shape), mesh_dim_names=("cfg", *DIMS))
    return init_device_mesh(device_type, tuple(shape), mesh_dim_names=DIMS)


def cp_mesh(mesh):
    """The 2-D CP mesh of ``mesh`` (itself, or its ``['agkv', 'ulysses']`` slice of a 3-D CFG mesh)."""
    return mesh if mesh.ndim == 2 else mesh[DIMS]


def label(mesh) -> str:
    """How the header names a mesh, e.g. ``mesh 2x2 (agkv 2 x ulysses 2; rows [[0, 1], [2, 3]])``."""
    m = cp_mesh(mesh)
    o, i = (int(x) for x in m.shape)
    rows = m.mesh.tolist()
    cfg = f"cfg 2 x " if mesh.ndim == 3 else ""
    return f"mesh {cfg}{o}x{i} ({cfg}agkv {o} x ulysses {i}; rows {rows})"


def dim_times(mesh, b: int, s_local: int, h: int, d: int, dtype: torch.dtype, transport: str,
              device: torch.device, warmup: int = 1, samples: int = 3, calls: int = 1) -> dict[str, float]:
    """``{'ulysses': ms, 'agkv': ms}``: each dim's collectives of one 2-D call on ``mesh`` for this rank's
    ``[b, s_local, h, d]`` q/k/v (``transport`` as the call was given), the slowest rank's per sample, median of
    ``samples``. Collective. Raises ValueError where the inner size does not divide ``h``."""
    from cp_ops import ops as lib
    from cp_ops.transport.base import resolve

    m = cp_mesh(mesh)
    outer, inner = m.get_group(DIMS[0]), m.get_group(DIMS[1])
    o_n, i_n = outer.size(), inner.size()
    if h % i_n:
        raise ValueError(f"dim_times: the inner (ulysses) size must divide the heads; got heads={h}, inner={i_n}")
    tr_in = resolve(transport, device.type)
    tr_out = "torch" if tr_in == "torch" else "auto"
    g = torch.Generator(device=device).manual_seed(0xD135)
    x = [torch.randn(b, s_local, h, d, generator=g, device=device, dtype=dtype) for _ in range(3)]
    local = [torch.randn(b, i_n * s_local, h // i_n, d, generator=g, device=device, dtype=dtype) for _ in range(2)]
    out: dict[str, float] = {}

    def ulysses():
        lib.wait(torch.ops.cp_ops.ulysses_start(x, i_n, inner.group_name, tr_in))
        lib.wait(torch.ops.cp_ops.ulysses_inverse_start(local[0], i_n, inner.group_name, tr_in))

    def agkv():
        kf, vf = torch.ops.cp_ops.agkv_gather_start(local[0], local[1], o_n, outer.group_name, tr_out)
        lib.wait(kf), lib.wait(vf)

    for name, n, fn in (("ulysses", i_n, ulysses), ("agkv", o_n, agkv)):
        if n == 1:
            out[name] = 0.0
            continue
        dist.barrier()
        out[name] = summary(max_over_ranks_each(steady_ms(fn, device, warmup, samples, calls), device))["median"]
    return out


def forward_dim_times(model, spec, kw, mesh, transport: str, device: torch.device, samples: int = 3) -> dict:
    """Per-dim communication of one forward of the parallelized ``model`` (``cp-ops run --mesh``): one eager forward
    records the 2-D attention calls, each distinct one is timed by :func:`dim_times`, summed over the calls. Returns
    ``{'ms': {'ulysses': ms, 'agkv': ms}, 'calls': n}``. Collective."""
    from cp_ops import plan
    from cp_ops.mesh import is_mesh

    seen: dict = {}
    real = plan.run

    def recording(call):
        if is_mesh(call.group):
            seq = call.seq_lens
            key = (tuple(call.q.shape), call.q.dtype, None if seq is None else tuple(seq))
            seen[key] = seen.get(key, 0) + 1
        return real(call)

    plan.run = recording
    try:
        with torch.no_grad():
            spec.predict(model, kw)
    finally:
        plan.run = real
    total = {"ulysses": 0.0, "agkv": 0.0}
    for (shape, dtype, seq), n in seen.items():
        b, s, h, d = shape
        s = max(seq) if seq else s  # uneven shards move padded to the largest block
        got = dim_times(mesh, b, s, h, d, dtype, transport, device, 1, samples, 1)
        for name in total:
            total[name] += n * got[name]
    return {"ms": total, "calls": sum(seen.values())}
