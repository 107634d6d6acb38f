"""parallelize() on a 2-D CP mesh ('agkv', 'ulysses') and on a CFG × 2-D mesh ('cfg', 'agkv', 'ulysses'): tiny Wan and
Flux equal to the unparallelized model (gloo, 4 and 8 ranks)."""

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

pytest.importorskip("diffusers")

from diffusers_tiny import build, inputs, sample  # noqa: E402
from dist_util import run_ranks  # noqa: E402


def _rel(out, ref):
    return ((out - ref).abs().max() / ref.abs().max()).item()


def _mesh_models(rank, w):
    from cp_ops.integrations.diffusers import parallelize

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("agkv", "ulysses"))
    for name in ("wan", "flux"):
        model = build(name)
        cp_model = parallelize(copy.deepcopy(model), group=mesh, transport="torch")
        assert cp_model._cp_ops_state.attn_group is mesh
        for size, text, b in (((1, 2, 4), 8, 1), ((1, 3, 3), 7, 2)):  # 8 image tokens (even), 9 (uneven)
            g = torch.Generator().manual_seed(size[2] + b)
            kw = inputs(name, b, size, text, g)
            with torch.no_grad():
                ref = sample(model(**kw))
                out = sample(cp_model(**kw))
            # equal to rounding: each SDPA call attends a row's queries for H/I heads where one device attends all
            # queries and heads at once (CPU SDPA's reduction depends on that shape, ~1e-7; test_mesh2d.py checks the
            # 2-D attention bitwise against the same calls)
            assert out.shape == ref.shape and _rel(out, ref) <= 1e-5, (name, size, _rel(out, ref))
    with pytest.raises(ValueError, match="mode must be one of"):
        parallelize(build("wan"), group=mesh, mode="ulysses")
    with pytest.raises(ValueError, match="cfg_parallel=True with a 2-D CP mesh"):
        parallelize(build("wan"), group=mesh, cfg_parallel=True)


def test_models_on_2x2_mesh():
    run_ranks(_mesh_models, 4)


def _cfg_mesh_models(rank, w):
    from cp_ops.integrations.diffusers import parallelize

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("cfg", "agkv", "ulysses"))
    for name in ("wan", "flux"):
        model = build(name)
        cp_model = parallelize(copy.deepcopy(model), group=mesh, transport="torch")
        assert cp_model._cp_ops_group.size() == 4 and cp_model._cp_ops_state.attn_group.ndim == 2
        g = torch.Generator().manual_seed(3)
        kw = inputs(name, 2, (1, 2, 4), 8, g)  # [cond, uncond]
        with torch.no_grad():
            ref = sample(model(**kw))
            out = sample(cp_model(**kw))
        # each lane runs batch 1 where the reference ran batch 2: equal to rounding
        assert out.shape == ref.shape and _rel(out, ref) <= 1e-5, (name, _rel(out, ref))


def test_models_on_cfg_x_2x2_mesh():
    run_ranks(_cfg_mesh_models, 8)


def test_mesh_rules_raise_at_parallelize():
    """parallelize(group=mesh, comm_dtype=...) with K and V in different formats on a mesh of more than one row (its
    outer dim gathers K and V together) raises at once, naming the mesh, and installs nothing (was: raised at the
    first forward); a 3-D CFG mesh too; FP8 with K and V alike is accepted; a 3-D mesh of other dim names is told the
    3-D form."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from cp_ops.integrations.diffusers import parallelize

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        for shape, names, seen in (((2, 4), ("agkv", "ulysses"), "2x4"),
                                   ((2, 2, 2), ("cfg", "agkv", "ulysses"), "2x2")):
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            model = build("wan")
            with pytest.raises(ValueError, match=rf"parallelize on a {seen} mesh: .*K and V"):
                parallelize(model, group=mesh, comm_dtype={"k": torch.float8_e5m2})
            assert getattr(model, "_cp_ops_group", None) is None  # nothing installed
            assert parallelize(model, group=mesh, comm_dtype=torch.float8_e4m3fn) is model
        model = build("wan")
        # a 3-D mesh of other names: the message names the 3-D form parallelize takes (was: "must be 1-D, or 2-D")
        with pytest.raises(ValueError, match=r"3-D mesh must have mesh_dim_names=\('cfg', 'agkv', 'ulysses'\).*got a "
                                             r"3-D mesh of shape \(2, 2, 2\) with mesh_dim_names=\('agkv', 'ulysses', "
                                             r"'cfg'\)"):
            parallelize(model, group=init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("agkv", "ulysses", "cfg")))
        assert parallelize(model, group=init_device_mesh("cpu", (2, 4), mesh_dim_names=("agkv", "ulysses")),
                           comm_dtype=next(model.parameters()).dtype) is model
    finally:
        dist.destroy_process_group()


def _flat_group_across_nodes(rank, w, network_gbps):
    """parallelize(model) on the flat WORLD group whose ranks sit on 2 simulated nodes, mode='auto': the model's
    attention calls take the cost model's split (cp_ops.plan.split); the output equals the unparallelized model."""
    from cp_ops import config, plan
    from cp_ops.plan import flat, split
    from cp_ops.integrations.diffusers import parallelize

    config.configure(node_id=f"node{rank // 2}", network_gbps=network_gbps)
    model = build("wan")
    cp_model = parallelize(copy.deepcopy(model), transport="torch")
    for size in ((1, 2, 4), (1, 3, 3)):  # 8 image tokens (even), 9 (uneven)
        kw = inputs("wan", 1, size, 8, torch.Generator().manual_seed(size[2]))
        with torch.no_grad():
            ref = sample(model(**kw))
            out = sample(cp_model(**kw))
        assert out.shape == ref.shape and _rel(out, ref) <= 1e-5, (size, _rel(out, ref))
    picked = {(p.info.mode, p.info.shape) for p, _ in plan._plans.values()
              if isinstance(p, flat.Rerouted) and isinstance(p.info, split.Split)}
    # a fast network: latency decides (one collective, pure AGKV); a slow one: the fewest network bytes, which pure
    # Ulysses (4 heads) sends in fewer collectives than the 2x2 split (tests/test_split.py's hand-checked cases)
    want = ("agkv", "4x1") if network_gbps > 1 else ("ulysses", "1x4")
    assert want in picked, picked


@pytest.mark.parametrize("network_gbps", [50.0, 1e-3])
def test_models_on_a_flat_group_across_two_nodes(network_gbps):
    run_ranks(_flat_group_across_nodes, 4, network_gbps)
