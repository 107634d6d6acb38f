"""Build and load cp_ops' CUDA extension (``csrc/cp_fast.cu`` and ``csrc/lse_merge.cu``, one module) once per
process, for sm_90 through ``torch.utils.cpp_extension.load``, cached in ``$CP_OPS_EXT_DIR`` (default
``~/.cache/cp_ops/ext/<hash of the sources, torch and CUDA versions>``). Imported by the fast transport and the LSE
merge kernel, never on CPU-only paths. A failed build leaves ``<build dir>/build.log`` and is not retried in this
process; one build per folder at a time across processes (:func:`build_lock`; ``docs/install.md``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import traceback
from pathlib import Path
from typing import Iterator

from ._checkout import part_dir
from ._file_lock import LockTimeout, file_lock

log = logging.getLogger("cp_ops")
LOCK_NAME = "cp_ops_build.lock"  # our flock in the build folder
TORCH_BATON = "lock"  # torch.utils.cpp_extension's FileBaton in the build folder

def _find_source(name: str = "cp_fast.cu") -> Path:
    """``name``, a ``.cu`` file of ``csrc/`` (the wheel's or the checkout's); may not exist: :func:`load` says so."""
    return Path(part_dir("csrc")) / name


_SOURCE = _find_source()  # the transport's lanes and kernels
_MERGE_SOURCE = _find_source("lse_merge.cu")  # the LSE merge kernel (its own concept, same module)


def _sources() -> list[Path]:
    return [_SOURCE, _MERGE_SOURCE]


_lock = threading.Lock()
_state: dict = {}


def source_path() -> Path:
    return _SOURCE


def build_dir() -> Path:
    """Where the extension is (or will be) built: ``$CP_OPS_EXT_DIR`` or a per-source cache folder."""
    import torch

    from . import config

    base = config.settings.ext_dir
    if base:
        return Path(base)
    h = hashlib.sha256()
    for src in _sources():
        if src.exists():
            h.update(src.read_bytes())
    h.update(f"{torch.__version__}|{torch.version.cuda}".encode())
    return Path(os.path.expanduser("~/.cache/cp_ops/ext")) / h.hexdigest()[:16]


@contextlib.contextmanager
def build_lock(bdir: Path, timeout_s: float | None = None) -> Iterator[None]:
    """Hold the build folder ``bdir``'s lock, waiting at most ``timeout_s`` (default ``CP_OPS_TIMEOUT_S``) for a live
    holder. While held, torch's ``FileBaton`` file (``bdir/lock``) is stale and removed. LockTimeout: a live process
    held it for ``timeout_s`` s (named, with what to do)."""
    from . import config

    timeout_s = config.settings.timeout_s if timeout_s is None else timeout_s
    lock = bdir / LOCK_NAME
    hint = (f"If that process is building the extension, wait for it (a build takes ~1 min) or raise "
            f"CP_OPS_TIMEOUT_S (now {timeout_s:g} s); if it hangs, end it. transport='torch' needs no build.")
    with file_lock(lock, timeout_s, purpose=f"the cp_ops CUDA extension build in {bdir}", hint=hint):
        baton = bdir / TORCH_BATON
        if baton.exists():
            log.warning("cp_ops: removing %s, a stale torch build lock (left by a process killed during the build)",
                        baton)
            baton.unlink(missing_ok=True)
        yield


def current_stream(device) -> int:
    """``torch.cuda.current_stream(device).cuda_stream`` without building a Stream object (one C call)."""
    import torch

    idx = torch.cuda.current_device() if device.index is None else device.index
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # CUDA builds of torch have it
    return raw(idx) if raw is not None else torch.cuda.current_stream(idx).cuda_stream


def loaded():
    """The extension module when this process already loaded it (by :func:`load`), else None: never builds."""
    result = _state.get("result")
    return result[0] if result else None


def load():
    """Return ``(module, None)`` or ``(None, reason)``; builds on the first call, then cached in-process."""
    with _lock:
        if "result" in _state:
            return _state["result"]
        _state["result"] = _load()
        return _state["result"]


def _load():
    missing = [str(p) for p in _sources() if not p.exists()]
    if missing:
        return None, f"the extension source {', '.join(missing)} is missing (cp_ops installed without csrc/)"
    bdir = build_dir()
    bdir.mkdir(parents=True, exist_ok=True)
    try:
        with build_lock(bdir):
            return _build(bdir)
    except LockTimeout as e:
        return None, str(e)


def _build(bdir: Path):
    """Build (or load the cached) extension in ``bdir``; the caller holds :func:`build_lock`."""
    import torch
    from torch.utils import cpp_extension

    old_arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
    try:
        mod = cpp_extension.load(
            name="cp_ops_fast_ext",
            sources=[str(p) for p in _sources()],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", "--expt-relaxed-constexpr"],
            build_directory=str(bdir),
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - any build/load failure becomes a reason with the log path
        log_file = bdir / "build.log"
        log_file.write_text(f"torch {torch.__version__} cuda {torch.version.cuda}\n{e}\n\n{traceback.format_exc()}")
        return None, f"the cp_ops CUDA extension (csrc/cp_fast.cu) failed to build or load; build log: {log_file}"
    finally:
        if old_arch is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = old_arch
    (bdir / "build.log").write_text(f"built/loaded OK: {getattr(mod, '__file__', '?')}\n")
    return mod, None
