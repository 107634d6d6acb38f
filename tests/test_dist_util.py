"""tests/dist_util.run_ranks, the harness every multi-rank test uses: a rank's failure, hang or bad exit is
reported naming the rank; CP_OPS_* variables set (or removed) by the test reach the ranks' cp_ops settings; what a
call does in its ranks does not reach the next call; a call that needs a fresh interpreter gets one."""

import os

import pytest
import torch
import torch.distributed as dist

import dist_util
from dist_util import run_ranks

_STATE = {"calls": 0}  # mutated inside ranks: must not be seen by the next call


def _fail_on_rank_1(rank, w):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    assert t.item() == w * (w + 1) / 2, t
    if rank == 1:
        raise ValueError(f"planted failure on rank {rank} of {w}")


def test_a_rank_failure_names_the_rank_and_its_traceback():
    with pytest.raises(AssertionError, match=r"(?s)--- rank 1 ---.*ValueError: planted failure on rank 1 of 3") as e:
        run_ranks(_fail_on_rank_1, 3)
    assert "--- rank 0 ---" not in str(e.value) and "--- rank 2 ---" not in str(e.value)


def _hang_on_rank_0(rank, w):
    if rank == 0:
        import time

        time.sleep(600)


def test_a_hung_rank_is_killed_and_named():
    # (rank 1 returns at once, but on a loaded machine it may not be done within the timeout either)
    with pytest.raises(AssertionError, match=r"ranks \[0(, 1)?\] did not finish within 3.0s"):
        run_ranks(_hang_on_rank_0, 2, timeout=3.0)


def _exit_without_exception(rank, w):
    if rank == 1:
        os._exit(3)


def test_a_rank_exiting_non_zero_is_named():
    with pytest.raises(AssertionError, match=r"ranks exited non-zero: \[\(1, 3\)\]"):
        run_ranks(_exit_without_exception, 2)


def _settings_from_env(rank, w, timeout_s, tune_modes):
    from cp_ops import config

    assert float(os.environ["CP_OPS_TIMEOUT_S"]) == timeout_s, os.environ["CP_OPS_TIMEOUT_S"]
    assert config.settings.timeout_s == timeout_s, config.settings
    assert config.settings.sources["timeout_s"] == "env CP_OPS_TIMEOUT_S", config.settings.sources
    assert "CP_OPS_TUNE_MODES" not in os.environ
    assert config.settings.tune_modes is tune_modes and config.settings.sources["tune_modes"] == "default"


def test_cp_ops_variables_set_or_removed_by_the_test_reach_the_ranks(monkeypatch):
    monkeypatch.setenv("CP_OPS_TIMEOUT_S", "77")
    monkeypatch.delenv("CP_OPS_TUNE_MODES", raising=False)
    run_ranks(_settings_from_env, 2, 77.0, False)  # tune_modes: off by default (reproducible)
    monkeypatch.setenv("CP_OPS_TIMEOUT_S", "78")  # a second call sees the new value, not the first call's
    run_ranks(_settings_from_env, 2, 78.0, False)


def _mutate_state(rank, w):
    from cp_ops import config

    _STATE["calls"] += 1
    assert _STATE["calls"] == 1, _STATE  # a fresh process every call: the previous call's increment is gone
    assert config.settings.check_ranks == "on", config.settings.check_ranks
    config.configure(check_ranks="debug")  # a test changing settings in its ranks changes nothing after it
    assert dist.get_world_size() == w and dist.get_rank() == rank


def test_what_a_call_changes_in_its_ranks_does_not_reach_the_next_call():
    for _ in range(3):
        run_ranks(_mutate_state, 2)
    assert _STATE["calls"] == 0  # ranks are other processes


def _parent_is(rank, w, pid, spawned):
    """Spawned ranks are children of the test process; forked ones, of the fork server."""
    assert (os.getppid() == pid) is spawned, ("parent", os.getppid(), "test process", pid, "spawned", spawned)


def _preloaded(rank, w, pythonpath):
    """A forked rank starts with the fork server's imports done, and the caller's PYTHONPATH (not the server's)."""
    import sys

    missing = [m for m in ("rank_preload", "torch._inductor.compile_fx", "cp_ops") if m not in sys.modules]
    assert not missing, ("not preloaded by the fork server", missing)
    assert os.environ.get("PYTHONPATH") == pythonpath, (os.environ.get("PYTHONPATH"), pythonpath)


def test_forked_ranks_start_with_the_servers_imports():
    run_ranks(_preloaded, 2, os.environ.get("PYTHONPATH"))


def test_fresh_interpreters_when_asked():
    run_ranks(_parent_is, 2, os.getpid(), False)  # forked from the fork server
    run_ranks(_parent_is, 2, os.getpid(), True, fresh=True)


def test_fresh_interpreters_when_the_environment_or_device_needs_them():
    env = dict(os.environ)
    differs = "spawn: environment differs from the fork server's: "
    assert dist_util.start_method("cpu", False, env) == "forkserver"
    assert dist_util.start_method("cpu", False, dict(env, CP_OPS_CHECK_RANKS="always")) == "forkserver"
    unset = {k: v for k, v in env.items() if k != "CP_OPS_TUNE_MODES"}
    assert dist_util.start_method("cpu", False, unset) == "forkserver"
    # read at import (torch, Inductor's config): the server's copies were imported without them
    assert dist_util.start_method("cpu", False, dict(env, TORCH_SHOW_CPP_STACKTRACES="1")) == (
        differs + "TORCH_SHOW_CPP_STACKTRACES")
    assert dist_util.start_method("cpu", False, dict(env, TORCHINDUCTOR_FX_GRAPH_CACHE="0")) == (
        differs + "TORCHINDUCTOR_FX_GRAPH_CACHE")
    assert dist_util.start_method("cpu", False, dict(env, OMP_NUM_THREADS="1")) == differs + "OMP_NUM_THREADS"
    # read where used: applied in the rank (Inductor writes both into this process's environment as it compiles)
    assert dist_util.start_method("cpu", False, dict(env, TORCHINDUCTOR_CACHE_DIR="/tmp/x")) == "forkserver"
    assert dist_util.start_method("cpu", False, dict(env, _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR="1")) == "forkserver"
    assert dist_util.start_method("cpu", False, dict(env, SOME_TEST_VARIABLE="1")) == "forkserver"
    assert dist_util.start_method("cpu", False, dict(env, CP_OPS_TESTS_SPAWN="1")) == "spawn: CP_OPS_TESTS_SPAWN=1"
    assert dist_util.start_method("cuda", False, env) == "spawn: device=cuda"
    assert dist_util.start_method("cpu", True, env) == "spawn: fresh=True"


def test_a_rendezvous_taken_by_a_test_beside_is_started_again_once(monkeypatch):
    """A group whose gloo rendezvous failed before the body on every failing rank (its port taken by a test running
    beside it) is started once more; a body's failure, a second rendezvous failure or a hang is raised as before."""
    race = "--- rank 0 ---\n(before or after the test body)\n  in init_rank\nRuntimeError: Gloo connectFullMesh failed"
    calls = []
    monkeypatch.setattr(dist_util, "STATS", type(dist_util.STATS)())  # the session's summary counts real starts

    def attempts(*results):
        def attempt(*a):
            calls.append(a)
            return results[len(calls) - 1]
        calls.clear()
        monkeypatch.setattr(dist_util, "_attempt", attempt)

    attempts(([race], [], [(0, 1)]), ([], [], []))
    dist_util.run_ranks(_parent_is, 2)
    assert len(calls) == 2
    attempts(([race], [], [(0, 1)]), ([race], [], [(0, 1)]))
    with pytest.raises(AssertionError, match="connectFullMesh"):
        dist_util.run_ranks(_parent_is, 2)
    assert len(calls) == 2
    body = "--- rank 1 ---\nTraceback: in _parent_is\nRuntimeError: Gloo connectFullMesh failed"  # in the body
    attempts(([body], [], [(1, 1)]),)
    with pytest.raises(AssertionError, match="in _parent_is"):
        dist_util.run_ranks(_parent_is, 2)
    assert len(calls) == 1
    attempts(([race], [1], [(1, -9)]),)  # a rank hung: not a rendezvous race
    with pytest.raises(AssertionError, match="connectFullMesh"):
        dist_util.run_ranks(_parent_is, 2)
    assert len(calls) == 1
