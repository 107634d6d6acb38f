"""CP attention on CUDA with ONE GPU (marked gpu; skipped without CUDA).

* Two ranks share one GPU over gloo with CUDA tensors (``cpu:gloo,cuda:gloo``): every mode body runs its CUDA
  kernels (cuDNN, the LSE kernels, the LSE merge) on real data moved by the torch transport, against one device —
  bitwise for transport-then-attend, within bf16 tolerance for the pipelined variants; and under
  ``torch.compile(fullgraph=True)`` with the overlap pass, equal to eager.
* A fake process group of W ranks on the one GPU (no data moved): every variant runs eager, compiled and captured
  in a CUDA graph and replayed (shapes, dtype, no error) — what the zero-communication bound and CUDA-graphed models
  rely on.
* The CUDA extension's LSE merge (csrc/lse_merge.cu) against the fp32 reference and the Triton kernel.
"""

import pytest
import torch
from dist_util import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

VARIANTS = [("agkv", 1), ("agkv", 2), ("agkv", 3), ("ulysses", 1), ("ulysses", 2)]


def _two_ranks_one_gpu(rank, w):
    import cp_ops

    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(3)
    b, s, h, d = 1, 2048, 8, 64
    q, k, v = (torch.randn(b, s, h, d, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(3))
    sl = slice(rank * s // w, (rank + 1) * s // w)
    ref = cp_ops.local_attention(q, k, v)[:, sl]
    for mode, chunks in VARIANTS:
        out = cp_ops.attention(q[:, sl], k[:, sl], v[:, sl], mode=mode, chunks=chunks, transport="torch")
        if chunks == 1 and mode == "agkv":
            assert torch.equal(out, ref), (mode, chunks, (out.float() - ref.float()).abs().max().item())
        else:
            err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            assert err < 2e-2, (mode, chunks, err)
    # uneven shards and a key mask
    seq = (1100, 948)
    off = (0, 1100)
    mask = torch.rand(b, s, generator=g, device=dev) > 0.3
    mask[:, 0] = True
    rs = slice(off[rank], off[rank] + seq[rank])
    ref_m = cp_ops.local_attention(q, k, v, key_mask=mask)[:, rs]
    for mode in ("agkv", "ulysses"):
        out = cp_ops.attention(q[:, rs], k[:, rs], v[:, rs], mode=mode, chunks=1, transport="torch", seq_lens=seq,
                               key_mask=mask[:, rs])
        err = ((out.float() - ref_m.float()).abs().max() / ref_m.float().abs().max()).item()
        assert err < 2e-2, (mode, "uneven+mask", err)
    # uneven without a mask: the prefix split (the real rows taken as views) and the short block first (selected)
    for seq in ((1100, 948), (948, 1100)):
        rs = slice(0, seq[0]) if rank == 0 else slice(seq[0], s)
        ref = cp_ops.local_attention(q[:, rs], k, v)  # this rank's queries against every key: AGKV's one call
        for mode in ("agkv", "ulysses"):
            out = cp_ops.attention(q[:, rs], k[:, rs], v[:, rs], mode=mode, chunks=1, transport="torch", seq_lens=seq)
            if mode == "agkv":
                assert torch.equal(out, ref), (seq, (out.float() - ref.float()).abs().max().item())
            else:
                err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                assert err < 2e-2, (mode, seq, err)
    # compiled with the overlap pass = eager
    def block(x):
        return cp_ops.attention(x * 0.5, x, x, mode="agkv", chunks=1, transport="torch")

    x = q[:, sl].contiguous()
    eager = block(x)
    compiled = cp_ops.compile(block, fullgraph=True)(x)
    assert torch.equal(compiled, eager)
    torch.cuda.synchronize()


def test_two_ranks_on_one_gpu_over_gloo_equal_one_device():
    run_ranks(_two_ranks_one_gpu, 2, timeout=300, device="one_gpu")


@pytest.mark.parametrize("world", [2, 4])
def test_fake_group_eager_compiled_and_captured(world):
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (the 'fake' backend)

    import cp_ops
    from cp_ops.timing import Graphed

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world)
    try:
        dev = torch.device("cuda", 0)
        b, s, h, d = 1, 1024, 8, 128
        q, k, v = (torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
        for mode, chunks in VARIANTS:
            out = cp_ops.attention(q, k, v, mode=mode, chunks=chunks, transport="torch")
            assert out.shape == q.shape and out.dtype == q.dtype
            # dynamic=False: the same lambda recompiled with another closure int would make chunks symbolic;
            # reset: one lambda per variant would otherwise pass Dynamo's recompile limit (8) for its code object
            torch._dynamo.reset()
            comp = torch.compile(lambda a, b_, c: cp_ops.attention(a, b_, c, mode=mode, chunks=chunks,
                                                                    transport="torch"), fullgraph=True, dynamic=False)
            assert comp(q, k, v).shape == q.shape
            # capture after an eager warm-up on a side stream (cp_ops.timing.Graphed, as bench and run do), replay
            static = [t.clone() for t in (q, k, v)]
            graphed = Graphed(lambda: cp_ops.attention(*static, mode=mode, chunks=chunks, transport="torch"), dev,
                              warmup=1)
            got = graphed()
            torch.cuda.synchronize()
            assert got.shape == q.shape, (mode, chunks)
        # uneven shards on the prefix split (rank 0 holds the most; the real rows taken as views, Ulysses' output
        # re-padded by one pad): eager, compiled and captured, the compiled = eager bitwise (the fake collectives
        # write their outputs: torch 2.11's fake all-to-all leaves them unwritten; the bound tool's filled groups)
        from cp_ops.cli import bound_fill

        with bound_fill.filled():
            filled = dist.new_group(list(range(world)))
        seq = cp_ops.layout.shard_sizes(s * world - 3, world)
        qu, ku, vu = (t[:, :seq[0]].contiguous() for t in (q, k, v))
        for mode in ("agkv", "ulysses"):
            eager = cp_ops.attention(qu, ku, vu, mode=mode, transport="torch", seq_lens=seq, group=filled)
            torch._dynamo.reset()
            comp = torch.compile(lambda a, b_, c: cp_ops.attention(a, b_, c, mode=mode, transport="torch",
                                                                    seq_lens=seq, group=filled),
                                 fullgraph=True, dynamic=False)
            assert torch.equal(comp(qu, ku, vu), eager), mode
            graphed = Graphed(lambda: cp_ops.attention(qu, ku, vu, mode=mode, transport="torch", seq_lens=seq,
                                                       group=filled), dev, warmup=1)
            assert graphed().shape == qu.shape, mode
            torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def test_extension_merge_matches_the_fp32_reference_and_triton():
    """csrc/lse_merge.cu (used once the extension is loaded) against the eager fp32 merge and the Triton kernel:
    every dtype, 2..4 partials, 16-byte (one vector per thread and row: the 2-row kernel; or several) and scalar
    paths (D·size % 16), a row count that leaves a block part-filled, strided LSEs as cuDNN returns them, and
    a partial whose LSE is -inf for a row (its block had no key for it: weight 0)."""
    from cp_ops.kernels import lse_merge
    from cp_ops.transport import _fast_build

    ext, why = _fast_build.load()
    assert ext is not None, why
    g = torch.Generator(device="cuda").manual_seed(7)
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float16, 2e-3), (torch.float32, 1e-5)):
        for n in (2, 3, 4):
            for b, s, h, d in ((1, 257, 40, 128), (2, 33, 3, 36), (1, 5, 2, 72), (1, 77, 5, 64)):
                outs = [torch.randn(b, s, h, d, generator=g, device="cuda").to(dtype) for _ in range(n)]
                # LSEs as cuDNN gives them: [B, H, S, 1] squeezed (strides of a [B, H, S] view)
                lses = [(torch.randn(b, h, s, 1, generator=g, device="cuda") * 4).squeeze(-1) for _ in range(n)]
                lses[0][:, 0, 0] = float("-inf")  # a block with no unmasked key for that row: weight 0
                for lse in lses:  # a row with no key in any block (issue 20 item 15): defined as 0, never NaN
                    lse[:, -1, -1] = float("-inf")
                ref = lse_merge.merge_eager(outs, lses, dtype)
                got = lse_merge._merge_ext(outs, lses, dtype)
                assert got is not None, (dtype, n, b, s, h, d)
                assert not torch.isnan(got.float()).any()
                assert torch.equal(got[:, -1, -1], torch.zeros_like(got[:, -1, -1])), (dtype, n, "all -inf row")
                err = _rel(got, ref)
                assert err <= tol, (dtype, n, (b, s, h, d), err)
                tri = lse_merge._merge_triton(outs, lses, dtype, False)
                assert not torch.isnan(tri.float()).any() and not tri[:, -1, -1].any(), (dtype, n, "Triton")
                assert _rel(got, tri) <= tol, (dtype, n, (b, s, h, d))
    # not for it: partials in another dtype than the output -> None (the Triton kernel takes it)
    o = [torch.randn(1, 4, 2, 8, device="cuda") for _ in range(2)]
    l = [torch.randn(1, 2, 4, device="cuda") for _ in range(2)]
    assert lse_merge._merge_ext(o, l, torch.bfloat16) is None
