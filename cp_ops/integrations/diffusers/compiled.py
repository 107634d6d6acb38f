"""Regional compilation of a diffusers transformer: every repeated block through :func:`cp_ops.compile`
(``parallelize(..., compile=True)``, ``cp-ops run --compile regional``; docs/diffusers_compile_caches.md).

Each block's instance ``forward`` becomes ``cp_ops.compile(block.forward, fullgraph=True, dynamic=False)``; the blocks
of one class share one Dynamo frame, so a model compiles once per block class and shape, as diffusers'
``compile_repeated_blocks``. Module hooks stay eager around the compiled forwards. Which blocks: the classes the model
names in ``_repeated_blocks``, else the children of the ``blocks`` names given.
"""

from __future__ import annotations

from typing import Iterable

import torch

#: instance attribute holding the pre-hook handle of a compiled block (see :func:`_canonical_strides`)
_HOOK = "_cp_ops_strides"


def repeated_blocks(model: torch.nn.Module, blocks: Iterable[str] = ()) -> list[torch.nn.Module]:
    """The modules regional compilation compiles (see the module docstring); a module inside another listed one is
    not listed again. ``blocks``: names of ModuleLists of ``model`` to use when its class has no ``_repeated_blocks``.
    """
    names = set(getattr(type(model), "_repeated_blocks", None) or ())
    if not names:
        return [b for name in blocks for b in getattr(model, name, [])]
    found, inside = [], []
    for path, module in model.named_modules():
        if any(path.startswith(p + ".") for p in inside):
            continue
        if type(module).__name__ in names:
            found.append(module)
            inside.append(path)
    return found


def compile_blocks(model: torch.nn.Module, *, cuda_graphs: bool = False, overlap: bool = True,
                   blocks: Iterable[str] = (), **compile_kwargs) -> int:
    """Compile every repeated block of ``model`` in place (regional compilation); returns how many. ``cuda_graphs``:
    ``mode="reduce-overhead"`` (call ``torch.compiler.cudagraph_mark_step_begin()`` before each step); ``overlap``: the
    cp_ops overlap pass (False: plain lowering); ``blocks``: see :func:`repeated_blocks`; ``compile_kwargs`` override
    the defaults. ValueError: no repeated block, or one already compiled; RuntimeError as :func:`cp_ops.compile`."""
    import cp_ops

    why = not_compilable(model, blocks)
    if why:
        raise ValueError(f"compile_blocks: {why}")
    found = repeated_blocks(model, blocks)
    kw = {"fullgraph": True, "dynamic": False, "overlap": overlap, **compile_kwargs}  # compile_kwargs may override
    if cuda_graphs:
        kw["mode"] = "reduce-overhead"
    for block in found:
        # the instance's forward; equal cp_ops.compile options make equal Inductor backends: one Dynamo frame
        block.forward = cp_ops.compile(block.forward, **kw)
        block.__dict__[_HOOK] = block.register_forward_pre_hook(_canonical_strides, with_kwargs=True)
    return len(found)


def not_compilable(model: torch.nn.Module, blocks: Iterable[str] = ()) -> str | None:
    """Why :func:`compile_blocks` would refuse ``model`` (no repeated block; blocks already compiled), or None."""
    found = repeated_blocks(model, blocks)
    if not found:
        return (f"{type(model).__name__} names no _repeated_blocks and no block list was given "
                f"(blocks={tuple(blocks)}); nothing to compile")
    if any(_HOOK in b.__dict__ for b in found):
        return f"the blocks of this {type(model).__name__} are already compiled (uncompile_blocks first)"
    return None


def uncompile_blocks(model: torch.nn.Module, blocks: Iterable[str] = ()) -> None:
    """Undo :func:`compile_blocks` (the instance ``forward`` attributes and the stride pre-hooks)."""
    for block in repeated_blocks(model, blocks):
        block.__dict__.pop("forward", None)
        hook = block.__dict__.pop(_HOOK, None)
        if hook is not None:
            hook.remove()


def contiguous_strides(shape) -> tuple:
    """The strides ``torch.empty(shape)`` gets (row-major; a size-0 or size-1 dim counts as 1 in its outer ones)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def canonical(x):
    """``x`` itself when its strides are :func:`contiguous_strides` of its shape (or not a tensor), else such a copy."""
    if not isinstance(x, torch.Tensor) or x.stride() == contiguous_strides(x.shape):
        return x
    return torch.empty(x.shape, dtype=x.dtype, device=x.device).copy_(x)


def _canonical_strides(module, args, kwargs):
    """Forward pre-hook of a compiled block: tensor arguments copied to contiguous strides. The first block's input
    is a view (a transposing patch embedding, the CP split), which Dynamo guards by stride even along a size-1 dim:
    without this every block class compiles twice."""
    return tuple(canonical(a) for a in args), {k: canonical(v) for k, v in kwargs.items()}
