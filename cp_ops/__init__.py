"""cp_ops — context-parallel (CP) attention for diffusion transformers.

Public API:
    attention(q, k, v, *, group=None, mode="auto", transport="auto", scale=None)  BSHD shards in and out
        (also chunks=, tag=, and seq_lens= / key_mask= for uneven shards and key-padding masks: cp_ops.layout.Shards;
        mode 'auto' / chunks None: the rules, cp_ops.plan.rules; measured only with CP_OPS_TUNE_MODES=1,
        cp_ops.plan.measured)
    describe(q, *, group=None, mode="auto", transport="auto", chunks=None, ...)   what attention picked / would pick
        for that call: mode, chunks, transport, source (explicit, heuristic, measured, cached, ...) and why; local
    layout.shard_sizes(total, W) / layout.shard(x, dim, rank, W)                   the standard uneven split
    agkv_gather / ulysses_all_to_all / ulysses_all_to_all_inverse                  the collectives, eager
    select_transport(requested, device_type)                                       'torch' or 'fast'
    choose_mode(mode, heads, world_size)                                           the heuristic for 'auto' (unmeasured)
    modes.names() / modes.register(name, fn, ...)                                  the CP attention modes
    local_attention(q, k, v, scale=None)                                           single-device reference
    compile(model, **torch_compile_kwargs)                                         torch.compile + overlap pass
The torch.library ops live under ``torch.ops.cp_ops``; see :mod:`cp_ops.ops`.

Importing: with torch already imported, ``import cp_ops`` loads the core at once (registers ``torch.ops.cp_ops.*``,
parses the settings); otherwise the first public name used loads it (the ``cp-ops`` command parses its arguments
before torch loads; code calling ``torch.ops.cp_ops.*`` directly imports torch or ``cp_ops.ops`` first). Neither way
imports torch's compiler or changes a process-wide setting.
"""

import sys as _sys

from . import _checkout as _checkout

_checkout.install()  # a source checkout: cp_ops.passes is <root>/passes, as the wheel installs it

from ._version import __version__  # noqa: E402,F401
from ._hooks import add_compile_hook as _add_compile_hook  # noqa: E402  (torch-free)
__all__ = [
    "attention",
    "describe",
    "agkv_gather",
    "ulysses_all_to_all",
    "ulysses_all_to_all_inverse",
    "select_transport",
    "local_attention",
    "choose_mode",
    "modes",
    "compile",
]


def _register_lowerings() -> None:
    """The compile hook: register the Inductor lowerings of the launches on the first trace (a failure warns)."""
    try:
        from .passes.lowering import register

        register()
    except Exception as e:  # noqa: BLE001 - a broken lowering must not break tracing
        import logging

        logging.getLogger("cp_ops").warning(
            "cp_ops: the Inductor lowerings of the cp_ops launches (cp_ops.passes.lowering) were not registered: "
            "%s: %s; Inductor lowers the launches as plain kernels and may reuse a launch's input before its wait",
            type(e).__name__, e,
        )


_add_compile_hook(_register_lowerings)


def _load_core() -> None:
    """Import the core's public names into this module (what ``import cp_ops`` did eagerly before)."""
    from . import ops  # noqa: F401  (registers torch.ops.cp_ops.*)
    from . import modes
    from .api import attention, describe, local_attention

    modes.load_builtin()  # the mode bodies, imported with the core (never inside traced code)
    from .plan.rules import choose_mode
    from .collectives import agkv_gather, ulysses_all_to_all, ulysses_all_to_all_inverse
    from .compiler import compile  # noqa: A004  (torch.compile + the overlap pass; imports Inductor only when called)
    from .transport.base import select_transport

    globals().update({k: v for k, v in locals().items() if k in __all__})


if "torch" in _sys.modules:  # the usual case (torch imported first): the core costs ~20 ms more; register the ops now
    _load_core()


def __getattr__(name: str):
    if name == "modes":  # a submodule (torch-free registry): import it alone, without the core
        import importlib

        return importlib.import_module(f"{__name__}.modes")
    if name in __all__:  # the first public name used imports the core
        _load_core()
        return globals()[name]
    raise AttributeError(f"module 'cp_ops' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
