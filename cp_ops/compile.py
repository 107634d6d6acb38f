"""``cp_ops.compile``: ``torch.compile`` with the K/V-communication overlap pass on.

The pass (:mod:`cp_ops.passes`) moves each K/V communication launch to right after K and V are ready and its wait to
right before attention, so the transfer runs under the Q projection, Q norm and Q RoPE of any DiT block.
The pass is imported here, lazily, when :func:`compile` is called: ``import cp_ops`` imports neither it nor
Inductor.
"""

from __future__ import annotations

from typing import Any, Callable


def compile(model: Callable | None = None, *, overlap: bool = True, **kwargs: Any):  # noqa: A001 - mirrors torch.compile
    """``torch.compile(model, **kwargs)`` with the cp_ops overlap pass enabled for this model only.

    Args:
        model: an ``nn.Module`` or function (``None``: returns a decorator, as ``torch.compile`` does).
        overlap: False compiles without the pass (same lowerings), for A/B comparisons.
        **kwargs: passed to ``torch.compile`` (``fullgraph``, ``dynamic``, ``mode``, ``options``, ...).
            The pass rides in ``options`` (Inductor config entries ``post_grad_custom_post_pass`` and
            ``_pre_fusion_custom_pass``); passes you already set there run first. ``mode`` is turned into
            the Inductor options it stands for (``torch._inductor.list_mode_options``), since ``mode`` and
            ``options`` cannot both be given to ``torch.compile``.

    Returns:
        What ``torch.compile`` returns: the compiled module/function.

    Raises:
        ValueError: ``backend`` other than 'inductor' (the pass is an Inductor pass).
        ImportError: ``overlap=True`` and :mod:`cp_ops.passes` does not import (cp_ops installed without it).
    """
    import torch

    backend = kwargs.get("backend", "inductor")
    if backend != "inductor":
        raise ValueError(f"cp_ops.compile runs Inductor passes and needs backend='inductor'; got backend={backend!r}")
    if overlap:
        from .passes import inductor_options

        options = kwargs.get("options")
        mode = kwargs.pop("mode", None)
        if mode is not None:
            from torch._inductor import list_mode_options

            options = {**list_mode_options(mode, kwargs.get("dynamic")), **(options or {})}
        kwargs["options"] = inductor_options(options)
    if model is None:
        return lambda m: torch.compile(m, **kwargs)
    return torch.compile(model, **kwargs)
