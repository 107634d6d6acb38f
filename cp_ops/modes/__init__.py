"""CP attention modes: a registry of mode bodies, one file per body.

A mode body turns the local shards ``q, k, v`` ``[B, S_local, H, D]`` of W ranks into this rank's attention output
``[B, S_local, H, D]`` (q's dtype, a tensor of its own: never a view of a transport's pooled buffer). It is one
function written against the communication interface of :mod:`cp_ops.comm`::

    body(q, k, v, comm, *, scale, chunks, shards, key_mask) -> out

``comm`` launches and waits (traced: the ``torch.library`` ops; eager: the transport directly — the same body
either way), ``chunks`` is the pipeline stage count, ``shards`` a :class:`cp_ops.layout.Shards` for uneven shards or a
key mask (None for the even, unmasked call), ``key_mask`` the bool ``[B, S_local]`` mask or None. The dispatcher
(:mod:`cp_ops.dispatch`) has checked the inputs, resolved the transport and agreed the call's variant; W > 1;
inputs never require grad there. Bodies import :mod:`cp_ops.kernels`, :mod:`cp_ops.layout` and nothing above.

A new mode is one file here defining its body plus one line in :data:`_BUILTIN` (its name, module, body function,
properties), so the names are known without importing torch (the CLI lists them before torch loads); the public
``mode=`` argument, :func:`choose`, the CLI choices and the diffusers integration derive from :func:`names`.

Modes:
    agkv     — :mod:`.agkv` (chunks 1) and :mod:`.agkv_pipelined` (chunks ≥ 2): gather K/V, keep the local Q.
    ulysses  — :mod:`.ulysses` (any chunks: head sub-groups): all-to-all sequence ↔ heads; W must divide H.
    agkv_ulysses — :mod:`.agkv_ulysses` (2-D mesh): Ulysses over the inner dim, AGKV of the Ulysses-local K/V over the
               outer dim (pipelined for chunks ≥ 2); the inner size must divide H.
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
    #: body gets a :class:`cp_ops.comm.MeshComm` and a :class:`cp_ops.mesh.MeshShards` (:mod:`cp_ops.dispatch_mesh`).
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
    """Import every built-in body (the core calls this when it loads, so that no import happens inside code that
    ``torch.compile`` traces)."""
    for m in list(_REGISTRY.values()):
        for ref in (m.body, m.pipelined):
            if ref is not None:
                _load(ref)


def heads_divisible(heads: int, world_size: int) -> bool:
    """Whether W divides H (the rule of every mode that splits heads)."""
    return heads % world_size == 0


def check_heads(mode: str, heads: int, world_size: int) -> None:
    """Raise ValueError if ``mode`` splits heads over the ranks and W does not divide H."""
    if spec(mode).needs_heads_divisible and not heads_divisible(heads, world_size):
        others = [m for m in names(False) if not _REGISTRY[m].needs_heads_divisible]
        hint = f"use mode={others[0]!r}, or a CP group whose size divides {heads}" if others else \
            f"use a CP group whose size divides {heads}"
        raise ValueError(f"mode={mode!r} needs the head count divisible by the CP world size; got heads={heads}, "
                         f"world_size={world_size} ({hint})")


def choose(mode: str, heads: int, world_size: int) -> str:
    """The concrete mode for ``mode=`` at ``heads`` H and CP world size W.

    'auto' → 'agkv' at W = 2 or where W does not divide H; else 'ulysses'. Why: per rank Ulysses receives
    4(W−1)/W of one local tensor (Q, K, V in, the output back), AGKV 2(W−1) (K and V of every peer): equal at
    W = 2, where Ulysses still adds a second all-to-all after the attention (nothing to hide it under) and the
    head packing, and AGKV measured ahead at every S on 2x H200 (bf16, H=40, D=128, chunks 1: 4K 1.23x vs 1.10x
    fast, 1.10x vs 0.88x torch; 8K 1.53x vs 1.48x fast, 1.40x vs 1.27x torch;
    benchmarks/results/2026-11-30d_h200x2_torch2.11_cu130); from W = 3 Ulysses moves less (W = 4: 3 vs 6 local
    tensors). A named mode is checked (ValueError: unknown name; H % W != 0 for a mode that splits heads) and
    returned.
    """
    if mode == "auto":
        return "ulysses" if world_size > 2 and heads_divisible(heads, world_size) and "ulysses" in _REGISTRY \
            else "agkv"
    if spec(mode).dims != 1:
        raise ValueError(f"mode={mode!r} runs on a 2-D DeviceMesh (mesh_dim_names ('agkv', 'ulysses')); got a 1-D CP "
                         f"group of {world_size} ranks: pass group=mesh, or one of {names()}")
    check_heads(mode, heads, world_size)
    return mode
