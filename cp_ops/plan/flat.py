"""The plan of a call on a flat CP group (a ``ProcessGroup`` or a 1-D mesh): :func:`decide` (the input rules on
every rank, the mode, transport, stages, body, layout and variant tag, each rule's reason in :attr:`Decision.why`),
then the body run *traced* (:func:`traced`, an :class:`~cp_ops.comm.OpComm`) or *eager* (a cached :class:`Plan`, a
:class:`~cp_ops.comm.DirectComm`); the data path: ``docs/architecture.md``.
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .. import config, contract, emulate, layout, modes, validate
from .. import comm_dtype as cd
from ..comm import DirectCodec, DirectComm, OpCodec, OpComm
from ..kernels import local_attention
from ..transport import base as transport_base
from . import measured, rules
from .call import Call, make

#: The rank contract's name of an attention call (its messages say "cp_ops.attention (call #n)").
CALL = "cp_ops.attention"


class Decision(NamedTuple):
    """What a call runs, decided once (its fields: the mode, transport, stages, body, the rank contract's tag, the
    layout, the FP8 formats, and why: the rules' reasons or where the measured choice came from)."""

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
    why: str = ""
    source: str = "heuristic"


def decide(call: Call, pg: dist.ProcessGroup, given_why: str = "") -> Decision:
    """Check a call's inputs (every rank raises if one rank's fail; errors as :func:`cp_ops.attention`) and make its
    decisions. ``given_why``: the rule that chose ``mode`` where the caller did not (a degenerate mesh)."""
    q, k, v, mode, transport, scale, chunks = call.q, call.k, call.v, call.mode, call.transport, call.scale, call.chunks
    seq_lens, key_mask, tag, comm_dtype = call.seq_lens, call.key_mask, call.tag, call.comm_dtype
    world = pg.size()
    chosen, mode_why, resolved, fmts, asked_fmts, scale_word = mode, "", transport, cd.NONE, cd.NONE, None
    fp8_why = ""
    try:  # FP8's mode rule: 'auto' with K and V apart runs Ulysses (a bad comm_dtype or q: the checks raise it)
        mode, fp8_why = rules.fp8_mode(mode, comm_dtype, q.shape[2], world)
    except (AttributeError, IndexError, TypeError):
        pass
    if tag is not None and torch.compiler.is_compiling():
        tag = constant(tag)
        if _symbolic(tag):
            raise ValueError(f"tag must be a Python constant under torch.compile; got {tag!r} holding a symbolic int "
                             "(an int that changed between compiles of the same code): pass a str tag (e.g. "
                             "f'layer{i}'), or compile with dynamic=False")

    def local_checks():
        nonlocal chosen, mode_why, resolved, fmts, asked_fmts, scale_word
        rules.check_chunks(chunks)
        scale_word = contract.scale_field(scale)  # TypeError for a scale that is not a number
        validate.check_same(("q", "k", "v"), (q, k, v))
        layout.check_not_bhsd("q", q)  # a BHSD tensor passed as BSHD: ValueError naming both layouts
        chosen, why = rules.mode_rule(mode, q.shape[2], world)
        mode_why = fp8_why or given_why or why
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
            if not modes.spec(chosen).masks_pipelined:
                check_mask_chunks(chosen, chunks)
        if tag is not None:
            contract.variant_tag(tag=tag)  # TypeError for a tag whose repr differs across ranks

    contract.api_checked(pg, CALL, local_checks)
    if world == 1:
        return Decision(1, chosen, resolved, 1, None, False, 0, None, key_mask is not None, fmts,
                        "a group of one rank: local attention, nothing moved")
    if (seq_lens is not None or key_mask is not None) and chunks is None:
        c, why = rules.chunks_rule(chosen, world, resolved, None, layout_call=True)
        why, source = f"{why}; {mode_why}", "heuristic"
    else:
        ch = measured.decide(mode, chunks, chosen, q, pg, resolved, runner(q, pg, resolved, asked_fmts),
                             cd.tag(asked_fmts) or "", mode_why)
        chosen, c, why, source = ch.mode, ch.chunks, ch.why, ch.source
        if source == "explicit" and fp8_why:  # the FP8 rule chose the mode, the caller the chunks
            why, source = f"{mode_why}; chunks={c} given", "heuristic"
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
                    key_mask is not None, fmts, why, source)


def check_mask_chunks(mode: str, chunks) -> None:
    """A key mask needs chunks None or 1 in a mode whose pipelined variant merges partial outputs by LSE."""
    if chunks is not None and chunks > 1:
        raise ValueError(f"mode={mode!r} with chunks > 1 takes no key_mask (its pipelined variant merges partial "
                         f"outputs by LSE, whose kernels take no mask); got chunks={chunks}: pass chunks=1 or None")


def _total(q, world: int, seq_lens):
    """The call's token count over all ranks: ``sum(seq_lens)``, else ``W * S_local``."""
    return sum(seq_lens) if seq_lens is not None else world * q.shape[1]


def _constant(n):
    """``n`` as a Python int while Dynamo traces (a symbolic int, automatic dynamic: comparing it with each candidate
    guards on its value). Raises ValueError past 4096."""
    if type(n) is int:
        return n
    for i in range(1, 4097):
        if n == i:
            return i
    raise ValueError(f"chunks must be an int from 1 to 4096; got {n!r}")


def constant(value):
    """``value`` (an int, a tuple/list of them, str, ...) with every int made a constant of the trace: a lazy constant
    (torch 2.13) becomes one guarded by value; a symbolic int stays symbolic (the callers raise)."""
    t = type(value)
    if t is tuple or t is list:
        return t(constant(x) for x in value)
    if t is int:
        return operator.index(value)
    return value


def _symbolic(value) -> bool:
    return any(_symbolic(x) for x in value) if isinstance(value, (tuple, list)) else isinstance(value, torch.SymInt)


def runner(q, pg, transport: str, fmts=cd.NONE):
    """What :func:`cp_ops.plan.measured.measure` times: ``runner(mode, chunks)`` → a call with that explicit mode and
    chunks on random ``q, k, v`` like ``q`` (seeded alike on every rank), in the formats ``fmts``."""
    made: list = []

    def timed(mode: str, chunks: int):
        if not made:
            g = torch.Generator(device=q.device).manual_seed(0x5EED)
            made.extend(torch.randn(q.shape, generator=g, device=q.device, dtype=q.dtype) for _ in range(3))
        call = make(*made, group=pg, mode=mode, transport=transport, chunks=chunks, comm_dtype=fmts)
        plan = build(call, pg)  # the eager plan the call would run (W > 1, explicit mode and chunks: nothing measured)
        return lambda: plan.run(call)

    return timed


def describe(call: Call, pg, mode_why: str = ""):
    """What a call runs, without a collective (:func:`cp_ops.describe`): the rules' reasons, or once the call ran
    its recorded decision. ``mode_why``: the rule that chose ``mode`` where the caller did not."""
    q, mode, transport, chunks = call.q, call.mode, call.transport, call.chunks
    world = pg.size()
    rules.check_chunks(chunks)
    validate.check_same(("q",), (q,))
    layout.check_not_bhsd("q", q)
    fmts = cd.normalize(call.comm_dtype, q.dtype)  # ValueError for a bad one, as the call
    mode, fp8_why = rules.fp8_mode(mode, fmts, q.shape[2], world)
    chosen, why = rules.mode_rule(mode, q.shape[2], world)
    mode_why = fp8_why or mode_why or why
    cd.for_mode(fmts, chosen)  # AGKV with K and V apart: ValueError, as the call
    resolved = transport_base.resolve(transport, q.device.type)
    runs_on = transport_base.agreed_name(resolved, pg.group_name, q.device)
    shown = runs_on or "auto"
    if fp8_why and chunks is not None:
        return measured.Choice(chosen, chunks, "heuristic", {}, shown, f"{fp8_why}; chunks={chunks} given")
    if mode != "auto" and chunks is not None:
        return measured.Choice(chosen, chunks, "explicit", {}, shown, "mode and chunks given by the caller")
    if world == 1:
        return measured.Choice(chosen, 1, "heuristic", {}, shown, "a group of one rank: local attention, nothing moved")
    if (call.seq_lens is not None or call.key_mask is not None) and chunks is None:
        return measured.Choice(chosen, 1, "heuristic", {}, shown,
                               f"{rules.chunks_rule(chosen, world, resolved, None, True)[1]}; {mode_why}")
    stored = measured.lookup(mode, chunks, q, pg, resolved, cd.tag(fmts) or "")
    if stored is not None:
        return stored._replace(transport=shown)
    # not decided yet: what the first call would decide, short of measuring and of asking the group
    name = runs_on or transport_base.select_transport(resolved, q.device.type)
    note = "" if runs_on else (f"; transport 'auto' is agreed with the group at the first call: '{name}' assumed (this "
                               "rank can run it)")
    c = measured.choose(mode, chunks, chosen, tuple(q.shape), pg, q.device, name, config.settings.tune_modes, mode_why)
    if isinstance(c, measured.Open):
        cands = ", ".join(f"{m}/{n}" for m, n in c.candidates)
        return measured.Choice(c.preferred[0], c.preferred[1], "pending", {}, shown,
                               f"measuring on (CP_OPS_TUNE_MODES=1) and no call made yet: the first eager call "
                               f"measures {cands} (or takes the choice every rank's cache file holds); until then the "
                               f"heuristic's candidate{note}")
    return c._replace(transport=shown, why=c.why + note)


def traced(call: Call, pg) -> torch.Tensor:
    """The traced path of a call on ``pg`` (module docstring)."""
    q, k, v, scale, key_mask = call.q, call.k, call.v, call.scale, call.key_mask
    d = decide(call, pg)
    if d.world == 1:
        return one_rank(call, d.fmts)
    if d.as_op:
        return torch.ops.cp_ops.agkv_pipelined_attention(q, k, v, d.world, pg.group_name, d.transport, scale,
                                                         d.chunks, None if d.seq_lens is None else list(d.seq_lens),
                                                         CALL, d.tag, d.fmts[1])
    shards = _shards(d, pg, q)
    comm = OpComm(d.world, pg.group_name, d.transport, CALL, d.tag, pg.rank(), d.seq_lens, OpCodec(d.fmts))
    try:
        return d.body(q, k, v, comm, scale=scale, chunks=d.chunks, shards=shards, key_mask=key_mask)
    except BaseException:
        if not torch.compiler.is_compiling():
            comm.drain()
        raise


def one_rank(call: Call, fmts, kv_trips: int = 1):
    """A group (or mesh) of one rank: local attention; with ``CP_OPS_EMULATE_COMM=1`` and FP8 formats, emulated
    (:mod:`cp_ops.emulate`; ``kv_trips``: the links K and V cross, 2 on a mesh)."""
    if fmts != cd.NONE and config.settings.emulate_comm:
        return emulate.attention(call.q, call.k, call.v, call.scale, call.key_mask, fmts, kv_trips)
    return local_attention(call.q, call.k, call.v, call.scale, call.key_mask)


def _shards(d: Decision, pg, q) -> layout.Shards | None:
    if d.seq_lens is None and not d.has_mask:
        return None
    return layout.Shards(d.seq_lens, d.world, pg.rank(), q.shape[1], q.device)


def direct_comm(pg, transport: str, tag: int, seq_lens, fmts, device) -> DirectComm:
    """The eager plan's comm on ``pg``: its first launch of each call makes the rank contract's exchange with the
    op's signature (``seq_lens`` folded into ``tag``)."""
    tag = contract.with_seq_lens(tag, seq_lens)
    check = (lambda shape, dtype, extra: contract.CallCheck(pg, CALL, transport, shape, dtype, extra, 0, tag,
                                                            contract.tag_note(tag)))
    return DirectComm(pg, None, check, lambda: transport_base.for_group(transport, pg, device), DirectCodec(fmts))


class Rerouted:
    """The eager plan of a call that runs as another: ``reroute(call)`` (the cross-node split's mode or mesh, a
    degenerate mesh's dim) run by ``plan``, or ``traced`` where ``plan`` is None (nothing to move). ``pg``: its
    group, ``info``: what chose it."""

    __slots__ = ("pg", "info", "reroute", "plan", "traced")

    def __init__(self, pg, info, reroute, plan, traced):
        self.pg, self.info, self.reroute, self.plan, self.traced = pg, info, reroute, plan, traced

    def run(self, call: Call):
        call = self.reroute(call)
        return self.traced(call) if self.plan is None else self.plan.run(call)


class Plan:
    """What every eager call with one key runs (module docstring): ``run(call)`` → output."""

    __slots__ = ("pg", "d", "shards", "comm", "epoch", "device")

    def __init__(self, pg, d: Decision, shards, device):
        self.pg, self.d, self.shards, self.device = pg, d, shards, device
        self.comm, self.epoch = None, -1

    def run(self, call: Call):
        d = self.d
        if d.world == 1:
            return one_rank(call, d.fmts)
        if self.epoch != transport_base.epoch:  # first call, or the transports' per-group choices were reset
            self.comm = direct_comm(self.pg, d.transport, d.tag, d.seq_lens, d.fmts, self.device)
            self.epoch = transport_base.epoch
        comm = self.comm
        comm.armed = True
        try:
            return d.body(call.q, call.k, call.v, comm, scale=call.scale, chunks=d.chunks, shards=self.shards,
                          key_mask=call.key_mask)
        except BaseException:
            comm.drain()
            raise


def build(call: Call, pg, given_why: str = "") -> Plan | None:
    """The eager plan of ``call`` on ``pg`` (None: nothing to move). Raises as :func:`decide` (on every rank)."""
    d = decide(call, pg, given_why)
    q = call.q
    shards = _shards(d, pg, q) if d.world > 1 else None
    b, s, h, hd = q.shape
    rows = shards.smax if shards is not None else s
    if d.world > 1 and b * rows * h * hd == 0:
        return None
    return Plan(pg, d, shards, q.device)
