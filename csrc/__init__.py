"""The fast transport's CUDA source (``cp_fast.cu``), shipped as package data so that a wheel carries it;
found by :func:`cp_ops.transport._fast_build.source_path` through ``importlib.resources``."""
