"""What the rank fork server (tests/dist_util.py) imports once, so that the ranks forked from it need not: torch and
its compiler stack, pytest, cp_ops, and diffusers' transformer models (with transformers) where diffusers is
installed. Seconds on 2 cores, per process: torch ~2-5, Dynamo + Inductor ~2-4, diffusers' models ~4.

It also fills two of Inductor's per-process caches that every rank's first CPU compile would otherwise fill itself,
both pure functions of the machine and the torch install (no compiled code, threads or Dynamo state is created):
the usable vector ISAs (``cpu_vec_isa.valid_vec_isa_list``: builds a probe .so per ISA, once per cache dir, then
dlopens each in a child Python, ~1.5 s a process on an idle core, several under load) and ``codecache.torch_key``
(a hash of torch's sources, ~0.2 s). A rank that sets ``TORCHINDUCTOR_VEC_ISA_OK`` or other import-time variables is
spawned fresh (dist_util.IMPORT_TIME) and decides for itself; ``config.cpp.vec_isa_ok`` patched in a rank is still
honoured (the ISA's answer is cached per value).

It then compiles a tiny function once (Inductor, the suite's ATen fallbacks), undoes that compile's Dynamo state and
counters, and ends the progress-bar monitor thread it started: what every process's first compile pays once (the
modules Inductor imports lazily, its pattern tables: ~0.5 s of CPU) is paid here, not in each rank that compiles.
Last, the server's objects are moved out of the garbage collector's view (``gc.freeze``): a rank's full collections
would otherwise walk (and copy-on-write) every object that torch, diffusers and the rest imported.

A module that fails to import, or a cache that fails to fill, is left out here: a rank that needs it does it itself,
and fails as a spawned rank would.
"""

import gc
import importlib

MODULES = ["torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx", "pytest", "cp_ops",
           "cp_ops.cli.launch", "diffusers.models.transformers"]

for _name in MODULES:
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001, S110 - see the module docstring
        pass


def _inductor_caches() -> None:
    from torch._inductor import codecache, cpu_vec_isa

    cpu_vec_isa.valid_vec_isa_list()
    if hasattr(codecache, "torch_key"):
        codecache.torch_key()


try:
    _inductor_caches()
except Exception:  # noqa: BLE001, S110 - see the module docstring
    pass


try:  # Inductor without C++ kernels in the ranks, as in the test process (tests/inductor_mode.py)
    import inductor_mode

    inductor_mode.fallback_kernels()
except Exception:  # noqa: BLE001, S110
    pass


def _first_compile() -> None:
    """One compile, leaving no Dynamo state, counter, thread or OpenMP team behind (see the module docstring)."""
    import torch
    from torch._dynamo.utils import counters

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # no OpenMP team in the server: its forks set their own thread counts
    try:
        torch.compile(lambda x: (x.sin() * 2).sum(-1), fullgraph=True)(torch.ones(2, 2))
    finally:
        torch._dynamo.reset()
        counters.clear()
        torch.set_num_threads(threads)
        import tqdm  # torch.fx's interpreter made a (disabled) bar, whose class started a monitor thread

        if getattr(tqdm.tqdm, "monitor", None) is not None:
            tqdm.tqdm.monitor.exit()
            tqdm.tqdm.monitor = None


try:
    _first_compile()
except Exception:  # noqa: BLE001, S110 - see the module docstring
    pass

gc.collect()
gc.freeze()
