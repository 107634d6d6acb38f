"""Ulysses under torch.compile packs its send buffers in traced torch code (cp_ops.layout.ulysses_pack_traced) and
moves them with ``cp_ops::ulysses_packed_start``, K/V first, then Q (cp_ops.comm.OpComm.ulysses): on real 2-rank
gloo groups, compiled = eager bitwise (the same bytes reach the same attention calls) and = single-device SDPA,
at chunks 1 and 2 (pipelined sub-groups), even and uneven shards, with and without a key mask."""

import torch
import torch.distributed as dist

import cp_ops
from cp_ops import layout
from cp_ops.kernels import local_attention as masked_attention
from dist_util import run_ranks


def _cases(rank, w):
    pg = dist.group.WORLD
    b, h, d = 1, 4 * w, 8
    graphs = []

    def backend(gm, example_inputs):  # Dynamo + AOTAutograd's graph, run as traced: the traced path, cheap on CPU
        from torch._dynamo.backends.common import aot_autograd

        graphs.append(gm)
        return aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

    for seed, (total, masked, chunks) in enumerate([(16, False, 1), (16, False, 2), (13, True, 1), (16, True, 1)]):
        seq = layout.shard_sizes(total, w)
        g = torch.Generator().manual_seed(1000 + seed)  # the same full inputs on every rank, fresh per case
        q, k, v = (torch.randn(b, total, h, d, generator=g) for _ in range(3))
        mask = torch.rand(b, total, generator=g) > 0.4 if masked else None
        sh = lambda t: layout.shard(t, 1, rank, w, seq_lens=seq)  # noqa: E731
        kw = {"seq_lens": seq} if total % w else {}
        if masked:
            kw["key_mask"] = sh(mask)

        def fn(q, k, v):
            return cp_ops.attention(q, k, v, group=pg, mode="ulysses", chunks=chunks, **kw)

        with torch.no_grad():
            eager = fn(sh(q), sh(k), sh(v))
            torch._dynamo.reset()
            compiled = torch.compile(fn, fullgraph=True, backend=backend)(sh(q), sh(k), sh(v))
        assert torch.equal(compiled, eager), (total, masked, chunks, (compiled - eager).abs().max().item())
        ref = sh(masked_attention(q, k, v, None, mask))  # one device, all keys
        torch.testing.assert_close(eager, ref, rtol=1e-5, atol=1e-5)
        assert ref.abs().max() > 0.1
        launches = [n for n in graphs[-1].graph.nodes if n.op == "call_function" and "ulysses" in str(n.target)]
        # per sub-group: K/V's packed launch, then Q's; then the inverse(s)
        names = [str(n.target).split(".")[1] for n in launches]
        g_count = min(chunks, h // w)
        assert names.count("ulysses_packed_start") == 2 * g_count, names
        assert "ulysses_start" not in names, names


def test_traced_pack_compiled_equals_eager_and_single_device():
    run_ranks(_cases, 2)
