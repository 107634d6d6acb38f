import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def _threads_per_worker() -> None:
    """Under pytest-xdist, each worker's torch takes its share of the cores (CI: 2 cores, 2 workers -> 1 thread):
    two workers each running intra-op threads on every core oversubscribe them, and OpenMP's spinning threads then
    burn the other worker's time. Rank processes set their own share (dist_util._body)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


_threads_per_worker()


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


def pytest_configure(config):
    """Two workers take tests by work stealing (``--dist worksteal``) rather than fixed batches: a few tests take
    10-25 s on CI's 2 cores, and stealing keeps one worker from ending with a queue of them while the other idles."""
    if getattr(config.option, "dist", "no") == "load" and config.pluginmanager.hasplugin("xdist"):
        config.option.dist = "worksteal"
