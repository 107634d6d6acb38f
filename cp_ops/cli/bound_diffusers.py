"""diffusers' own context parallelism as a side of ``cp-ops bound MODEL --worlds W --compare diffusers``: a
weight-sharing copy with ``enable_parallelism`` over a ``("ring", "ulysses")`` mesh of the first W ranks of the fake
default group (:mod:`.bound_fill`), timed beside cp_ops'. The side, its rows and its limits: ``docs/measuring.md``.
"""

from __future__ import annotations

import torch


#: the CP layouts a diffusers side can take
LAYOUTS = ("ulysses", "ring")


def config(layout: str, world: int, heads: int | None, mesh):
    """The ``ContextParallelConfig`` of ``layout`` at ``world`` ranks on ``mesh``; an unknown layout: ValueError."""
    from diffusers import ContextParallelConfig

    if layout == "ulysses":
        anything = bool(heads) and heads % world != 0
        return ContextParallelConfig(ulysses_degree=world, mesh=mesh, ulysses_anything=anything)
    if layout == "ring":
        return ContextParallelConfig(ring_degree=world, mesh=mesh)
    raise ValueError(f"a diffusers CP layout is one of {LAYOUTS}; got {layout!r}")


def mesh_for(layout: str, world: int, device: torch.device):
    """A ``("ring", "ulysses")`` device mesh over ranks ``0 .. world-1`` of the default (fake) group: ``(1, W)`` for
    Ulysses, ``(W, 1)`` for ring; its groups write their outputs where the default group does."""
    import contextlib

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from . import bound_fill

    shape = (1, world) if layout == "ulysses" else (world, 1)
    making = bound_fill.filled() if bound_fill.is_filled(dist.group.WORLD) else contextlib.nullcontext()
    with making:
        return DeviceMesh(torch.device(device).type, torch.arange(world).view(*shape),
                          mesh_dim_names=("ring", "ulysses"))


def parallelize(model: torch.nn.Module, layout: str, world: int, heads: int | None, device: torch.device,
                inputs: dict | None = None) -> str:
    """``model.enable_parallelism`` with diffusers' ``layout`` over ``world`` ranks (:func:`mesh_for`); returns the
    label (``'ulysses'``, ``'ulysses_anything'``, ``'ring'``). ``inputs``: checked against diffusers' even split first
    (:func:`require_even`; not for ``ulysses_anything``). Raises RuntimeError without an accelerator, ValueError for an
    unknown layout or a sequence W does not divide, and what diffusers raises."""
    logger_compat()
    if torch.accelerator.device_count() == 0:  # what diffusers would do: rank % 0, a ZeroDivisionError
        raise RuntimeError("diffusers' enable_parallelism needs an accelerator (it places rank r on device "
                           "r % torch.accelerator.device_count(), 0 here)")
    cfg = config(layout, world, heads, mesh_for(layout, world, device))
    if inputs and not getattr(cfg, "ulysses_anything", False):
        require_even("diffusers", model, inputs, world)
    model.enable_parallelism(config=cfg)
    return "ulysses_anything" if getattr(cfg, "ulysses_anything", False) else layout


class _AllSeen(Exception):
    """Ends :func:`split_lengths`' forward once every entry of the plan was seen."""


def split_lengths(model: torch.nn.Module, inputs: dict, plan: dict | None = None) -> list[tuple[str, int]]:
    """``(where, length)`` of each tensor a CP plan (diffusers' ``_cp_plan`` form; default: the model's) splits when
    ``model(**inputs)`` runs: a module's inputs (keyword or position, as diffusers' split hook finds them) and outputs
    (``split_output``), where they have the plan's ``expected_dims``. Found by hooks on a forward of ``model``, stopped
    once every plan path was seen. ``where``: e.g. ``'transformer_blocks.0 hidden_states'``, ``'pos_embed output 0'``"""
    import inspect

    from diffusers.hooks.context_parallel import _get_submodule_by_name

    plan = getattr(type(model), "_cp_plan", None) if plan is None else plan
    found: list[tuple[str, int]] = []
    pending: set[str] = set()
    handles = []

    def record(where, t, spec):
        if isinstance(t, torch.Tensor) and (spec.expected_dims is None or t.dim() == spec.expected_dims):
            found.append((where, t.shape[spec.split_dim]))

    def done(path):
        pending.discard(path)
        if not pending:
            raise _AllSeen

    for path, entry in (plan or {}).items():
        if not isinstance(entry, dict):  # an output gather: splits nothing
            continue
        mods = _get_submodule_by_name(model, path)
        mod = mods[0] if isinstance(mods, list) else mods
        ins = {k: v for k, v in entry.items() if not v.split_output}
        outs = {k: v for k, v in entry.items() if v.split_output}
        names = list(inspect.signature(type(mod).forward).parameters)[1:]
        pending.add(path)

        def pre(m, args, kwargs, path=path, ins=ins, outs=outs, names=names):
            for key, spec in ins.items():
                i = names.index(key) if isinstance(key, str) and key in names else key
                t = kwargs.get(key) if key in kwargs else args[i] if isinstance(i, int) and i < len(args) else None
                record(f"{path} {key}".strip(), t, spec)
            if not outs:
                done(path)

        def post(m, args, kwargs, out, path=path, outs=outs):
            out = out if isinstance(out, (tuple, list)) else (out,)
            for i, spec in outs.items():
                record(f"{path} output {i}".strip(), out[i] if i < len(out) else None, spec)
            done(path)

        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        if outs:
            handles.append(mod.register_forward_hook(post, with_kwargs=True))
    try:
        if pending:
            with torch.no_grad():
                model(**inputs)
    except _AllSeen:
        pass
    finally:
        for h in handles:
            h.remove()
    return found


def require_even(lib: str, model: torch.nn.Module, inputs: dict, world: int, plan: dict | None = None) -> None:
    """Raise ValueError (one line, naming each length) where ``world`` does not divide a length ``plan`` splits
    (:func:`split_lengths`): ``lib``'s even split pads nothing and asserts at the first forward (e.g. Qwen-Image at
    1328x1328: 6889 image tokens, which no even W divides). Empty ``inputs``: nothing checked."""
    if not inputs:
        return
    bad: dict[int, str] = {}
    for where, n in split_lengths(model, inputs, plan):
        if n % world and (n not in bad or " output " in bad[n]):  # a length named by a module's input, where one is
            bad[n] = where
    if bad:
        what = ", ".join(f"{n} ({where})" for n, where in bad.items())
        owner = lib + ("'" if lib.endswith("s") else "'s")
        raise ValueError(f"{owner} CP splits each sequence evenly over the W ranks (no padding) and W={world} does not "
                         f"divide {what}: a {lib} user at this resolution and text length hits the same AssertionError")


def logger_compat() -> None:
    """diffusers 0.42.1's CP hooks call ``logger.warning_once`` (transformers adds it); without it: ``warning``."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        import diffusers.hooks.context_parallel as dcp

        if not hasattr(dcp.logger, "warning_once"):
            dcp.logger.warning_once = dcp.logger.warning
