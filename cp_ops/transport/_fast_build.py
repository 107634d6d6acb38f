"""Build and load the fast transport's CUDA extension (``csrc/cp_fast.cu``, with the LSE merge kernel of
``csrc/lse_merge.cu`` in the same module), once per process, cached on disk.

Built with ninja through ``torch.utils.cpp_extension.load`` for sm_90 on first use on a CUDA machine, into
``$CP_OPS_EXT_DIR`` (default ``~/.cache/cp_ops/ext/<hash of the sources, torch and CUDA versions>``); a later
process with the same source loads the cached ``.so`` without compiling. Never imported on CPU-only paths.
A failed build leaves its full compiler output in ``<build dir>/build.log``; :func:`load` then returns the
reason naming that file (and does not retry in this process).
"""

from __future__ import annotations

import hashlib
import os
import threading
import traceback
from pathlib import Path

def _find_source(name: str = "cp_fast.cu") -> Path:
    """``name`` (a ``.cu`` file of the repository's ``csrc/``): ``cp_ops/csrc/<name>`` in an installed wheel,
    ``<root>/csrc/<name>`` in a source checkout or an editable install (:func:`cp_ops._checkout.part_dir`).
    May not exist (cp_ops installed without its sources): :func:`load` reports that."""
    from .._checkout import part_dir

    return Path(part_dir("csrc")) / name


_SOURCE = _find_source()  # the transport's lanes and kernels
_MERGE_SOURCE = _find_source("lse_merge.cu")  # the LSE merge kernel (its own concept, same module)


def _sources() -> list[Path]:
    """Every source of the extension."""
    return [_SOURCE, _MERGE_SOURCE]


_lock = threading.Lock()
_state: dict = {}


def source_path() -> Path:
    return _SOURCE


def build_dir() -> Path:
    """Where the extension is (or will be) built: ``$CP_OPS_EXT_DIR`` or a per-source cache folder."""
    import torch

    from .. import config

    base = config.settings.ext_dir
    if base:
        return Path(base)
    h = hashlib.sha256()
    for src in _sources():
        if src.exists():
            h.update(src.read_bytes())
    h.update(f"{torch.__version__}|{torch.version.cuda}".encode())
    return Path(os.path.expanduser("~/.cache/cp_ops/ext")) / h.hexdigest()[:16]


def log_path() -> Path:
    return build_dir() / "build.log"


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
    import torch
    from torch.utils import cpp_extension

    bdir = build_dir()
    bdir.mkdir(parents=True, exist_ok=True)
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
        log = bdir / "build.log"
        log.write_text(f"torch {torch.__version__} cuda {torch.version.cuda}\n{e}\n\n{traceback.format_exc()}")
        return None, f"the cp_ops CUDA extension (csrc/cp_fast.cu) failed to build or load; build log: {log}"
    finally:
        if old_arch is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = old_arch
    (bdir / "build.log").write_text(f"built/loaded OK: {getattr(mod, '__file__', '?')}\n")
    return mod, None
