"""Every cp_ops ``torch.library`` op in one table: schema, fake kernel and real kernel, side by side.

The ``*_start`` ops are *launches*: they start the communication and return at once, their outputs registered so
that ``torch.ops._c10d_functional.wait_tensor(out)`` waits for it — a compiler can move the launch early and the
wait late. Each takes ``world_size`` (fake kernels need no group), ``group_name`` and a resolved ``transport``; a
launch's real kernel checks the rank contract with ``call``, ``tag`` and ``seq_lens`` (which only name the call).
Layouts (W = world_size): agkv_gather_start ``[B, S_local, H, D]`` × 2 → ``[B, W*S_local, H, D]`` × 2;
mask_gather_start uint8 ``[B, S]`` → ``[W*B, S]``; ulysses_start n × ``[B, S_local, H, D]`` →
``[W, B, S_local, n, H/W, D]``; ulysses_packed_start that buffer, packed by traced code → the same shape;
ulysses_inverse_start ``[B, S, H/W, D]`` → ``[W, B, S/W, H/W, D]``. ``after`` (Ulysses launches): an ordering input,
never read, so Inductor keeps no more launches of one pool key in flight than a pooling transport has slots.
agkv_pipelined_attention is synchronous; fp8_* are the FP8 codec of ``comm_dtype`` for traced code.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _register_work
from torch.distributed.distributed_c10d import _resolve_process_group

from . import config
from ._hooks import run_compile_hooks  # the Inductor lowerings (cp_ops.passes), imported lazily on the first trace
from .transport import base as transport_base
from . import contract, op_def, validate
from .comm import DirectCodec, DirectComm
from .kernels import fp8, fp8_ulysses


def _group(world_size: int, group_name: str) -> dist.ProcessGroup:
    pg = _resolve_process_group(group_name)
    if pg.size() != world_size:
        raise ValueError(f"group '{group_name}' has {pg.size()} ranks but the op was given world_size={world_size}")
    return pg


def _register(work, *outs: torch.Tensor) -> None:
    if config.settings.blocking:
        work.wait()
        return
    if not isinstance(work, dist.Work):  # a host wait written in Python (the torch transport's CPU collectives)
        work = _AsWork(work)
    for out in outs:
        _register_work(out, work)


class _AsWork(dist.Work):
    """A transport's work that is not a ``dist.Work``, as one, so ``wait_tensor`` can wait it."""

    def __init__(self, work):
        super().__init__()
        self.work = work

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - Work signature
        return self.work.wait()

    def is_completed(self) -> bool:
        return self.work.is_completed()


# ---- AGKV all-gather ---------------------------------------------------------------------------
@op_def.define("cp_ops::agkv_gather_start")
def agkv_gather_start(
    k: torch.Tensor, v: torch.Tensor, world_size: int, group_name: str, transport: str, call: str = "", tag: int = 0,
    seq_lens: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    pg = _group(world_size, group_name)
    contract.op_checked(pg, "cp_ops::agkv_gather_start", transport, k, lambda: _check_agkv(k, v, world_size), 2,
                        call=call, tag=tag, seq_lens=seq_lens)
    if k.numel() == 0:  # nothing to move (every rank agreed on this shape)
        b, s, h, d = k.shape
        return k.new_empty(b, world_size * s, h, d), v.new_empty(b, world_size * s, h, d)
    k_full, v_full, work = transport_base.for_group(transport, pg, k.device).agkv_start(k, v, pg)
    _register(work, k_full, v_full)
    return k_full, v_full


# The fake kernels and the real kernels check the same rules (cp_ops.validate), which the public API uses too.
def _check_agkv(k, v, world_size) -> None:
    validate.check_same(("k", "v"), (k, v), wire=True)


@agkv_gather_start.register_fake
def _(k, v, world_size, group_name, transport, call="", tag=0, seq_lens=None):
    run_compile_hooks()
    _check_agkv(k, v, world_size)
    b, s, h, d = k.shape
    return k.new_empty(b, world_size * s, h, d), v.new_empty(b, world_size * s, h, d)


# ---- Ulysses all-to-all, sequence → heads ------------------------------------------------------
@op_def.define("cp_ops::ulysses_start")
def ulysses_start(xs: list[torch.Tensor], world_size: int, group_name: str, transport: str, call: str = "",
                  tag: int = 0, seq_lens: list[int] | None = None) -> torch.Tensor:
    pg = _group(world_size, group_name)
    contract.op_checked(pg, "cp_ops::ulysses_start", transport, xs[0] if xs else None,
                        lambda: _check_ulysses(xs, world_size), len(xs), call=call, tag=tag, seq_lens=seq_lens)
    if xs[0].numel() == 0:
        b, s, h, d = xs[0].shape
        return xs[0].new_empty(world_size, b, s, len(xs), h // world_size, d)
    buf, work = transport_base.for_group(transport, pg, xs[0].device).ulysses_start(xs, pg)
    _register(work, buf)
    return buf


def _check_ulysses(xs, world_size) -> None:
    validate.check_same(tuple(f"xs[{i}]" for i in range(len(xs))), tuple(xs), wire=True)
    validate.check_heads_divisible(xs[0].shape[2], world_size)


@ulysses_start.register_fake
def _(xs, world_size, group_name, transport, call="", tag=0, seq_lens=None):
    run_compile_hooks()
    _check_ulysses(xs, world_size)
    b, s, h, d = xs[0].shape
    return xs[0].new_empty(world_size, b, s, len(xs), h // world_size, d)


# ---- Ulysses all-to-all of a send buffer packed by traced code (Inductor fuses the pack into Q/K/V's producers) ----
@op_def.define("cp_ops::ulysses_packed_start")
def ulysses_packed_start(send: torch.Tensor, world_size: int, group_name: str, transport: str, call: str = "",
                         tag: int = 0, seq_lens: list[int] | None = None, count: int = 0,
                         after: torch.Tensor | None = None) -> torch.Tensor:
    pg = _group(world_size, group_name)
    # the eager path's signature: [B, S_local, W*(heads sent per group), D], ``count`` tensors (0: the n slots here)
    like = send
    if send.dim() == 6:
        w, b, s, n, hs, d = send.shape
        like = contract.Like((b, s, w * hs, d), send.dtype)
        count = count or n
    contract.op_checked(pg, "cp_ops::ulysses_packed_start", transport, like,
                        lambda: _check_ulysses_packed(send, world_size), count or 1, call=call, tag=tag,
                        seq_lens=seq_lens)
    if send.numel() == 0:
        return torch.empty_like(send, memory_format=torch.contiguous_format)
    buf, work = transport_base.ulysses_packed_start(transport_base.for_group(transport, pg, send.device), send, pg)
    _register(work, buf)
    return buf


def _check_ulysses_packed(send, world_size) -> None:
    validate._require(send.dim() == 6 and send.shape[0] == world_size, lambda: (
        f"ulysses_packed_start takes a send buffer [W={world_size}, B, S_local, n, H/W, D]; got shape "
        f"{tuple(send.shape)}"))
    if send.dtype != torch.uint8:  # uint8: FP8 encoded rows (cp_ops::fp8_ulysses_pack)
        validate.check_dtype("send", send)


@ulysses_packed_start.register_fake
def _(send, world_size, group_name, transport, call="", tag=0, seq_lens=None, count=0, after=None):
    run_compile_hooks()
    _check_ulysses_packed(send, world_size)
    return torch.empty_like(send, memory_format=torch.contiguous_format)


# ---- Ulysses all-to-all, heads → sequence ------------------------------------------------------
@op_def.define("cp_ops::ulysses_inverse_start")
def ulysses_inverse_start(x: torch.Tensor, world_size: int, group_name: str, transport: str, call: str = "",
                          tag: int = 0, seq_lens: list[int] | None = None,
                          after: torch.Tensor | None = None) -> torch.Tensor:
    pg = _group(world_size, group_name)
    contract.op_checked(pg, "cp_ops::ulysses_inverse_start", transport, x,
                        lambda: _check_ulysses_inverse(x, world_size), 1, call=call, tag=tag, seq_lens=seq_lens)
    if x.numel() == 0:
        b, s, hl, d = x.shape
        return x.new_empty(world_size, b, s // world_size, hl, d)
    buf, work = transport_base.for_group(transport, pg, x.device).ulysses_inverse_start(x, pg)
    _register(work, buf)
    return buf


def _check_ulysses_inverse(x, world_size) -> None:
    validate.check_same(("x",), (x,), wire=True)
    validate.check_seq_divisible(x.shape[1], world_size)


@ulysses_inverse_start.register_fake
def _(x, world_size, group_name, transport, call="", tag=0, seq_lens=None, after=None):
    run_compile_hooks()
    _check_ulysses_inverse(x, world_size)
    b, s, hl, d = x.shape
    return x.new_empty(world_size, b, s // world_size, hl, d)


# ---- key-padding mask beside its keys -------------------------------------------------------------
@op_def.define("cp_ops::mask_gather_start")
def mask_gather_start(mask: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    pg = _group(world_size, group_name)
    if mask.numel() == 0:
        return mask.new_empty(world_size * mask.shape[0], mask.shape[1])
    out, work = transport_base.mask_all_gather(mask, pg)
    _register(work, out)
    return out


@mask_gather_start.register_fake
def _(mask, world_size, group_name):
    run_compile_hooks()
    torch._check(mask.dim() == 2, lambda: f"mask_gather_start takes a [B, S] mask; got {mask.dim()}-D")
    return mask.new_empty(world_size * mask.shape[0], mask.shape[1])


# ---- pipelined AGKV: the body of cp_ops/modes/agkv_pipelined.py as one op ----------------------------
# AGKV attention with the transfer under the attention of the blocks already here, partials merged by LSE;
# synchronous for the caller's stream (not a launch: no wait_tensor needed).
@op_def.define("cp_ops::agkv_pipelined_attention")
def agkv_pipelined_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, world_size: int, group_name: str, transport: str,
    scale: float | None, chunks: int, seq_lens: list[int] | None = None, call: str = "", tag: int = 0,
    comm_fmt: str = ""
) -> torch.Tensor:
    from . import layout
    from .modes.agkv_pipelined import agkv_pipelined

    pg = _group(world_size, group_name)

    def rules():
        _check_agkv_pipelined(q, k, v, chunks)
        if seq_lens is not None:
            layout.check_seq_lens(seq_lens, world_size, pg.rank(), k.shape[1])

    # the exchange's shape: the largest shard's (what the eager path compares); bad seq_lens fail the rules inside
    # op_checked, which tells the peers, so nothing here may raise on them first
    smax = max(k.shape[1], *seq_lens) if seq_lens else k.shape[1]
    like = k if smax == k.shape[1] else contract.Like((k.shape[0], smax, *k.shape[2:]), k.dtype)
    contract.op_checked(pg, "cp_ops::agkv_pipelined_attention", transport, like, rules, 2, call=call, tag=tag,
                        seq_lens=seq_lens)
    shards = None if seq_lens is None else layout.Shards(seq_lens, world_size, pg.rank(), k.shape[1], k.device)
    if q.numel() == 0 and smax * k.shape[0] * k.shape[2] * k.shape[3] == 0:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    comm = DirectComm(pg, transport_base.for_group(transport, pg, k.device),
                      codec=DirectCodec(("", comm_fmt, comm_fmt, "")) if comm_fmt else None)
    try:
        return agkv_pipelined(q, k, v, comm, scale=scale, chunks=chunks, shards=shards)
    except BaseException:
        comm.drain()
        raise


def _check_agkv_pipelined(q, k, v, chunks) -> None:
    validate.check_same(("q", "k", "v"), (q, k, v))
    torch._check(chunks >= 1, lambda: f"chunks must be >= 1; got {chunks}")


@agkv_pipelined_attention.register_fake
def _(q, k, v, world_size, group_name, transport, scale, chunks, seq_lens=None, call="", tag=0, comm_fmt=""):
    _check_agkv_pipelined(q, k, v, chunks)
    return torch.empty_like(q, memory_format=torch.contiguous_format)


# It communicates whatever its output: a rank without tokens has an empty output, which Inductor computed without the
# op (its peers then waited for its block). Side-effectful: no dead-code pass removes it.
torch.fx.node.has_side_effect(torch.ops.cp_ops.agkv_pipelined_attention.default)


# ---- the FP8 codec of comm_dtype (cp_ops.kernels.fp8): encode before a launch, decode after its wait ----------------
@op_def.define("cp_ops::fp8_encode")
def fp8_encode(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return fp8.encode(x, fmt)


@fp8_encode.register_fake
def _(x, fmt):
    fp8._check_encode(x, fmt)
    return x.new_empty(fp8.encoded_shape(x.shape), dtype=torch.uint8)


@op_def.define("cp_ops::fp8_decode")
def fp8_decode(buf: torch.Tensor, dtype: torch.dtype, fmt: str) -> torch.Tensor:
    return fp8.decode(buf, dtype, fmt)


@fp8_decode.register_fake
def _(buf, dtype, fmt):
    fp8._check_decode(buf, dtype, fmt)
    return buf.new_empty((*buf.shape[:-1], buf.shape[-1] - fp8.SCALE_BYTES), dtype=dtype)


# ---- the FP8 codec fused with the Ulysses layouts (cp_ops.kernels.fp8_ulysses): one pass each way ------------------
@op_def.define("cp_ops::fp8_ulysses_pack")
def fp8_ulysses_pack(xs: list[torch.Tensor], world_size: int, lo: int, hi: int | None, fmt: str) -> torch.Tensor:
    return fp8_ulysses.pack_encode(xs, world_size, lo, hi, fmt)


@fp8_ulysses_pack.register_fake
def _(xs, world_size, lo, hi, fmt):
    fp8_ulysses.check_pack(xs, world_size, lo, hi, fmt)
    return xs[0].new_empty(fp8_ulysses.packed_shape(xs[0].shape, world_size, lo, hi, len(xs)), dtype=torch.uint8)


@op_def.define("cp_ops::fp8_ulysses_unpack")
def fp8_ulysses_unpack(buf: torch.Tensor, dtype: torch.dtype, fmt: str) -> torch.Tensor:
    return fp8_ulysses.unpack_decode(buf, dtype, fmt)


@fp8_ulysses_unpack.register_fake
def _(buf, dtype, fmt):
    fp8_ulysses.check_unpack(buf, dtype, fmt, 6)
    return buf.new_empty(fp8_ulysses.unpacked_shape(buf.shape), dtype=dtype)


@op_def.define("cp_ops::fp8_ulysses_inverse_unpack")
def fp8_ulysses_inverse_unpack(buf: torch.Tensor, dtype: torch.dtype, fmt: str) -> torch.Tensor:
    return fp8_ulysses.inverse_decode(buf, dtype, fmt)


@fp8_ulysses_inverse_unpack.register_fake
def _(buf, dtype, fmt):
    fp8_ulysses.check_unpack(buf, dtype, fmt, 5)
    return buf.new_empty(fp8_ulysses.unpacked_shape(buf.shape), dtype=dtype)


# ---- pipelined Ulysses: a sub-group's inverse copied out of its (maybe pooled) buffer ----------------
# back ``[W, B, S', Hl, D]`` → ``out [B, S, W, Hl, D]`` (the first S of each block). An opaque op: Inductor could fuse
# a traced copy into a later kernel, reading ``back`` after a later launch took its pooled slot. custom_op, not
# op_def.define: a mutating op, whose ADInplaceOrView kernel custom_op registers.
@torch.library.custom_op("cp_ops::ulysses_inverse_copy_out", mutates_args=("out",))
def ulysses_inverse_copy_out(back: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(back.narrow(2, 0, out.shape[1]).permute(1, 2, 0, 3, 4))


@ulysses_inverse_copy_out.register_fake
def _(back, out):
    validate._require(back.dim() == 5 and out.dim() == 5 and back.shape[2] >= out.shape[1], lambda: (
        f"ulysses_inverse_copy_out takes back [W, B, S', Hl, D] and out [B, S <= S', W, Hl, D]; got "
        f"{tuple(back.shape)} and {tuple(out.shape)}"))


# ---- waits and synchronous wrappers ------------------------------------------------------------
def wait(t: torch.Tensor) -> torch.Tensor:
    """Wait for the launch that produced ``t``; returns ``t``, now valid on the current stream."""
    return torch.ops._c10d_functional.wait_tensor(t)


# ---- autograd: forward-only, with an error that says so ------------------------------------------
# The error is an op's *real* kernel: a forward with inputs that require grad runs (AOTAutograd traces the joint
# graph through the fake kernel); only an actual backward raises.
def no_backward_message(name: str) -> str:
    return (
        f"cp_ops.{name} has no backward: cp_ops targets DiT inference (forward only). Run the model under "
        "torch.no_grad() / torch.inference_mode(), or detach the inputs of cp_ops.attention"
    )


@op_def.define("cp_ops::backward_unsupported")
def backward_unsupported(grad: torch.Tensor, shape: list[int], name: str) -> torch.Tensor:
    """Called by every cp_ops backward: raises RuntimeError (:func:`no_backward_message`)."""
    raise RuntimeError(no_backward_message(name))


@backward_unsupported.register_fake
def _(grad, shape, name):
    return grad.new_empty(shape)


def refuse_grad(grad: torch.Tensor, shape, name: str) -> torch.Tensor:
    """The gradient (of ``shape``) for an input of a cp_ops function that has no backward: raises when run."""
    return torch.ops.cp_ops.backward_unsupported(grad, list(shape), name)


def _save_shapes(ctx, inputs, output):
    # per input: its shape (a tensor list: their shapes), None where it takes no gradient; shapes only
    ctx.shapes = [[x.shape for x in i] if isinstance(i, (list, tuple)) and i and isinstance(i[0], torch.Tensor)
                  else i.shape if isinstance(i, torch.Tensor) else None for i in inputs]


def _no_backward(name: str):
    def backward(ctx, *grads):
        # one entry per input the call passed: the dispatcher leaves out trailing inputs equal to their defaults
        g = next(x for x in grads if x is not None)
        return tuple(None if shape is None else [refuse_grad(g, s, name) for s in shape] if isinstance(shape, list)
                     else refuse_grad(g, shape, name) for shape in ctx.shapes[:len(ctx.needs_input_grad)])

    return backward


for _op in (agkv_gather_start, ulysses_start, ulysses_packed_start, ulysses_inverse_start, agkv_pipelined_attention):
    _op.register_autograd(_no_backward(_op._name), setup_context=_save_shapes)
    # the calls whose signatures the rank contract exchanges
    contract.register_op(_op._qualname)
# a key mask is bool-like, but a float one that requires grad must still trace (AOTAutograd's joint graph) and refuse
# only at backward
mask_gather_start.register_autograd(_no_backward(mask_gather_start._name), setup_context=_save_shapes)


#: The launches that carry attention's inputs (K/V, and Q for Ulysses): the overlap pass opens a window from each
#: (and may split one by tensor). LAUNCH_OPS: every launch, what a compiler integration lowers and reorders.
KV_LAUNCH_OPS = (
    torch.ops.cp_ops.agkv_gather_start.default,
    torch.ops.cp_ops.ulysses_start.default,
    torch.ops.cp_ops.ulysses_packed_start.default,
)
LAUNCH_OPS = KV_LAUNCH_OPS + (
    torch.ops.cp_ops.ulysses_inverse_start.default,
    torch.ops.cp_ops.mask_gather_start.default,
)
