"""Waits that speak: a rank waiting on late or absent peers logs a warning naming them and the call long before
CP_OPS_TIMEOUT_S, and every wait's timeout error says the same thing in the same words. Real gloo ranks; the warn
delay and the timeout are set small (1 s, a few s) to prove the same behaviour as the defaults (10 s, 300 s)."""

from __future__ import annotations

import logging
import time

import pytest
import torch
import torch.distributed as dist

import cp_ops
from cp_ops import config
from dist_util import run_ranks

H, D = 4, 8
#: the one vocabulary of every wait's timeout error (its first line)
TIMEOUT = (r"{call} on CP group '0': rank 1 \(global rank 1[^)]*\) did not arrive within CP_OPS_TIMEOUT_S={t} s\. "
           r"Check that every rank makes this call: a rank skipped this call")


class _Log(logging.Handler):
    """The cp_ops warnings this rank logged, with the time since ``t0``; ``then()`` runs at each."""

    def __init__(self, then=None):
        super().__init__(logging.WARNING)
        self.t0, self.got, self.then = time.monotonic(), [], then
        logging.getLogger("cp_ops").addHandler(self)

    def emit(self, record):
        self.got.append((time.monotonic() - self.t0, record.getMessage()))
        if self.then is not None:
            self.then()

    def waits(self):
        return [(t, m) for t, m in self.got if "not there after" in m]


def _call(rank, w, seed):
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(1, w * 8, H, D, generator=g) for _ in range(3)]
    q, k, v = (x[:, rank * 8:(rank + 1) * 8] for x in full)
    out = cp_ops.attention(q, k, v, mode="agkv", transport="torch")
    torch.testing.assert_close(out, cp_ops.local_attention(q, full[1], full[2]), rtol=1e-5, atol=1e-5)


def _late(rank, w, use_shm):
    import datetime

    from cp_ops import contract

    contract._USE_SHM = use_shm
    config.configure(timeout_s=30.0, wait_warn_s=1.0)
    store = dist.distributed_c10d._get_default_store()
    for n, seed in ((1, 0), (2, 1)):  # late at the first call (rendezvous), then at a later call (the exchange)
        if rank == 1:  # late: arrives once rank 0 has warned (at most 20 s)
            store.wait([f"warned{n}"], datetime.timedelta(seconds=20))
            _call(rank, w, seed)
            continue
        log = _Log(lambda n=n: store.set(f"warned{n}", "1"))
        _call(rank, w, seed)  # waits for rank 1, then succeeds
        logging.getLogger("cp_ops").removeHandler(log)
        warned = log.waits()
        assert warned, f"no warning while rank 1 was late: {log.got}"
        t, first = warned[0]
        assert t < 3.0, f"the first warning came after {t:.1f} s (wait_warn_s=1)"
        assert f"cp_ops.attention call #{n} on CP group '0': rank 1 (global rank 1" in first, first
        assert "CP_OPS_TIMEOUT_S=30 s" in first and "skipped this call" in first, first
        assert len(warned) <= 2, warned  # 1 s, 3 s: back-off, never one per poll


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "gloo"])
def test_a_late_peer_is_named_in_a_warning_and_the_call_then_succeeds(use_shm):
    run_ranks(_late, 2, use_shm)


def _skips(rank, w):
    config.configure(timeout_s=3.0, wait_warn_s=1.0)
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:  # skips its first call and stays alive (as a rank in `if rank == 0: model(...)` would)
        store.wait(["r0_first_done"])
    else:
        log = _Log()
        with pytest.raises(RuntimeError, match=TIMEOUT.format(call=r"cp_ops\.attention call #1", t=3)) as e:
            _call(rank, w, 0)
        assert "node identit" not in str(e.value) and "tensors=" not in str(e.value), str(e.value)
        assert "calling again waits for them again" in str(e.value).split("\n", 1)[1], str(e.value)
        assert [m for _, m in log.waits()], log.got
        store.set("r0_first_done", "1")
    _call(rank, w, 1)  # the retry meets rank 1
    if rank == 1:  # skips call #2, alive
        store.wait(["r0_second_done"])
        return
    log = _Log()
    with pytest.raises(RuntimeError, match=TIMEOUT.format(call=r"cp_ops\.attention call #2", t=3)):
        _call(rank, w, 2)
    assert any("call #2" in m and "rank 1 (global rank 1" in m for _, m in log.waits()), log.got
    store.set("r0_second_done", "1")


def test_a_skipped_call_on_a_live_rank_warns_then_raises_in_one_vocabulary():
    run_ranks(_skips, 2)


def _skips_forward(rank, w):
    import diffusers_tiny

    from cp_ops.integrations.diffusers import parallelize

    config.configure(timeout_s=3.0, wait_warn_s=1.0)
    model = parallelize(diffusers_tiny.build("wan"), mode="agkv", transport="torch")
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:  # `if rank == 0: model(...)`, and rank 1 goes on to wait elsewhere
        store.wait(["r0_done"])
        return
    log = _Log()
    inputs = diffusers_tiny.inputs("wan", 1, (2, 4, 4), 6, torch.Generator().manual_seed(0))
    with torch.no_grad(), pytest.raises(RuntimeError,
                                        match=TIMEOUT.format(call=r"cp_ops\.parallelize inputs of forward #1", t=3)):
        model(**inputs)
    assert any("cp_ops.parallelize inputs of forward #1" in m for _, m in log.waits()), log.got
    store.set("r0_done", "1")


def test_a_skipped_forward_names_the_forward():
    pytest.importorskip("diffusers")
    run_ranks(_skips_forward, 2)


def _skips_mesh(rank, w):
    from cp_ops.mesh import init_cp_mesh

    config.configure(timeout_s=1.0, wait_warn_s=10.0)  # the timeout alone, soon
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:  # skips init_cp_mesh, alive
        store.wait(["r0_done"])
        return
    # the error names the function by the path a user can call (cp_ops.mesh.init_cp_mesh; cp_ops has no init_cp_mesh)
    with pytest.raises(RuntimeError, match=TIMEOUT.format(call=r"cp_ops\.mesh\.init_cp_mesh", t=1)):
        init_cp_mesh(4096, 24, 128, device_type="cpu")
    store.set("r0_done", "1")


def test_a_skipped_init_cp_mesh_names_its_importable_path():
    run_ranks(_skips_mesh, 2)
