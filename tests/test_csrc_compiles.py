"""The CUDA extension's sources compile and link for sm_90 with the nvcc on this machine (CPU-only machines with
a CUDA toolkit: catches a csrc change that would break the fast transport's build on the GPU host). Skipped
without nvcc. Nothing runs on a GPU here: behaviour is the GPU tests' (the gpu-marked tests of tests/test_fast.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

NVCC = shutil.which("nvcc")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(NVCC is None, reason="no nvcc on this machine")
def test_extension_sources_compile_and_link(tmp_path):
    from cp_ops import _ext

    incs = [f"-I{os.path.join(os.path.dirname(torch.__file__), 'include')}", f"-I{sysconfig.get_paths()['include']}"]
    objs, procs = [], []
    # -O0: the host code unoptimized (what is checked is that it compiles and links: about half of the host compiler's
    # time at -O1); the device code is compiled as the build does (nvcc's device optimization is -O3 either way)
    for src in _ext._sources():  # compiled side by side (one core each), as ninja would
        assert src.is_file() and src.parent == ROOT / "csrc", src
        obj = tmp_path / (src.stem + ".o")
        procs.append((src, subprocess.Popen(
            [NVCC, "-std=c++17", "-O0", "--expt-relaxed-constexpr", "-arch=sm_90", "-Xcompiler", "-fPIC", *incs,
             "-DTORCH_EXTENSION_NAME=cp_ops_fast_ext", "-c", str(src), "-o", str(obj)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
        objs.append(str(obj))
    try:
        for src, p in procs:
            _, err = p.communicate(timeout=600)
            assert p.returncode == 0, f"{src.name}:\n{err[-4000:]}"
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    so = tmp_path / "cp_ops_fast_ext.so"
    p = subprocess.run([NVCC, "-shared", "-arch=sm_90", *objs, "-o", str(so)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    syms = subprocess.run(["nm", "-C", str(so)], capture_output=True, text=True).stdout
    assert "PyInit_cp_ops_fast_ext" in syms and "register_lse_merge" in syms
