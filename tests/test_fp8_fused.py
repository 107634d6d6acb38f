"""FP8 communication with the codec fused into the layouts (issue 24 item 1): the Ulysses encode writes the send
buffer itself and the decode writes the unpacked layout; AGKV encodes K and V in one pass and decodes the gathered
buffers (only the real rows, with uneven shards) in one pass (:func:`cp_ops.kernels.fp8.encode_into` /
:func:`~cp_ops.kernels.fp8.decode_into`, used by :class:`cp_ops.comm.DirectComm`).

The fused path must give bitwise what the unfused one gave (encode, pack, move, decode, unpack: the codec is per row,
so only where the bytes go changes): on gloo ranks W = 2, 3, 4, even and uneven, every format grouping, against the
unfused path of the same comm (a transport without ``all_to_all_packed``) and against the round trip of the full
tensors. The Triton kernels: in the interpreter (CPU, where Triton is installed) and on CUDA (gpu-marked), bitwise
against the torch version.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from cp_ops import comm_dtype as cd
from cp_ops import layout
from cp_ops.comm import DirectComm
from cp_ops.kernels import fp8
from cp_ops.transport.torch import transport as torch_transport
from dist_util import run_ranks

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
CPU = torch.device("cpu")


class _Unfused:
    """The torch transport without ``all_to_all_packed``: the comm encodes, the transport packs (the unfused path)."""

    def __getattr__(self, name):
        if name == "all_to_all_packed":
            raise AttributeError(name)
        return getattr(torch_transport, name)


def _comm(pg, tr, fmts):
    c = DirectComm(pg, tr)  # armed False, transport given: no rank-contract exchange (the tests' own calls)
    c.fmts = fmts
    return c


def _full(shape, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(*shape[:-1], 1, generator=g) * 2)
    return x.to(dtype)


def _rt(x, f):
    return fp8.round_trip(x, f) if f else x


def _ranks(rank, w):
    pg = dist.group.WORLD
    b, h, d = 2, 2 * w, 24
    hl = h // w
    for seq in ((5,) * w, layout.shard_sizes(4 * w + 1, w), (0,) + tuple(range(3, 3 + w - 1))):
        total = sum(seq)
        sh = layout.Shards(seq, w, rank, seq[rank], CPU)
        full = [_full((b, total, h, d), seed=100 * w + 7 * i + total) for i in range(3)]
        mine = [layout.shard(x, 1, rank, w, seq_lens=seq) for x in full]
        if rank == 1:  # a strided input (q as a view of a wider tensor), as a projection's split gives
            wider = torch.cat([mine[0], mine[0][:, :, :1]], dim=2)
            mine[0] = wider[:, :, :h]
        padded = [sh.pad(x) for x in mine]
        for c in (E4, E5, {"q": E4, "v": E4, "o": E4}, {"k": E4, "v": E4}, {"k": E5, "v": E4}, {"o": E5}):
            fmts = cd.for_mode(cd.normalize(c, torch.bfloat16), "ulysses")
            for lo, hi in ((0, hl), (1, 2)):
                fused = _comm(pg, torch_transport, fmts).ulysses(padded, lo, hi)
                plain = _comm(pg, _Unfused(), fmts).ulysses(padded, lo, hi)
                got = sh.ulysses_rows(fused.wait(), layout.ulysses_unpack_all)  # the real rows (padding: never written)
                ref = sh.ulysses_rows(plain.wait(), layout.ulysses_unpack_all)
                assert all(torch.equal(a, r) for a, r in zip(got, ref)), (w, seq, c, lo, hi)
                for i, (x, t) in enumerate(zip(full, got)):
                    heads = _rt(x, fmts[i])[:, :, rank * hl + lo:rank * hl + hi]
                    assert torch.equal(t, heads), (w, seq, c, lo, hi, i)
                    assert t.is_contiguous(), "the unpacked slots are views of one contiguous tensor"
            # the way back: this rank's heads of every token (re-padded) → its tokens of every head
            o_full = _full((b, total, h, d), seed=5 + total)
            mine_o = sh.repad(o_full[:, :, rank * hl:(rank + 1) * hl])
            outs = [sh.inverse_rows(_comm(pg, tr, fmts).ulysses_inverse(mine_o).wait())
                    for tr in (torch_transport, _Unfused())]
            assert torch.equal(outs[0], outs[1]), (w, seq, c, "inverse")
            assert torch.equal(outs[0], layout.shard(_rt(o_full, fmts[3]), 1, rank, w, seq_lens=seq))
        # AGKV: K and V in one format (its rule), the real rows selected inside the decode
        for c in (E4, E5):
            fmts = cd.for_mode(cd.normalize(c, torch.bfloat16), "agkv")
            for rows in (sh, None):
                kf, vf, _ = _comm(pg, torch_transport, fmts).agkv(padded[1], padded[2], rows=rows).wait()
                if rows is None:
                    kf, vf = sh.rows(kf), sh.rows(vf)
                assert torch.equal(kf, _rt(full[1], fmts[1])) and torch.equal(vf, _rt(full[2], fmts[2])), (w, seq, c)
        # no FP8: the rows argument selects (the body no longer does)
        kf, vf, _ = _comm(pg, torch_transport, cd.NONE).agkv(padded[1], padded[2], rows=sh).wait()
        assert torch.equal(kf, full[1]) and torch.equal(vf, full[2])


@pytest.mark.parametrize("w", [2, 3, 4])
def test_fused_equals_unfused_on_gloo_ranks(w):
    run_ranks(_ranks, w)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_strided_codec_torch_version(fmt, dtype):
    """encode_into / decode_into (the torch version on CPU) against encode/decode and a stack/permute/index_select."""
    assert fp8.strided_rule(fp8.encode_into, fp8.decode_into, dtype, fmt, CPU) is None


def test_strided_codec_rejects_bad_input():
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="same leading dims"):
        fp8.encode_into([x], [torch.empty(2, 4, 12, dtype=torch.uint8)], "e4m3")
    with pytest.raises(ValueError, match="uint8"):
        fp8.encode_into([x], [torch.empty(2, 3, 12)], "e4m3")
    with pytest.raises(ValueError, match="one output per input"):
        fp8.decode_into([fp8.encode(x, "e4m3")], [], "e4m3")
    with pytest.raises(ValueError, match="same leading dims"):
        fp8.decode_into([torch.empty(1, 2, 3, 4, 5, 6, 12, dtype=torch.uint8)],
                        [torch.empty(1, 2, 3, 4, 5, 6, 8)], "e4m3")
    enc = fp8.encode(x, "e4m3")
    with pytest.raises(ValueError, match="share one dtype"):
        fp8.decode_into([enc, enc], [torch.empty(2, 3, 8), torch.empty(2, 3, 8, dtype=torch.bfloat16)], "e4m3")


def test_strided_kernels_in_the_interpreter_equal_torch():
    """The one Triton kernel (every layout, the gather) bitwise against the torch version in Triton's CPU interpreter,
    on Ulysses-shaped buffers: skipped where Triton is not installed (CI's CPU-only torch)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    code = (
        "import torch\n"
        "from cp_ops.kernels import fp8\n"
        "from cp_ops import layout\n"
        "enc = lambda a, o, f: fp8._launch(a, o, f, True)\n"
        "dec = lambda a, o, f, index=None: fp8._launch(a, o, f, False, index)\n"
        "for dt in (torch.float32, torch.bfloat16, torch.float16):\n"
        "    for f in ('e4m3', 'e5m2'):\n"
        "        assert fp8.strided_rule(enc, dec, dt, f, torch.device('cpu')) is None, (dt, f)\n"
        "torch.manual_seed(0)\n"
        "w, b, s, h, d = 4, 2, 3, 8, 64\n"
        "xs = [torch.randn(b, s, h, d).bfloat16() for _ in range(3)]\n"
        "hl = h // w\n"
        "send = torch.empty(w, b, s, 3, hl, d + 4, dtype=torch.uint8)\n"
        "enc([x.unflatten(2, (w, hl)).permute(2, 0, 1, 3, 4) for x in xs], [send[:, :, :, i] for i in range(3)], "
        "'e4m3')\n"
        "ref = layout.ulysses_pack([fp8.encode_torch(x, 'e4m3') for x in xs], w)\n"
        "assert torch.equal(send, ref)\n"
        "out = torch.empty(3, b, w, s, hl, d, dtype=torch.bfloat16)\n"
        "dec([ref[:, :, :, i] for i in range(3)], [out[i].transpose(0, 1) for i in range(3)], 'e4m3')\n"
        "want = [t.contiguous() for t in layout.ulysses_unpack_all(fp8.decode_torch(ref, torch.bfloat16, 'e4m3'))]\n"
        "got = layout.ulysses_unpack_all(out.permute(2, 1, 3, 0, 4, 5))\n"
        "assert all(torch.equal(a, b) for a, b in zip(got, want))\n"
        "assert fp8.self_test(torch.device('cpu')) is None\n"
        "print('ok')\n")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


ONE_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@ONE_CUDA
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # fp16: the self-test (use_triton) checks it
@pytest.mark.parametrize("w,b,s,h,d", [(2, 1, 2048, 24, 128), (8, 2, 333, 40, 128), (4, 1, 77, 12, 64)])
def test_fused_kernels_equal_torch_cuda(fmt, dtype, w, b, s, h, d):
    """The fused Triton passes on CUDA, bitwise against the unfused torch version: the Ulysses pack of q, k, v (q a
    strided view), its unpack, heads [1, 2) of each group (pipelined), the inverse pack, the AGKV gather's rows."""
    dev = torch.device("cuda")
    assert fp8.use_triton(dev), fp8.self_test(dev)
    g = torch.Generator(device=dev).manual_seed(3)
    wide = (torch.randn(b, s, h + 2, d, generator=g, device=dev) * 3).to(dtype)
    xs = [wide[:, :, 1:h + 1]] + [(torch.randn(b, s, h, d, generator=g, device=dev) * 3).to(dtype) for _ in range(2)]
    hl = h // w
    for lo, hi in ((0, hl), (1, 2)):
        send = torch.empty(w, b, s, 3, hi - lo, d + 4, dtype=torch.uint8, device=dev)
        views = [x.unflatten(2, (w, hl))[:, :, :, lo:hi].permute(2, 0, 1, 3, 4) for x in xs]
        fp8.encode_into(views, [send[:, :, :, i] for i in range(3)], fmt)
        ref = layout.ulysses_pack([fp8.encode_torch(layout.ulysses_heads(x, w, lo, hi), fmt) for x in xs], w)
        assert torch.equal(send, ref), (lo, hi, (send != ref).sum().item())
        out = torch.empty(3, b, w, s, hi - lo, d, dtype=dtype, device=dev)
        fp8.decode_into([ref[:, :, :, i] for i in range(3)], [out[i].transpose(0, 1) for i in range(3)], fmt)
        want = layout.ulysses_unpack_all(fp8.decode_torch(ref, dtype, fmt))
        assert all(torch.equal(a, c) for a, c in zip(layout.ulysses_unpack_all(out.permute(2, 1, 3, 0, 4, 5)), want))
    o = xs[0].transpose(1, 2).contiguous().transpose(1, 2)[:, :, :hl]  # SDPA's output: a transposed view
    send = torch.empty(w, b, s // w, hl, d + 4, dtype=torch.uint8, device=dev)
    sb, ss, sh, sd = o.stride()
    fp8.encode_into([o[:, :w * (s // w)].as_strided((w, b, s // w, hl, d), ((s // w) * ss, sb, ss, sh, sd),
                                                    o.storage_offset())], [send], fmt)
    assert torch.equal(send, layout.ulysses_inverse_pack(fp8.encode_torch(o[:, :w * (s // w)], fmt), w))
    enc = fp8.encode_torch(xs[1], fmt)
    idx = torch.randperm(s, generator=g, device=dev)[: s - 3]
    kf = torch.empty(b, s - 3, h, d, dtype=dtype, device=dev)
    fp8.decode_into([enc], [kf], fmt, index=(1, idx))
    assert torch.equal(kf, fp8.decode_torch(enc, dtype, fmt).index_select(1, idx))
