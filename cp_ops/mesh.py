"""2-D CP meshes: what a ``DeviceMesh`` with ``mesh_dim_names=("agkv", "ulysses")`` means to cp_ops (``docs/2d.md``).

O rows (the outer dim: AGKV between the rows), I ranks per row (the inner dim: Ulysses inside a row); rank
``r = o·I + i`` holds the r-th block of tokens; I must divide the head count; other dim names raise ValueError.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from . import layout

#: The dim names of a 2-D CP mesh: (outer, inner).
DIM_NAMES = ("agkv", "ulysses")


def is_mesh(group: Any) -> bool:
    """Whether ``group`` is a ``DeviceMesh`` of more than one dim. Cheap (every :func:`cp_ops.attention` call); a
    ProcessGroup is asked nothing (under Dynamo its unknown attributes raise)."""
    if group is None or isinstance(group, ProcessGroup):
        return False
    return isinstance(group, DeviceMesh) and group.ndim != 1  # (Dynamo of torch 2.11 cannot trace hasattr on a mesh)


class MeshInfo(NamedTuple):
    """A 2-D mesh as plain values: per dim (outer, inner) the group's name, size, this rank's index and backend."""

    outer_name: str
    outer: int
    o: int
    outer_backend: str
    inner_name: str
    inner: int
    i: int
    inner_backend: str

    @property
    def world(self) -> int:
        return self.outer * self.inner

    @property
    def rank(self) -> int:
        """This rank's index in the mesh, row-major (its token block)."""
        return self.o * self.inner + self.i

    @property
    def shape(self) -> str:
        return f"{self.outer}x{self.inner}"


def check_names(mesh: Any) -> None:
    """A CP mesh must be 2-D with ``mesh_dim_names == ("agkv", "ulysses")``. Raises ValueError naming what was seen."""
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or names != DIM_NAMES:
        raise ValueError(f"a DeviceMesh CP group must be 1-D, or 2-D with mesh_dim_names={DIM_NAMES} (outer: AGKV, "
                         f"inner: Ulysses); got a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)} with mesh_dim_names="
                         f"{mesh.mesh_dim_names} (slice a larger mesh: mesh['agkv', 'ulysses'])")


def describe(mesh: Any) -> tuple:
    """``mesh`` as a :class:`MeshInfo`'s fields (a plain tuple: a constant for the compiler). Raises ValueError
    (:func:`check_names`)."""
    from .group import backend_name

    check_names(mesh)
    out = []
    for name in DIM_NAMES:
        pg = mesh.get_group(name)
        out += [pg.group_name, pg.size(), pg.rank(), backend_name(pg)]
    return tuple(out)


describe._dynamo_marked_constant = True  # type: ignore[attr-defined]


def groups(mesh: Any):
    """``(outer, inner)`` process groups of a 2-D CP mesh (eager code)."""
    return mesh.get_group(DIM_NAMES[0]), mesh.get_group(DIM_NAMES[1])


def row_lens(seq_lens, outer: int, inner: int) -> tuple:
    """The token count of each row (outer index) from the W = O·I per-rank counts (row-major)."""
    return tuple(sum(seq_lens[r * inner:(r + 1) * inner]) for r in range(outer))


class MeshShards:
    """:class:`cp_ops.layout.Shards` of one 2-D call: ``inner`` over this rank's row, ``outer`` over the rows (their
    token totals). ``seq_lens``: the W counts in mesh rank order, or None (every rank ``s_local`` tokens)."""

    __slots__ = ("inner", "outer")

    def __init__(self, seq_lens, info: MeshInfo, s_local: int, device):
        n, o, i = info.inner, info.o, info.i
        seq = tuple(seq_lens) if seq_lens is not None else (s_local,) * info.world
        self.inner = layout.Shards(seq[o * n:(o + 1) * n], n, i, s_local, device)
        rows = row_lens(seq, info.outer, n)
        self.outer = layout.Shards(rows, info.outer, o, rows[o], device)


def init_cp_mesh(tokens: int, heads: int, head_dim: int, *, dtype: str = "bf16", batch: int = 1,
                 device_type: str = "cuda", links=None, overlapped: bool = False):
    """Build the 2-D CP mesh over every rank that the cost model predicts fastest for attention over ``tokens``
    tokens (:func:`cp_ops.cost.choose`), from the ranks' node layout (:mod:`cp_ops.node`). ``links``: the cost
    model's figures (None: :func:`cp_ops.cost.links`). Collective: every rank calls it alike.

    Returns:
        ``(mesh, prediction)``: a ``DeviceMesh`` of shape ``(O, I)`` with ``mesh_dim_names=("agkv", "ulysses")`` (pass
        it as ``group=`` to :func:`cp_ops.attention` / :func:`cp_ops.parallelize`), and the chosen
        :class:`cp_ops.cost.Prediction` (pure Ulysses is ``1×W``, pure AGKV ``W×1``).
    Raises:
        ValueError: the nodes hold different rank counts; the ranks are not numbered node by node (torchrun's order,
            which keeps each inner group on one node); the ranks passed different arguments (every rank raises, naming
            each rank's); bad counts (:func:`cp_ops.cost.predict`).
        RuntimeError: torch.distributed is not initialized; a rank did not take part within ``CP_OPS_TIMEOUT_S``.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from . import cost, node
    from .contract import agree, waiting_in
    from .group import resolve_group

    world = resolve_group(None)
    asked = (f"tokens={tokens}, heads={heads}, head_dim={head_dim}, dtype={dtype!r}, batch={batch}, "
             f"device_type={device_type!r}, links={links!r}, overlapped={overlapped}")
    with waiting_in("cp_ops.mesh.init_cp_mesh"):  # the words of its waits on peers
        ids = node.group_nodes(world)
        seen = agree(world, "init_cp_mesh", asked, "init_cp_mesh's arguments")
    if len(set(seen)) > 1:  # else each rank could build another mesh (init_device_mesh checks nothing of it)
        raise ValueError("init_cp_mesh: every rank must pass the same arguments (the ranks build one mesh from them); "
                         "got " + "; ".join(f"rank {r}: {a}" for r, a in enumerate(seen)))
    nodes, per = node.layout(ids)
    if not node.node_major(ids):
        raise ValueError(f"init_cp_mesh needs the ranks numbered node by node (torchrun's order: ranks 0..{per - 1} on "
                         f"one node, ...); got node identities {list(ids)} by rank")
    p = cost.choose(tokens, heads, head_dim, ranks_per_node=per, nodes=nodes, dtype=dtype, batch=batch,
                    links=links or cost.links(), overlapped=overlapped)
    assert p.outer * p.inner == dist.get_world_size()
    return init_device_mesh(device_type, (p.outer, p.inner), mesh_dim_names=DIM_NAMES), p
