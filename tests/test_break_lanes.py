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
from test_cfg_pipelines import _output, tiny_qwenimage  # noqa: E402


def _fail_at(pipe, rank: int, fail_rank: int, nth: int, exc=RuntimeError):
    """Make ``pipe.transformer``'s ``nth`` forward on ``fail_rank`` raise ``exc`` (a pre-hook: inside the lane's
    forward). Returns a switch: ``armed[0] = False`` disarms it."""
    armed, seen = [True], [0]

    def hook(*_):
        seen[0] += 1
        if armed[0] and rank == fail_rank and seen[0] == nth:
            armed[0] = False
            raise exc(f"boom on rank {fail_rank}")

    pipe.transformer.register_forward_pre_hook(hook)
    return armed


def _lane_fails(rank, w):
    from cp_ops.integrations.diffusers import parallelize_pipeline

    ref_pipe, call = tiny_qwenimage(steps=3)
    ref_pipe.set_progress_bar_config(disable=True)
    ref = _output(ref_pipe, call)
    pipe, call = tiny_qwenimage(steps=3)
    parallelize_pipeline(pipe, mode="agkv", transport="torch", chunks=1, cfg_parallel=True)
    assert np.array_equal(_output(pipe, call), ref)  # the shapes are known: step 2 makes no agreement
    # each rank runs one forward per step (its branch): the 2nd is step 2's — rank 1's the unconditional one (rank 0
    # waits for it in the exchange), then rank 0's the conditional one (rank 1 has run its own and waits)
    for fail_rank in (1, 0):
        _fail_at(pipe, rank, fail_rank, 2)
        t0 = time.monotonic()
        if rank == fail_rank:
            with pytest.raises(RuntimeError, match=f"^boom on rank {fail_rank}$"):
                _output(pipe, call)
        else:
            with pytest.raises(RuntimeError, match=rf"^cfg_parallel=True: QwenImagePipeline's CFG lane exchange: "
                                                   rf"rank {fail_rank} \(global rank {fail_rank}[^)]*\) raised "
                                                   rf"RuntimeError: boom on rank {fail_rank} in its forward"):
                _output(pipe, call)
            waited = time.monotonic() - t0
            assert waited < 10, f"the partner of a failing lane waited {waited:.1f} s"
        # the pipeline stays usable: the next call runs in step and gives the unparallelized output
        assert np.array_equal(_output(pipe, call), ref), fail_rank
    # the first step of a new output shape: the partner waits in the lanes' agreement on the shape, not the exchange
    for fail_rank, size in ((1, dict(height=64)), (0, dict(width=64))):
        _fail_at(pipe, rank, fail_rank, 1)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=f"^boom on rank {fail_rank}$" if rank == fail_rank else
                           rf"^cfg_parallel=True: .*rank {fail_rank} .*raised RuntimeError: boom on rank {fail_rank}"):
            _output(pipe, {**call, **size})
        assert time.monotonic() - t0 < 10
        assert np.array_equal(_output(pipe, call), ref), (fail_rank, size)


def test_a_lane_that_raises_is_named_by_its_partner_in_seconds_and_the_next_call_works(monkeypatch):
    monkeypatch.setenv("CP_OPS_TIMEOUT_S", "30")  # before the fix: the partner hung until the group's timeout
    run_ranks(_lane_fails, 2, timeout=120)
