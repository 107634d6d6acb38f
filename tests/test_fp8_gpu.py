"""FP8 communication on CUDA with ONE GPU (marked gpu; skipped without CUDA): the fused Triton encode/decode kernels
against the torch reference quantizer (bitwise: the same math), and two ranks sharing the GPU over gloo with CUDA
tensors (the Triton kernels in the real data path) bitwise equal to the same kernel calls on round-tripped tensors."""

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


# Known failure, measured on 1x H200 (Triton 3.6, torch 2.11, 2026-12-01): the Triton encode differs from the torch
# quantizer in 46-53 bytes of the self-test's sweep for every format and dtype, so use_triton() is False there and the
# codec runs the torch version (correct, slower: 80-1500 us per tensor). Strict: the day the kernels match, this fails
# and the mark comes off.
@pytest.mark.xfail(strict=True, reason="Triton FP8 encode not bitwise equal to torch's on H200 (self-test: 46-53 "
                   "bytes differ); the codec falls back to the torch version")
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 4096, 24, 128), (2, 333, 5, 64), (3, 7, 2, 6)])
def test_triton_codec_equals_torch(fmt, dtype, shape):
    from cp_ops.kernels import fp8

    assert fp8.use_triton(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(shape, generator=g, device="cuda") * 3).to(dtype)
    x[0, 0, 0] = 0
    x[0, -1, -1] = torch.finfo(dtype).tiny
    enc = fp8.encode_triton(x, fmt)
    ref = fp8.encode_torch(x, fmt)
    assert torch.equal(enc, ref), (enc != ref).sum().item()
    for out in (torch.bfloat16, torch.float32):
        assert torch.equal(fp8.decode_triton(enc, out, fmt), fp8.decode_torch(enc, out, fmt))
    # a strided slice (what pipelined AGKV decodes per piece)
    part = enc[:, 1:3]
    assert torch.equal(fp8.decode_triton(part, dtype, fmt), fp8.decode_torch(part, dtype, fmt))


def _two_ranks(rank, w, port, errq):
    import traceback

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        torch.cuda.set_device(0)
        dist.init_process_group("cpu:gloo,cuda:gloo", rank=rank, world_size=w)
        import cp_ops
        from cp_ops import comm_dtype as cd
        from cp_ops.kernels import fp8

        dev = torch.device("cuda", 0)
        g = torch.Generator(device=dev).manual_seed(3)
        b, s, h, d = 1, 2048, 8, 64
        q, k, v = (torch.randn(b, s, h, d, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(3))
        sl = slice(rank * s // w, (rank + 1) * s // w)
        rt = lambda x, f: fp8.round_trip(x, f) if f else x  # noqa: E731
        ref = cp_ops.local_attention(q, k, v)[:, sl]
        E4 = torch.float8_e4m3fn
        for mode, chunks, c in (("agkv", 1, E4), ("agkv", 2, E4), ("ulysses", 1, E4),
                                ("ulysses", 1, {"q": E4, "v": E4, "o": E4}), ("ulysses", 2, torch.float8_e5m2)):
            fq, fk, fv, fo = cd.for_mode(cd.normalize(c), mode)
            out = cp_ops.attention(q[:, sl], k[:, sl], v[:, sl], mode=mode, chunks=chunks, transport="torch",
                                   comm_dtype=c)
            if mode == "agkv":
                same = cp_ops.local_attention(q[:, sl], rt(k, fk), rt(v, fv))
            else:
                hl = h // w
                qr, kr, vr = rt(q, fq), rt(k, fk), rt(v, fv)
                same = torch.cat([cp_ops.local_attention(*(t[:, :, i * hl:(i + 1) * hl] for t in (qr, kr, vr)))
                                  for i in range(w)], dim=2)
                same = rt(same[:, sl].contiguous(), fo)
            if chunks == 1:
                assert torch.equal(out, same), (mode, c, (out.float() - same.float()).abs().max().item())
            else:
                assert ((out.float() - same.float()).abs().max() / same.float().abs().max()).item() < 2e-2
            err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            assert 0 < err < 0.15, (mode, chunks, c, err)

        def block(x):
            return cp_ops.attention(x * 0.5, x, x, mode="ulysses", chunks=1, transport="torch", comm_dtype=E4)

        x = q[:, sl].contiguous()
        assert torch.equal(cp_ops.compile(block, fullgraph=True)(x), block(x))
        torch.cuda.synchronize()
        errq.put((rank, None))
    except BaseException:  # noqa: BLE001
        errq.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_two_ranks_on_one_gpu_fp8_equal_round_tripped_reference():
    import torch.multiprocessing as mp

    from cp_ops.cli.launch import free_port

    ctx = mp.get_context("spawn")
    errq = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_two_ranks, args=(r, 2, port, errq)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    errors = []
    while not errq.empty():
        r, e = errq.get()
        if e:
            errors.append(f"rank {r}:\n{e}")
    assert not errors, "\n".join(errors)
    assert not alive, "a rank did not finish within 240 s"
