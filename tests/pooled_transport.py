"""A CPU transport for tests that behaves like the fast one where aliasing matters: its outputs are views of
persistent buffers it reuses (``pooled_outputs=True``, one slot per (role, shape, dtype)), so the next call of
the same shape overwrites what the previous one returned. Data moves with gloo, straight into the pool."""

from __future__ import annotations

import torch

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
