"""The fast transport's build lock (issue 20, item 4): a rank killed during the CUDA extension build leaves no lock
that hangs the host's later processes; a live holder costs a bounded wait that ends in an error naming the lock.

CPU only: nvcc never runs. ``cpp_extension.load`` is replaced by a stand-in that takes torch's own build lock as
torch does (``FileBaton`` on ``<build dir>/lock``: try to create the file, else wait while it exists): before the
fix, the file a killed builder left behind made every later ``load()`` wait on it forever.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from cp_ops import config
from cp_ops import _ext
from cp_ops._file_lock import LockTimeout, file_lock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_HOLDER = """
import sys, time
from pathlib import Path
from cp_ops import _ext
bdir = Path(sys.argv[1])
with _ext.build_lock(bdir, timeout_s=30):
    (bdir / "lock").write_text("")  # torch's FileBaton, as cpp_extension.load makes it mid-build
    print("held", flush=True)
    time.sleep(600)
"""

_LOADER = """
import os, sys, types
from torch.utils import cpp_extension
from torch.utils.file_baton import FileBaton
from cp_ops import config
from cp_ops import _ext

def load(name, sources, build_directory, **kw):  # torch's _jit_compile locking, without the compiler
    baton = FileBaton(os.path.join(build_directory, "lock"))
    if baton.try_acquire():
        baton.release()
    else:
        baton.wait()  # unbounded, as in torch
    return types.SimpleNamespace(__file__="stand-in.so")

cpp_extension.load = load
config.configure(ext_dir=sys.argv[1], timeout_s=20)
mod, why = _ext.load()
assert mod is not None, why
print("loaded", mod.__file__, flush=True)
"""


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CP_OPS_")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture
def holder(tmp_path):
    """A process holding the build lock of ``tmp_path`` (with torch's baton file made), until killed."""
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                         env=_env())
    try:
        line = p.stdout.readline()  # bounded: the child prints or dies (then readline returns "")
        assert line.strip() == "held", (line, p.poll())
        yield p
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        p.stdout.close()


def test_live_holder_costs_a_bounded_wait_that_names_the_lock(holder, tmp_path, monkeypatch):
    lock = tmp_path / _ext.LOCK_NAME
    t0 = time.monotonic()
    with pytest.raises(LockTimeout) as info:
        with _ext.build_lock(tmp_path, timeout_s=1.0):
            pass
    waited = time.monotonic() - t0
    assert 1.0 <= waited < 10, waited
    msg = str(info.value)
    assert str(lock) in msg and f"pid {holder.pid}" in msg and "CP_OPS_TIMEOUT_S" in msg, msg
    # load() takes its bound from the settings (CP_OPS_TIMEOUT_S) and returns the reason (transport='auto'
    # then falls back to torch; an explicit 'fast' raises it)
    monkeypatch.setattr(config.settings, "ext_dir", str(tmp_path))
    monkeypatch.setattr(config.settings, "timeout_s", 0.5)
    monkeypatch.setattr(_ext, "_state", {})
    t0 = time.monotonic()
    mod, why = _ext.load()
    assert mod is None and str(lock) in why and "waited 0.5 s" in why, why
    assert time.monotonic() - t0 < 10
    monkeypatch.setattr(_ext, "_state", {})


def test_a_killed_builder_leaves_no_lock_behind(holder, tmp_path):
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=30)
    assert (tmp_path / "lock").exists()  # torch's baton outlives its holder: what hung every later process
    t0 = time.monotonic()
    with _ext.build_lock(tmp_path, timeout_s=5.0):  # ours was released by the OS
        assert not (tmp_path / "lock").exists()  # and the stale baton is gone
    assert time.monotonic() - t0 < 2
    # the next process's load() goes through torch's own locking without waiting forever
    (tmp_path / "lock").write_text("")  # left again, as by a second killed builder
    p = subprocess.run([sys.executable, "-c", _LOADER, str(tmp_path)], capture_output=True, text=True, timeout=120,
                       env=_env())
    assert p.returncode == 0 and "loaded stand-in.so" in p.stdout, p.stdout + p.stderr[-3000:]


def test_file_lock_is_exclusive_and_reentrant_after_release(tmp_path):
    lock = tmp_path / "x.lock"
    with file_lock(lock, 1.0):
        assert lock.read_text().strip() == str(os.getpid())
        with pytest.raises(LockTimeout, match="x.lock"):  # a second open file description: flock excludes it too
            with file_lock(lock, 0.2):
                pass
    with file_lock(lock, 0.2):  # released on exit
        pass
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        with file_lock(lock, 0):
            pass
