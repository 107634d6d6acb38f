"""Run the ``cp-ops`` command inside the test process: ``cp_ops.cli.main.main(argv)``, its ranks forked from the
rank fork server (tests/dist_util.py) instead of spawned as fresh interpreters.

A ``python -m cp_ops ...`` subprocess costs an interpreter start and ``import torch`` for the command and again for
each of its ranks (seconds each on CI's 2 cores). A test about what the command does with its arguments, its
``--out`` file or its printed lines needs none of that; it calls :func:`run_cli`. What only a real process shows
(the entry point, ``sys.exit`` codes, torchrun, what a fresh interpreter imports) keeps one subprocess test per
entry point: ``test_cli.py::test_bench_cpu_default``, ``::test_cli_bad_input_subprocess``,
``test_cli_output.py::test_torchrun_*``, ``test_cli_startup.py``.

What differs from the subprocess, and why it does not matter to the tests using it: ``cp_ops.cli.launch.launch``
is replaced by :func:`dist_util.run_ranks` (a rank that exits non-zero is an ``AssertionError``, not an exit code:
use a subprocess for that); the ranks' stdout/stderr are collected per rank and appended after the command's own
(rank 0 first), not interleaved in time; ``CP_OPS_*`` variables are removed (as the subprocess tests' environment
did) and ``cp_ops.config.settings`` is restored afterwards.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile

from dist_util import run_ranks


@dataclasses.dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def _rank(rank, world_size, fn, fn_args, cwd, log_dir):
    """One CLI rank: in the caller's working directory, stdout/stderr into ``log_dir``, then what the CLI's own
    launch runs (``fn(rank, world_size, device, *fn_args)``)."""
    import torch

    os.chdir(cwd)
    for fd, name in ((1, "out"), (2, "err")):
        f = os.open(os.path.join(log_dir, f"rank{rank}.{name}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    try:
        fn(rank, world_size, torch.device("cpu"), *fn_args)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def run_cli(argv: list[str], monkeypatch, capsys) -> Result:
    """``cp-ops *argv`` in this process (CPU ranks through the fork server); its exit code and output."""
    from cp_ops import config
    from cp_ops.cli import launch as launch_mod
    from cp_ops.cli import main as main_mod

    for k in [k for k in os.environ if k.startswith("CP_OPS_")]:
        monkeypatch.delenv(k)
    saved = config.snapshot()
    with tempfile.TemporaryDirectory(prefix="cp_ops_cli_") as log_dir:
        worlds = []

        def launch(fn, nproc, device, *args):
            assert device == "cpu", device
            worlds.append(nproc)
            run_ranks(_rank, nproc, fn, args, os.getcwd(), log_dir)

        monkeypatch.setattr(launch_mod, "launch", launch)
        capsys.readouterr()
        try:
            code = main_mod.main(list(argv))
        except SystemExit as e:  # argparse (--help, a bad flag)
            code = e.code if isinstance(e.code, int) else 1
        finally:
            config.restore(saved)
        captured = capsys.readouterr()
        out, err = [captured.out], [captured.err]
        for r in range(worlds[-1] if worlds else 0):
            for parts, name in ((out, "out"), (err, "err")):
                path = os.path.join(log_dir, f"rank{r}.{name}")
                if os.path.exists(path):
                    with open(path, "rb") as f:
                        parts.append(f.read().decode())
    return Result(code, "".join(out), "".join(err))
