"""Every cp_ops ``torch.library`` op: schema, fake kernel and real kernel, side by side.

The ops are *launches*: they start the communication and return at once, with their outputs registered
so that ``torch.ops._c10d_functional.wait_tensor(out)`` waits for it (as c10d's functional collectives
do) — a compiler can then move the launch early and the wait late. Outputs are not valid until waited.
Python wrappers below give the synchronous form for eager users.

Each op takes ``world_size: int`` (so fake kernels need no process group), ``group_name: str`` and an
op-level ``transport`` from :func:`cp_ops.transport.base.resolve`: a registered name (raises when the group
cannot use it) or 'auto' (the first of ``AUTO_ORDER`` that suits the group, else torch).

Ops:
    cp_ops::agkv_gather_start(k, v, world_size, group_name, transport) -> (k_full, v_full)
        k, v ``[B, S_local, H, D]`` → ``[B, W*S_local, H, D]`` each, tokens in rank order.
    cp_ops::ulysses_start(xs, world_size, group_name, transport) -> buf
        n tensors ``[B, S_local, H, D]`` → ``[W, B, S_local, n, H/W, D]`` (see :mod:`cp_ops.layout`).
    cp_ops::ulysses_inverse_start(x, world_size, group_name, transport) -> buf
        ``[B, S, H/W, D]`` → ``[W, B, S/W, H/W, D]``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _register_work
from torch.distributed.distributed_c10d import _resolve_process_group

from . import config
from ._hooks import run_compile_hooks  # the Inductor lowerings (passes/) arrive through it: core never imports passes
from .transport import base as transport_base
from .validate import checked_call

def _transport(name: str, pg: dist.ProcessGroup, t: torch.Tensor):
    """The transport object for this call (the one selector: :func:`cp_ops.transport.base.for_group`)."""
    return transport_base.for_group(name, pg, t.device)


def _group(world_size: int, group_name: str) -> dist.ProcessGroup:
    pg = _resolve_process_group(group_name)
    if pg.size() != world_size:
        raise ValueError(f"group '{group_name}' has {pg.size()} ranks but the op was given world_size={world_size}")
    return pg


def _register(work, *outs: torch.Tensor) -> None:
    if config.settings.blocking:
        work.wait()
        return
    for out in outs:
        _register_work(out, work)


def _check_bshd_fake(name: str, t: torch.Tensor) -> None:
    torch._check(t.dim() == 4, lambda: f"{name} must be 4-D [B, S, H, D]; got shape {tuple(t.shape)}")


# ---- AGKV all-gather ---------------------------------------------------------------------------
@torch.library.custom_op("cp_ops::agkv_gather_start", mutates_args=())
def agkv_gather_start(
    k: torch.Tensor, v: torch.Tensor, world_size: int, group_name: str, transport: str
) -> tuple[torch.Tensor, torch.Tensor]:
    pg = _group(world_size, group_name)
    checked_call(pg, "agkv_gather", k, lambda: _check_agkv(k, v))
    if k.numel() == 0:  # nothing to move (every rank agreed on this shape)
        b, s, h, d = k.shape
        return k.new_empty(b, world_size * s, h, d), v.new_empty(b, world_size * s, h, d)
    k_full, v_full, work = _transport(transport, pg, k).agkv_start(k, v, pg)
    _register(work, k_full, v_full)
    return k_full, v_full


def _check_agkv(k, v) -> None:
    _check_bshd_fake("k", k)
    torch._check(k.shape == v.shape, lambda: f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    torch._check(k.dtype == v.dtype, lambda: f"k and v dtypes differ: {k.dtype} vs {v.dtype}")


@agkv_gather_start.register_fake
def _(k, v, world_size, group_name, transport):
    run_compile_hooks()
    _check_agkv(k, v)
    b, s, h, d = k.shape
    return k.new_empty(b, world_size * s, h, d), v.new_empty(b, world_size * s, h, d)


# ---- Ulysses all-to-all, sequence → heads ------------------------------------------------------
@torch.library.custom_op("cp_ops::ulysses_start", mutates_args=())
def ulysses_start(xs: list[torch.Tensor], world_size: int, group_name: str, transport: str) -> torch.Tensor:
    pg = _group(world_size, group_name)
    checked_call(pg, "ulysses", xs[0] if xs else None, lambda: _check_ulysses(xs, world_size), extra=len(xs))
    if xs[0].numel() == 0:
        b, s, h, d = xs[0].shape
        return xs[0].new_empty(world_size, b, s, len(xs), h // world_size, d)
    buf, work = _transport(transport, pg, xs[0]).ulysses_start(xs, pg)
    _register(work, buf)
    return buf


def _check_ulysses(xs, world_size) -> None:
    torch._check(len(xs) >= 1, lambda: "ulysses_start needs at least one tensor")
    x0 = xs[0]
    _check_bshd_fake("xs[0]", x0)
    for i, x in enumerate(xs):
        torch._check(x.shape == x0.shape, lambda: f"xs[{i}] shape {tuple(x.shape)} != xs[0] {tuple(x0.shape)}")
        torch._check(x.dtype == x0.dtype, lambda: f"xs[{i}] dtype {x.dtype} != xs[0] {x0.dtype}")
    b, s, h, d = x0.shape
    torch._check(h % world_size == 0, lambda: f"heads={h} not divisible by world_size={world_size}")


@ulysses_start.register_fake
def _(xs, world_size, group_name, transport):
    run_compile_hooks()
    _check_ulysses(xs, world_size)
    b, s, h, d = xs[0].shape
    return xs[0].new_empty(world_size, b, s, len(xs), h // world_size, d)


# ---- Ulysses all-to-all, heads → sequence ------------------------------------------------------
@torch.library.custom_op("cp_ops::ulysses_inverse_start", mutates_args=())
def ulysses_inverse_start(x: torch.Tensor, world_size: int, group_name: str, transport: str) -> torch.Tensor:
    pg = _group(world_size, group_name)
    checked_call(pg, "ulysses_inverse", x, lambda: _check_ulysses_inverse(x, world_size))
    if x.numel() == 0:
        b, s, hl, d = x.shape
        return x.new_empty(world_size, b, s // world_size, hl, d)
    buf, work = _transport(transport, pg, x).ulysses_inverse_start(x, pg)
    _register(work, buf)
    return buf


def _check_ulysses_inverse(x, world_size) -> None:
    _check_bshd_fake("x", x)
    torch._check(x.shape[1] % world_size == 0, lambda: f"seq={x.shape[1]} not divisible by world_size={world_size}")


@ulysses_inverse_start.register_fake
def _(x, world_size, group_name, transport):
    run_compile_hooks()
    _check_ulysses_inverse(x, world_size)
    b, s, hl, d = x.shape
    return x.new_empty(world_size, b, s // world_size, hl, d)


# ---- waits and synchronous wrappers ------------------------------------------------------------
def wait(t: torch.Tensor) -> torch.Tensor:
    """Wait for the launch that produced ``t``; returns ``t``, now valid on the current stream."""
    return torch.ops._c10d_functional.wait_tensor(t)


# ---- autograd: forward-only, with an error that says so ------------------------------------------
def _no_backward(name: str):
    def backward(ctx, *grads):
        raise RuntimeError(
            f"cp_ops.{name} has no backward: cp_ops targets DiT inference (forward only). Run the model under "
            "torch.no_grad() / torch.inference_mode(), or detach the inputs of cp_ops.attention"
        )

    return backward


for _op, _name in ((agkv_gather_start, "agkv_gather_start"), (ulysses_start, "ulysses_start"),
                   (ulysses_inverse_start, "ulysses_inverse_start")):
    _op.register_autograd(_no_backward(_name), setup_context=lambda ctx, inputs, output: None)


#: Every launch op (the ops table): a compiler integration derives from it what it lowers and reorders.
LAUNCH_OPS = (
    torch.ops.cp_ops.agkv_gather_start.default,
    torch.ops.cp_ops.ulysses_start.default,
    torch.ops.cp_ops.ulysses_inverse_start.default,
)
#: The launches that carry attention's inputs (K/V, and Q for Ulysses): the overlap pass opens a window from each.
#: A launch whose first argument is a list of tensors packs them; the pass may split such a launch by tensor.
KV_LAUNCH_OPS = LAUNCH_OPS[:2]
