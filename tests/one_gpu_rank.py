"""A rank of ``tests/dist_util.run_ranks(..., device="one_gpu")``: every rank on cuda:0 in one ``cpu:gloo,cuda:gloo``
group (gloo moves the CUDA tensors), so one GPU runs W ranks' real kernels on data really moved; with
``backend="staged"`` the group is tests/staged_pg.py's instead (each collective staged through host memory onto gloo:
gloo's own CUDA path died with SIGSEGV in other libraries' collectives), on ``device="one_gpu"`` or on CPU ranks.

This module imports only the standard library at its top, and the test's body (named ``"module:function"``, so
unpickling the spawned target imports nothing of cp_ops) is imported after the group exists: on the H200 (torch
2.11) the same body segfaulted in its first gloo CUDA all-gather's wait when the rank had imported cp_ops (through
dist_util) before ``set_device``/``init_process_group``, and passed when it had not.
"""

import importlib
import os
import sys
import traceback


def worker(rank, world_size, port, ref, args, errq, backend=None, cuda=True):
    """Spawned target: join the group (``backend``: None, gloo for CPU and CUDA tensors, or ``"staged"``; ``cuda``:
    on cuda:0, else CPU ranks sharing the cores), import ``ref`` ("module:function"), call it as
    ``fn(rank, world_size, *args)``; report ``(rank, None)`` or ``(rank, traceback)`` on ``errq``; a failure before
    the body is reported too."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the test modules and dist_util
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        if cuda:
            torch.cuda.set_device(0)
        else:  # as dist_util's CPU ranks: the ranks share the cores
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
        if backend == "staged":
            import staged_pg

            staged_pg.register()
        dist.init_process_group(backend or "cpu:gloo,cuda:gloo", rank=rank, world_size=world_size)
        module, name = ref.split(":")
        fn = getattr(importlib.import_module(module), name)
        fn(rank, world_size, *args)
        if cuda:
            torch.cuda.synchronize()
        errq.put((rank, None))
    except BaseException:  # noqa: BLE001 - every failure reaches the parent
        errq.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
