"""What the rank fork server (tests/dist_util.py) imports once, so that the ranks forked from it need not: torch and
its compiler stack, pytest, cp_ops, and diffusers' transformer models (with transformers) where diffusers is
installed. Seconds on 2 cores, per process: torch ~2-5, Dynamo + Inductor ~2-4, diffusers' models ~4.

A module that fails to import is left out here: a rank that needs it imports it itself, and fails as a spawned
rank would.
"""

import importlib

MODULES = ["torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx", "pytest", "cp_ops",
           "cp_ops.cli.launch", "diffusers.models.transformers"]

for _name in MODULES:
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001, S110 - see the module docstring
        pass
