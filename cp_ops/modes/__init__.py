"""CP attention modes: a registry of mode bodies, one file per body.

A body turns the local shards ``q, k, v`` ``[B, S_local, H, D]`` of W > 1 ranks into this rank's output
``[B, S_local, H, D]`` (q's dtype, never a view of a transport's pooled buffer), written once against
:mod:`cp_ops.comm` (traced: the ``torch.library`` ops; eager: the transport directly)::

    body(q, k, v, comm, *, scale, chunks, shards, key_mask) -> out

``chunks``: the stage count; ``shards``: a :class:`cp_ops.layout.Shards` for uneven shards or a key mask (else None);
``key_mask``: bool ``[B, S_local]`` or None. The plan has checked the inputs; bodies import only :mod:`cp_ops.kernels`
and :mod:`cp_ops.layout`. A new mode: one file here and one line in :data:`_BUILTIN` (names known without importing
torch); ``mode=``, the mode rule, the CLI and the diffusers integration derive from :func:`names`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Mode:
    name: str
    #: W must divide H (the mode splits heads over the ranks).
    needs_heads_divisible: bool
    #: one line for help texts.
    summary: str
    #: "module:function" of the body for chunks = 1 (a callable once registered at run time).
    body: str | Callable
    #: "module:function" of the body for chunks ≥ 2, or None (then chunks ≥ 2 runs ``body`` too).
    pipelined: str | Callable | None = None
    #: the pipelined body waits per source (``comm.agkv_sources``), which traced code cannot express: traced, it runs
    #: inside one op (``cp_ops::agkv_pipelined_attention``) that calls the same body with the direct comm.
    pipelined_as_op: bool = False
    #: the mode's bodies take ``shards``/``key_mask`` (uneven shards, key masks); pipelined with a key mask too.
    masks_pipelined: bool = True
    #: the CP group it runs on: 1 = a process group (or 1-D mesh); 2 = a 2-D ``DeviceMesh`` (outer, inner), whose
    #: body gets a :class:`cp_ops.comm.MeshComm` and a :class:`cp_ops.mesh.MeshShards` (:mod:`cp_ops.plan.mesh2d`).
    dims: int = 1


#: The modes cp_ops ships. One line per mode.
_BUILTIN = {
    "agkv": Mode("agkv", False, "gather K/V, keep local Q", "cp_ops.modes.agkv:agkv",
                 "cp_ops.modes.agkv_pipelined:agkv_pipelined", pipelined_as_op=True, masks_pipelined=False),
    "ulysses": Mode("ulysses", True, "all-to-all sequence<->heads; W must divide the heads",
                    "cp_ops.modes.ulysses:ulysses"),
    "agkv_ulysses": Mode("agkv_ulysses", True, "2-D mesh: Ulysses over the inner dim, AGKV over the outer dim",
                         "cp_ops.modes.agkv_ulysses:agkv_ulysses", masks_pipelined=False, dims=2),
}
_REGISTRY: dict[str, Mode] = dict(_BUILTIN)


def register(name: str, body: Callable, *, pipelined: Callable | None = None, needs_heads_divisible: bool = False,
             summary: str = "") -> Mode:
    """Add a mode (replacing one of the same name): ``body`` (and ``pipelined`` for chunks ≥ 2) as described in the
    module docstring. Raises ValueError: ``name`` is 'auto' or not an identifier."""
    if name == "auto" or not name.isidentifier():
        raise ValueError(f"a mode name must be an identifier other than 'auto'; got {name!r}")
    m = Mode(name, needs_heads_divisible, summary, body, pipelined)
    _REGISTRY[name] = m
    return m


def names(include_auto: bool = True, dims: int = 1) -> tuple[str, ...]:
    """Every name a caller may pass as ``mode=`` with a CP group of ``dims`` dimensions (1: a process group or 1-D
    mesh; 2: a 2-D ``DeviceMesh``): 'auto' (unless ``include_auto=False``) and each registered mode of that kind."""
    return (("auto",) if include_auto else ()) + tuple(n for n, m in _REGISTRY.items() if m.dims == dims)


def spec(name: str) -> Mode:
    """The registry entry of ``name`` (imports nothing). Raises ValueError naming the valid names."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"mode must be one of {names()}; got {name!r}") from None


_LOADED: dict[str, Callable] = {}  # "module:function" -> the body (imported once; traced code only reads this)


def _load(ref):
    if callable(ref):
        return ref
    fn = _LOADED.get(ref)
    if fn is None:
        mod, name = ref.split(":")
        fn = _LOADED[ref] = getattr(importlib.import_module(mod), name)
    return fn


def body(name: str, chunks: int) -> Callable:
    """The body of mode ``name`` for ``chunks`` stages (imports its module on first use)."""
    m = spec(name)
    return _load(m.pipelined if chunks > 1 and m.pipelined is not None else m.body)


def load_builtin() -> None:
    """Import every built-in body (the core does when it loads: no import happens inside code torch.compile traces)."""
    for m in list(_REGISTRY.values()):
        for ref in (m.body, m.pipelined):
            if ref is not None:
                _load(ref)
