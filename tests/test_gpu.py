"""GPU tests (NCCL, one GPU per rank): run on the GPU machine; skipped without 2 CUDA GPUs."""

import pytest
import torch

import cp_ops
from dist_util import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


def _cuda_equal_single_gpu(rank, w):
    dev = torch.device("cuda", rank)
    for b, s, h, d in [(1, 4096, 40, 128), (2, 2048, 8, 64), (1, 8192, 12, 128)]:
        g = torch.Generator(device=dev).manual_seed(s + h)
        q, k, v = (torch.randn(b, s, h, d, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(3))
        ref = cp_ops.local_attention(q, k, v)
        sl = s // w
        sh = lambda t: t[:, rank * sl : (rank + 1) * sl].contiguous()  # noqa: E731
        for mode in ("agkv", "ulysses"):
            out = cp_ops.attention(sh(q), sh(k), sh(v), mode=mode, transport="torch")
            torch.cuda.synchronize()
            # AGKV: the same cuDNN kernel sees the same rows; Ulysses: the same heads.
            assert torch.equal(out, sh(ref)), (mode, (b, s, h, d), (out.float() - sh(ref).float()).abs().max().item())


def test_cuda_attention_bitwise_equal_single_gpu():
    run_ranks(_cuda_equal_single_gpu, 2, device="cuda")


def _cuda_compiled(rank, w):
    dev = torch.device("cuda", rank)
    g = torch.Generator(device=dev).manual_seed(rank)
    q, k, v = (torch.randn(1, 1024, 8, 64, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(3))
    for mode in ("agkv", "ulysses"):
        fn = lambda q, k, v: cp_ops.attention(q * 1.5, k, v, mode=mode)  # noqa: E731
        torch.testing.assert_close(torch.compile(fn, fullgraph=True)(q, k, v), fn(q, k, v), rtol=0, atol=0)


def test_cuda_compiled_equals_eager():
    run_ranks(_cuda_compiled, 2, device="cuda")
