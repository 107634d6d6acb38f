"""CFG lanes, the planned layout and the default capture as a user could break them: a lane's forward that raises
mid-run (its partner raises within seconds naming it, and the next call works), and the pipeline calls the lanes
must refuse or run right."""

import importlib.util
import time

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
NEEDS = [m for m in ("transformers",) if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(NEEDS), reason=f"diffusers pipelines need {NEEDS} (pip install transformers)")

from dist_util import run_ranks  # noqa: E402
from test_cfg_pipelines import _cfg_off, _output, tiny_qwenimage  # noqa: E402


def _fail_at(pipe, rank: int, fail: bool, nth: int, exc=RuntimeError):
    """Make ``pipe.transformer``'s ``nth`` forward raise ``exc`` where ``fail`` (a pre-hook: inside the lane's
    forward)."""
    armed, seen = [fail], [0]

    def hook(*_):
        seen[0] += 1
        if armed[0] and seen[0] == nth:
            armed[0] = False
            raise exc("boom in lane")

    pipe.transformer.register_forward_pre_hook(hook)


def _lane_fails(rank, w):
    from cp_ops.integrations.diffusers import parallelize_pipeline

    half = w // 2
    lane = rank // half
    ref_pipe, call = tiny_qwenimage(steps=3)
    ref_pipe.set_progress_bar_config(disable=True)
    ref = _output(ref_pipe, call)
    tol = 0 if w == 2 else 1e-5
    pipe, call = tiny_qwenimage(steps=3)
    parallelize_pipeline(pipe, mode="agkv", transport="torch", chunks=1, cfg_parallel=True)
    assert np.abs(_output(pipe, call) - ref).max() <= tol  # the shapes are known: step 2 makes no agreement
    # each rank runs one forward per step (its branch): the 2nd is step 2's — lane 1's the unconditional one (lane 0
    # waits for it in the exchange), then lane 0's the conditional one (lane 1 has run its own and waits); then the
    # same at the first step of a new output shape (the partner waits in the lanes' agreement on the shape); then an
    # interrupt (a BaseException) in lane 1's forward
    cases = [(1, 2, {}, RuntimeError), (0, 2, {}, RuntimeError), (1, 1, dict(height=64), RuntimeError),
             (0, 1, dict(width=64), RuntimeError), (1, 2, {}, KeyboardInterrupt)]
    for fail_lane, nth, size, exc in cases:
        _fail_at(pipe, rank, lane == fail_lane, nth, exc)
        partner = rank + half if lane == 0 else rank - half
        t0 = time.monotonic()
        with pytest.raises(exc if lane == fail_lane else RuntimeError,
                           match="^boom in lane$" if lane == fail_lane else
                           rf"^cfg_parallel=True: QwenImagePipeline's CFG lane exchange: rank {fail_lane} \(global "
                           rf"rank {partner}[^)]*\) raised {exc.__name__}: boom in lane in its forward; this rank "
                           "stops too"):
            _output(pipe, {**call, **size})
        waited = time.monotonic() - t0
        assert waited < 10, f"the partner of a failing lane waited {waited:.1f} s"
        # the pipeline stays usable: the next call runs in step and gives the unparallelized output
        assert np.abs(_output(pipe, call) - ref).max() <= tol, (fail_lane, nth, size)
    # Ctrl-C reaching every rank in step 2: lane 0 waits in the exchange (interrupted there), lane 1 is in its
    # unconditional forward (interrupted there): both raise KeyboardInterrupt, and the next call runs
    import signal

    def interrupt(*_):
        raise KeyboardInterrupt("Ctrl-C")

    seen = [0]

    def at_step_2(*_):
        seen[0] += 1
        if seen[0] != 2:
            return
        if lane == 0:  # its conditional forward: it waits in the exchange 0.3 s later
            signal.setitimer(signal.ITIMER_REAL, 0.3)
        else:
            time.sleep(0.8)
            raise KeyboardInterrupt("Ctrl-C")

    old = signal.signal(signal.SIGALRM, interrupt)
    h = pipe.transformer.register_forward_pre_hook(at_step_2)
    try:
        with pytest.raises(KeyboardInterrupt):
            _output(pipe, call)
    finally:
        h.remove()
        signal.signal(signal.SIGALRM, old)
    assert np.abs(_output(pipe, call) - ref).max() <= tol, "after an interrupt"

    # the exchange as on CUDA (stream-ordered: the host does not wait, so a failed lane cannot join it with
    # placeholders its partner would take for outputs): the partner reads the failure before its next exchange and
    # raises naming it, without making that exchange; the next call runs
    from cp_ops.integrations.diffusers import lanes as lanes_mod

    saved = lanes_mod._host_waits
    lanes_mod._host_waits = lambda tensors: False
    try:
        seen = [0]

        def late(*_):
            seen[0] += 1
            if seen[0] == 2 and lane == 0:
                time.sleep(0.3)  # lane 1 fails meanwhile: lane 0 reaches the exchange after it told

        h = pipe.transformer.register_forward_pre_hook(late)
        _fail_at(pipe, rank, lane == 1, 2)
        with pytest.raises(RuntimeError, match="^boom in lane$" if lane == 1 else
                           r"^cfg_parallel=True: QwenImagePipeline's CFG lane exchange: rank 1 .* raised RuntimeError: "
                           r"boom in lane and did not come to this exchange; this rank stops too.*the next pipe"):
            _output(pipe, call)
        h.remove()
        assert np.abs(_output(pipe, call) - ref).max() <= tol, "stream-ordered exchange"
    finally:
        lanes_mod._host_waits = saved


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_lane_that_raises_is_named_by_its_partner_in_seconds_and_the_next_call_works(monkeypatch, world_size):
    monkeypatch.setenv("CP_OPS_TIMEOUT_S", "30")  # before the fix: the partner hung until the group's timeout
    run_ranks(_lane_fails, world_size, timeout=150)


def _calls_a_user_makes(rank, w):
    """One launch, many calls: each must equal the unparallelized pipeline or be refused on every rank."""
    import warnings

    from cp_ops.integrations.diffusers import parallelize_pipeline

    def ref_of(**kw):
        p, c = tiny_qwenimage()
        p.set_progress_bar_config(disable=True)
        return _output(p, {**c, **kw})

    pipe, call = tiny_qwenimage()
    parallelize_pipeline(pipe, mode="agkv", transport="torch", chunks=1, cfg_parallel=True)
    tol = 0 if w == 2 else 1e-5
    # guidance switched per call: paired, then off (over all W ranks, one warning), then paired again
    for scale in (4.0, 1.0, 4.0):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = _output(pipe, {**call, "true_cfg_scale": scale})
        err = np.abs(out - ref_of(true_cfg_scale=scale)).max()
        assert err <= (tol if scale > 1 else 1e-5), ("true_cfg_scale", scale, err)  # CP W: joint attention rounds
    # two images per prompt: a batch of 2 per branch (each lane one image), equal to rounding
    out = _output(pipe, {**call, "num_images_per_prompt": 2})
    err = np.abs(out - ref_of(num_images_per_prompt=2)).max()
    assert out.shape[0] == 2 and err <= 1e-5, ("num_images_per_prompt=2", out.shape, err)
    # a callback that reads the latents after each step: the same values as on one device, on every rank
    seen = {}

    def cb(p, i, t, kw):
        seen.setdefault(id(p), []).append(kw["latents"].double().sum().item())
        return {}

    ref_pipe, _ = tiny_qwenimage()
    ref_pipe.set_progress_bar_config(disable=True)
    _output(ref_pipe, {**call, "callback_on_step_end": cb})
    _output(pipe, {**call, "callback_on_step_end": cb})
    a, b = seen[id(ref_pipe)], seen[id(pipe)]
    assert len(a) == len(b) == 2 and np.allclose(a, b, rtol=0, atol=1e-4), (a, b)
    # a different prompt on one rank: refused on every rank, naming it; the next call runs
    g = torch.Generator().manual_seed(10 + rank)
    with pytest.raises(ValueError, match="different arguments: prompt_embeds"):
        _output(pipe, {**call, "prompt_embeds": torch.randn(1, 8, 16, generator=g)})
    assert np.abs(_output(pipe, call) - ref_of()).max() <= tol

    # Wan 2.2 (two experts, switched mid-run) with guidance turned off by a callback after step 1: step 1 paired,
    # the steps after over all the ranks
    from cp_ops.examples.tiny import tiny_wan22

    outs = []
    for parallel in (False, True):
        wan, wcall = tiny_wan22(steps=3)
        wan.set_progress_bar_config(disable=True)
        if parallel:
            parallelize_pipeline(wan, mode="agkv", transport="torch", chunks=1, cfg_parallel=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outs.append(_output(wan, {**wcall, "callback_on_step_end": _cfg_off}))
    assert np.abs(outs[1] - outs[0]).max() <= tol, np.abs(outs[1] - outs[0]).max()
    _shared_components(rank, w)


def _shared_components(rank, w):
    """A second pipeline on the parallelized one's components (as ``from_pipe`` makes): parallelize_pipeline runs it
    on the transformers as they are (CFG lanes paired, calls checked); layout arguments for them are refused."""
    import diffusers

    from cp_ops.integrations.diffusers import parallelize_pipeline

    ref_pipe, call = tiny_qwenimage()
    ref_pipe.set_progress_bar_config(disable=True)
    ref = _output(ref_pipe, call)
    pipe, call = tiny_qwenimage()
    parallelize_pipeline(pipe, transport="torch", chunks=1)  # planned: 2 lanes
    assert pipe.cp_ops_layout.cfg_parallel
    other = diffusers.QwenImagePipeline(**pipe.components)
    with pytest.raises(ValueError, match=r"already parallelized \(this pipeline shares them .*from_pipe\): call "
                                         r"parallelize_pipeline\(pipe\) with no layout arguments"):
        parallelize_pipeline(other, mode="agkv")
    parallelize_pipeline(other)
    assert other.cp_ops_layout is pipe.cp_ops_layout and other.cp_ops_writes_output == (rank == 0)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # paired: no both-lanes warning
        assert np.abs(_output(other, call) - ref).max() <= (0 if w == 2 else 1e-5)
    assert np.abs(_output(pipe, call) - ref).max() <= (0 if w == 2 else 1e-5)  # the first pipeline still runs


def test_calls_a_user_makes_on_cfg_lanes():
    run_ranks(_calls_a_user_makes, 2)


def _planned_odd_and_subgroups(rank, w):
    """The planner at W=3 (odd: one CP group) and on groups that are not WORLD (W=4 as two groups of 2, each planning
    its own lanes): the unparallelized output."""
    import torch.distributed as dist

    from cp_ops.integrations.diffusers import parallelize_pipeline

    ref_pipe, call = tiny_qwenimage()
    ref_pipe.set_progress_bar_config(disable=True)
    ref = _output(ref_pipe, call)
    group = None
    if w == 4:
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        group = groups[rank // 2]
    pipe, call = tiny_qwenimage()
    parallelize_pipeline(pipe, group, transport="torch", chunks=1)
    lay = pipe.cp_ops_layout
    assert lay.cfg_parallel == (w == 4), str(lay)
    out = _output(pipe, call)
    assert np.abs(out - ref).max() <= (1e-5 if w == 3 else 0), np.abs(out - ref).max()
    dist.barrier()  # rank 0 holds the store: it stays until the other group is done


@pytest.mark.parametrize("world_size", [3, 4])
def test_planned_layout_at_odd_n_and_on_a_subgroup(world_size):
    run_ranks(_planned_odd_and_subgroups, world_size)


def test_cfg_lanes_on_a_fake_group():
    """The 'fake' backend (what cp-ops bound measures on) has no store to tell failures through: parallelize with
    cfg_parallel=True installs there as before."""
    import diffusers_tiny
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from cp_ops.integrations.diffusers import parallelize

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        model = diffusers_tiny.build("wan")
        parallelize(model, mode="agkv", transport="torch", cfg_parallel=True)
        assert model._cp_ops_lanes.peers is None and model._cp_ops_group.size() == 2
    finally:
        dist.destroy_process_group()
