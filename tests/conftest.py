import gc
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import inductor_mode  # noqa: E402

# Inductor's CPU kernels without SIMD: on CPU the compiled code is only CI's stand-in for the GPUs' Triton kernels, and
# what the tests check (cp_ops' ops, passes, graphs, numbers against eager) does not depend on the C++ kernels being
# vectorized; scalar kernels compile faster (-12 % CPU time over the compile-heavy test files, -16 % for
# test_uneven's compiled tests) and no process probes the vector ISAs. Set before torch is imported, so the pytest
# workers, the rank fork server (tests/dist_util.py) and every subprocess a test starts see it; set it to 1 to
# test the vectorized kernels.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
# Inductor compiles in the compiling process, not in a pool of compile workers: each rank process and subprocess a
# test starts would otherwise start its own pool (more interpreters importing torch on 2 cores) for graphs of a few
# kernels each (-8 % CPU time for test_uneven's compiled test).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def _threads_per_worker() -> None:
    """Under pytest-xdist, each worker's torch takes its share of the cores (CI: 2 cores, 2 workers -> 1 thread):
    two workers each running intra-op threads on every core oversubscribe them, and OpenMP's spinning threads then
    burn the other worker's time. Rank processes set their own share (dist_util._body)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


_threads_per_worker()


inductor_mode.fallback_kernels()  # Inductor without C++ kernels (tests/inductor_mode.py)


@pytest.fixture
def inductor_kernels():
    """Inductor generating its own (fused) kernels for this test's compiles (tests/inductor_mode.py)."""
    with inductor_mode.inductor_kernels():
        yield


def pytest_collection_finish(session):
    """What the imports and the collection made (torch, Dynamo, diffusers, the test modules) is moved out of the
    garbage collector's view: the full collections that a compile's many short-lived objects trigger would otherwise
    walk all of it each time (-35 % of the GC time of a test process over the compile-heavy files)."""
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session, exitstatus):
    """End the rank fork server (tests/dist_util.py) if this session started one."""
    dist_util = sys.modules.get("dist_util")
    if dist_util is not None:
        dist_util.stop_server()


def pytest_terminal_summary(terminalreporter):
    """One line per way tests/dist_util.run_ranks started ranks (forked from the fork server, or spawned and why)."""
    dist_util = sys.modules.get("dist_util")
    if dist_util is not None and dist_util.STATS:
        terminalreporter.write_sep("-", "rank processes (tests/dist_util.py)")
        for what, n in sorted(dist_util.STATS.items()):
            terminalreporter.write_line(f"{n:4d} calls: {what}")


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): two workers on a CPU-only machine (CI has 2 cores: Inductor compiles and
    the rank processes of two tests overlap); none where CUDA is present, so GPU tests never share the GPUs with
    another test's ranks."""
    import torch

    if torch.cuda.is_available():
        return 0
    return max(1, min(2, os.cpu_count() or 1))


#: The longest tests on CI (2 cores, ``pytest -n auto --durations=0``), longest first. Under
#: xdist they are dealt in turn to the heads of the workers' shares of the collection (:func:`_deal`), so every worker
#: starts with long tests and ends with short ones: a long test that starts last holds the whole run while the other
#: worker idles. An order only: a test not named here runs after them, in collection order; a name that no longer
#: matches a test is skipped over.
LONGEST = (
    "tests/test_pass_correctness.py::test_compiled_with_pass_equals_without_and_eager_2_ranks",
    "tests/test_uneven.py::test_compiled_equals_eager",
    "tests/test_cli_bound.py::test_bound_compile_workers_then_side_processes",
    "tests/test_csrc_compiles.py::test_extension_sources_compile_and_link",
    "tests/test_diffusers_models.py::test_models_equal_unparallelized[2]",
    "tests/test_pass_graph.py::test_diffusers_wan_transformer_one_window_per_layer[agkv]",
    "tests/test_pass_benchmark.py::test_cpu_smoke_run",
    "tests/test_cli.py::test_bench_cpu_default",
    "tests/test_mesh2d.py::test_2d_compiled_equals_eager",
    "tests/test_packaging.py::test_wheel_then_its_fresh_install_compiles_with_the_pass_and_finds_the_sources",
    "tests/test_pass_correctness.py::test_dynamic_shapes_pipelined_ulysses_2_ranks",
    "tests/test_diffusers_context.py::test_short_streams_and_replicated_context[4]",
    "tests/test_cli_bound.py::test_side_process_failures_are_reported",
    "tests/test_nodes.py::test_torchrun_two_simulated_nodes",
    "tests/test_pipeline.py::test_example_under_torchrun",
    "tests/test_pooled.py::test_compiled_pipelined_ulysses_keeps_pool_slots",
    "tests/test_diffusers_compiled.py::test_parallelize_compile_equals_eager",
    "tests/test_readme.py::test_torch_logs_switch_as_documented",
    "tests/test_fp8.py::test_compiled_equals_eager",
    "tests/test_compiled_once_per_class.py::test_regional_compile_once_per_block_class[ulysses]",
    "tests/test_pass_inflight.py::test_plain_torch_compile_gets_lowerings_without_importing_passes",
    "tests/test_cli_output.py::test_torchrun_bad_argument_is_one_line_from_rank_0",
    "tests/test_ulysses_traced_pack.py::test_traced_pack_compiled_equals_eager_and_single_device",
    "tests/test_grad.py::test_parallelized_model_with_grad_eager_and_compiled_agree",
)


def _deal(items: list, workers: int) -> list:
    """``items`` reordered for ``workers`` xdist workers taking tests by work stealing: the scheduler hands worker j
    the j-th contiguous share of the collection (the first ``n // workers`` items, then a fair share of the rest, ...)
    and an idle worker steals from the tail of another's share. The tests of :data:`LONGEST` are dealt in turn to the
    heads of the shares (the longest to share 0, the next to share 1, ...), the other tests fill the shares up."""
    rank = {nodeid: i for i, nodeid in enumerate(LONGEST)}
    long = sorted((it for it in items if it.nodeid in rank), key=lambda it: rank[it.nodeid])
    rest = [it for it in items if it.nodeid not in rank]
    sizes, left = [], len(items)
    for j in range(workers):
        sizes.append(left // (workers - j))  # what xdist's worksteal scheduler sends worker j (its _send_tests)
        left -= sizes[-1]
    heads = [long[j::workers] for j in range(workers)]
    if any(len(h) > n for h, n in zip(heads, sizes)):  # a few tests selected: nothing to deal
        return items
    out, i = [], 0
    for head, n in zip(heads, sizes):
        out += head + rest[i:i + n - len(head)]
        i += n - len(head)
    return out


def pytest_collection_modifyitems(config, items):
    """Under two or more xdist workers the longest tests start first, one worker each (:func:`_deal`)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        items[:] = _deal(items, workers)


def pytest_configure(config):
    """Two workers take tests by work stealing (``--dist worksteal``) rather than fixed batches: a few tests take
    10-25 s on CI's 2 cores, and stealing keeps one worker from ending with a queue of them while the other idles."""
    if getattr(config.option, "dist", "no") == "load" and config.pluginmanager.hasplugin("xdist"):
        config.option.dist = "worksteal"
