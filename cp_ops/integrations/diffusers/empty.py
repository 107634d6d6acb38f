"""Model code on a rank whose split left it no token of a stream (a text or an image smaller than W).

Such a rank still runs the forward (its collectives must meet the peers'), on empty tensors. diffusers' RoPE
``x.reshape(*x.shape[:-1], -1, 2)`` raises on them (the -1 is ambiguous). :class:`EmptyShapes`, a torch function
mode a split enters on a rank it leaves empty for the rest of that forward, resolves such a ``reshape``/``view`` of
an empty tensor as for a non-empty one of the same other sizes (``[B, 0, H, D]`` → ``(B, 0, H, -1, 2)``: ``D / 2``);
anything else goes through unchanged. No number is involved: the tensors are empty.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_SHAPED = {torch.Tensor.reshape, torch.Tensor.view, torch.reshape}


def _resolved(x: torch.Tensor, shape) -> tuple | None:
    """``shape`` (one -1) with the -1 resolved for the empty ``x`` (module docstring), or None."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    if not all(isinstance(n, int) for n in shape) or list(shape).count(-1) != 1 or 0 not in shape:
        return None
    have = asked = 1  # (plain loops: Dynamo traces them, where a whole-model compile runs this mode)
    for n in x.shape:
        have = have * n if n != 0 else have
    for n in shape:
        asked = asked * n if n not in (0, -1) else asked
    if asked == 0 or have % asked:
        return None
    return tuple(have // asked if n == -1 else n for n in shape)


#: Tensor methods written in Python that call ``super()`` (torch/_tensor.py), which Dynamo cannot trace from inside a
#: mode's handler: their functional forms (the same op)
_FUNCTIONAL = ((torch.Tensor.unflatten, torch.unflatten), (torch.Tensor.split, torch.split))


class EmptyShapes(TorchFunctionMode):
    """Resolve ``-1`` in ``reshape``/``view`` of tensors with no element (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SHAPED and args and isinstance(args[0], torch.Tensor) and args[0].numel() == 0 and not kwargs:
            shape = _resolved(args[0], args[1:])
            if shape is not None:
                return func(args[0], shape)
        for method, functional in _FUNCTIONAL:
            if func is method:
                return functional(*args, **kwargs)
        return func(*args, **kwargs)
