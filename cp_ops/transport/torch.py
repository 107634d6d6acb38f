"""The torch transport: ``torch.distributed`` collectives — NCCL on CUDA, gloo on CPU; works multi-node.

AGKV is one coalesced all-gather per call, written straight into the final ``[B, S, H, D]`` buffers
(per batch row when B > 1, so no rearranging copy follows). Ulysses is one ``all_to_all_single`` over a
packed buffer carrying every tensor of the call. Outputs are fresh tensors (never pooled).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..layout import ulysses_inverse_pack, ulysses_pack
from .base import register


class TorchTransport:
    name = "torch"
    slots_per_key = None
    pooled_outputs = False

    def unavailable_reason(self, device: torch.device) -> str | None:
        return None

    def group_reason(self, group: dist.ProcessGroup, device: torch.device) -> str | None:
        return None

    def agkv_start(self, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup):
        w = group.size()
        b, s, h, d = k.shape
        k_full = k.new_empty(b, w * s, h, d)
        v_full = v.new_empty(b, w * s, h, d)
        k_in, v_in = k.contiguous(), v.contiguous()
        outs = [k_full[i] for i in range(b)] + [v_full[i] for i in range(b)]
        ins = [k_in[i] for i in range(b)] + [v_in[i] for i in range(b)]
        work = group.allgather_into_tensor_coalesced(outs, ins)
        return k_full, v_full, work

    def ulysses_start(self, xs: list[torch.Tensor], group: dist.ProcessGroup):
        send = ulysses_pack(xs, group.size())
        recv = torch.empty_like(send)
        work = group.alltoall_base(recv, send, [], [])
        return recv, work

    def ulysses_inverse_start(self, x: torch.Tensor, group: dist.ProcessGroup):
        send = ulysses_inverse_pack(x, group.size())
        recv = torch.empty_like(send)
        work = group.alltoall_base(recv, send, [], [])
        return recv, work


transport = register(TorchTransport(), auto_rank=99)
