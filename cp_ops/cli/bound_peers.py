"""Other libraries' context parallelism as sides of ``cp-ops bound MODEL --worlds W --compare PEER[,PEER...]``.

Each peer parallelizes a copy of the model (sharing its weights) the way its README tells a user to parallelize that
diffusers transformer, over W ranks of the tool's fake group (:mod:`cp_ops.cli.bound_fill`: this process is rank 0,
every collective writes this rank's data, nothing moves), and is timed beside cp_ops in the same interleaved rounds:

============  =====================================================================================================
``diffusers``  ``model.enable_parallelism(config=ContextParallelConfig(...))`` (:mod:`cp_ops.cli.bound_diffusers`)
``paraattn``   para-attn 0.3.38: ``parallelize_transformer(model, mesh=init_context_parallel_mesh(...))``
               (FLUX, Wan; Ulysses over every rank, or ring)
``xdit``       xfuser 0.7.0 / yunchang 0.6.4: xDiT's own groups (``init_distributed_environment``,
               ``initialize_model_parallel``) and its transformer wrapper class with USP attention processors
``cache-dit``  cache-dit 1.5.3: ``cache_dit.enable_cache(model, parallelism_config=ParallelismConfig(...))``
               (no cache: its context parallelism alone)
============  =====================================================================================================

Every peer takes the whole world as its CP group (that is how each README runs it: ``torchrun --nproc_per_node W``),
so while a peer builds and while its side runs, the default process group is the fake group of W ranks
(:func:`world_of`); cp_ops and the other sides name their groups and never see the swap. A peer that refuses a
model or a layout (an error from the peer, or a package that is not installed) is a row with its reason; the run
goes on. Nothing here is imported by cp_ops itself, and each peer is imported only when its side is built.
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Peer:
    """One library: its CLI name, the module that tells it is installed, how to install it, its CP layouts and the
    function that parallelizes a model with it (:func:`parallelize`)."""

    name: str
    module: str
    install: str
    layouts: tuple[str, ...]
    build: Callable


@dataclass
class Built:
    """What a peer's build returns: a label of what ran (the row's ``mode``) and, where the peer reads process-wide
    state at call time, a context manager factory every call of the side runs inside (its default group, its own
    global groups)."""

    label: str
    around: Callable | None = None


@contextlib.contextmanager
def world_of(group: dist.ProcessGroup):
    """While active, ``group`` (a fake group of W ranks with this process as rank 0) is torch.distributed's default
    group: ``dist.get_world_size()`` is W, ``init_device_mesh`` spans its W ranks, and groups made inside it write
    their outputs where ``group`` does (:func:`cp_ops.cli.bound_fill.filled`). Restored on exit."""
    from torch.distributed import distributed_c10d as c10d

    from . import bound_fill

    prev = c10d._world.default_pg
    making = bound_fill.filled() if bound_fill.is_filled(group) else contextlib.nullcontext()
    c10d._world.default_pg = group
    try:
        with making:
            yield
    finally:
        c10d._world.default_pg = prev


@contextlib.contextmanager
def own_class_patches(model: torch.nn.Module):
    """Keep what a peer patches on a class (cache-dit sets ``WanAttnProcessor.__call__`` for every Wan model in the
    process) to ``model``: the classes of ``model``'s modules and attention processors are snapshotted; on exit every
    class attribute the block changed is restored, and each of ``model``'s objects of a changed class gets a subclass
    that holds the peer's version. Other sides (cp_ops', diffusers' one device) keep diffusers' classes."""
    objs = list(model.modules())
    objs += [m.processor for m in objs if getattr(m, "processor", None) is not None]
    classes = {type(o) for o in objs}
    before = {c: dict(vars(c)) for c in classes}
    try:
        yield
    finally:
        for cls, old in before.items():
            changed = {k: v for k, v in vars(cls).items() if k not in old or old[k] is not v}
            if not changed:
                continue
            for k in changed:
                if k in old:
                    setattr(cls, k, old[k])
                else:
                    delattr(cls, k)
            own = type(cls.__name__, (cls,), {k: v for k, v in changed.items() if k not in ("__dict__", "__weakref__")})
            objs = list(model.modules())
            for o in objs + [m.processor for m in objs if getattr(m, "processor", None) is not None]:
                if type(o) is cls:
                    o.__class__ = own


def _diffusers(model, layout: str, group, heads: int | None, device: torch.device) -> Built:
    from . import bound_diffusers

    return Built(bound_diffusers.parallelize(model, layout, group.size(), heads, device))


def _paraattn(model, layout: str, group, heads: int | None, device: torch.device) -> Built:
    """para-attn's README: ``parallelize_pipe(pipe)`` over ``init_context_parallel_mesh(device_type)`` (every rank
    Ulysses; ``max_ring_dim_size`` makes ring dims). Its forward chunks the RoPE ids over the default group at call
    time: each call runs inside :func:`world_of`. Refuses (its own ValueError) a transformer class it has no adapter
    for (Qwen-Image); Ulysses needs W to divide the heads (its AssertionError at the first call)."""
    from para_attn.context_parallel import init_context_parallel_mesh
    from para_attn.context_parallel.diffusers_adapters import parallelize_transformer

    _paraattn_gqa_compat()
    w = group.size()
    with world_of(group):
        mesh = init_context_parallel_mesh(torch.device(device).type, max_ring_dim_size=w if layout == "ring" else None)
        parallelize_transformer(model, mesh=mesh)
    return Built(layout, around=lambda: world_of(group))


def _paraattn_gqa_compat() -> None:
    """diffusers >= 0.35 calls ``F.scaled_dot_product_attention(..., enable_gqa=False)``; para-attn 0.3.38's Ulysses
    and ring functions (which its attention mode calls with SDPA's keyword arguments) predate the keyword and raise
    TypeError. Both are wrapped once to drop ``enable_gqa=False`` (the default: nothing changes); ``True`` still
    reaches para-attn and fails there."""
    import para_attn.para_attn_interface as pai

    def drop(fn):
        if getattr(fn, "_cp_ops_gqa_compat", False):
            return fn

        def call(*args, enable_gqa=False, **kwargs):
            if enable_gqa:
                kwargs["enable_gqa"] = enable_gqa
            return fn(*args, **kwargs)

        call._cp_ops_gqa_compat = True
        return call

    pai.ulysses_attn_func = drop(pai.ulysses_attn_func)
    pai.ring_attn_func = drop(pai.ring_attn_func)


def _cachedit(model, layout: str, group, heads: int | None, device: torch.device) -> Built:
    """cache-dit's README: ``cache_dit.enable_cache(transformer, parallelism_config=ParallelismConfig(ulysses_size=W))``
    (``ring_size=W`` for ring), no cache config: its context parallelism alone (its own copy of diffusers' CP hooks and
    its attention backend, ``'native'``). Its mesh spans the default group: built inside :func:`world_of`."""
    import cache_dit
    from cache_dit import ParallelismConfig

    w = group.size()
    sizes = dict(ulysses_size=w) if layout == "ulysses" else dict(ring_size=w)
    with world_of(group):
        cache_dit.enable_cache(model, parallelism_config=ParallelismConfig(**sizes))
    return Built(layout, around=lambda: world_of(group))


#: the peers --compare takes, in the order their sides are built
PEERS = {p.name: p for p in (
    Peer("diffusers", "diffusers", "pip install diffusers", ("ulysses", "ring"), _diffusers),
    Peer("paraattn", "para_attn", "pip install --no-deps para-attn==0.3.38 (an sdist: built with setuptools-scm)",
         ("ulysses", "ring"), _paraattn),
    Peer("cache-dit", "cache_dit", "pip install --no-deps cache-dit==1.5.3", ("ulysses", "ring"), _cachedit),
)}


def parallelize(name: str, model: torch.nn.Module, layout: str, group: dist.ProcessGroup, heads: int | None,
                device: torch.device) -> Built:
    """Parallelize ``model`` in place with peer ``name``'s ``layout`` over ``group`` (a fake group of W ranks, this
    process rank 0). Raises RuntimeError naming the install line when the peer is not installed, ValueError for an
    unknown peer or layout, and whatever the peer raises when it refuses the model."""
    peer = PEERS.get(name)
    if peer is None:
        raise ValueError(f"--compare takes {', '.join(PEERS)}; got {name!r}")
    if layout not in peer.layouts:
        raise ValueError(f"{name}'s layouts are {', '.join(peer.layouts)}; got {layout!r}")
    if importlib.util.find_spec(peer.module) is None:
        raise RuntimeError(f"{name} is not installed: {peer.install}")
    with own_class_patches(model):
        return peer.build(model, layout, group, heads, device)
