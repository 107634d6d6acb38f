"""What can be checked on CPU of ranks sharing one GPU and of the fast transport's device-timeout report:

* the output gather of ``parallelize`` on a group whose CUDA backend is gloo (ranks sharing a GPU) stages through host
  memory (c10d's functional all-gather of CUDA tensors on gloo crashed with SIGSEGV); the decision, and the gathered
  output equal to one device;
* a device-wait timeout the fast transport recorded (a stand-in lane whose ``check()`` raises) is raised at the
  ``parallelize`` output gather and after a captured forward's replay, not only at the next fast call;
* ``--device shared``: accepted by bench and run; refused without a GPU, in the user's terms.

The GPU side (W = 2, 4, 8 ranks on one GPU, both transports) is tests/test_one_gpu.py.
"""

import copy

import pytest
import torch
from dist_util import run_ranks


class _TimedOutLane:
    """A fast lane whose device wait gave up: ``check()`` raises as ``Lane.check`` does."""

    def check(self):
        raise RuntimeError("cp_ops fast transport: call 7 timed out waiting for group rank 1 (stand-in)")


def _gather_body(rank, w):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401

    from cp_ops.integrations.diffusers import hooks, parallelize
    from cp_ops.transport import fast
    from diffusers_tiny import build, inputs, sample

    assert hooks.gather_route(dist.group.WORLD, "auto") == "host"  # a gloo group, no fast lane: through host memory
    model = build("wan")
    kw = inputs("wan", 1, (2, 4, 4), 8, torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = sample(model(**kw))
        par = parallelize(copy.deepcopy(model), mode="agkv", transport="torch", chunks=1)
        assert par._cp_ops_state.gloo_cuda
        got = sample(par(**kw))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # a device wait of the fast transport timed out (outputs poisoned): the gather raises it
        fast.transport.lane = _TimedOutLane()
        try:
            with pytest.raises(RuntimeError, match="call 7 timed out"):
                par(**kw)
        finally:
            fast.transport.lane = None


def test_gather_on_gloo_group_and_device_timeout_raised_at_the_gather():
    run_ranks(_gather_body, 2, timeout=120)


def test_gather_route_none_without_gloo_for_cuda():
    """A group that moves CUDA tensors with NCCL (a fake group here): c10d's all-gather, no detour."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (the 'fake' backend)

    from cp_ops.integrations.diffusers import hooks

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=2)
    try:
        assert hooks.gather_route(dist.group.WORLD, "auto") is None
    finally:
        dist.destroy_process_group()


def test_device_timeout_raised_after_a_captured_replay(monkeypatch):
    """A replay runs no Python of the forward: the recorded timeout is checked after it."""
    from test_captured import Net, Recorder, _r

    from cp_ops import captured
    from cp_ops.transport import fast

    monkeypatch.setattr(captured, "BACKEND", Recorder())
    net = captured.capture_forward(Net())
    with torch.no_grad():
        net(_r(2, 4))  # warm-up + capture
        net(_r(2, 4, seed=1))  # a replay
        monkeypatch.setattr(fast.transport, "lane", _TimedOutLane())
        with pytest.raises(RuntimeError, match="call 7 timed out"):
            net(_r(2, 4, seed=2))


@pytest.mark.parametrize("cmd", ["bench", "run"])
def test_device_shared_flag(cmd, monkeypatch, capsys):
    from cli_util import run_cli

    argv = [cmd] + (["wan"] if cmd == "run" else []) + ["--device", "shared", "--nproc", "2"]
    r = run_cli(argv, monkeypatch, capsys)
    assert r.returncode != 0
    assert "--device shared puts every rank on cuda:0: it needs a CUDA GPU" in r.stderr + r.stdout, r
