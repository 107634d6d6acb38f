"""The torch transport staged through host memory (a group running CUDA tensors over gloo, whose coalesced all-gather
and send/recv have no CUDA path): forced on for CPU gloo ranks here, every mode body's result equals the unstaged
transport's bitwise (the same kernels on the same gathered data; pipelined variants too: the staged exchange lands
the same pieces, so the same stages), and every launch went through the staging; a rank that stages pairs with one
that does not."""

import torch

import cp_ops
from dist_util import run_ranks

VARIANTS = [("agkv", 1), ("agkv", 2), ("agkv", 3), ("agkv", 5), ("ulysses", 1), ("ulysses", 2)]


def _calls(seq, mask, rank, w, q, k, v):
    sl = slice(sum(seq[:rank]), sum(seq[:rank + 1]))
    outs = [cp_ops.attention(q[:, sl], k[:, sl], v[:, sl], mode=m, chunks=c, transport="torch", seq_lens=seq)
            for m, c in VARIANTS]
    outs += [cp_ops.attention(q[:, sl], k[:, sl], v[:, sl], mode=m, transport="torch", seq_lens=seq,
                              key_mask=mask[:, sl]) for m in ("agkv", "ulysses")]
    return outs


def _staged_equals_unstaged(rank, w):
    from cp_ops.transport import torch as tt

    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 96, 4, 16, generator=g) for _ in range(3))
    mask = torch.rand(2, 96, generator=g) > 0.3
    mask[:, 0] = True
    even, uneven = (48, 48), (53, 43)
    plain = [_calls(seq, mask, rank, w, q, k, v) for seq in (even, uneven)]
    staged_calls = []
    real_staged = tt._staged

    def counted(launch, *args):
        staged_calls.append(launch.__name__)
        return real_staged(launch, *args)

    tt.stage_through_host, tt._staged = (lambda group, device: True), counted
    staged = [_calls(seq, mask, rank, w, q, k, v) for seq in (even, uneven)]
    assert {"_agkv_gather", "_alltoall_base"} <= set(staged_calls), staged_calls
    for a, b in zip(plain, staged):  # pipelined too: the staged exchange lands the same pieces (the same stages)
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), (i, (x - y).abs().max().item())
    # traced: the ops register the staged launch's work with its outputs (a dist.Work), waited by wait_tensor
    x = q[:, rank * 48:(rank + 1) * 48].contiguous()
    for m in ("agkv", "ulysses"):
        block = lambda t: cp_ops.attention(t * 0.5, t, t, mode=m, transport="torch")  # noqa: E731
        del staged_calls[:]
        traced = torch.compile(block, fullgraph=True, backend="aot_eager")(x)
        assert staged_calls and torch.equal(traced, block(x)), (m, staged_calls)
    sl = slice(0, 53) if rank == 0 else slice(53, 96)  # and the staged results are right, not only the same
    ref = cp_ops.local_attention(q, k, v, key_mask=mask)[:, sl]
    assert torch.allclose(staged[1][-2], ref, atol=1e-5, rtol=1e-4)


def test_staged_through_host_equals_unstaged():
    run_ranks(_staged_equals_unstaged, 2)


def _one_rank_stages(rank, w):
    """Only rank 0 stages (a peer whose tensors the group moves where they are): every variant's launches pair with
    the peers' (the same collectives, the same point-to-point sends) and give the unstaged results bitwise."""
    from cp_ops.transport import torch as tt

    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 3 * 40, 6, 16, generator=g) for _ in range(3))
    mask = torch.rand(1, 3 * 40, generator=g) > 0.3
    mask[:, 0] = True
    seq = (40, 40, 40)
    plain = _calls(seq, mask, rank, w, q, k, v)
    if rank == 0:
        tt.stage_through_host = lambda group, device: True
    staged = _calls(seq, mask, rank, w, q, k, v)
    for i, (x, y) in enumerate(zip(plain, staged)):
        assert torch.equal(x, y), (rank, i, (x - y).abs().max().item())


def test_a_rank_that_stages_pairs_with_one_that_does_not(monkeypatch):
    monkeypatch.setenv("CP_OPS_TIMEOUT_S", "30")  # a mispaired exchange fails within it, not at the test's timeout
    run_ranks(_one_rank_stages, 3, timeout=120)


def test_stage_through_host_only_for_a_gpu_over_gloo():
    from cp_ops.transport.torch import stage_through_host

    class _Gloo:  # named as torch names gloo's backend class
        pass

    _Gloo.__name__ = "ProcessGroupGloo"

    class _Group:
        def __init__(self, backend):
            self.backend = backend

        def _get_backend(self, device):
            if self.backend is None:
                raise RuntimeError("no backend for " + device.type)
            return self.backend

    cuda = torch.device("cuda", 0)
    assert stage_through_host(_Group(_Gloo()), cuda)
    assert not stage_through_host(_Group(_Gloo()), torch.device("cpu"))
    assert not stage_through_host(_Group(object()), cuda)  # NCCL, fake: moved where they are
    assert not stage_through_host(_Group(None), cuda)


def test_stage_through_host_sees_through_the_debug_wrapper():
    """``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wraps every backend in a ``_ProcessGroupWrapper`` (its collectives checked,
    then run on the wrapped backend): a gloo group running CUDA tensors under it is still staged (else gloo's
    missing CUDA path again); a real gloo group of one rank, the wrapper as torch builds it."""
    import torch.distributed as dist

    from cp_ops.transport.torch import stage_through_host

    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            group = dist.group.WORLD
            backend = group._get_backend(torch.device("cuda", 0))
            assert type(backend).__name__ == "_ProcessGroupWrapper", type(backend)
            assert stage_through_host(group, torch.device("cuda", 0))
            assert not stage_through_host(group, torch.device("cpu"))
        finally:
            dist.destroy_process_group()
    finally:
        dist.set_debug_level(level)
