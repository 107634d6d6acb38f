"""The generic split/gather hooks that carry out a :mod:`plan <cp_ops.integrations.diffusers.plan>` on a model.

Pre-hooks split named inputs, hooks split outputs or all-gather them (uneven blocks: the prefix split of
:func:`~cp_ops.layout.shard_sizes`). Each split records its stream's full token count in :class:`CPState`, which the
attention (:mod:`.dispatch`) reads; a rank left with no token runs on empty tensors (:mod:`.empty`). No host sync:
every size comes from shapes.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ...contract import announce
from ...layout import Shards
from ...transport.base import check_all
from ...transport.torch import stage_through_host
from .empty import EmptyShapes
from .plan import Gather, Plan, Split, shard_sizes

# torch 2.13 renamed all_gather_tensor to all_gather_single (same signature); 2.11 has only the old name.
_all_gather_async = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _all_gather(x: torch.Tensor, gather_dim: int, group, via: str | None = None) -> torch.Tensor:
    """c10d's functional all-gather, waited at once on the stream (an unwaited result the model drops stays
    registered with c10d; on NCCL a consumer outside the dispatcher would race it). ``via`` (:func:`gather_route`),
    for CUDA tensors over gloo, where c10d's functional all-gather crashed (SIGSEGV, torch 2.11): ``"fast"`` gathers
    dim 0 through the fast transport's lane (a CUDA graph can hold it), ``"host"`` through a host copy."""
    if via == "fast" and x.is_cuda and gather_dim == 0:
        return _fast_gather(x, group)
    if via is not None and x.is_cuda:
        return _all_gather(x.cpu(), gather_dim, group).to(x.device)
    return funcol.wait_tensor(_all_gather_async(x, gather_dim=gather_dim, group=group))


def _fast_gather(x: torch.Tensor, group) -> torch.Tensor:
    """All ranks' ``x`` concatenated along dim 0, through the fast transport's AGKV gather (the rows as tokens of
    one head; K and V the same tensor), waited on the current stream and copied out of the transport's pool."""
    from ...transport.fast import transport as fast

    rows = x.contiguous().view(1, x.shape[0], 1, -1)
    full, _, work = fast.agkv_start(rows, rows, group)
    work.wait()
    return full.view((group.size() * x.shape[0],) + tuple(x.shape[1:])).clone()


def gather_route(pg: dist.ProcessGroup, transport: str) -> str | None:
    """How the output gather moves CUDA tensors on ``pg``: None (c10d's all-gather: NCCL) unless ``pg`` runs CUDA
    tensors over gloo (ranks sharing one GPU; :func:`cp_ops.transport.torch.stage_through_host` decides), then
    ``"fast"`` where the fast transport's lane is this group (and ``transport`` is not ``'torch'``), else ``"host"``."""
    if not stage_through_host(pg, torch.device("cuda")):
        return None
    if transport != "torch":
        from ...transport.fast import transport as fast

        lane = fast.lane
        if lane is not None and list(lane.ranks) == dist.get_process_group_ranks(pg):
            return "fast"
    return "host"


class CPState:
    """One parallelized model's CP group, its attention settings (as ``parallelize`` got them) and the full token
    count of each stream seen in the current forward."""

    def __init__(self, pg: dist.ProcessGroup, mode: str, transport: str, streams, chunks: int | None = None,
                 comm_dtype=None):
        self.pg, self.mode, self.transport, self.chunks = pg, mode, transport, chunks
        self.comm_dtype = comm_dtype  # cp_ops.comm_dtype's normal form (every attention call's comm_dtype=)
        self.attn_group = pg  # what cp_ops.attention gets: a 2-D CP mesh over pg's ranks where parallelize got one
        self.rank, self.world = pg.rank(), pg.size()
        self.gloo_cuda = stage_through_host(pg, torch.device("cuda"))  # ranks sharing a GPU: see gather_route
        announce(pg)  # this rank's pid, so a peer waiting for it later can tell that it exited (cp_ops._peers)
        # every stream's key exists from the start (0 = not yet recorded): under torch.compile the dict's keys
        # never change, so a forward that writes the totals before reading them traces once for all resolutions
        self.totals: dict[str, int] = dict.fromkeys(streams, 0)
        #: the streams of every routed attention (:func:`cp_ops.integrations.diffusers.dispatch.route` adds them)
        self.attn_streams: set[tuple[str, ...]] = set()
        #: attention streams -> the every-key mask bool [B, S_total] of the current forward (:meth:`note_key_mask`)
        self.key_masks: dict[tuple[str, ...], torch.Tensor] = {}
        self._mask_src: tuple | None = None  # (mask input, its version, its spec and the totals) key_masks came from
        #: (attention streams, mask shape) -> the buffer that mask lives in: one per shape, so forwards alternating
        #: between shapes (CFG's prompt and negative prompt of different lengths) keep each one's address
        self._mask_bufs: dict[tuple, torch.Tensor] = {}
        self._empty = None  # the EmptyShapes mode this forward entered (a split left this rank no token), or None

    def allow_empty(self) -> None:
        """This rank holds no token of a split stream: until the forward ends, ``reshape``/``view`` of its empty
        tensors resolve ``-1`` (:mod:`.empty`; eager, or traced by torch.compile: Dynamo inlines the mode)."""
        if self._empty is None:
            self._empty = EmptyShapes()
            self._empty.__enter__()

    def end_forward(self) -> None:
        mode, self._empty = self._empty, None
        if mode is not None:
            mode.__exit__(None, None, None)

    def record(self, stream: str, total) -> None:
        if stream not in self.totals:
            raise ValueError(f"cp_ops.parallelize: stream {stream!r} is not one of the plan's {tuple(self.totals)}")
        self.totals[stream] = total

    def forget_totals(self) -> None:
        """Every stream back to "not recorded" (0), at the start and end of each forward: a whole-model compile then
        does not specialize on the previous call's counts (Dynamo guards on the values found at entry)."""
        for s in self.totals:
            self.totals[s] = 0

    def total(self, stream: str, where: str):
        v = self.totals.get(stream, 0)
        if isinstance(v, int) and v == 0:
            raise RuntimeError(f"cp_ops.parallelize: {where} needs the token count of stream {stream!r}, which no "
                               f"split has recorded in this forward (streams: {tuple(self.totals)}): the model's "
                               "plan splits that stream later than it is used, or the module was called outside the "
                               "parallelized model's forward (its counts are forgotten after each forward)")
        return v

    def note_key_mask(self, full: torch.Tensor, spec: Split) -> None:
        """A block's key-mask input ``full`` (bool, before its split): build once per mask (tensor, version, split,
        counts) the every-key mask ``[B, S_total]`` of each routed attention over its streams (:func:`_every_key`),
        which the attention passes instead of gathering its own (:class:`.dispatch.CPAttention` checks its block on
        the device). One fixed buffer per (streams, shape): compiled blocks' CUDA graphs read it in place at replay.
        Traced (a whole-model compile): every call gathers."""
        if torch.compiler.is_compiling() or self.world == 1 or self.attn_group is not self.pg:
            self.key_masks = {}  # traced (whole-model compile) or a 2-D mesh: every call gathers its own mask
            return
        key = (spec, self.pg, tuple(sorted(self.totals.items())))  # the group: a CFG lanes' forward over all ranks
        version = None if full.is_inference() else full._version  # an inference tensor has no version: rebuilt
        src = self._mask_src
        if src is not None and version is not None and src[0] is full and src[1] == version and src[2] == key:
            return
        masks = {}
        b = full.movedim(spec.dim % full.dim(), -1).shape[0]
        for streams in self.attn_streams:
            shape = (b, sum(self.totals.get(s, 0) for s in streams))
            m = _every_key(full, spec, self, streams, self._mask_bufs.get((streams, shape)))
            if m is not None:
                if len(self._mask_bufs) >= _MAX_MASK_BUFS and (streams, tuple(m.shape)) not in self._mask_bufs:
                    self._mask_bufs.clear()  # shapes without end (e.g. every resolution): no buffer kept forever
                masks[streams] = self._mask_bufs[(streams, tuple(m.shape))] = m
        self.key_masks, self._mask_src = masks, (full, version, key)

    def seq_lens(self, streams: tuple[str, ...], where: str) -> tuple:
        """Every rank's local token count of a sequence made of ``streams`` (each rank: its block of each)."""
        per = [shard_sizes(self.total(s, where), self.world) for s in streams]
        return tuple(sum(p[r] for p in per) for r in range(self.world))


#: the most every-key mask buffers one model keeps (CPState._mask_bufs; cleared past it)
_MAX_MASK_BUFS = 64

#: forward inputs that hold key-padding masks in diffusers' models (True = attend): what :meth:`CPState.note_key_mask`
#: looks at (Z-Image's ``noise_mask``, also bool and split, is not one)
KEY_MASK_INPUTS = frozenset({"attention_mask", "attn_mask", "encoder_hidden_states_mask", "encoder_attention_mask"})


def _every_key(full: torch.Tensor, spec: Split, state: CPState, streams: tuple[str, ...],
               into: torch.Tensor | None = None) -> torch.Tensor | None:
    """The every-key mask bool ``[B, S_total]`` of an attention over ``streams`` from the mask input ``full``: rank
    by rank, its block of each stream (all True where ``spec`` does not cover it), into ``into`` where it fits. None
    where it does not apply (a stream not in the attention's, a count not recorded, not one flag per key)."""
    if not set(spec.streams) <= set(streams) or any(state.totals.get(s, 0) == 0 for s in streams):
        return None
    x = full.movedim(spec.dim % full.dim(), -1)
    b, n = x.shape[0], x.shape[-1]
    if x.numel() != b * n or n != sum(state.totals[s] for s in spec.streams):
        return None
    x = x.reshape(b, n)
    start, at = 0, {}
    for s in spec.streams:
        at[s] = start
        start += state.totals[s]
    w, parts = state.world, []
    for r in range(w):
        for s in streams:
            sizes = shard_sizes(state.totals[s], w)
            lo = sum(sizes[:r])
            parts.append(x[:, at[s] + lo: at[s] + lo + sizes[r]] if s in at else
                         torch.ones(b, sizes[r], dtype=torch.bool, device=x.device))
    total = sum(p.shape[1] for p in parts)
    if into is not None and into.shape == (b, total) and into.dtype == torch.bool and into.device == x.device \
            and (not into.is_inference() or torch.is_inference_mode_enabled()):  # (no in-place write to one outside)
        return torch.cat(parts, dim=1, out=into)
    return torch.cat(parts, dim=1)


def split_tensor(x: torch.Tensor, spec: Split, state: CPState, where: str) -> torch.Tensor:
    """This rank's block of ``x`` along ``spec.dim``; records each stream's total when it is the only one."""
    dim = spec.dim % x.dim()
    if len(spec.streams) == 1:
        total = x.shape[dim]
        state.record(spec.streams[0], total)
        parts = [(0, total)]
    else:  # a concatenation of full streams: split each
        totals = [state.total(s, where) for s in spec.streams]
        if sum(totals) != x.shape[dim]:
            raise ValueError(f"cp_ops.parallelize: {where} has {x.shape[dim]} tokens along dim {dim}; the streams "
                             f"{spec.streams} it concatenates hold {totals} tokens")
        starts = [sum(totals[:i]) for i in range(len(totals))]
        parts = list(zip(starts, totals))
    r, w = state.rank, state.world
    blocks = []
    for start, total in parts:
        if spec.every_rank and isinstance(total, int) and total < w:
            raise ValueError(f"cp_ops.parallelize: {where} has {total} tokens along dim {dim}, fewer than the CP "
                             f"world size {w}: pass at least {w} tokens (e.g. pad the prompt), or use at most "
                             f"{max(total, 1)} ranks. Why: {spec.every_rank}")
        sizes = shard_sizes(total, w)
        if isinstance(sizes[r], int) and sizes[r] == 0:  # fewer tokens than ranks: this rank holds none of them
            state.allow_empty()
        blocks.append(x.narrow(dim, start + sum(sizes[:r]), sizes[r]))
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=dim)


def gather_tensor(x: torch.Tensor, spec: Gather, state: CPState) -> torch.Tensor:
    """All ranks' blocks of ``x`` along ``spec.dim``, in rank order (uneven blocks per :func:`shard_sizes`)."""
    d = spec.dim % x.dim()
    w = state.world
    total = state.total(spec.stream, f"the gather of stream {spec.stream!r}")
    # gather along dim 0 (token dim moved to the front), then move it back: rank-ordered blocks concatenate
    local = x.movedim(d, 0)
    sizes = shard_sizes(total, w)
    shards = Shards(sizes, w, state.rank, sizes[state.rank], x.device)
    via = gather_route(state.pg, state.transport) if state.gloo_cuda and x.is_cuda else None
    if shards.full:
        out = _all_gather(local.contiguous(), 0, state.pg, via)
    else:  # every block padded to the largest, gathered, the real rows taken (a view under the prefix split)
        out = shards.rows(_all_gather(shards.pad(local.unsqueeze(0))[0], 0, state.pg, via), 0)
    return out.movedim(0, d)


def _applies(spec, x) -> bool:
    return isinstance(x, torch.Tensor) and (spec.expected_dims is None or x.dim() == spec.expected_dims)


def resolve(model: torch.nn.Module, pattern: str) -> list[tuple[str, torch.nn.Module]]:
    """The modules a plan path names: ``""`` = the model, ``a.*.b`` = ``b`` of each child of ``a``; none: ValueError."""
    found = [("", model)]
    for atom in [a for a in pattern.split(".") if a] if pattern else []:
        nxt = []
        for path, mod in found:
            children = list(mod.named_children()) if atom == "*" else \
                [(atom, getattr(mod, atom))] if isinstance(getattr(mod, atom, None), torch.nn.Module) else []
            nxt += [(f"{path}.{n}" if path else n, c) for n, c in children]
        if not nxt:
            raise ValueError(f"cp_ops.parallelize: plan path {pattern!r} names no module of "
                             f"{type(model).__name__} (no {atom!r} under {[p for p, _ in found]})")
        found = nxt
    return found


def _split_hooks(module: torch.nn.Module, specs: dict, state: CPState, where: str):
    """(pre, post): a forward pre-hook splitting named inputs, a forward hook splitting outputs (None: none)."""
    pre_hook = out_hook = None
    by_name = {k: v for k, v in specs.items() if isinstance(k, str)}
    by_output = {k: v for k, v in specs.items() if isinstance(k, int)}
    # single-stream splits first: a multi-stream split reads the totals they record
    by_name = dict(sorted(by_name.items(), key=lambda kv: len(kv[1].streams)))
    if by_name:
        params = list(inspect.signature(module.forward).parameters)
        missing = [n for n in by_name if n not in params and "kwargs" not in params]
        if missing:
            raise ValueError(f"cp_ops.parallelize: plan splits inputs {missing} of {where}, whose forward takes "
                             f"{params}")

        position = {n: params.index(n) for n in by_name if n in params}  # where a positional input stands

        def pre_hook(mod, args, kwargs):
            args = list(args)
            for name, spec in by_name.items():
                if name in kwargs:
                    box, at = kwargs, name
                elif position.get(name, len(args)) < len(args):
                    box, at = args, position[name]
                else:
                    continue
                if _applies(spec, box[at]):
                    if name in KEY_MASK_INPUTS and box[at].dtype == torch.bool:
                        state.note_key_mask(box[at], spec)
                    box[at] = split_tensor(box[at], spec, state, f"{where}.{name}")
            return tuple(args), kwargs

    if by_output:

        def out_hook(mod, args, output):
            single = not isinstance(output, (tuple, list))
            outs = [output] if single else list(output)
            for i, spec in by_output.items():
                if _applies(spec, outs[i]):
                    outs[i] = split_tensor(outs[i], spec, state, f"{where} output {i}")
            return outs[0] if single else type(output)(outs)

    return pre_hook, out_hook


def _gather_hook(spec: Gather, state: CPState, before: Callable[[], None]):
    def gather_hook(mod, args, output):
        if not _applies(spec, output):
            return output
        before()
        out = gather_tensor(output, spec, state)
        if not torch.compiler.is_compiling():
            check_all()  # a device wait of this forward (or an earlier one) that timed out raises here
        return out

    return gather_hook


def wrap_forward(model: torch.nn.Module, pre: list, post: list, finally_=None) -> None:
    """Run ``pre`` (``(mod, args, kwargs) -> (args, kwargs)``) before and ``post`` (``(mod, args, output) ->
    output``) after ``model.forward``, inside it: unlike module hooks (frames of their own under torch.compile), the
    splits, forward and gathers share one traced frame, their token counts symbolic. ``finally_``: always after."""
    if not pre and not post:
        return
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        try:
            for f in pre:
                args, kwargs = f(model, args, kwargs)
            out = inner(*args, **kwargs)
            for f in post:
                out = f(model, args, out)
            return out
        finally:
            if finally_ is not None:
                finally_()

    model.forward = forward


def install(model: torch.nn.Module, plan: Plan, state: CPState, before_gather: Callable[[], None],
            outer_pre: tuple = (), outer_post: tuple = ()) -> None:
    """Install ``plan`` on ``model``: hooks on submodules; the model's own entries (path ``""``), between
    ``outer_pre`` and ``outer_post``, wrap its forward (:func:`wrap_forward`) between hooks that forget the stream
    totals. Every path is resolved first, so a bad plan installs nothing."""
    def forget_before(mod, args, kwargs):
        state.forget_totals()
        return args, kwargs

    def forget_after(mod, args, output):
        state.forget_totals()
        return output

    resolved = [(pattern, entry, resolve(model, pattern)) for pattern, entry in plan]
    root_pre, root_post = [forget_before] + list(outer_pre), []
    for pattern, entry, modules in resolved:
        for path, module in modules:
            where = path or type(model).__name__
            if isinstance(entry, Gather):
                pre, post = None, _gather_hook(entry, state, before_gather)
            else:
                pre, post = _split_hooks(module, entry, state, where)
            if module is model:
                root_pre += [pre] if pre else []
                root_post += [post] if post else []
                continue
            if pre:
                module.register_forward_pre_hook(pre, with_kwargs=True)
            if post:
                module.register_forward_hook(post)
    wrap_forward(model, root_pre, root_post + list(outer_post) + [forget_after], state.end_forward)
