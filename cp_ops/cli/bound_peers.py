"""Other libraries' context parallelism as sides of ``cp-ops bound MODEL --worlds W --compare PEER[,PEER...]``.

Each peer parallelizes a weight-sharing copy of the model as its README tells a user to, over W ranks of the tool's
fake group (:mod:`cp_ops.cli.bound_fill`), timed beside cp_ops in the same rounds: ``diffusers``
(``enable_parallelism``, :mod:`cp_ops.cli.bound_diffusers`), ``paraattn`` (para-attn 0.3.38,
``parallelize_transformer``), ``xdit`` (xfuser 0.7.0 / yunchang 0.6.4: its groups, runtime state and wrapper class),
``cache-dit`` (1.5.3, ``enable_cache`` with a ``ParallelismConfig``, no cache). Every peer takes the whole world as
its CP group (``torchrun --nproc_per_node W``), so while a peer builds and runs the default group is the fake group
of W ranks (:func:`world_of`); cp_ops' sides name their groups. A peer that refuses a model or layout, or is not
installed, is a row with its reason. Each peer is imported only when its side is built.
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
    state at call time, a context manager factory every call of the side runs inside (its default or global groups)."""

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
    before = {c: dict(vars(c)) for c in {type(o) for o in _objects(model)}}
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
            for o in _objects(model):
                if type(o) is cls:
                    o.__class__ = own


def _objects(model: torch.nn.Module) -> list:
    mods = list(model.modules())
    return mods + [m.processor for m in mods if getattr(m, "processor", None) is not None]


def _diffusers(model, layout: str, group, heads: int | None, device: torch.device, inputs: dict) -> Built:
    from . import bound_diffusers

    return Built(bound_diffusers.parallelize(model, layout, group.size(), heads, device, inputs))


def _paraattn(model, layout: str, group, heads: int | None, device: torch.device, inputs: dict) -> Built:
    """para-attn's README: ``parallelize_pipe(pipe)`` over ``init_context_parallel_mesh(device_type)`` (Ulysses;
    ``max_ring_dim_size`` makes ring dims). Its forward chunks the RoPE ids over the default group at call time, so
    each call runs inside :func:`world_of`. It refuses classes it has no adapter for (Qwen-Image), Wan with diffusers
    >= 0.35 (:func:`_paraattn_refuses`), and Ulysses where W does not divide the heads (at the first call)."""
    from para_attn.context_parallel import init_context_parallel_mesh
    from para_attn.context_parallel.diffusers_adapters import parallelize_transformer

    _paraattn_refuses(model)
    _paraattn_gqa_compat()
    w = group.size()
    with world_of(group):
        mesh = init_context_parallel_mesh(torch.device(device).type, max_ring_dim_size=w if layout == "ring" else None)
        parallelize_transformer(model, mesh=mesh)
    return Built(layout, around=lambda: world_of(group))


def _paraattn_refuses(model) -> None:
    """Raise ValueError where para-attn's adapter cannot run ``model`` with this diffusers: para-attn <= 0.3.38's Wan
    adapter chunks ``self.rope(hidden_states)`` as one complex tensor, but diffusers >= 0.35's Wan rope (it has
    ``freqs_cos``) returns a ``(cos, sin)`` pair, and every forward fails in ``get_assigned_chunk``."""
    from importlib.metadata import version

    from packaging.version import Version

    if type(model).__name__ == "WanTransformer3DModel" and hasattr(getattr(model, "rope", None), "freqs_cos") and \
            Version(version("para_attn")) <= Version("0.3.38"):
        raise ValueError(f"para-attn {version('para_attn')}'s Wan adapter predates diffusers 0.35's real-valued Wan "
                         "RoPE (it chunks one complex RoPE tensor; the rope now returns a (cos, sin) tuple): every Wan "
                         "forward fails with 'tuple' object has no attribute 'shape'")


def _paraattn_gqa_compat() -> None:
    """diffusers >= 0.35 passes SDPA ``enable_gqa=False``, which para-attn 0.3.38's Ulysses and ring functions predate
    (TypeError): both are wrapped once to drop ``enable_gqa=False`` (the default); ``True`` still reaches them."""
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


def _cachedit(model, layout: str, group, heads: int | None, device: torch.device, inputs: dict) -> Built:
    """cache-dit's README: ``enable_cache(transformer, parallelism_config=ParallelismConfig(ulysses_size=W))``
    (``ring_size=W`` for ring), no cache: its context parallelism alone, built inside :func:`world_of` (its mesh spans
    the default group)."""
    import cache_dit
    from cache_dit import ParallelismConfig

    from . import bound_diffusers

    w = group.size()
    # its plans split the streams diffusers' _cp_plan splits (Qwen-Image: image and text), with its copy of diffusers'
    # even sharder: a length W does not divide is refused here, with the lengths, not at the first call
    bound_diffusers.require_even("cache-dit", model, inputs, w)
    sizes = dict(ulysses_size=w) if layout == "ulysses" else dict(ring_size=w)
    # cache-dit's CP takes its own registered backends, not the one the tool set on the model (diffusers' cuDNN)
    model.reset_attention_backend()
    with world_of(group):
        cache_dit.enable_cache(model, parallelism_config=ParallelismConfig(**sizes))
    return Built(layout, around=lambda: world_of(group))


#: xfuser's process-wide parallel state (module globals of xfuser.core.distributed.parallel_state)
_XDIT_GROUPS = ("_WORLD", "_TP", "_SP", "_PP", "_CFG", "_DP", "_FS", "_DIT", "_VAE", "_MODEL_REPLICA")

#: the diffusers transformer class -> xDiT's wrapper class of it (its module under
#: xfuser.model_executor.models.transformers, its name): what xDiT's model runner loads for FLUX.1, Wan and Qwen-Image
_XDIT_WRAPPERS = {
    "FluxTransformer2DModel": ("transformer_flux", "xFuserFlux1Transformer2DWrapper"),
    "WanTransformer3DModel": ("transformer_wan", "xFuserWanTransformer3DWrapper"),
    "QwenImageTransformer2DModel": ("transformer_qwen", "xFuserQwenImageTransformerWrapper"),
}


def _xdit_state() -> dict:
    """xDiT's process-wide state: its groups (parallel_state), yunchang's Ulysses/ring groups, its runtime state."""
    import xfuser.core.distributed.parallel_state as ps
    import xfuser.core.distributed.runtime_state as rs
    from yunchang.globals import PROCESS_GROUP

    return dict(groups={k: getattr(ps, k) for k in _XDIT_GROUPS}, runtime=rs._RUNTIME,
                yunchang=dict(vars(PROCESS_GROUP)))


def _set_xdit_state(state: dict | None) -> None:
    """Install ``state`` (:func:`_xdit_state`; None: none initialized)."""
    import xfuser.core.distributed.parallel_state as ps
    import xfuser.core.distributed.runtime_state as rs
    from yunchang.globals import PROCESS_GROUP

    for k in _XDIT_GROUPS:
        setattr(ps, k, None if state is None else state["groups"][k])
    rs._RUNTIME = None if state is None else state["runtime"]
    for k in ("ULYSSES_PG", "RING_PG"):
        setattr(PROCESS_GROUP, k, None)
    if state is not None:
        vars(PROCESS_GROUP).update(state["yunchang"])


@contextlib.contextmanager
def _xdit_active(state: dict, group):
    """While active, ``state`` is xDiT's state and ``group`` the default group (:func:`world_of`)."""
    prev = _xdit_state()
    _set_xdit_state(state)
    try:
        with world_of(group):
            yield
    finally:
        _set_xdit_state(prev)


@contextlib.contextmanager
def _groups_of_the_default_backend():
    """xDiT makes each group twice, with the device's backend (NCCL) and with gloo; on the fake group every group is
    made with the default group's backend instead (a fake group that writes its outputs), so nothing connects."""
    import torch.distributed.distributed_c10d as c10d

    made = c10d.new_group

    def new_group(ranks=None, timeout=None, backend=None, *args, **kwargs):
        return made(ranks, timeout, None, *args, **kwargs)

    dist.new_group = c10d.new_group = new_group
    try:
        yield
    finally:
        dist.new_group = c10d.new_group = made


def _xdit(model, layout: str, group, heads: int | None, device: torch.device, inputs: dict) -> Built:
    """xDiT's model runner (README "Using model runner") on the model in hand: its process-wide groups and runtime
    state from an ``xFuserArgs(ulysses_degree=W)`` config (``ring_degree=W`` for ring), then the model turned into
    xDiT's wrapper class of it (its forward splits the sequence, its processors call USP), on the same weights. The
    state is global: each side keeps its own and installs it around each call (:func:`_xdit_active`). Refuses a class
    it has no wrapper for; xfuser itself refuses a machine without an accelerator (at import)."""
    import importlib
    import inspect

    from xfuser.config import xFuserArgs
    from xfuser.core.distributed import get_runtime_state, init_distributed_environment, initialize_runtime_state

    name = type(model).__name__
    if name not in _XDIT_WRAPPERS:
        raise ValueError(f"xDiT has no wrapper for {name} (it wraps {', '.join(_XDIT_WRAPPERS)} here)")
    where, wrapper_name = _XDIT_WRAPPERS[name]
    wrapper = getattr(importlib.import_module(f"xfuser.model_executor.models.transformers.{where}"), wrapper_name)
    w = group.size()
    degrees = dict(ulysses_degree=w) if layout == "ulysses" else dict(ring_degree=w)
    device = torch.device(device)
    prev = _xdit_state()
    _set_xdit_state(None)
    try:
        with world_of(group), _groups_of_the_default_backend():
            init_distributed_environment(world_size=w, rank=0, local_rank=device.index or 0)
            args = xFuserArgs(model=name, **degrees)
            engine_config, _ = args.create_config()
            pipe = type(name.split("Transformer")[0] + "Pipeline", (), {})()  # what the runtime state reads of one
            pipe.transformer, pipe.vae_scale_factor = model, 8
            pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal = 8, 4
            initialize_runtime_state(pipe, engine_config)
            text, latents = inputs.get("encoder_hidden_states"), inputs.get("hidden_states")
            if latents is None or latents.dim() != 5:  # an image model: as the runner does before calling the pipeline
                get_runtime_state().set_input_parameters(  # (its video models' runners set nothing)
                    batch_size=1 if text is None else text.shape[0], num_inference_steps=28,
                    max_condition_sequence_length=None if text is None else text.shape[1],
                    split_text_embed_in_sp=True)
            init = inspect.signature(wrapper.__init__).parameters
            kwargs = {k: v for k, v in model.config.items() if k in init}
            if "attention_kwargs" in init:  # Wan: what the runner passes
                from xfuser.model_executor.models.runner_models.wan import _build_attention_kwargs

                kwargs["attention_kwargs"] = _build_attention_kwargs(args)
            base = type(model)
            model.__class__ = wrapper
            own_init = base.__dict__["__init__"]
            base.__init__ = lambda self, *a, **k: None  # the model exists: only the wrapper's own part of __init__
            try:
                wrapper.__init__(model, **kwargs)
            finally:
                base.__init__ = own_init
            model.to(device)  # the wrapper's new buffers (the weights are there already: not copied)
            state = _xdit_state()
    finally:
        _set_xdit_state(prev)
    return Built(layout, around=lambda: _xdit_active(state, group))


#: the peers --compare takes, in the order their sides are built
PEERS = {p.name: p for p in (
    Peer("diffusers", "diffusers", "pip install diffusers", ("ulysses", "ring"), _diffusers),
    Peer("paraattn", "para_attn", "pip install para-attn==0.3.38 (or cp_ops[peers])", ("ulysses", "ring"), _paraattn),
    Peer("xdit", "xfuser", "pip install xfuser==0.7.0 yunchang==0.6.4 (or cp_ops[peers]; it needs an accelerator)",
         ("ulysses", "ring"), _xdit),
    Peer("cache-dit", "cache_dit", "pip install cache-dit[parallelism]==1.5.3 (or cp_ops[peers])", ("ulysses", "ring"),
         _cachedit),
)}


def prepare(names: list[str]) -> None:
    """What peers ``names`` change process-wide on first use, done before any side is built (else the compiled blocks
    of sides built before, guarding on it, compile again in the timed rounds): cache-dit's attention backends in
    diffusers' registry. A peer that cannot be imported is left alone (its sides say why)."""
    if "cache-dit" in names and importlib.util.find_spec("cache_dit") is not None:
        try:
            from cache_dit.attention import _maybe_register_custom_attn_backends

            _maybe_register_custom_attn_backends()
        except Exception:  # noqa: BLE001 - its sides report it
            pass


def parallelize(name: str, model: torch.nn.Module, layout: str, group: dist.ProcessGroup, heads: int | None,
                device: torch.device, inputs: dict | None = None) -> Built:
    """Parallelize ``model`` in place with peer ``name``'s ``layout`` over ``group`` (a fake group of W ranks, this
    process rank 0); ``inputs``: the forward's keyword arguments (some peers look at them while they build). Raises
    RuntimeError naming the install line when the peer is not installed, ValueError for an
    unknown peer or layout, and whatever the peer raises when it refuses the model."""
    peer = PEERS.get(name)
    if peer is None:
        raise ValueError(f"--compare takes {', '.join(PEERS)}; got {name!r}")
    if layout not in peer.layouts:
        raise ValueError(f"{name}'s layouts are {', '.join(peer.layouts)}; got {layout!r}")
    if importlib.util.find_spec(peer.module) is None:
        raise RuntimeError(f"{name} is not installed: {peer.install}")
    with own_class_patches(model):
        return peer.build(model, layout, group, heads, device, inputs or {})
