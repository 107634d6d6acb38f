"""CP attention modes: a registry, one file per mode (:mod:`.agkv`, :mod:`.ulysses`).

A mode turns the local shards ``q, k, v`` ``[B, S_local, H, D]`` of W ranks into this rank's attention
output ``[B, S_local, H, D]`` using the ops of :mod:`cp_ops._library`. Its function is called as
``fn(q, k, v, *, world_size, group_name, transport, scale)`` after :func:`cp_ops.attention` has checked the
inputs (same shape/dtype/device, ranks agree) and resolved the transport; W > 1. Inputs never require
grad there (:func:`cp_ops.attention` detaches them and attaches its own raising backward). The result must
not alias a transport's receive buffer (``Transport.pooled_outputs``: the fast transport reuses them): end
with a kernel that writes a new tensor (SDPA, or a copying unpack such as
:func:`cp_ops.layout.ulysses_inverse_unpack`).

A new mode is one file here that calls :func:`register` plus one line in :data:`_BUILTIN` (its name, module and
properties, so the names are known without importing torch: the CLI lists them before torch loads); the
public ``mode=`` argument, :func:`choose`, the CLI choices and the diffusers integration derive from
:func:`names`. A mode's module is imported the first time the mode is used.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Mode:
    name: str
    fn: Callable[..., "torch.Tensor"] | None  # None until the mode's module is imported (see module)
    #: W must divide H (the mode splits heads over the ranks).
    needs_heads_divisible: bool
    #: one line for help texts.
    summary: str
    #: the module that defines ``fn`` and calls :func:`register` (imported on first use).
    module: str = ""


#: The modes cp_ops ships: name -> (module, needs_heads_divisible, summary). One line per mode.
_BUILTIN = {
    "agkv": ("cp_ops.modes.agkv", False, "gather K/V, keep local Q"),
    "ulysses": ("cp_ops.modes.ulysses", True, "all-to-all sequence <-> heads around attention"),
}
_REGISTRY: dict[str, Mode] = {n: Mode(n, None, div, summary, mod) for n, (mod, div, summary) in _BUILTIN.items()}


def register(name: str, fn: Callable[..., "torch.Tensor"], *, needs_heads_divisible: bool = False,
             summary: str = "") -> Mode:
    """Add a mode (replacing one of the same name). ``name`` must not be 'auto'."""
    if name == "auto" or not name.isidentifier():
        raise ValueError(f"a mode name must be an identifier other than 'auto'; got {name!r}")
    m = Mode(name, fn, needs_heads_divisible, summary, getattr(fn, "__module__", ""))
    _REGISTRY[name] = m
    return m


def names(include_auto: bool = True) -> tuple[str, ...]:
    """Every name a caller may pass as ``mode=``: 'auto' (unless ``include_auto=False``) and each registered mode."""
    return (("auto",) if include_auto else ()) + tuple(_REGISTRY)


def spec(name: str) -> Mode:
    """The registry entry of ``name`` (its properties; ``fn`` may still be None): imports nothing.
    Raises ValueError naming the valid names."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"mode must be one of {names()}; got {name!r}") from None


def load_builtin() -> None:
    """Import every built-in mode's module (the core calls this when it loads, so that no import happens
    inside code that ``torch.compile`` traces)."""
    for m in list(_REGISTRY.values()):
        if m.fn is None and m.module:
            importlib.import_module(m.module)


def get(name: str) -> Mode:
    """The registered mode ``name``. Raises ValueError naming the valid names."""
    try:
        m = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"mode must be one of {names()}; got {name!r}") from None
    if m.fn is None:  # a built-in mode not imported yet: its module registers the function
        importlib.import_module(m.module)
        m = _REGISTRY[name]
    return m


def check_heads(mode: str, heads: int, world_size: int) -> None:
    """Raise ValueError if ``mode`` splits heads over the ranks and W does not divide H."""
    if spec(mode).needs_heads_divisible and heads % world_size != 0:
        others = [m for m in names(False) if not _REGISTRY[m].needs_heads_divisible]
        raise ValueError(
            f"mode={mode!r} needs the head count divisible by the CP world size; got heads={heads}, "
            f"world_size={world_size} (use mode={others[0]!r}, or a CP group whose size divides {heads})"
            if others else
            f"mode={mode!r} needs the head count divisible by the CP world size; got heads={heads}, "
            f"world_size={world_size}"
        )


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
        return "ulysses" if world_size > 2 and heads % world_size == 0 and "ulysses" in _REGISTRY else "agkv"
    check_heads(mode, heads, world_size)
    return mode

