"""Faults a user can hit, each on real gloo ranks: an error on every rank that names the cause, within a
bound — never wrong numbers, a hang until the timeout, a crash, or a leak."""

from __future__ import annotations

import errno
import logging
import os
import time

import pytest
import torch
import torch.distributed as dist

import cp_ops
from cp_ops import config
from dist_util import run_ranks

H, D = 4, 8


def _shards(rank, w, s_local, seed):
    """q, k, v: this rank's block of a global [1, W*s_local, H, D] tensor, and the global k, v."""
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(1, w * s_local, H, D, generator=g) for _ in range(3)]
    return [x[:, rank * s_local:(rank + 1) * s_local].contiguous() for x in full], full


def _attend(rank, w, seed, group=None, **kw):
    """One CP attention call on fresh inputs, compared with the single-device result."""
    (q, k, v), (_, kf, vf) = _shards(rank, w, 8, seed)
    kw = {"mode": "agkv", "transport": "torch", "chunks": 1, **kw}
    out = cp_ops.attention(q, k, v, group=group, **kw)
    torch.testing.assert_close(out, cp_ops.local_attention(q, kf, vf), rtol=1e-5, atol=1e-5)


def _dead_in(rank: int = 1) -> str:
    """The words naming a peer that exited."""
    return rf"rank {rank} \(global rank {rank}, pid \d+ on [^)]*\) exited"


def _wan_inputs():
    import diffusers_tiny

    return diffusers_tiny.inputs("wan", 1, (2, 4, 4), 6, torch.Generator().manual_seed(0))


# ---- a rank skips one layer's attention ------------------------------------------------------------
def _skip_layer(rank, w):
    layers = ("blocks.0.attn1", "blocks.1.attn1")  # two layers of one shape: identical signatures but for the tag
    for mode, chunks, seq_lens in (("agkv", 1, None), ("ulysses", 1, None), ("agkv", 2, None), ("agkv", 1, (8, 8))):
        kw = dict(mode=mode, chunks=chunks, seq_lens=seq_lens)
        for i, name in enumerate(layers):  # in step: correct
            _attend(rank, w, i, tag=name, **kw)
        (q, k, v), _ = _shards(rank, w, 8, 5)
        # rank 1 skips layer 0 (an `if` on its local data): its layer-1 call meets rank 0's layer-0 call
        mine = layers[0] if rank == 0 else layers[1]
        with pytest.raises(ValueError, match=r"differ in variant: rank 0: .* tag=blocks\.0\.attn1.*; rank 1: .* "
                                             r"tag=blocks\.1\.attn1.*a rank skipped a layer's attention"):
            cp_ops.attention(q, k, v, transport="torch", tag=mine, **kw)
        _attend(rank, w, 6, tag=layers[1], **kw)  # nothing moved, the call numbers stay paired: the group works
    # untagged calls are unchanged, a tag of ints works as well
    _attend(rank, w, 7)
    _attend(rank, w, 8, tag=("block", 3))


def test_a_rank_skipping_one_layer_raises_on_every_rank_at_that_call():
    run_ranks(_skip_layer, 2)


def _skip_layer_parallelize(rank, w):
    import diffusers_tiny

    from cp_ops.integrations.diffusers import dispatch, parallelize

    model = parallelize(diffusers_tiny.build("wan"), mode="agkv", transport="torch", chunks=1)
    real, seen = dispatch.attention, []

    def skip_first_on_rank_1(q, k, v, **kw):  # rank 1 skips its first attention call (layer 0): a per-rank `if`
        seen.append(kw.get("tag"))
        if rank == 1 and len(seen) == 1:
            return cp_ops.local_attention(q, k, v)
        return real(q, k, v, **kw)

    dispatch.attention = skip_first_on_rank_1
    want = r"differ in variant: rank 0: .*tag=blocks\.0\.attn1.*rank 1: .*tag=blocks\.1\.attn1"
    with torch.no_grad(), pytest.raises(ValueError, match=want):
        model(**_wan_inputs())
    # raised at the first mispaired call (layer 0 on rank 0), not at the output gather after the last layer
    assert len(seen) == 2 - (rank == 0), seen


def test_parallelize_tags_each_attention_module():
    pytest.importorskip("diffusers")
    run_ranks(_skip_layer_parallelize, 2)


# ---- a dead or absent peer ------------------------------------------------------------------------
def _peer_exits(rank, w, use_shm):
    from cp_ops import contract

    contract._USE_SHM = use_shm
    _attend(rank, w, 0)
    if rank == 1:
        os._exit(0)  # dies without a word (its parent reaps it only later: a zombie meanwhile)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=_dead_in() + r".* while this rank waited for it"):
        _attend(rank, w, 1)
    took = time.monotonic() - t0
    assert took < 5.0, f"a dead peer took {took:.1f} s to notice (CP_OPS_TIMEOUT_S={config.settings.timeout_s:g})"
    print(f"dead peer noticed in {took:.2f} s ({'shared memory' if use_shm else 'gloo'})")
    # the group is unusable from now on: every later call says so at once
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=_dead_in()):
        _attend(rank, w, 2)
    assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "gloo"])
def test_a_peer_that_exits_is_noticed_within_seconds(use_shm):
    run_ranks(_peer_exits, 2, use_shm)


def _only_rank_0_runs_the_model(rank, w):
    import diffusers_tiny

    from cp_ops.integrations.diffusers import parallelize

    model = parallelize(diffusers_tiny.build("wan"), mode="agkv", transport="torch")
    if rank == 1:
        return  # exits cleanly, never running the forward (its teardown: seconds on a busy machine)
    config.configure(timeout_s=120.0)
    t0 = time.monotonic()
    with torch.no_grad(), pytest.raises(RuntimeError, match=_dead_in()):
        model(**_wan_inputs())
    took = time.monotonic() - t0
    assert took < 30.0, took  # rank 1's exit + at most 0.25 s; the timeout would be 120 s and say so
    print(f"absent peer noticed in {took:.2f} s")


def test_a_peer_that_exits_before_the_first_call_is_noticed():
    pytest.importorskip("diffusers")
    run_ranks(_only_rank_0_runs_the_model, 2)


def _dies_while_mapping(rank, w):
    import uuid

    from cp_ops import _shm_exchange

    name = uuid.UUID(int=1234567 + os.getppid())  # the file's name, known to the test
    _shm_exchange.uuid.uuid4 = lambda: name
    if rank == 1:
        def die(*args, **kw):
            os._exit(0)

        _shm_exchange.ShmExchange.attach = die
        _attend(rank, w, 0)
        return
    path = f"/dev/shm/cp_ops_rank_check_{name.hex}"
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"CP group '0'.*" + _dead_in()):
        _attend(rank, w, 0)
    took = time.monotonic() - t0
    assert took < 5.0, took
    print(f"peer dying while mapping noticed in {took:.2f} s")
    assert not os.path.exists(path), f"{path} left behind"


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_a_peer_dying_while_mapping_the_shared_memory_gives_a_clean_error():
    run_ranks(_dies_while_mapping, 2)


# ---- a retry after a first-call timeout -------------------------------------------------------------
def _retry(rank, w):
    config.configure(timeout_s=4.0)
    if rank == 1:
        time.sleep(6.0)  # late: rank 0's first call has timed out and its retry waits
    else:
        with pytest.raises(RuntimeError, match=r"cp_ops\.attention call #1 on CP group '0': rank 1 \(global rank 1"
                                               r".*did not arrive within CP_OPS_TIMEOUT_S=4 s(.|\n)*calling again waits"):
            _attend(rank, w, 0)
    _attend(rank, w, 0)  # rank 0 retries and meets the late rank 1
    for seed in (1, 2):
        _attend(rank, w, seed, mode="ulysses")


def test_a_retry_after_a_first_call_timeout_works():
    run_ranks(_retry, 2)


# ---- /dev/shm full ---------------------------------------------------------------------------------
def test_dev_shm_full_is_an_oserror_naming_it(monkeypatch):
    import uuid

    from cp_ops import _shm_exchange

    name = uuid.UUID(int=7654321 + os.getpid())
    monkeypatch.setattr(_shm_exchange.uuid, "uuid4", lambda: name)

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full, raising=False)
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with pytest.raises(OSError, match=rf"cannot reserve \d+ bytes in {base or '.*'} .*No space left on device"):
        _shm_exchange.ShmExchange.create(2, 18)
    if base:
        assert not os.path.exists(f"{base}/cp_ops_rank_check_{name.hex}")


def _shm_full(rank, w):
    from cp_ops import contract

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logging.getLogger("cp_ops").addHandler(Keep())
    if rank == 0:
        def full(fd, offset, size):
            raise OSError(errno.ENOSPC, "No space left on device")

        os.posix_fallocate = full  # /dev/shm full on rank 0's side (it makes the file)
    for seed in range(3):
        _attend(rank, w, seed)
    st = contract._groups[dist.group.WORLD.group_name]
    assert st.shm is None and st.side is not None  # the gloo side group carries the exchange on every rank
    assert any("instead of host shared memory" in m and "/dev/shm" in m and "No space left" in m for m in seen), seen


def test_dev_shm_full_falls_back_to_gloo_on_every_rank():
    run_ranks(_shm_full, 2)


# ---- transport='auto' with mixed availability ------------------------------------------------------
class StandIn:
    """A transport preferred by 'auto' whose availability this rank decides; it moves data as the torch one."""

    name = "stand_in"
    pooled_outputs = False
    slots_per_key = None
    device_types = ("cpu",)

    def __init__(self, here: bool):
        from cp_ops.transport import torch as torch_transport

        self.here, self.used, self.inner = here, 0, torch_transport.transport

    def unavailable_reason(self, device):
        return None if self.here else "the stand-in cannot run on this rank"

    def group_reason(self, group, device):
        return self.unavailable_reason(device)  # not agreed by itself: for_group must agree for it

    def agkv_start(self, k, v, group):
        self.used += 1
        return self.inner.agkv_start(k, v, group)

    def ulysses_start(self, xs, group):
        self.used += 1
        return self.inner.ulysses_start(xs, group)

    def ulysses_inverse_start(self, x, group):
        self.used += 1
        return self.inner.ulysses_inverse_start(x, group)


def _auto_mixed(rank, w):
    from cp_ops.transport import base

    t = base.register(StandIn(here=rank == 0), auto_rank=0)
    for mode in ("agkv", "ulysses"):
        _attend(rank, w, 0, mode=mode, transport="auto")
    assert base.for_group("auto", dist.group.WORLD, torch.device("cpu")).name == "torch"
    assert t.used == 0
    t.here = True  # available on every rank: a new group takes it, on every rank
    g = dist.new_group(list(range(w)))
    for mode in ("agkv", "ulysses"):
        _attend(rank, w, 1, group=g, mode=mode, transport="auto")
    assert base.for_group("auto", g, torch.device("cpu")).name == "stand_in" and t.used >= 2


def test_auto_with_a_transport_only_some_ranks_can_run_falls_back_to_torch_on_every_rank():
    run_ranks(_auto_mixed, 2)


# ---- per-group leak -------------------------------------------------------------------------------
def _held():
    fds = len(os.listdir("/proc/self/fd"))
    threads = len(os.listdir("/proc/self/task"))
    with open("/proc/self/maps") as f:
        maps = sum("cp_ops_rank_check" in line for line in f)
    return fds, threads, maps


def _group_churn(rank, w):
    for i in range(21):
        g = dist.new_group(list(range(w)))
        _attend(rank, w, i, group=g)
        dist.destroy_process_group(g)
        if i == 0:
            first = _held()
    last = _held()
    grown = [b - a for a, b in zip(first, last)]
    assert grown[0] <= 2 and grown[1] <= 0 and grown[2] <= 0, \
        f"20 groups made, used once and destroyed added {grown} (fds, threads, shared-memory maps)"


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self entries")
def test_destroyed_groups_release_what_cp_ops_made_for_them():
    run_ranks(_group_churn, 2)


# ---- a rank fails (or dies) inside a call, after its exchange: its peers raise at once, naming it --------------
def _fails_inside(rank, w, how):
    import datetime

    from cp_ops.modes import ulysses

    config.configure(timeout_s=60.0)  # the failure is named at once, never waited out
    store = dist.distributed_c10d._get_default_store()
    _attend(rank, w, 0, mode="ulysses", chunks=2)
    real, n = ulysses.local_attention, [0]

    def second_chunk_fails(*a, **kw):  # rank 1's attention of the call's second chunk: both all-to-alls of the
        n[0] += 1                      # first chunk made, the second chunk's inverse never
        if rank == 1 and n[0] == 2:
            if how == "exits":
                os._exit(0)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*a, **kw)

    ulysses.local_attention = second_chunk_fails
    t0 = time.monotonic()
    if rank == 1:
        with pytest.raises(torch.OutOfMemoryError):
            _attend(rank, w, 1, mode="ulysses", chunks=2)
        store.wait(["rank0_done"], datetime.timedelta(seconds=60))  # alive while rank 0 waits
        return
    said = r"raised OutOfMemoryError: CUDA out of memory \(simulated\)" if how == "raises" else r"exited( \([^)]*\))?"
    with pytest.raises(RuntimeError, match=r"cp_ops\.attention call #2 on CP group '0': rank 1 \(global rank 1[^)]*\) "
                                           + said + r" during this call's communication"):
        _attend(rank, w, 1, mode="ulysses", chunks=2)
    took = time.monotonic() - t0
    assert took < 10.0, f"rank 1's failure took {took:.1f} s to reach rank 0 (CP_OPS_TIMEOUT_S=60)"
    print(f"a peer that {how} inside a call: named in {took:.2f} s")
    with pytest.raises(RuntimeError, match="cannot be used by cp_ops any more"):  # out of step: said at once
        _attend(rank, w, 2, mode="ulysses", chunks=2)
    store.set("rank0_done", "1")


@pytest.mark.parametrize("how", ["raises", "exits"])
def test_a_peer_that_fails_inside_a_pipelined_call_is_named_at_once(how):
    run_ranks(_fails_inside, 2, how)


# ---- a 2-D mesh recovers when a rank reaches its first call late ---------------------------------------------
def _mesh_late(rank, w):
    from torch.distributed.device_mesh import init_device_mesh

    config.configure(timeout_s=3.0, wait_warn_s=100.0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("agkv", "ulysses"))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, H, D, generator=g) for _ in range(3))
    mine = slice(4 * rank, 4 * rank + 4)
    want = cp_ops.local_attention(q, k, v)[:, mine]
    if rank == 3:
        time.sleep(4.5)  # past CP_OPS_TIMEOUT_S: its peers' first call raises
    seen = []
    for attempt in range(4):  # every rank calls again until the call goes through
        try:
            out = cp_ops.attention(q[:, mine], k[:, mine], v[:, mine], group=mesh, transport="torch", chunks=1)
            break
        except (RuntimeError, ValueError) as e:
            seen.append(f"{type(e).__name__}: {str(e).splitlines()[0]}")
    else:
        raise AssertionError(f"rank {rank}: no retry went through: {seen}")
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for seed in (1, 2):  # in step afterwards
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, 16, H, D, generator=g) for _ in range(3))
        out = cp_ops.attention(q[:, mine], k[:, mine], v[:, mine], group=mesh, transport="torch", chunks=1)
        torch.testing.assert_close(out, cp_ops.local_attention(q, k, v)[:, mine], rtol=1e-5, atol=1e-5)
    print(f"rank {rank}: {len(seen)} failed attempts before the retry went through: {seen}")


def test_a_2d_mesh_recovers_after_a_late_first_call():
    run_ranks(_mesh_late, 4)
