"""``cp_ops.compile``: ``torch.compile`` with the K/V-communication overlap pass on.

The pass (:mod:`passes`) moves each K/V communication launch to right after K and V are ready and its wait to
right before attention, so the transfer runs under the Q projection, Q norm and Q RoPE of any DiT block.
The core never imports the pass: it is found through the entry-point group :data:`OVERLAP_PASS_GROUP`
(declared in ``pyproject.toml``: ``passes:inductor_options``), so the dependency runs one way, passes → cp_ops.
"""

from __future__ import annotations

from typing import Any, Callable

#: Entry-point group naming the overlap pass: a callable ``(existing Inductor options | None) -> options``.
OVERLAP_PASS_GROUP = "cp_ops.overlap_pass"


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
        RuntimeError: ``overlap=True`` and no overlap pass is declared (entry-point group
            ``cp_ops.overlap_pass``; the ``passes`` package of this project, not installed).
    """
    import torch

    from ._hooks import declared_entry_points

    backend = kwargs.get("backend", "inductor")
    if backend != "inductor":
        raise ValueError(f"cp_ops.compile runs Inductor passes and needs backend='inductor'; got backend={backend!r}")
    if overlap:
        found = declared_entry_points(OVERLAP_PASS_GROUP)
        if not found:
            raise RuntimeError(
                f"cp_ops.compile(overlap=True) found no overlap pass (entry-point group {OVERLAP_PASS_GROUP!r}, "
                "package 'passes'): install cp_ops with its passes (pip install -e .), or pass overlap=False"
            )
        options = kwargs.get("options")
        mode = kwargs.pop("mode", None)
        if mode is not None:
            from torch._inductor import list_mode_options

            options = {**list_mode_options(mode, kwargs.get("dynamic")), **(options or {})}
        for _, inductor_options in found:
            options = inductor_options(options)
        kwargs["options"] = options
    if model is None:
        return lambda m: torch.compile(m, **kwargs)
    return torch.compile(model, **kwargs)
