"""A CPU transport for tests that behaves like the fast one where aliasing matters: its outputs are views of
persistent buffers it reuses (``pooled_outputs=True``, one slot per (role, shape, dtype)), so the next call of
the same shape overwrites what the previous one returned. Data moves with gloo, straight into the pool."""

from __future__ import annotations

import torch
import torch.distributed as dist

from cp_ops.layout import ulysses_inverse_pack, ulysses_pack
from cp_ops.transport.base import register


class PooledTestTransport:
    name = "pooled_test"
    pooled_outputs = True
    slots_per_key = 1

    def __init__(self):
        self.pool: dict[tuple, torch.Tensor] = {}

    def unavailable_reason(self, device):
        return None if device.type == "cpu" else "pooled_test runs on CPU only"

    def group_reason(self, group, device):
        return self.unavailable_reason(device)

    def slot(self, role, shape, like):
        """A view of a persistent flat buffer (larger than needed, as a pool's slot would be)."""
        key = (role, tuple(shape), like.dtype)
        if key not in self.pool:
            self.pool[key] = like.new_empty(2 * torch.Size(shape).numel() + 8)
        return self.pool[key][8:8 + torch.Size(shape).numel()].view(shape)

    def receive_buffers(self):
        return list(self.pool.values())

    def agkv_start(self, k, v, group):
        w = group.size()
        b, s, h, d = k.shape
        k_full = self.slot("agkv_k", (b, w * s, h, d), k)
        v_full = self.slot("agkv_v", (b, w * s, h, d), v)
        k_in, v_in = k.contiguous(), v.contiguous()
        outs = [k_full[i] for i in range(b)] + [v_full[i] for i in range(b)]
        ins = [k_in[i] for i in range(b)] + [v_in[i] for i in range(b)]
        return k_full, v_full, group.allgather_into_tensor_coalesced(outs, ins)

    def ulysses_start(self, xs, group):
        send = ulysses_pack(xs, group.size())
        recv = self.slot("ulysses", send.shape, send)
        return recv, group.alltoall_base(recv, send, [], [])

    def ulysses_inverse_start(self, x, group):
        send = ulysses_inverse_pack(x, group.size())
        recv = self.slot("ulysses_inverse", send.shape, send)
        return recv, group.alltoall_base(recv, send, [], [])


def install() -> PooledTestTransport:
    """Register (once per process) and return the test transport; not in 'auto''s order."""
    from cp_ops.transport import base

    if PooledTestTransport.name in base.names():
        return base.get(PooledTestTransport.name)
    return register(PooledTestTransport())


class _FreedOnWait(dist.Work):
    """A gloo work whose ``wait()`` gives its pool slot back (as the fast transport's FastWork does; a ``dist.Work``
    so that traced code's ``wait_tensor`` can wait it)."""

    def __init__(self, work, free):
        super().__init__()
        self.work, self.free = work, free

    def wait(self, timeout=None):
        self.work.wait()
        self.free()
        return True

    def is_completed(self):
        return self.work.is_completed()


class SlottedTestTransport(PooledTestTransport):
    """The fast transport's pool discipline on CPU: ``slots_per_key`` = 2 slots per (role, shape, dtype), taken in
    turn; a launch whose slot still holds an output not waited raises RuntimeError (cp_ops.transport.fast.pool), so a
    body that keeps more than two launches of one key in flight fails here as it would on the GPU. Has the fast
    transport's ``ulysses_packed_start``."""

    name = "slotted_test"
    slots_per_key = 2

    def __init__(self):
        super().__init__()
        self.turn: dict[tuple, int] = {}
        self.busy: set[tuple] = set()

    def slot(self, role, shape, like):
        """A view of a persistent flat buffer at an offset of 64 elements (16-byte aligned for any dtype, as
        Inductor checks an op's outputs; the base class's 8 are not for uint8)."""
        key = (role, tuple(shape), like.dtype)
        if key not in self.pool:
            self.pool[key] = like.new_empty(2 * torch.Size(shape).numel() + 64)
        return self.pool[key][64:64 + torch.Size(shape).numel()].view(shape)

    def take(self, role, shape, like):
        key = (role, tuple(shape), like.dtype)
        i = self.turn.get(key, 0)
        if (key, i) in self.busy:
            raise RuntimeError(f"slotted_test: slot {i} of {key} still holds an output that was not waited "
                               f"(at most {self.slots_per_key} launches of one key in flight)")
        self.turn[key] = (i + 1) % self.slots_per_key
        self.busy.add((key, i))
        return self.slot((role, i), shape, like), lambda: self.busy.discard((key, i))

    def agkv_start(self, k, v, group):
        w = group.size()
        b, s, h, d = k.shape
        (k_full, fk), (v_full, fv) = self.take("agkv_k", (b, w * s, h, d), k), self.take("agkv_v", (b, w * s, h, d), v)
        k_in, v_in = k.contiguous(), v.contiguous()
        outs = [k_full[i] for i in range(b)] + [v_full[i] for i in range(b)]
        ins = [k_in[i] for i in range(b)] + [v_in[i] for i in range(b)]
        return k_full, v_full, _FreedOnWait(group.allgather_into_tensor_coalesced(outs, ins), lambda: (fk(), fv()))

    def ulysses_start(self, xs, group):
        return self.ulysses_packed_start(ulysses_pack(xs, group.size()), group)

    def ulysses_packed_start(self, send, group):
        send = send.contiguous()
        recv, free = self.take("ulysses", send.shape, send)
        return recv, _FreedOnWait(group.alltoall_base(recv, send, [], []), free)

    def ulysses_inverse_start(self, x, group):
        send = ulysses_inverse_pack(x, group.size())
        recv, free = self.take("ulysses_inverse", send.shape, send)
        return recv, _FreedOnWait(group.alltoall_base(recv, send, [], []), free)


def install_slotted() -> SlottedTestTransport:
    """Register (once per process) and return :class:`SlottedTestTransport`; not in 'auto''s order."""
    from cp_ops.transport import base

    if SlottedTestTransport.name in base.names():
        return base.get(SlottedTestTransport.name)
    return register(SlottedTestTransport())
