"""Resolve the CP group a public function was given (``None``: the default group, a ``ProcessGroup`` or a 1-D
``DeviceMesh``) into a ``ProcessGroup``; ops take its ``group_name``, so a compiled graph names it by a string."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def resolve_group(group: Any = None) -> dist.ProcessGroup:
    """The ``ProcessGroup`` for ``group``. RuntimeError: torch.distributed is not initialized; ValueError: a
    DeviceMesh of more than one dimension, or an unsupported type."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "cp_ops needs an initialized torch.distributed process group: call "
            "torch.distributed.init_process_group(...) (or launch with torchrun / `cp-ops ... --nproc N`) first.\n"
            "To see what cp_ops.describe(q, ...) picks for W ranks without launching them, describe on a 'fake' group "
            "of W ranks (nothing runs): from torch.testing._internal.distributed.fake_pg import FakeStore; "
            "torch.distributed.init_process_group('fake', store=FakeStore(), rank=0, world_size=W)"
        )
    if group is None:
        return dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"rank {dist.get_rank()} is not a member of this CP group (dist.new_group returned "
            "GroupMember.NON_GROUP_MEMBER here): call cp_ops only on the ranks of the group"
        )
    if isinstance(group, dist.ProcessGroup):
        return group
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"a DeviceMesh CP group must be 1-D here (pass mesh['cp']; cp_ops.attention and parallelize also take a "
                f"2-D ('agkv', 'ulysses') mesh: docs/2d.md); got a {group.ndim}-D mesh "
                f"with dimension names {group.mesh_dim_names}"
            )
        return group.get_group()
    raise ValueError(f"group must be None, a ProcessGroup or a 1-D DeviceMesh; got {type(group).__name__}")


def backend_name(group: dist.ProcessGroup) -> str:
    """The group's backend string as torch reports it: 'nccl', 'gloo', 'fake', or 'cpu:gloo,cuda:nccl'."""
    return str(dist.get_backend(group))
