"""diffusers' own context parallelism as a side of ``cp-ops bound MODEL --worlds W --compare diffusers``: a copy of
the model (sharing its weights) with ``enable_parallelism(config=ContextParallelConfig(...))`` over a device mesh of
the first W ranks of the fake default group (``("ring", "ulysses")`` dims: ``(1, W)`` for Ulysses, ``(W, 1)`` for
ring), timed beside cp_ops' in the same rounds; its functional collectives write on the tool's fake groups
(:mod:`cp_ops.cli.bound_fill`). The side, its rows and its limits: ``docs/measuring.md``.
"""

from __future__ import annotations


import torch


#: the CP layouts a diffusers side can take
LAYOUTS = ("ulysses", "ring")


def config(layout: str, world: int, heads: int | None, mesh):
    """The ``ContextParallelConfig`` of ``layout`` at ``world`` ranks on ``mesh``.

    Raises:
        ValueError: an unknown layout (the accepted ones named).
    """
    from diffusers import ContextParallelConfig

    if layout == "ulysses":
        anything = bool(heads) and heads % world != 0
        return ContextParallelConfig(ulysses_degree=world, mesh=mesh, ulysses_anything=anything)
    if layout == "ring":
        return ContextParallelConfig(ring_degree=world, mesh=mesh)
    raise ValueError(f"a diffusers CP layout is one of {LAYOUTS}; got {layout!r}")


def mesh_for(layout: str, world: int, device: torch.device):
    """A ``("ring", "ulysses")`` device mesh over ranks ``0 .. world-1`` of the default (fake) group: ``(1, W)`` for
    Ulysses, ``(W, 1)`` for ring. This process must be rank 0 of a default group of >= ``world`` ranks; the mesh's
    groups write their outputs where the default group does (:func:`cp_ops.cli.bound_fill.filled`)."""
    import contextlib

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from . import bound_fill

    shape = (1, world) if layout == "ulysses" else (world, 1)
    making = bound_fill.filled() if bound_fill.is_filled(dist.group.WORLD) else contextlib.nullcontext()
    with making:
        return DeviceMesh(torch.device(device).type, torch.arange(world).view(*shape),
                          mesh_dim_names=("ring", "ulysses"))


def parallelize(model: torch.nn.Module, layout: str, world: int, heads: int | None, device: torch.device) -> str:
    """``model.enable_parallelism`` with diffusers' ``layout`` over ``world`` ranks (see :func:`mesh_for`); returns
    a label (``'ulysses'``, ``'ulysses_anything'``, ``'ring'``). Raises what diffusers raises (e.g. on CPU:
    RuntimeError, no accelerator: diffusers itself would divide by zero) and ValueError for an unknown layout."""
    logger_compat()
    if torch.accelerator.device_count() == 0:  # what diffusers would do: rank % 0, a ZeroDivisionError
        raise RuntimeError("diffusers' enable_parallelism needs an accelerator (it places rank r on device "
                           "r % torch.accelerator.device_count(), 0 here)")
    cfg = config(layout, world, heads, mesh_for(layout, world, device))
    model.enable_parallelism(config=cfg)
    return "ulysses_anything" if getattr(cfg, "ulysses_anything", False) else layout


def logger_compat() -> None:
    """diffusers 0.42.1's CP hooks call ``logger.warning_once`` (added by transformers); without transformers the
    same message through ``warning``."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        import diffusers.hooks.context_parallel as dcp

        if not hasattr(dcp.logger, "warning_once"):
            dcp.logger.warning_once = dcp.logger.warning
