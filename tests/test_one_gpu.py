"""CP attention on CUDA with ONE GPU (marked gpu; skipped without CUDA).

* W = 2, 4, 8 ranks sharing the GPU (``run_ranks(..., device="one_gpu")``), the torch transport (gloo with CUDA
  tensors) and the fast one (CUDA IPC and NVSHMEM heaps): every mode, pipelined chunks, uneven shards, key masks,
  FP8, 2-D meshes, compiled, captured, 200 calls with shapes changing, ``parallelize`` (eager and whole-forward
  capture), full-depth Wan2.1-1.3B, and faults needing a real peer (a peer that never arrives, a killed rank); each
  check recorded in ``shared_device.json`` (``benchmarks/gpu_one.sh OUT shared wan``).

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
    from cp_ops import _ext

    ext, why = _ext.load()
    assert ext is not None, why
    g = torch.Generator(device="cuda").manual_seed(7)
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float16, 2e-3), (torch.float32, 1e-5)):
        for n in (2, 3, 4):
            for b, s, h, d in ((1, 257, 40, 128), (2, 33, 3, 36), (1, 5, 2, 72), (1, 77, 5, 64)):
                outs = [torch.randn(b, s, h, d, generator=g, device="cuda").to(dtype) for _ in range(n)]
                # LSEs as cuDNN gives them: [B, H, S, 1] squeezed (strides of a [B, H, S] view)
                lses = [(torch.randn(b, h, s, 1, generator=g, device="cuda") * 4).squeeze(-1) for _ in range(n)]
                lses[0][:, 0, 0] = float("-inf")  # a block with no unmasked key for that row: weight 0
                for lse in lses:  # a row with no key in any block: defined as 0, never NaN
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


# ---- W ranks sharing one GPU: every multi-rank path, both transports, W = 2, 4, 8 ----------------------------------
# Each rank is a process of its own on cuda:0 (a ``cpu:gloo,cuda:gloo`` group): separate CUDA contexts, CUDA IPC,
# flags written by another process; only the link is missing. Each check is compared with one device (bitwise where
# the same kernel sees the same data) and recorded: ``{world_size, transport, heap, what, passed, max_err}``, written
# by rank 0 to ``$TEST_SHARED_DEVICE_OUT/shared_<W>_<transport>_<heap>.json`` (a temporary folder when unset). No
# timing is recorded: ranks sharing a device say nothing about speed.
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

SHARED = [(w, t, h) for w in (2, 4, 8) for t, h in (("torch", ""), ("fast", "ipc"), ("fast", "nvshmem"))]


def _out_dir(tmp_path) -> str:
    out = os.environ.get("TEST_SHARED_DEVICE_OUT") or str(tmp_path)
    os.makedirs(out, exist_ok=True)
    return out


def _err(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def _shared_checks(rank, w, transport, heap):
    """(what, fn) pairs; fn() returns (passed, max_err)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import cp_ops
    from cp_ops import comm_dtype as cd
    from cp_ops.kernels import fp8
    from cp_ops.layout import shard_sizes

    dev = torch.device("cuda", 0)
    b, h, d = 1, 16, 128  # the same local shapes at every W: Inductor's caches serve the later compiles
    s = 512 * w
    sl = slice(rank * s // w, (rank + 1) * s // w)

    def fresh(seed, s=s, h=h):
        g = torch.Generator(device=dev).manual_seed(seed)
        return [torch.randn(b, s, h, d, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(3)]

    q, k, v = fresh(1)
    ref = cp_ops.local_attention(q, k, v)[:, sl]

    def att(*t, **kw):
        return cp_ops.attention(*t, transport=transport, **kw)

    def same(out, want):
        return torch.equal(out, want), _err(out, want)

    def close(out, want, tol=2e-2):
        e = _err(out, want)
        return e / want.float().abs().max().item() < tol, e

    checks = []
    checks.append(("agkv chunks=1", lambda: same(att(q[:, sl], k[:, sl], v[:, sl], mode="agkv", chunks=1), ref)))
    checks.append(("ulysses chunks=1", lambda: close(att(q[:, sl], k[:, sl], v[:, sl], mode="ulysses", chunks=1),
                                                    ref)))
    for mode, c in (("agkv", 2), ("agkv", 4), ("ulysses", 2), ("ulysses", 4)):
        checks.append((f"{mode} chunks={c}", lambda mode=mode, c=c: close(
            att(q[:, sl], k[:, sl], v[:, sl], mode=mode, chunks=c), ref)))
    seq = shard_sizes(s - 3, w)  # uneven: the prefix split (ceil on every rank but the last)
    off = sum(seq[:rank])
    rs = slice(off, off + seq[rank])
    ref_u = cp_ops.local_attention(q[:, rs], k[:, :s - 3], v[:, :s - 3])
    checks.append(("uneven agkv", lambda: same(att(q[:, rs], k[:, rs], v[:, rs], mode="agkv", chunks=1,
                                                   seq_lens=seq), ref_u)))
    checks.append(("uneven ulysses", lambda: close(att(q[:, rs], k[:, rs], v[:, rs], mode="ulysses", chunks=1,
                                                       seq_lens=seq), ref_u)))
    g = torch.Generator(device=dev).manual_seed(5)
    mask = torch.rand(b, s, generator=g, device=dev) > 0.3
    mask[:, 0] = True
    ref_m = cp_ops.local_attention(q, k, v, key_mask=mask)[:, sl]
    for mode in ("agkv", "ulysses"):
        checks.append((f"key mask {mode}", lambda mode=mode: close(
            att(q[:, sl], k[:, sl], v[:, sl], mode=mode, chunks=1, key_mask=mask[:, sl]), ref_m)))
    e4 = torch.float8_e4m3fn

    def fp8_check(mode):
        fq, fk, fv, fo = cd.for_mode(cd.normalize(e4), mode)
        rt = lambda x, f: fp8.round_trip(x, f) if f else x  # noqa: E731
        out = att(q[:, sl], k[:, sl], v[:, sl], mode=mode, chunks=1, comm_dtype=e4)
        if mode == "agkv":
            want = cp_ops.local_attention(q[:, sl], rt(k, fk), rt(v, fv))
        else:
            hl = h // w
            qr, kr, vr = rt(q, fq), rt(k, fk), rt(v, fv)
            want = torch.cat([cp_ops.local_attention(*(t[:, :, i * hl:(i + 1) * hl] for t in (qr, kr, vr)))
                              for i in range(w)], dim=2)
            want = rt(want[:, sl].contiguous(), fo)
        return same(out, want)

    checks.append(("fp8 e4m3 agkv", lambda: fp8_check("agkv")))
    checks.append(("fp8 e4m3 ulysses", lambda: fp8_check("ulysses")))

    def compiled(mode):
        def block(x):
            return att(x * 0.5, x, x, mode=mode, chunks=1)

        x = q[:, sl].contiguous()
        torch._dynamo.reset()
        return same(cp_ops.compile(block, fullgraph=True)(x), block(x))

    checks.append(("compiled agkv (overlap pass)", lambda: compiled("agkv")))
    checks.append(("compiled ulysses (overlap pass)", lambda: compiled("ulysses")))

    def captured(mode):
        """A CUDA graph of the call (after an eager warm-up on a side stream), replayed on fresh inputs: = eager."""
        static = [t[:, sl].clone() for t in (q, k, v)]
        st = torch.cuda.Stream()
        st.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(st):
            att(*static, mode=mode, chunks=1)
        torch.cuda.current_stream().wait_stream(st)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = att(*static, mode=mode, chunks=1)
        ok, worst = True, 0.0
        for i in range(3):
            new = [t[:, sl] for t in fresh(100 + i)]
            for a, n in zip(static, new):
                a.copy_(n)
            graph.replay()
            got = out.clone()
            want = att(*new, mode=mode, chunks=1)
            ok &= torch.equal(got, want)
            worst = max(worst, _err(got, want))
        torch.cuda.synchronize()
        return ok, worst

    if transport == "fast":  # gloo's collectives cannot be captured
        checks.append(("captured agkv", lambda: captured("agkv")))
        checks.append(("captured ulysses", lambda: captured("ulysses")))

    def loop():
        """200 calls in a row, shapes changing (pool and slot reuse), fresh inputs each: AGKV bitwise, Ulysses close."""
        ok, worst = True, 0.0
        for i in range(200):
            sl_len = (64, 128, 96, 160)[i % 4]
            mode = ("agkv", "ulysses")[(i // 4) % 2]
            n = sl_len * w
            qq, kk, vv = fresh(1000 + i, s=n)
            part = slice(rank * sl_len, (rank + 1) * sl_len)
            out = att(qq[:, part], kk[:, part], vv[:, part], mode=mode, chunks=1)
            want = cp_ops.local_attention(qq, kk, vv)[:, part]
            good, e = same(out, want) if mode == "agkv" else close(out, want)
            ok &= good
            worst = max(worst, e)
        return ok, worst

    checks.append(("200 calls, shapes changing", loop))

    def mesh(shape):
        m = init_device_mesh("cuda", shape, mesh_dim_names=("agkv", "ulysses"))
        return close(att(q[:, sl], k[:, sl], v[:, sl], group=m, chunks=1), ref)

    # The fast transport has one lane per process: a mesh runs its inner dim on it when the lane is that dim's width
    # (CP_OPS_FAST_LANE_WIDTH, test_shared_device_mesh_fast), its outer dim on torch.
    lane = os.environ.get("CP_OPS_FAST_LANE_WIDTH")
    for shape in {4: [(2, 2)], 8: [(2, 4), (4, 2)]}.get(w, []):
        if transport == "torch" or lane == str(shape[1]):
            inner = " (inner fast)" if transport == "fast" else ""
            checks.append((f"mesh {shape[0]}x{shape[1]}{inner}", lambda shape=shape: mesh(shape)))

    def tiny_wan():
        """A tiny Wan (bf16 on the GPU), its inputs, and its one-device output."""
        import copy

        from diffusers_tiny import build, inputs, sample

        torch.manual_seed(0)
        base = build("wan").to(dev, torch.bfloat16)
        kw = inputs("wan", 1, (2, 8, 8), 8, torch.Generator().manual_seed(7))
        kw = {k_: (v_.to(dev, torch.bfloat16) if v_.is_floating_point() else v_.to(dev)) for k_, v_ in kw.items()}
        with torch.no_grad():
            return base, kw, sample(copy.deepcopy(base)(**kw))

    def model(graphs):
        """A tiny Wan through parallelize: every rank's output = one device (eager); the captured forward = eager."""
        import copy

        from cp_ops.integrations.diffusers import parallelize
        from diffusers_tiny import sample

        base, kw, want = tiny_wan()
        with torch.no_grad():
            par = parallelize(copy.deepcopy(base), mode="agkv", transport=transport, chunks=1,
                              cuda_graphs="forward" if graphs else False)
            got = sample(par(**kw))
            if graphs:
                got = sample(par(**kw))  # a replay
                eager = sample(parallelize(copy.deepcopy(base), mode="agkv", transport=transport, chunks=1,
                                           cuda_graphs=False)(**kw))
                return same(got, eager)
        return close(got, want)

    def per_block():
        """compile=True, cuda_graphs=True through parallelize: each block compiled and graphed; = one device within
        bf16 rounding (Inductor fuses what eager runs op by op)."""
        import copy

        from cp_ops.integrations.diffusers import parallelize
        from diffusers_tiny import sample

        base, kw, want = tiny_wan()
        with torch.no_grad():
            par = parallelize(copy.deepcopy(base), mode="agkv", transport=transport, chunks=1, compile=True,
                              cuda_graphs=True)
            outs = []
            for _ in range(3):  # warm-up, capture, replay
                torch.compiler.cudagraph_mark_step_begin()  # as documented: the last forward's outputs may go
                outs.append(sample(par(**kw)))
        ok, e = close(outs[-1], want, tol=3e-2)
        return ok and torch.equal(outs[-1], outs[-2]), e

    checks.append(("parallelize tiny wan eager", lambda: model(False)))
    if transport == "fast":
        checks.append(("parallelize tiny wan cuda_graphs=forward", lambda: model(True)))
        checks.append(("parallelize tiny wan compile+per-block graphs", per_block))
    return checks


def _shared_body(rank, w, transport, heap, out):
    import torch.distributed as dist

    records = []
    only = os.environ.get("TEST_SHARED_DEVICE_ONLY")  # a substring of the checks to run (all when unset)
    for what, fn in _shared_checks(rank, w, transport, heap):
        if only and only not in what:
            continue
        try:
            ok, e = fn()
            records.append(dict(what=what, passed=bool(ok), max_err=e))
        except Exception as ex:  # noqa: BLE001 - recorded; the next check runs (a failed call leaves cp_ops usable)
            records.append(dict(what=what, passed=False, max_err=None,
                                error=f"{type(ex).__name__}: {str(ex).splitlines()[0][:300] if str(ex) else ''}"))
        torch.cuda.synchronize()
    every = [None] * w
    dist.all_gather_object(every, records)
    merged = []
    for i, r in enumerate(records):
        mine = [rr[i] for rr in every]
        errs = [m["max_err"] for m in mine if m["max_err"] is not None]
        tag = os.environ.get("TEST_SHARED_DEVICE_TAG", "")  # e.g. "+mps": the run's conditions
        rec = dict(world_size=w, transport=transport, heap=(heap + tag) if heap else None, what=r["what"],
                   passed=all(m["passed"] for m in mine), max_err=max(errs) if errs else None)
        bad = [(j, m["error"]) for j, m in enumerate(mine) if "error" in m]
        if bad:
            rec["error"] = f"rank {bad[0][0]}: {bad[0][1]}"
        merged.append(rec)
    if rank == 0:
        name = f"shared_{w}_{transport}_{heap or 'none'}{os.environ.get('TEST_SHARED_DEVICE_TAG', '')}.json"
        with open(os.path.join(out, name), "w") as f:
            json.dump(merged, f, indent=1)
    failed = [r for r in merged if not r["passed"]]
    assert not failed, json.dumps(failed, indent=1)


@pytest.mark.parametrize("w,transport,heap", SHARED, ids=[f"w{w}-{t}{'-' + h if h else ''}" for w, t, h in SHARED])
def test_shared_device(w, transport, heap, monkeypatch, tmp_path):
    if heap == "nvshmem" and importlib.util.find_spec("nvshmem") is None:
        pytest.skip("nvshmem4py is not installed")
    if heap:
        monkeypatch.setenv("CP_OPS_FAST_HEAP", heap)
    monkeypatch.setenv("CP_OPS_TIMEOUT_S", "60")
    run_ranks(_shared_body, w, transport, heap, _out_dir(tmp_path), timeout=540, device="one_gpu")


MESH_FAST = [(4, 2), (8, 4), (8, 2)]  # (W, the inner dim's width: the fast lane's)


@pytest.mark.parametrize("w,lane", MESH_FAST, ids=[f"w{w}-inner{n}" for w, n in MESH_FAST])
def test_shared_device_mesh_fast(w, lane, monkeypatch, tmp_path):
    """2-D meshes with transport='fast': the inner dim on the fast lane (its width set), the outer on torch."""
    monkeypatch.setenv("CP_OPS_FAST_HEAP", "ipc")
    monkeypatch.setenv("CP_OPS_FAST_LANE_WIDTH", str(lane))
    monkeypatch.setenv("TEST_SHARED_DEVICE_ONLY", "mesh")
    monkeypatch.setenv("TEST_SHARED_DEVICE_TAG", f"+mesh{lane}")
    monkeypatch.setenv("CP_OPS_TIMEOUT_S", "60")
    run_ranks(_shared_body, w, "fast", "ipc", _out_dir(tmp_path), timeout=300, device="one_gpu")


def _peer_never_arrives(rank, w, transport):
    """Rank 1 skips a call of rank 0: rank 0's wait ends within the bound (CP_OPS_TIMEOUT_S), its outputs poisoned
    (fast: NaN) and the error raised at the next check, naming the peer. The per-call rank contract is off (it would
    name the skipped call on the host first).
    Rank 0's spin shares the GPU with rank 1's work (time-slicing without MPS): rank 1 runs kernels meanwhile."""
    import time

    import torch.distributed as dist

    import cp_ops
    from cp_ops.transport import fast

    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(3)
    q, k, v = (torch.randn(1, 256, 2 * w, 128, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(3))
    cp_ops.attention(q, k, v, mode="agkv", chunks=1, transport=transport)  # both: the lane, the shape's decision
    torch.cuda.synchronize()
    dist.barrier()
    bound = float(os.environ["CP_OPS_TIMEOUT_S"])
    if rank == 0:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as e:
            out = cp_ops.attention(q, k, v, mode="agkv", chunks=1, transport=transport)
            torch.cuda.synchronize()
            assert torch.isnan(out.float()).all(), "a timed-out call's outputs are poisoned (NaN)"
            fast.check()
        took = time.monotonic() - t0
        assert took < bound + 15, took
        assert "rank 1" in str(e.value) or "peer" in str(e.value), str(e.value)
        out = os.environ.get("TEST_SHARED_DEVICE_OUT")
        if out:
            with open(os.path.join(out, "never_arrives_fast.json"), "w") as f:
                json.dump(dict(world_size=w, transport=transport, heap=os.environ.get("CP_OPS_FAST_HEAP"),
                               what="a peer that never arrives: device wait bounded, outputs NaN, raised at check",
                               passed=True, max_err=None, seconds=round(took, 1), bound_s=bound,
                               message=str(e.value)[:400]), f)
    else:
        x = torch.randn(4096, 4096, device=dev)
        t0 = time.monotonic()
        while time.monotonic() - t0 < bound + 2:  # kernels of its own while rank 0 spins
            x = (x @ x).tanh_()
        torch.cuda.synchronize()
    dist.barrier()


def test_fast_peer_never_arrives_bounded_on_a_shared_gpu(monkeypatch):
    monkeypatch.setenv("CP_OPS_FAST_HEAP", "ipc")
    monkeypatch.setenv("CP_OPS_TIMEOUT_S", "5")
    monkeypatch.setenv("CP_OPS_CHECK_RANKS", "off")
    run_ranks(_peer_never_arrives, 2, "fast", timeout=120, device="one_gpu")


def _killed(rank, w, transport):
    """Rank 1 dies before a call; rank 0 raises within seconds (fast: at the device wait's bound), naming it."""
    import time

    import torch.distributed as dist

    import cp_ops
    from cp_ops.transport import fast

    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(3)
    q, k, v = (torch.randn(1, 256, 2 * w, 128, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(3))
    cp_ops.attention(q, k, v, mode="agkv", chunks=1, transport=transport)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 1:
        os._exit(0)  # killed: no exception, no report
    time.sleep(1)
    t0 = time.monotonic()
    with pytest.raises(Exception) as e:  # noqa: B017 - the message is checked below
        cp_ops.attention(q, k, v, mode="agkv", chunks=1, transport=transport)
        torch.cuda.synchronize()
        fast.check()
    took = time.monotonic() - t0
    assert took < float(os.environ["CP_OPS_TIMEOUT_S"]) + 15, took
    assert "1" in str(e.value), str(e.value)
    out = os.environ.get("TEST_SHARED_DEVICE_OUT")
    if out:
        with open(os.path.join(out, f"killed_{transport}.json"), "w") as f:
            json.dump(dict(world_size=w, transport=transport,
                           heap=os.environ.get("CP_OPS_FAST_HEAP") if transport == "fast" else None,
                           what="kill a rank mid-call", passed=True, max_err=None, seconds=round(took, 1),
                           message=str(e.value)[:400]), f)
    os._exit(0)  # the group cannot be destroyed with a dead peer


@pytest.mark.parametrize("transport", ["torch", "fast"])
def test_killed_rank_named_on_a_shared_gpu(transport, monkeypatch):
    monkeypatch.setenv("CP_OPS_FAST_HEAP", "ipc")
    monkeypatch.setenv("CP_OPS_TIMEOUT_S", "5")
    run_ranks(_killed, 2, transport, timeout=120, device="one_gpu")


def _wan_full(rank, w, transport, heap, out):
    """Full-depth Wan2.1-1.3B (random weights), 480p 81 frames (32760 tokens), one forward through parallelize:
    every rank's output = the one-device model's (within bf16 tolerance: the blocks' matmuls see other row counts)."""
    import copy

    from cp_ops.cli import models
    from cp_ops.integrations.diffusers import parallelize

    dev = torch.device("cuda", 0)
    model, cfg = models.build(models.WAN, "1.3b", None, dev, torch.bfloat16)
    kw = models._wan_inputs(cfg, 512, 1, 21, 60, 104, dev, torch.bfloat16, torch.Generator(device=dev).manual_seed(2))
    with torch.no_grad():
        if rank == 0:
            want = model(**kw)[0]
        par = parallelize(copy.deepcopy(model) if rank == 0 else model, mode="agkv", transport=transport, chunks=1,
                          cuda_graphs=False)
        got = par(**kw)[0]
    torch.cuda.synchronize()
    if rank == 0:
        e = _err(got, want)
        rel = e / want.float().abs().max().item()
        with open(os.path.join(out, f"wan_{w}_{transport}_{heap or 'none'}.json"), "w") as f:
            json.dump(dict(world_size=w, transport=transport, heap=heap or None, what="parallelize wan1.3b full depth "
                           "480p eager", passed=rel < 2e-2, max_err=e), f)
        assert rel < 2e-2, rel


MODELS_SHARED = [(w, t, h) for w in (2, 4, 8) for t, h in (("torch", ""), ("fast", "ipc"))]
MODEL_IDS = [f"w{w}-{t}{'-' + h if h else ''}" for w, t, h in MODELS_SHARED]


@pytest.mark.parametrize("w,transport,heap", MODELS_SHARED, ids=MODEL_IDS)
def test_wan_full_depth_shared(w, transport, heap, monkeypatch, tmp_path):
    if importlib.util.find_spec("diffusers") is None:
        pytest.skip("diffusers is not installed")
    if heap:
        monkeypatch.setenv("CP_OPS_FAST_HEAP", heap)
    run_ranks(_wan_full, w, transport, heap, _out_dir(tmp_path), timeout=300, device="one_gpu")


# ---- whole models, 4 denoising steps, W = 2, 4, 8: Flux-dev at the depth 8 copies fit one GPU, full-depth Wan ------
#: double- and single-stream blocks of each kind: Flux-dev's widths (24 heads x 128, joint dim 4096) at 6 + 6 blocks
#: = 3.0e9 parameters, 5.9 GB in bf16 (full depth 19 + 38: 11.9e9, 24 GB). W = 8 ranks hold 8 copies: 47 GB, with
#: their CUDA contexts, activations and graph pools within one 80 GB H100.
FLUX_LAYERS = 6


def _fbc_hook(model):
    """The FirstBlockCache head hook of ``model`` (diffusers' ``enable_cache``), or None."""
    for m in model.modules():
        reg = getattr(m, "_diffusers_hook", None)
        hook = reg.get_hook("fbc_leader_block_hook") if reg is not None else None
        if hook is not None:
            return hook
    return None


def _steps(model, kw, spec, steps=4, cache=False):
    """``steps`` steps of the model's scheduler (``spec.scheduler``) from the latents of ``kw``; returns (final latents
    fp32, [compute decision per step] of the step cache, or [] without one). With ``cache``: the steps run in one
    cache context (as the pipelines do)."""
    import contextlib

    lat = spec.get_latents(kw).clone()
    sched = spec.scheduler()
    sched.set_timesteps(steps, device=lat.device)
    kw = dict(kw)
    tdtype = kw["timestep"].dtype
    decisions = []
    ctx = model.cache_context("cond") if cache else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        for t in sched.timesteps:
            spec.set_latents(kw, lat)
            kw["timestep"] = spec.model_timestep(t.float()).expand(lat.shape[0]).to(tdtype)
            pred = spec.predict(model, kw)
            if cache:
                decisions.append(bool(_fbc_hook(model).state_manager.get_state().should_compute))
            lat = sched.step(pred, t, lat, return_dict=False)[0]
    return lat.float(), decisions


def _fbc_threshold(model, kw, spec):
    """A FirstBlockCache threshold between the smallest and largest step-to-step metric of the one-device model's
    all-compute run: the cached run then skips at least one step and computes the first one."""
    from diffusers import FirstBlockCacheConfig
    from diffusers.hooks import first_block_cache as fbc

    metrics = []
    real = fbc.FBCHeadBlockHook._should_compute_remaining_blocks

    def spy(self, r):
        prev = self.state_manager.get_state().head_block_residual
        if prev is not None:
            metrics.append(((r - prev).abs().float().mean() / prev.abs().float().mean()).item())
        return True

    model.enable_cache(FirstBlockCacheConfig(threshold=0.0))
    fbc.FBCHeadBlockHook._should_compute_remaining_blocks = spy
    try:
        _steps(model, kw, spec, cache=True)
    finally:
        fbc.FBCHeadBlockHook._should_compute_remaining_blocks = real
        model.disable_cache()
    return (min(metrics) + max(metrics)) / 2, metrics


def _step_checks(rank, w, transport, spec, dev, dtype, config, layers, size, label):
    """(what, passed, max_err, extra) per check: ``spec`` (a :mod:`cp_ops.cli.models` spec) at ``config`` with
    ``layers`` blocks of each kind (None: the config's depth; random weights from the config, as the bound tool
    builds it), latent ``size`` = (frames, height, width), 4 steps through parallelize — eager, eager with
    FirstBlockCache, compile=True (+ cuda_graphs="forward" on the fast transport) — each rank's final latents against
    the one-device model's (rank 0 runs it; within bf16 rounding: the blocks' matmuls see other row counts, joint
    attention its keys in another order) and bitwise equal across ranks (every rank gathers the same output); the
    cached runs' skip decisions equal the one-device model's."""
    import gc

    import torch.distributed as dist
    from diffusers import FirstBlockCacheConfig

    from cp_ops.cli import models
    from cp_ops.integrations.diffusers import parallelize

    def build():
        """One rank at a time: a build holds the fp32 weights until the cast (8 ranks at once would not fit)."""
        for r in range(w):
            if r == rank:
                built = models.build(spec, config, layers, dev, dtype)  # seed 0: every build has the same weights
            dist.barrier()
        return built

    model, cfg = build()
    kw = spec.make_inputs(cfg, spec.text_tokens[config], 1, *size, dev, dtype,
                          torch.Generator(device=dev).manual_seed(4))
    ref = [None] * 5
    if rank == 0:  # the one-device model: no cache, the cache's threshold, with the cache
        want, _ = _steps(model, kw, spec)
        tau, metrics = _fbc_threshold(model, kw, spec)
        model.enable_cache(FirstBlockCacheConfig(threshold=tau))
        want_c, want_dec = _steps(model, kw, spec, cache=True)
        model.disable_cache()
        ref = [want.cpu(), tau, metrics, want_c.cpu(), want_dec]
    dist.broadcast_object_list(ref, src=0)
    want, tau, metrics, want_c, want_dec = ref
    want, want_c = want.to(dev), want_c.to(dev)
    scale = want.abs().max().item()
    results = []

    def judge(what, got, ref, extra=None, ok=True, tol=3e-2):
        every = [None] * w
        dist.all_gather_object(every, got.cpu())
        same = all(torch.equal(e, every[0]) for e in every)
        e = _err(got, ref)
        results.append((what, bool(ok and same and e / scale < tol), e, dict(extra or {}, ranks_equal=same)))

    graphs = "forward" if transport == "fast" else False  # gloo's collectives cannot be captured
    variants = [("eager", {}), ("compile=True" + (" cuda_graphs=forward" if graphs else ""),
                                dict(compile=True, cuda_graphs=graphs))]
    for name, kwargs in variants:
        if model is None:
            model, _ = build()
        par = parallelize(model, mode="agkv", transport=transport, chunks=1, **kwargs)
        got, _ = _steps(par, kw, spec)
        judge(f"parallelize {label} 4 steps {name}", got, want)
        if not graphs or not kwargs:  # a step cache decides on the host: a whole-forward graph cannot hold it
            par.enable_cache(FirstBlockCacheConfig(threshold=tau))
            try:
                got, dec = _steps(par, kw, spec, cache=True)
            finally:
                par.disable_cache()
            judge(f"parallelize {label} 4 steps {name} + FirstBlockCache", got, want_c,
                  dict(decisions=dec, want_decisions=want_dec, threshold=tau),
                  ok=dec == want_dec and not all(want_dec))  # the cache skipped a step: the check is not vacuous
        del par, model
        model = None
        gc.collect()  # the hooks' reference cycles: two copies per rank would not fit at W = 8
        torch.cuda.empty_cache() if dev.type == "cuda" else None
    return results, dict(metrics=metrics, want_decisions=want_dec)


def _steps_body(rank, w, transport, heap, out, name, spec_name, config, layers, size, label):
    """:func:`_step_checks` on the shared GPU in bf16; rank 0 writes the records, every check must pass."""
    from cp_ops.cli import models

    dev = torch.device("cuda", 0)
    res, info = _step_checks(rank, w, transport, models.MODELS[spec_name], dev, torch.bfloat16, config, layers, size,
                             label)
    recs = [dict(world_size=w, transport=transport, heap=heap or None, what=what, passed=ok, max_err=e, **extra)
            for what, ok, e, extra in res]
    if rank == 0:
        with open(os.path.join(out, f"{name}_{w}_{transport}_{heap or 'none'}.json"), "w") as f:
            json.dump(recs, f, indent=1)
    failed = [r for r in recs if not r["passed"]]
    assert not failed, json.dumps(dict(failed=failed, **info), indent=1)


def _steps_shared(heap, monkeypatch):
    """What both 4-step model tests need before their ranks start."""
    if importlib.util.find_spec("diffusers") is None:
        pytest.skip("diffusers is not installed")
    if heap:
        monkeypatch.setenv("CP_OPS_FAST_HEAP", heap)


@pytest.mark.parametrize("w,transport,heap", MODELS_SHARED, ids=MODEL_IDS)
def test_flux_dev_steps_shared(w, transport, heap, monkeypatch, tmp_path):
    _steps_shared(heap, monkeypatch)
    run_ranks(_steps_body, w, transport, heap, _out_dir(tmp_path), "flux", "flux", "dev", FLUX_LAYERS, (1, 128, 128),
              f"flux-dev {FLUX_LAYERS}+{FLUX_LAYERS} blocks 1024x1024", timeout=420, device="one_gpu")


@pytest.mark.parametrize("w,transport,heap", MODELS_SHARED, ids=MODEL_IDS)
def test_wan_steps_shared(w, transport, heap, monkeypatch, tmp_path):
    """Full-depth Wan2.1-1.3B at 480p, 81 frames (32760 tokens), 4 UniPC steps: as the Flux test."""
    _steps_shared(heap, monkeypatch)
    run_ranks(_steps_body, w, transport, heap, _out_dir(tmp_path), "wansteps", "wan", "1.3b", None, (21, 60, 104),
              "wan1.3b full depth 480p", timeout=540, device="one_gpu")
