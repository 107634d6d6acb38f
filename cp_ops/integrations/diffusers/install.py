"""parallelize: one diffusers transformer made context-parallel (the hooks, the attention backend, the checks, the
optional compiled path); re-exported by :mod:`cp_ops.integrations.diffusers`."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
import torch.distributed as dist

from ... import captured, modes
from ...group import resolve_group
from ...comm_dtype import NONE as COMM_NONE, for_mode as comm_for_mode, normalize as normalize_comm_dtype
from ...mesh import DIM_NAMES, check_names, is_mesh
from ...plan.rules import check_chunks
from ...transport.base import names as transport_names
from ...transport.torch import stage_through_host
from . import caches, capture_safe, compiled, dispatch, hooks
from .checks import RankChecks
from .lanes import Lanes, swapped
from .plan import Gather
from .registry import SUPPORTED, spec_for

#: the values parallelize's ``cuda_graphs`` takes ("auto", the default: "forward" where it can be captured)
CUDA_GRAPHS = (False, True, "forward", "auto")


def mesh_groups(group: Any, cfg_parallel: bool):
    """``(pg, attn_group, cfg_parallel)`` for :func:`parallelize`'s ``group``: ``pg`` holds the ranks that split the
    tokens (rank order = token order) and gather the output; ``attn_group`` is what :func:`cp_ops.attention` gets
    (None: ``pg``, or each CFG lane's group). A 2-D ``("agkv", "ulysses")`` mesh: ``pg`` = its ranks row-major (the
    default group when the mesh is every rank in order, else ``mesh._flatten()``). A 3-D ``("cfg", "agkv",
    "ulysses")`` mesh of every rank in order, cfg size 2: ``pg`` = the default group (two CFG lanes, the mesh's cfg
    slices), ``attn_group`` = this rank's 2-D slice, ``cfg_parallel`` True. ValueError: any other mesh, or
    ``cfg_parallel=True`` with a 2-D mesh."""
    if not is_mesh(group):
        return resolve_group(group), None, cfg_parallel
    world = resolve_group(None)
    in_order = group.mesh.flatten().tolist() == list(range(world.size()))
    if group.ndim == 3 and tuple(group.mesh_dim_names or ()) == ("cfg",) + DIM_NAMES:
        if group.shape[0] != 2 or not in_order:
            raise ValueError(f"parallelize: a ('cfg', 'agkv', 'ulysses') mesh must have cfg size 2 and hold every rank "
                             f"in order (init_device_mesh(device, (2, O, I), ...)); got shape {tuple(group.shape)} "
                             f"over ranks {group.mesh.flatten().tolist()}")
        return world, group["agkv", "ulysses"], True
    if group.ndim == 3:
        raise ValueError(f"parallelize: a 3-D mesh must have mesh_dim_names=('cfg', 'agkv', 'ulysses') (CFG lanes x "
                         f"2-D CP), a 2-D one ('agkv', 'ulysses'); got a 3-D mesh of shape {tuple(group.shape)} with "
                         f"mesh_dim_names={group.mesh_dim_names}")
    check_names(group)
    if cfg_parallel:
        raise ValueError("parallelize: cfg_parallel=True with a 2-D CP mesh: pass a 3-D mesh with mesh_dim_names "
                         "('cfg', 'agkv', 'ulysses') instead (the CFG lanes are its cfg dim)")
    pg = world if in_order else group._flatten().get_group()
    assert dist.get_process_group_ranks(pg) == group.mesh.flatten().tolist()
    return pg, group, False


def _check_comm_dtype(fmts: tuple, mode: str, mesh) -> None:
    """K and V in different formats where the calls gather them together (mode 'agkv', a 2-D mesh of more than one
    row): ValueError here, not at the first forward."""
    if fmts == COMM_NONE:
        return
    rows, cols = (1, 1) if mesh is None else tuple(mesh.mesh.shape)
    kv_mode = "agkv_ulysses" if rows > 1 and cols > 1 else "agkv" if rows > 1 or mode == "agkv" else None
    if kv_mode is not None:
        try:
            comm_for_mode(fmts, kv_mode)
        except ValueError as e:
            where = f"a {rows}x{cols} mesh" if mesh is not None else f"mode={mode!r}"
            raise ValueError(f"parallelize on {where}: {e}") from None


def auto_graphs(model: torch.nn.Module, transport: str, pg) -> tuple[str | bool, str | None]:
    """``cuda_graphs="auto"``: ``("forward", None)`` where the whole forward can be captured, else ``(False, why)``
    (``why`` None: not on CUDA, eager without a word); what shows only at a call is the capture's fallback."""
    device = captured._device_of(model)
    try:
        captured.check_capturable(model)
    except ValueError as e:
        return False, (str(e) if device.type == "cuda" else None)
    if transport == "torch" and stage_through_host(pg, device):
        return False, ("its ranks share a GPU over gloo, and the torch transport moves their CUDA tensors through "
                       "host memory, which a CUDA graph cannot hold (transport='fast' can be captured)")
    return "forward", None


def _fell_back(name: str):
    def warn(why: str) -> None:
        warnings.warn(f"cp_ops.parallelize: {name} runs eager, its whole forward not captured in one CUDA graph (the "
                      f"default on CUDA): {why}. Pass cuda_graphs=False to choose eager without this warning",
                      stacklevel=3)
    return warn


def _undivided_heads(attn_modules, w: int) -> str | None:
    """``'PATH has heads=H, which W=w ranks do not divide'`` for the first attention module whose heads (or K/V heads)
    W does not divide; None when W divides every one."""
    for _, _, modules in attn_modules:
        for path, module in modules:
            for attr in ("heads", "kv_heads"):
                h = getattr(module, attr, None)
                if isinstance(h, int) and h % w:
                    return f"{path} has {attr}={h}, which W={w} ranks do not divide"
    return None


def parallelize(transformer: torch.nn.Module, group: Any = None, *, mode: str = "auto", transport: str = "auto",
                chunks: int | None = None, cfg_parallel: bool = False, compile: bool = False,  # noqa: A002
                cuda_graphs: bool | str = "auto", comm_dtype: Any = None) -> torch.nn.Module:
    """Make ``transformer`` run context-parallel over ``group``, in place; returns it.

    Every rank runs the same forward on the same full inputs (seed them alike); inside, each rank keeps its block of the
    tokens (uneven blocks: :func:`cp_ops.layout.shard_sizes`), the attention gets full context through
    :func:`cp_ops.attention`, and the output is all-gathered: every rank returns the unparallelized model's output
    (bitwise where the same kernel sees the same data; joint attention: equal to rounding). docs/pipelines.md,
    docs/diffusers_compile_caches.md (compile, CUDA graphs, step caches) and docs/fp8.md say more.

    Args:
        transformer: a diffusers transformer of a class in :data:`SUPPORTED`, or with a diffusers ``_cp_plan``.
        group: the ranks (None = default group, ProcessGroup or 1-D DeviceMesh), or a mesh (:func:`mesh_groups`):
            2-D ``("agkv", "ulysses")`` (2-D CP) or 3-D ``("cfg", "agkv", "ulysses")`` with cfg size 2 (CFG lanes).
        mode, transport: as :func:`cp_ops.attention`.
        chunks: pipeline stages of every CP attention call, as :func:`cp_ops.attention`'s; calls with ``seq_lens``
            or a key mask get ``chunks=1`` where ``chunks`` ≥ 2 is asked for.
        comm_dtype: what every CP attention call sends over the link, as :func:`cp_ops.attention`'s (None = the
            model's dtype; ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` or ``'e4m3'`` / ``'e5m2'``; a dict per
            tensor q/k/v/o); checked here, K and V in different formats where the calls gather them together.
        cfg_parallel: True: the ranks form two CFG lanes (:mod:`.lanes`): every rank passes a batch of 2
            ``[cond, uncond]``, each half of the ranks runs one sample with CP over W/2 ranks, every rank returns
            the batch of 2; under :func:`parallelize_pipeline` a pipeline's per-branch calls run on the two lanes.
        compile: also compile every repeated block (:mod:`.compiled`) through :func:`cp_ops.compile`
            (``fullgraph=True``, static shapes, the overlap pass); the first forward of each resolution compiles
            (tens of seconds for a full-size DiT).
        cuda_graphs: one of :data:`CUDA_GRAPHS` (CUDA only). ``True``: with ``compile``, CUDA graphs over each block
            (``mode="reduce-overhead"``): call ``torch.compiler.cudagraph_mark_step_begin()`` before each forward.
            ``"forward"``: the whole call captured in one CUDA graph per call signature and replayed
            (:func:`cp_ops.captured.capture_forward`; outputs returned cloned). ``False``: none. ``"auto"`` (the
            default): ``"forward"`` where it can be captured, else eager (on CUDA with one warning naming why; never
            other numbers than eager's).

    Step caches (``enable_cache``, before or after): ``FirstBlockCache``'s decision is made over the whole group
    (:mod:`.caches`); ``SeaCache`` is refused, and with ``cuda_graphs="forward"`` every step cache. A backward raises.

    Raises:
        ValueError: an unsupported class, unknown mode/transport, bad ``chunks`` or ``cuda_graphs``,
            ``mode='ulysses'`` with a group size that does not divide an attention's heads, a model already
            parallelized, ``cfg_parallel`` on an odd number of ranks, ``cuda_graphs=True`` without ``compile``,
            blocks already compiled, K and V in different FP8 formats gathered together. At run time: a stream with
            fewer tokens than ranks, a mask other than a bool key-padding mask, ranks given different inputs or
            making different cp_ops calls (on every rank: :mod:`cp_ops.contract`), a cfg_parallel batch other than 2.
        RuntimeError: torch.distributed not initialized; ``cuda_graphs="forward"``: a capture that failed on any rank
            (:class:`cp_ops.captured.CaptureError`, on every rank).
    """
    spec = spec_for(transformer)
    name = type(transformer).__name__
    if mode not in modes.names() + modes.names(False, dims=2):
        raise ValueError(f"mode must be one of {modes.names() + modes.names(False, dims=2)}; got {mode!r}")
    if transport not in transport_names():
        raise ValueError(f"transport must be one of {transport_names()}; got {transport!r}")
    check_chunks(chunks)
    comm_dtype = normalize_comm_dtype(comm_dtype, next((p.dtype for p in transformer.parameters()), None))
    if not any(cuda_graphs is v or (isinstance(v, str) and cuda_graphs == v) for v in CUDA_GRAPHS):
        raise ValueError(f"parallelize: cuda_graphs must be one of {CUDA_GRAPHS} (True: per-block graphs under "
                         "compile=True; 'forward': the whole forward captured in one graph; 'auto': 'forward' where "
                         f"it can be captured); got {cuda_graphs!r}")
    if cuda_graphs is True and not compile:
        raise ValueError("parallelize: cuda_graphs=True needs compile=True (CUDA graphs over the compiled blocks, "
                         "mode='reduce-overhead'); got compile=False (cuda_graphs='forward' captures the whole "
                         "eager forward)")
    if cuda_graphs == "forward":
        try:
            captured.check_capturable(transformer)
        except ValueError as e:
            raise ValueError(f"parallelize(cuda_graphs='forward'): {e}") from None
    if (why := caches.refused_cache(transformer)) is not None:
        raise ValueError(why)
    if compile and (why := compiled.not_compilable(transformer)) is not None:
        raise ValueError(f"parallelize(compile=True): {why}")
    if getattr(transformer, "_cp_ops_group", None) is not None:
        raise ValueError(f"this {name} is already parallelized over CP group "
                         f"'{transformer._cp_ops_group.group_name}'; parallelize a fresh model (hooks installed "
                         "twice would split the tokens twice)")
    if spec.check is not None:
        spec.check(transformer)
    pg, attn_group, cfg_parallel = mesh_groups(group, cfg_parallel)
    graphs, why = auto_graphs(transformer, transport, pg) if cuda_graphs == "auto" else (cuda_graphs, None)
    if cuda_graphs == "forward" and (hw := caches.host_hooks(transformer)) is not None:
        raise ValueError(f"parallelize(cuda_graphs='forward') cannot capture this {name}: {hw}; pass "
                         "cuda_graphs='auto' (captured where it can be, else eager with a warning) or False")
    if attn_group is not None and mode not in modes.names(dims=2):
        raise ValueError(f"parallelize on a 2-D CP mesh: mode must be one of {modes.names(dims=2)}; got {mode!r}")
    _check_comm_dtype(comm_dtype, mode, attn_group)
    plan = spec.plan(transformer)
    # resolve every path first, so a failure installs nothing
    for path, _ in plan:
        hooks.resolve(transformer, path)
    attn_modules = [(pattern, streams, hooks.resolve(transformer, pattern))
                    for pattern, streams in spec.attention.items()]
    w = pg.size() // 2 if cfg_parallel else pg.size()
    if mode == "ulysses" and attn_group is None and (why_heads := _undivided_heads(attn_modules, w)) is not None:
        raise ValueError(f"parallelize(mode='ulysses'): {why_heads} (Ulysses gives each rank H/W heads): use "
                         "mode='agkv' or 'auto', or a group whose size divides the heads")

    lanes = Lanes(transformer, pg) if cfg_parallel else None
    cp = lanes.cp if lanes is not None else pg
    transformer._cp_ops_group = cp  # marks the model before any hook goes in
    transformer._cp_ops_input_group = pg  # every rank holding part of the inputs (both CFG lanes): step caches
    checks = RankChecks(transformer, cp, spec.checked_inputs, input_pg=pg)  # a pre-hook: sees the full inputs
    if lanes is not None:  # a forward one lane runs alone (a pipeline's branch call): its inputs are the lane's
        transformer._cp_ops_lanes = lanes
        lanes.input_groups += [(checks, "input_pg"), (transformer, "_cp_ops_input_group")]
    streams = {s for _, e in plan for sp in ([e] if isinstance(e, Gather) else e.values())
               for s in ((sp.stream,) if isinstance(sp, Gather) else sp.streams)}
    streams |= {s for ss in spec.attention.values() for s in ss}
    state = hooks.CPState(cp, mode, transport, sorted(streams), chunks, comm_dtype)
    if attn_group is not None:
        state.attn_group = attn_group  # a 2-D mesh: cp (its ranks, row-major) splits and gathers, the mesh attends
    hooks.install(transformer, plan, state, checks.before_gather,
                  outer_pre=(lanes.select,) if lanes else (), outer_post=(lanes.gather,) if lanes else ())
    for pattern, streams, modules in attn_modules:
        for path, module in modules:
            dispatch.route(module, state, streams, path)
    transformer._cp_ops_state = state
    caches.agree_step_caches(transformer)  # caches enabled before (their decisions reduced over the group) ...
    caches.wrap_enable_cache(transformer)  # ... and after, through model.enable_cache
    if compile:
        compiled.compile_blocks(transformer, cuda_graphs=cuda_graphs is True)
    if why is not None:
        _fell_back(name)(why)
    if graphs == "forward":
        capture_safe.apply(transformer)  # diffusers code a capture refuses, replaced by equivalents
        # pg: every rank holding part of the inputs (both CFG lanes): each replay runs collectives over all of them
        # refused: a hook that acts on the host at each call (the default then runs eager, explicit 'forward' raises)
        auto = dict(fallback=_fell_back(name)) if cuda_graphs == "auto" else {}
        captured.capture_forward(transformer, group=pg, refuse=caches.host_hooks, **auto)
        if lanes is not None:
            lanes.input_groups.append((captured.captured(transformer), "group"))
    if lanes is not None:
        lanes.whole, lanes.whole_why = _whole_group(transformer, state, checks, pg, attn_group, attn_modules)
    return transformer


def _whole_group(model, state, checks, pg, mesh, attn_modules):
    """``(switch, None)``: a context manager that runs a forward of a model with CFG lanes (one with no CFG pair)
    with CP over all of ``pg``'s ranks (splits, attention, gather, rank checks, step caches' state), or
    ``(None, why)`` where none can run."""
    if mesh is not None:
        return None, "a 3-D mesh gives each lane a 2-D CP mesh, and the whole group none"
    if state.transport == "fast":
        return None, "transport='fast' runs on one CP group per process, the lane's"
    if state.mode == "ulysses" and (why := _undivided_heads(attn_modules, pg.size())) is not None:
        return None, why
    values = [(state, "pg", pg), (state, "attn_group", pg), (state, "rank", pg.rank()), (state, "world", pg.size()),
              (state, "gloo_cuda", stage_through_host(pg, torch.device("cuda"))), (checks, "pg", pg)]

    @contextlib.contextmanager
    def switch():
        with swapped(values), caches.state_apart(model, f"/over {pg.size()} ranks"):
            yield
    return switch, None
