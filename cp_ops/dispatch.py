"""Dispatch: one :func:`cp_ops.attention` call → its checks and decisions → one mode body run with one comm.

The data path (``docs/architecture.md``): public API (:mod:`cp_ops.attention`) → **dispatch** (here) → mode body
(:mod:`cp_ops.modes`) → comm (:mod:`cp_ops.comm`) → op (:mod:`cp_ops.ops`) or transport (:mod:`cp_ops.transport`)
→ kernel (:mod:`cp_ops.kernels`, ``csrc/``).

**Decisions** (:func:`decide`, the same on both paths): the input rules (:mod:`cp_ops.validate`, :mod:`cp_ops.layout`;
a rank whose rules fail tells its peers before raising, so every rank raises), the concrete mode
(:func:`cp_ops.modes.choose`), the transport (:func:`cp_ops.transport.base.resolve`), the stage count
(:func:`cp_ops.choices.decide`, which stores what :mod:`cp_ops.modes.tune` decides: the heuristic by default,
measured only when asked), the body, the layout
(:class:`cp_ops.layout.Shards` for ``seq_lens``/``key_mask``) and the variant tag the rank contract compares
(:func:`cp_ops.contract.variant_tag`: mode, chunks, shards, mask, the caller's ``tag``, ``comm_dtype``: the formats
:func:`cp_ops.comm_dtype.for_mode` gives, which the comm encodes and decodes; the softmax ``scale``:
:func:`cp_ops.contract.scale_field`).

**Two paths, one body:**

* *traced* (``torch.compile``, or a call the eager path does not cover: a tensor subclass or FakeTensor, a torch
  dispatch mode such as make_fx or a flop counter, an empty tensor): the body runs with :class:`~cp_ops.comm.OpComm`
  (the ``torch.library`` launches and ``wait_tensor``), decided per call (Dynamo traces it once).
* *eager*: a :class:`Plan` cached by the call's key — (q/k/v shapes, dtypes, devices, group, mode, transport, chunks,
  the measuring setting, ``seq_lens``, the mask's shape/dtype/device, ``tag`` by type and repr: ``True``, ``1``
  and ``1.0`` hash alike but are different tags; ``comm_dtype`` in its normal form; ``scale``) — holds the decisions of the
  first call with that key and a :class:`~cp_ops.comm.DirectComm`; a repeat call is a dict lookup and the body: the transport
  called directly, no dispatcher. A new argument of :func:`cp_ops.attention` must be part of the key.

Both make one rank-contract exchange per call, at the call's first launch, with the same signature, so ranks that
run a layer eager and compiled still agree. If the body raises between a launch and its wait (CUDA OOM in the
attention), the comm waits for what it launched (:meth:`~cp_ops.comm.DirectComm.drain`) before the error propagates:
the transport and the group stay usable and the peers' collectives of this call complete.
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from . import choices, config, contract, emulate, layout, modes, validate
from . import comm_dtype as cd
from .comm import DirectComm, OpComm
from .group import resolve_group
from .kernels import local_attention
from .modes import pipelined, tune
from .transport import base as transport_base

#: The rank contract's name of an attention call (its messages say "cp_ops.attention (call #n)").
CALL = "cp_ops.attention"
_dispatch_modes = torch._C._len_torch_dispatch_stack  # > 0 while a TorchDispatchMode (tracing, fake, ...) is active
_MAX_PLANS = 1024  # distinct keys kept (a model has a handful; a shape sweep clears and refills)
_plans: dict = {}


class Decision(NamedTuple):
    """What a call runs: the concrete mode, the resolved transport, the stages, the body, whether it runs as the
    pipelined op when traced, the rank contract's tag, the uneven counts (or None) and whether a mask comes."""

    world: int
    mode: str
    transport: str
    chunks: int
    body: Any
    as_op: bool
    tag: int
    seq_lens: tuple | None
    has_mask: bool
    fmts: tuple = cd.NONE  # the formats of (q, k, v, o) on the link (cp_ops.comm_dtype)


def decide(q, k, v, pg: dist.ProcessGroup, mode: str, transport: str, chunks, seq_lens, key_mask, tag,
           comm_dtype=None, scale=None) -> Decision:
    """Check a call's inputs (every rank raises if one rank's fail) and make its decisions (module docstring).

    Raises:
        ValueError / TypeError / RuntimeError: as :func:`cp_ops.attention`.
    """
    world = pg.size()
    chosen, resolved, fmts, asked_fmts, scale_word = mode, transport, cd.NONE, cd.NONE, None
    if comm_dtype is not None and mode == "auto":  # AGKV cannot carry K and V apart: 'auto' picks Ulysses then
        try:
            mode = cd.auto_mode(mode, cd.normalize(comm_dtype, q.dtype), q.shape[2], world)
        except (ValueError, AttributeError, IndexError, TypeError):
            pass  # a bad comm_dtype or q: the checks below raise it on every rank
    if tag is not None and torch.compiler.is_compiling():
        tag = constant(tag)
        if _symbolic(tag):
            raise ValueError(f"tag must be a Python constant under torch.compile; got {tag!r} holding a symbolic int "
                             "(an int that changed between compiles of the same code): pass a str tag (e.g. "
                             "f'layer{i}'), or compile with dynamic=False")

    def local_checks():
        nonlocal chosen, resolved, fmts, asked_fmts, scale_word
        pipelined.check_chunks(chunks)
        scale_word = contract.scale_field(scale)  # TypeError for a scale that is not a number
        validate.check_same(("q", "k", "v"), (q, k, v))
        layout.check_not_bhsd("q", q)  # a BHSD tensor passed as BSHD: ValueError naming both layouts
        chosen = modes.choose(mode, q.shape[2], world)
        resolved = transport_base.resolve(transport, q.device.type)
        asked_fmts = cd.normalize(comm_dtype, q.dtype)
        if q.shape[3] == 0:  # head_dim 0: nothing to encode (the codec's rows hold D >= 1 values), as nothing moves
            asked_fmts = cd.NONE
        fmts = cd.for_mode(asked_fmts, chosen)
        if world > 1:
            validate.check_device_for_group(q, pg)
        if seq_lens is not None:
            layout.check_seq_lens(seq_lens, world, pg.rank(), q.shape[1])
        if key_mask is not None:
            layout.check_key_mask(key_mask, q, _total(q, world, seq_lens))
            if chunks is not None and chunks > 1 and not modes.spec(chosen).masks_pipelined:
                raise ValueError(f"mode={chosen!r} with chunks > 1 takes no key_mask (its pipelined variant merges "
                                 f"partial outputs by LSE, whose kernels take no mask); got chunks={chunks}: pass "
                                 "chunks=1 or None")
        if tag is not None:
            contract.variant_tag(tag=tag)  # TypeError for a tag whose repr differs across ranks

    contract.api_checked(pg, CALL, local_checks)
    if world == 1:
        return Decision(1, chosen, resolved, 1, None, False, 0, None, key_mask is not None, fmts)
    layout_call = seq_lens is not None or key_mask is not None
    if layout_call and chunks is None:
        c = 1  # uneven shards / masks: transport-then-attend unless stages are asked for
    else:
        chosen, c = choices.decide(mode, chunks, chosen, q, pg, resolved, runner(q, pg, resolved, asked_fmts),
                                   cd.tag(asked_fmts) or "")
        fmts = cd.for_mode(asked_fmts, chosen)  # a measured choice may be another mode than the heuristic's
    if torch.compiler.is_compiling():
        c = _constant(constant(c))  # the variant tag is a constant of the graph
    seq = tuple(seq_lens) if seq_lens is not None else None
    spec = modes.spec(chosen)
    mask_word = "None" if key_mask is None else \
        "every key" if layout.every_key(key_mask, q.shape[1], _total(q, world, seq), seq) else "given"
    fp8 = cd.tag(fmts)
    # with an FP8 format the wire carries uint8 rows whatever the inputs' dtype, so the contract's dtype word cannot
    # tell ranks apart whose inputs differ in dtype (their outputs' all-to-all would then mismatch): the tag does
    t = contract.variant_tag(mode=chosen, chunks=c, key_mask=mask_word, tag=tag, comm_dtype=fp8, scale=scale_word,
                             input_dtype=validate.dtype_name(q.dtype) if fp8 else None)
    return Decision(world, chosen, resolved, c, modes.body(chosen, c), c > 1 and spec.pipelined_as_op, t, seq,
                    key_mask is not None, fmts)


def _total(q, world: int, seq_lens):
    """The call's token count over all ranks: ``sum(seq_lens)``, else ``W * S_local``."""
    return sum(seq_lens) if seq_lens is not None else world * q.shape[1]


def _constant(n):
    """``n`` as a Python int while Dynamo traces, where an int argument that changed between compiles of the same code
    can stay symbolic (automatic dynamic; torch 2.11): comparing it with each candidate guards on its value and yields
    the constant. Raises ValueError past 4096 (no stage count is that large)."""
    if type(n) is int:
        return n
    for i in range(1, 4097):
        if n == i:
            return i
    raise ValueError(f"chunks must be an int from 1 to 4096; got {n!r}")


def constant(value):
    """``value`` (an int, or a tuple/list of them, str, ...) with every int made a constant of the trace (under
    ``torch.compile``). Dynamo holds an int that changed between compiles of the same code (a function argument, a
    closure cell: ``chunks``, ``tag``) as a lazy constant (torch 2.13) or a symbolic int (automatic dynamic), which
    :func:`cp_ops.contract.variant_tag` (a constant function) cannot take; ``operator.index`` makes the lazy one a
    constant guarded by value (one graph per value). A symbolic int stays symbolic (the callers raise)."""
    t = type(value)
    if t is tuple or t is list:
        return t(constant(x) for x in value)
    if t is int:
        return operator.index(value)
    return value


def _symbolic(value) -> bool:
    if isinstance(value, (tuple, list)):
        return any(_symbolic(x) for x in value)
    return isinstance(value, torch.SymInt)


def runner(q, pg, transport: str, fmts=cd.NONE):
    """What the opt-in measured choice times (:func:`cp_ops.modes.tune.measure`): ``runner(mode, chunks)`` → a call of
    this dispatcher with that explicit mode and chunks on random ``q, k, v`` of ``q``'s shape, dtype and device
    (seeded alike on every rank: a collective every rank makes alike; the call's own data is not needed), moving
    them in the call's formats ``fmts`` (:mod:`cp_ops.comm_dtype`'s normal form)."""
    made: list = []

    def make(mode: str, chunks: int):
        if not made:
            g = torch.Generator(device=q.device).manual_seed(0x5EED)
            made.extend(torch.randn(q.shape, generator=g, device=q.device, dtype=q.dtype) for _ in range(3))
        a, b, c = made
        return lambda: attention(a, b, c, pg, mode, transport, None, chunks, None, None, None,
                                 None if fmts == cd.NONE else fmts)

    return make


def describe(q, group, mode: str, transport: str, chunks, seq_lens, key_mask, comm_dtype=None,
             mode_why: str = "") -> tune.Choice:
    """What a call of :func:`attention` with these arguments runs, without a collective: :func:`cp_ops.describe`
    (arguments, return and errors there; ``q`` in BSHD). ``mode_why``: for a ``mode`` a rule chose, not the caller
    (:mod:`cp_ops.dispatch_mesh`'s degenerate meshes), that rule in words."""
    pg = resolve_group(group)
    world = pg.size()
    pipelined.check_chunks(chunks)
    validate.check_same(("q",), (q,))
    layout.check_not_bhsd("q", q)
    fmts = cd.normalize(comm_dtype, q.dtype)  # ValueError for a bad one, as the call
    asked, mode = mode, cd.auto_mode(mode, fmts, q.shape[2], world)
    by_fmts = _by_formats(world, q.shape[2]) if mode != asked else mode_why  # 'auto' -> 'ulysses': K and V apart
    chosen = modes.choose(mode, q.shape[2], world)
    cd.for_mode(fmts, chosen)  # AGKV with K and V apart: ValueError, as the call
    resolved = transport_base.resolve(transport, q.device.type)
    runs_on = transport_base.agreed_name(resolved, pg.group_name, q.device)
    shown = runs_on or "auto"
    if by_fmts and chunks is not None:
        return tune.Choice(chosen, chunks, "heuristic", {}, shown, f"{by_fmts}; chunks={chunks} given")
    if mode != "auto" and chunks is not None:
        return tune.Choice(chosen, chunks, "explicit", {}, shown, "mode and chunks given by the caller")
    if world == 1:
        return tune.Choice(chosen, 1, "heuristic", {}, shown, "a group of one rank: local attention, nothing moved")
    if (seq_lens is not None or key_mask is not None) and chunks is None:
        return tune.Choice(chosen, 1, "heuristic", {}, shown, "uneven shards or a key mask: chunks=None means 1 "
                           f"(transport-then-attend); {_mode_rule(mode, chosen, q.shape[2], world, by_fmts)}")
    stored = choices.lookup(mode, chunks, q, pg, resolved, cd.tag(fmts) or "")
    if stored is not None:
        return stored._replace(transport=shown,
                               why=stored.why + _rule(mode, chunks, stored, q.shape[2], world, runs_on, by_fmts))
    # not decided yet: what the first call would decide, short of measuring and of asking the group
    name = runs_on or transport_base.select_transport(resolved, q.device.type)
    note = "" if runs_on else (f"; transport 'auto' is agreed with the group at the first call: '{name}' assumed (this "
                               "rank can run it)")
    c = tune.choose(mode, chunks, chosen, tuple(q.shape), pg, q.device, name, config.settings.tune_modes)
    if isinstance(c, tune.Open):
        cands = ", ".join(f"{m}/{n}" for m, n in c.candidates)
        return tune.Choice(c.preferred[0], c.preferred[1], "pending", {}, shown,
                           f"measuring on (CP_OPS_TUNE_MODES=1) and no call made yet: the first eager call measures "
                           f"{cands} (or takes the choice every rank's cache file holds); until then the heuristic's "
                           f"candidate{note}")
    return c._replace(transport=shown, why=c.why + _rule(mode, chunks, c, q.shape[2], world, name, by_fmts) + note)


def _by_formats(world: int, heads: int) -> str:
    """Why ``mode='auto'`` runs Ulysses when ``comm_dtype`` sends K and V in different formats
    (:func:`cp_ops.comm_dtype.auto_mode`), in words."""
    return (f"auto: comm_dtype sends K and V in different formats, which AGKV cannot carry (one gather moves both), "
            f"and W={world} divides H={heads} -> ulysses")


def _rule(mode: str, chunks, c, heads: int, world: int, transport, by_fmts: str = "") -> str:
    """The rule of the heuristic that gave ``c`` (a :class:`cp_ops.modes.tune.Choice`), in words ('' for another
    source): which branch of :func:`cp_ops.modes.choose` and of :func:`cp_ops.modes.pipelined.choose_chunks` fired;
    ``by_fmts``: the reason ``mode`` is not the caller's 'auto' (:func:`_by_formats`), or ''."""
    if c.source != "heuristic":
        return ""
    if chunks is not None:
        n = f"chunks={chunks} given"
    else:
        n = (f"chunks=None -> {c.chunks} (2 stages for AGKV on the fast transport, 1 elsewhere; transport "
             f"{transport or 'auto'})")
    return f"; {_mode_rule(mode, c.mode, heads, world, by_fmts)}; {n}"


def _mode_rule(mode: str, chosen: str, heads: int, world: int, by_fmts: str = "") -> str:
    """The branch of :func:`cp_ops.modes.choose` that turned ``mode`` into ``chosen``, in words (see :func:`_rule`)."""
    if by_fmts:
        return by_fmts
    if mode != "auto":
        return f"mode {chosen!r} given"
    if chosen == "ulysses":
        return f"auto: W={world} > 2 and W divides H={heads} -> ulysses (moves less than AGKV from W = 3)"
    if world == 2:
        return "auto: W=2 -> agkv (both modes receive the same bytes; Ulysses adds an exposed inverse all-to-all)"
    if heads % world:
        return f"auto: W={world} does not divide H={heads} -> agkv"
    return f"auto -> {chosen}"


def attention(q, k, v, group, mode, transport, scale, chunks, seq_lens, key_mask, tag,
              comm_dtype=None) -> torch.Tensor:
    """Run one CP attention call (inputs detached by the caller): the eager plan where it applies, else the traced
    path. Shapes and errors as :func:`cp_ops.attention`."""
    if comm_dtype is not None:
        comm_dtype = _normal(comm_dtype, q)
    if not torch.compiler.is_compiling():
        plan = _lookup(q, k, v, group, mode, transport, chunks, seq_lens, key_mask, tag, comm_dtype, scale)
        if plan is not None:
            return plan.run(q, k, v, scale, key_mask)
    pg = resolve_group(group)
    d = decide(q, k, v, pg, mode, transport, chunks, seq_lens, key_mask, tag, comm_dtype, scale)
    if d.world == 1:
        return _one_rank(q, k, v, scale, key_mask, d)
    if d.as_op:
        return torch.ops.cp_ops.agkv_pipelined_attention(q, k, v, d.world, pg.group_name, d.transport, scale,
                                                         d.chunks, None if d.seq_lens is None else list(d.seq_lens),
                                                         CALL, d.tag, d.fmts[1])
    shards = _shards(d, pg, q)
    comm = OpComm(d.world, pg.group_name, d.transport, CALL, d.tag, pg.rank(), d.seq_lens)
    comm.fmts = d.fmts
    try:
        return d.body(q, k, v, comm, scale=scale, chunks=d.chunks, shards=shards, key_mask=key_mask)
    except BaseException:
        if not torch.compiler.is_compiling():
            comm.drain()
        raise


def _normal(comm_dtype, q):
    """``comm_dtype`` in its normal form (:func:`cp_ops.comm_dtype.normalize`: hashable, a constant under compile), or
    as given when it is not valid (the checks of :func:`decide` raise it on every rank)."""
    try:
        return cd.normalize(comm_dtype, getattr(q, "dtype", None))
    except ValueError:
        return comm_dtype


def _one_rank(q, k, v, scale, key_mask, d: Decision):
    """A group of one rank: local attention; with ``CP_OPS_EMULATE_COMM=1`` and FP8 formats, the attention W > 1
    ranks compute at chunks = 1, every tensor that would cross the link round-tripped through the codec
    (:mod:`cp_ops.emulate`)."""
    if d.fmts != cd.NONE and config.settings.emulate_comm:
        return emulate.attention(q, k, v, scale, key_mask, d.fmts)
    return local_attention(q, k, v, scale, key_mask)


def _shards(d: Decision, pg, q) -> layout.Shards | None:
    if d.seq_lens is None and not d.has_mask:
        return None
    return layout.Shards(d.seq_lens, d.world, pg.rank(), q.shape[1], q.device)


# ---- the eager path: plans ---------------------------------------------------------------------------------------
class Plan:
    """What every eager call with one key runs (module docstring): ``run(q, k, v, scale, key_mask)`` → output."""

    __slots__ = ("pg", "d", "shards", "comm", "epoch", "device")

    def __init__(self, pg, d: Decision, shards, device):
        self.pg, self.d, self.shards, self.device = pg, d, shards, device
        self.comm, self.epoch = None, -1

    def run(self, q, k, v, scale, key_mask=None):
        d = self.d
        if d.world == 1:
            return _one_rank(q, k, v, scale, key_mask, d)
        if self.epoch != transport_base.epoch:  # first call, or the transports' per-group choices were reset
            pg, resolved, device = self.pg, d.transport, self.device
            tag = contract.with_seq_lens(d.tag, d.seq_lens)
            # the rank contract's exchange at each call's first launch: the signature the op would exchange for it
            check = (lambda shape, dtype, extra: contract.CallCheck(pg, CALL, resolved, shape, dtype, extra, 0, tag,
                                                                    contract.tag_note(tag)))
            self.comm = DirectComm(pg, None, check, lambda: transport_base.for_group(resolved, pg, device))
            self.comm.fmts = d.fmts
            self.epoch = transport_base.epoch
        comm = self.comm
        comm.armed = True
        try:
            return d.body(q, k, v, comm, scale=scale, chunks=d.chunks, shards=self.shards, key_mask=key_mask)
        except BaseException:
            comm.drain()
            raise


def plan_key(q, k, v, group, mode, transport, chunks, seq_lens, key_mask, tag, comm_key, scale=None):
    """The eager plan cache's key of a call (this module's and :mod:`cp_ops.dispatch_mesh`'s), or None: take the
    traced path (an argument that is not a plain tensor, a torch dispatch mode active — they must see the ops —,
    ``seq_lens`` not a tuple or list of ints, a key mask not a tensor). ``comm_key``: the caller's hashable form of
    ``comm_dtype``; ``scale``: the softmax scale (part of the variant tag). May raise TypeError/AttributeError (and an unhashable group at the dict lookup): the caller
    takes the traced path, which raises the error."""
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor \
            or _dispatch_modes():
        return None
    key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, group, mode,
           transport, chunks, type(chunks), config.settings.tune_modes,
           tag if tag is None or type(tag) is str or type(tag) is int else (type(tag), repr(tag)), comm_key, scale)
    if seq_lens is not None or key_mask is not None:
        extra = _layout_key(seq_lens, key_mask)
        if extra is None:
            return None
        key += extra
    return key


def _lookup(q, k, v, group, mode, transport, chunks, seq_lens, key_mask, tag, comm_dtype=None, scale=None):
    """The plan for this call (built and cached on the first call with its key, :func:`plan_key`), or None: take the
    traced path (as :func:`plan_key` says, nothing to move, an unhashable key)."""
    try:
        key = plan_key(q, k, v, group, mode, transport, chunks, seq_lens, key_mask, tag, comm_dtype, scale)
        if key is None:
            return None
        e = _plans.get(key)
    except (AttributeError, TypeError):  # not tensors, an unhashable group: the traced path raises the error
        return None
    if e is not None:
        if e[1] is (dist.group.WORLD if group is None else group):
            return e[0]
        # the default group was destroyed or replaced, or ``group`` is a DeviceMesh equal to the plan's (a mesh compares
        # by its layout: one made after destroy_process_group() equals the destroyed one) but maybe not over its group
        if group is None or e[0] is None or e[0].pg is not resolve_group(group):
            _plans.pop(key, None)
            return None
        _plans[key] = (e[0], group)  # another mesh object over the plan's group (e.g. a fresh slice of a larger mesh)
        return e[0]
    plan = _build(q, k, v, group, mode, transport, chunks, seq_lens, key_mask, tag, comm_dtype, scale)
    if len(_plans) >= _MAX_PLANS:
        _plans.clear()
    _plans[key] = (plan, dist.group.WORLD if group is None else group)
    return plan


def _layout_key(seq_lens, key_mask):
    """What a ``seq_lens`` / ``key_mask`` call adds to its key: ``seq_lens`` (a tuple of ints) and the mask's shape,
    dtype and device (its values are data, read at every call); None: the traced path (it raises on a bad one).
    Ints only, by type: ``4.0`` and ``True`` hash like ``4`` and ``1`` but are not token counts."""
    if seq_lens is not None:
        if type(seq_lens) is not tuple:
            if type(seq_lens) is not list:
                return None
            seq_lens = tuple(seq_lens)
        for n in seq_lens:
            if type(n) is not int:
                return None
    if key_mask is None:
        return (seq_lens, None)
    if type(key_mask) is not torch.Tensor:
        return None
    return (seq_lens, key_mask.shape, key_mask.dtype, key_mask.device)


def _build(q, k, v, group, mode, transport, chunks, seq_lens, key_mask, tag, comm_dtype=None, scale=None):
    pg = resolve_group(group)
    d = decide(q, k, v, pg, mode, transport, chunks, seq_lens, key_mask, tag, comm_dtype, scale)  # raises (every rank)
    shards = _shards(d, pg, q) if d.world > 1 else None
    b, s, h, hd = q.shape
    rows = shards.smax if shards is not None else s
    if d.world > 1 and b * rows * h * hd == 0:
        return None  # nothing to move: the ops' empty path
    return Plan(pg, d, shards, q.device)


def forget() -> None:
    """Drop every cached plan (tests; after changing what a plan caches, e.g. the chunks choice)."""
    _plans.clear()


choices.on_forget(forget)  # the plans hold the stored choices
contract.on_group_destroyed(lambda pg: forget())  # the plans hold their group: drop them when it is destroyed
