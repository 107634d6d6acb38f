"""GPU tests of uneven shards and key-padding masks (NCCL, one GPU per rank, bf16): run on the GPU machine;
skipped without 2 CUDA GPUs. Equal to one GPU for the same SDPA calls (bitwise), close to one SDPA call over the
whole sequence, for both transports ('torch' and 'auto': the fast one where it runs), eager and compiled."""

import pytest
import torch

import cp_ops
from cp_ops import layout
from cp_ops.kernels import local_attention as masked_attention
from dist_util import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


def _refs(q, k, v, mask, rank, w, seq, mode):
    sh = lambda t: layout.shard(t, 1, rank, w, seq_lens=seq).contiguous()  # noqa: E731
    if mode == "agkv":
        return masked_attention(sh(q), k, v, None, mask)
    hl = q.shape[2] // w
    groups = [masked_attention(*(t[:, :, g * hl:(g + 1) * hl].contiguous() for t in (q, k, v)), None, mask)
              for g in range(w)]
    return sh(torch.cat(groups, dim=2))


def _cuda_uneven(rank, w):
    dev = torch.device("cuda", rank)
    b, h, d = 2, 8, 128
    for seq in (layout.shard_sizes(4097, w), (3000, 1097), (4096, 0)):
        total = sum(seq)
        g = torch.Generator(device=dev).manual_seed(total + seq[0])
        q, k, v = (torch.randn(b, total, h, d, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(3))
        mask = torch.ones(b, total, dtype=torch.bool, device=dev)
        mask[0, -300:] = False  # text-style padding at the end of row 0
        mask[1] = torch.rand(total, generator=g, device=dev) > 0.2
        sh = lambda t: layout.shard(t, 1, rank, w, seq_lens=seq).contiguous()  # noqa: E731
        for m in (None, mask):
            full = sh(masked_attention(q, k, v, None, m))  # one SDPA call over the whole sequence
            for mode in ("agkv", "ulysses"):
                same = _refs(q, k, v, m, rank, w, seq, mode)
                for transport in ("torch", "auto"):
                    out = cp_ops.attention(sh(q), sh(k), sh(v), mode=mode, transport=transport, seq_lens=seq,
                                           key_mask=None if m is None else sh(m))
                    torch.cuda.synchronize()
                    err = (out.float() - full.float()).abs().max().item() if out.numel() else 0.0
                    print(f"rank {rank} seq={seq} mask={m is not None} {mode} {transport}: "
                          f"bitwise(same calls)={torch.equal(out, same)} max abs err vs one call={err:.3e}")
                    assert torch.equal(out, same), (seq, mode, transport, m is not None)
                    torch.testing.assert_close(out, full, rtol=2e-2, atol=2e-2)


def test_cuda_uneven_and_masked_equal_single_gpu():
    run_ranks(_cuda_uneven, 2, device="cuda")


def _cuda_compiled(rank, w):
    dev = torch.device("cuda", rank)
    seq = layout.shard_sizes(2049, w)
    g = torch.Generator(device=dev).manual_seed(rank)
    q, k, v = (torch.randn(1, seq[rank], 8, 64, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(3))
    mask = torch.rand(1, seq[rank], generator=g, device=dev) > 0.1
    for mode in ("agkv", "ulysses"):
        fn = lambda q, k, v, m: cp_ops.attention(q * 1.5, k, v, mode=mode, seq_lens=seq, key_mask=m)  # noqa: E731
        torch.testing.assert_close(torch.compile(fn, fullgraph=True)(q, k, v, mask), fn(q, k, v, mask), rtol=0, atol=0)


def test_cuda_uneven_compiled_equals_eager():
    run_ranks(_cuda_compiled, 2, device="cuda")
