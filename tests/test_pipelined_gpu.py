"""Pipelined AGKV and Ulysses on GPUs (marked gpu; skipped without them): bf16 vs one GPU, both transports;
torch.compile(fullgraph=True) = eager. Run with ``-s`` to see the max relative error of every case.

W = 2 NCCL ranks (``GPU_TEST_WORLD`` to change). Tolerance: max |out - ref| / max |ref| ≤ 1e-2 (bf16 partial
outputs merged in fp32); ``chunks=1`` bitwise equal to one GPU (the same cuDNN kernel sees the same rows).
"""

from __future__ import annotations

import os

import pytest
import torch

import cp_ops
from dist_util import run_ranks

WORLD = int(os.environ.get("GPU_TEST_WORLD", "2"))
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < WORLD,
                       reason=f"needs {WORLD} CUDA GPUs"),
]
# (B, S_local, H, D): S_local not a multiple of 3 or 4; H = 40 (the benchmark's) and a small one
CASES = [(1, 2050, 40, 128), (2, 1001, 8, 64)]


def _run(fn, *args):
    os.environ.setdefault("CP_OPS_TIMEOUT_S", "120")
    run_ranks(fn, WORLD, *args, timeout=400.0, device="cuda")


def _rand(shape, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(torch.bfloat16)


def _rel(out, ref) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _vs_single_gpu(rank, w, transport):
    from cp_ops.kernels import lse as attention_lse, lse_merge
    from cp_ops.transport import fast

    if transport == "fast":
        assert fast.unavailable_reason("cuda") is None, fast.unavailable_reason("cuda")
    worst = 0.0
    for i, (b, s_local, h, d) in enumerate(CASES):
        q, k, v = (_rand((b, w * s_local, h, d), 100 * i + j) for j in range(3))  # same on every rank
        ref = cp_ops.local_attention(q, k, v)
        sh = lambda t: t[:, rank * s_local:(rank + 1) * s_local].contiguous()  # noqa: E731
        for mode in ("agkv", "ulysses"):
            if mode == "ulysses" and h % w:
                continue
            for chunks in (1, 2, 3, 4, None):
                out = cp_ops.attention(sh(q), sh(k), sh(v), mode=mode, transport=transport, chunks=chunks)
                torch.cuda.synchronize()
                err = _rel(out, sh(ref))
                worst = max(worst, err)
                if rank == 0:
                    print(f"pipelined W={w} {transport} {mode} chunks={chunks} B={b} S_local={s_local} H={h} D={d}: "
                          f"max rel err {err:.2e}", flush=True)
                assert out.dtype == torch.bfloat16 and out.shape == sh(ref).shape
                if chunks == 1:
                    assert torch.equal(out, sh(ref)), (mode, "chunks=1 must stay bitwise", err)
                assert err <= 1e-2, (transport, mode, chunks, (b, s_local, h, d), err)
    if rank == 0:
        print(f"pipelined W={w} {transport}: worst max rel err {worst:.2e}; LSE kernel "
              f"{attention_lse.kernel_for('cuda', torch.bfloat16, 128)}; Triton merge {lse_merge.use_triton(q.device)}",
              flush=True)


@pytest.mark.parametrize("transport", ["torch", "fast"])
def test_pipelined_bf16_vs_single_gpu(transport):
    _run(_vs_single_gpu, transport)


def _fp32_and_fp16(rank, w):
    """fp32 (the tiny diffusers models' dtype) and fp16 on both transports, tiny and odd shapes: the LSE kernels are
    picked by dtype (cuDNN/flash for the half dtypes only; torch's memory-efficient kernel for fp32: the cuDNN op,
    called directly, took fp32 and returned NaN)."""
    from cp_ops.kernels import lse as attention_lse

    for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 2e-3)):
        for b, s_local, h, d in ((2, 9, 4, 8), (1, 333, 6, 64)):
            g = torch.Generator(device="cuda").manual_seed(s_local + d)
            q, k, v = (torch.randn(b, w * s_local, h, d, generator=g, device="cuda").to(dtype) for _ in range(3))
            ref = cp_ops.local_attention(q.float(), k.float(), v.float())
            sh = lambda t: t[:, rank * s_local:(rank + 1) * s_local].contiguous()  # noqa: E731
            for transport in ("torch", "fast"):
                for chunks in (2, 3):
                    out = cp_ops.attention(sh(q), sh(k), sh(v), mode="agkv", transport=transport, chunks=chunks)
                    torch.cuda.synchronize()
                    err = _rel(out, sh(ref))
                    assert out.dtype == dtype and err <= tol, (dtype, (b, s_local, h, d), transport, chunks, err)
        if rank == 0:
            print(f"{dtype}: LSE kernel {attention_lse.kernel_for('cuda', dtype, 64)}", flush=True)
    assert attention_lse.kernel_for("cuda", torch.float32, 64) == "efficient"


def test_pipelined_fp32_fp16_vs_reference():
    _run(_fp32_and_fp16)


def _compiled(rank, w):
    q, k, v = (_rand((1, 1000, 8, 128), 10 * rank + j) for j in range(3))
    for mode, chunks in (("agkv", 2), ("agkv", 3), ("ulysses", 2), ("ulysses", 4)):
        def fn(q, k, v):
            return cp_ops.attention(q * 1.5, k, v, mode=mode, transport="torch", chunks=chunks)

        eager = fn(q, k, v)
        compiled = torch.compile(fn, fullgraph=True)(q, k, v)
        torch.cuda.synchronize()
        assert torch.equal(compiled, eager), (mode, chunks, _rel(compiled, eager))


def test_pipelined_compiled_equals_eager():
    _run(_compiled)
