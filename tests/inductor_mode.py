"""How the suite runs Inductor. By default every graph is compiled as usual (lowering, cp_ops' lowerings, the overlap
pass, scheduling, the FX graph cache) but each op calls ATen instead of a generated C++ kernel: the CPU stand-in for
the GPUs' Triton kernels is what the tests check least and what Inductor spends most on (a compile-heavy file: -60 %
CPU time). A test of where the pass puts launches among fused kernels, or of the generated code, asks for the kernels
(:func:`inductor_kernels`; the ``inductor_kernels`` fixture of tests/conftest.py). ``TEST_INDUCTOR_KERNELS=1``:
kernels everywhere. The test process (tests/conftest.py) and the rank fork server (tests/rank_preload.py) call
:func:`fallback_kernels` before their first compile."""

import os


def fallback_kernels() -> None:
    """Inductor without C++ kernels in this process (unless ``TEST_INDUCTOR_KERNELS=1``)."""
    if os.environ.get("TEST_INDUCTOR_KERNELS", "0") != "1":
        import torch._inductor.config as c

        c.fallback_by_default = True


def inductor_kernels():
    """A context in which Inductor generates its own (fused) kernels."""
    import torch._inductor.config as c

    return c.patch(fallback_by_default=False)
