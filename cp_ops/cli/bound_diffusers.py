"""diffusers' own context parallelism as a side of ``cp-ops run MODEL --bound W --compare diffusers``.

A copy of the model (sharing its weights) gets ``enable_parallelism(config=ContextParallelConfig(...))`` over a
device mesh of the first W ranks of the fake default group (``("ring", "ulysses")`` dims: ``(1, W)`` for Ulysses,
``(W, 1)`` for ring), so one forward is rank 0's work under diffusers' CP, timed beside cp_ops' in the same rounds.
``ulysses``: ``ulysses_degree=W`` (``ulysses_anything=True`` where W does not divide the heads, as diffusers needs);
``ring``: ``ring_degree=W`` (diffusers' ring all-gathers K/V once, then attends to each block and merges by LSE).

**The fake collectives' outputs.** diffusers moves data with functional collectives
(``torch.distributed._functional_collectives``): ``all_to_all_single`` (Ulysses: Q, K, V and the output) and
``all_gather_tensor`` (ring: K/V; the output gather of every plan). On a fake group they move nothing; torch 2.11's
fake backend writes the all-gathers (every chunk = the input) but leaves the all-to-all's output unwritten, and kernels
on stale memory run faster than on real data. :func:`filling` does for diffusers what
:mod:`cp_ops.transport.fake_fill` does for cp_ops: while a diffusers side runs, the two functions are wrapped so an
all-to-all's output is replaced by its input (this rank's own data in every slot; a functional ``aten.copy``, as
Dynamo refuses in-place writes inside diffusers' ``autograd.Function`` attention) and every write — cp_ops' copy or torch's chunk copies — is recorded (:func:`fake_fill.recording`),
timed alone (``fill_ms``) and taken out of rank 0's time, as for cp_ops' sides. Under ``torch.compile`` the copy is
traced into the graph (Inductor may fuse it); the records then come from one eager forward of the same side before
compiling (same shapes and count). A diffusers collective outside these two (``_all_gather_anything``'s
``dist.all_gather``, used by its uneven "anything" sharders) is neither written nor recorded.

diffusers' ``enable_parallelism`` places rank r on ``device r % torch.accelerator.device_count()``: on a CPU-only
torch that is a division by zero, so its CP needs an accelerator; on CPU the side becomes a row with that reason (the
CPU tests patch the device count to exercise the same path).
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from ..transport import fake_fill

#: the CP layouts a diffusers side can take
LAYOUTS = ("ulysses", "ring")


def config(layout: str, world: int, heads: int | None, mesh):
    """The ``ContextParallelConfig`` of ``layout`` at ``world`` ranks on ``mesh``.

    Raises:
        ValueError: an unknown layout (the accepted ones named).
    """
    from diffusers import ContextParallelConfig

    if layout == "ulysses":
        anything = bool(heads) and heads % world != 0
        return ContextParallelConfig(ulysses_degree=world, mesh=mesh, ulysses_anything=anything)
    if layout == "ring":
        return ContextParallelConfig(ring_degree=world, mesh=mesh)
    raise ValueError(f"a diffusers CP layout is one of {LAYOUTS}; got {layout!r}")


def mesh_for(layout: str, world: int, device: torch.device):
    """A ``("ring", "ulysses")`` device mesh over ranks ``0 .. world-1`` of the default (fake) group: ``(1, W)`` for
    Ulysses, ``(W, 1)`` for ring. This process must be rank 0 of a default group of >= ``world`` ranks."""
    from torch.distributed.device_mesh import DeviceMesh

    shape = (1, world) if layout == "ulysses" else (world, 1)
    return DeviceMesh(torch.device(device).type, torch.arange(world).view(*shape), mesh_dim_names=("ring", "ulysses"))


def parallelize(model: torch.nn.Module, layout: str, world: int, heads: int | None, device: torch.device) -> str:
    """``model.enable_parallelism`` with diffusers' ``layout`` over ``world`` ranks (see :func:`mesh_for`); returns
    a label (``'ulysses'``, ``'ulysses_anything'``, ``'ring'``). Raises what diffusers raises (e.g. on CPU:
    RuntimeError, no accelerator: diffusers itself would divide by zero) and ValueError for an unknown layout."""
    _logger_compat()
    if torch.accelerator.device_count() == 0:  # what diffusers would do: rank % 0, a ZeroDivisionError
        raise RuntimeError("diffusers' enable_parallelism needs an accelerator (it places rank r on device "
                           "r % torch.accelerator.device_count(), 0 here)")
    cfg = config(layout, world, heads, mesh_for(layout, world, device))
    model.enable_parallelism(config=cfg)
    return "ulysses_anything" if getattr(cfg, "ulysses_anything", False) else layout


def _logger_compat() -> None:
    """diffusers 0.42.1's CP hooks call ``logger.warning_once`` (added by transformers); without transformers the
    same message through ``warning`` (as :func:`cp_ops.cli.run._diffusers_rows` does)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        import diffusers.hooks.context_parallel as dcp

        if not hasattr(dcp.logger, "warning_once"):
            dcp.logger.warning_once = dcp.logger.warning


#: 'all_to_all_single' / 'all_gather_tensor' -> True when a fake group leaves the functional collective's output
#: unwritten (set by :func:`probe`; before it, what :mod:`fake_fill` probed for the process-group calls)
_unwritten: dict[str, bool] = {}


def probe(group, device) -> dict[str, bool]:
    """Which of diffusers' functional collectives a fake ``group`` leaves unwritten, on tiny tensors on ``device``:
    ``{'all_to_all_single': bool, 'all_gather_tensor': bool}`` (kept for :func:`filling`). Probed through the
    functional path itself: it passes explicit split sizes, and torch's fake backend treats that call apart from
    ``alltoall_base(out, in, [], [])`` (torch 2.13 writes every slot with this rank's chunk 0 there)."""
    import torch.distributed._functional_collectives as funcol

    w = group.size()
    # random values: the output is a fresh torch.empty, and the caching allocator may hand it a block that held an
    # earlier probe's arange (fake_fill's) — on the H200 (2026-12-01g) an arange probe read "written" that way while
    # diffusers' all-to-alls were left unwritten (its Ulysses outputs non-finite)
    g = torch.Generator(device=device).manual_seed(20261201)
    inp = torch.randn(2 * w, generator=g, device=device)
    out = funcol.wait_tensor(funcol.all_to_all_single(inp, None, None, group))
    a2a_written = torch.equal(out, inp) or torch.equal(out, inp[:2].repeat(w))
    with warnings.catch_warnings():  # the function diffusers' ring calls (deprecated in torch 2.13 for another name)
        warnings.simplefilter("ignore", FutureWarning)
        out = funcol.wait_tensor(funcol.all_gather_tensor(inp, 0, group))
    _unwritten.update(all_to_all_single=not a2a_written, all_gather_tensor=not torch.equal(out[: inp.numel()], inp))
    return dict(_unwritten)


@contextlib.contextmanager
def filling():
    """While active, diffusers' functional all-to-alls write their outputs (= their inputs) and every write is
    recorded, as :mod:`cp_ops.transport.fake_fill` does for cp_ops (after :func:`fake_fill.enable`; a plain
    pass-through otherwise). For fake groups only: every group of a ``--bound`` run is one, so the wrappers ask no
    group anything (Dynamo traces them as they are). See the module docstring."""
    import torch.distributed._functional_collectives as funcol

    a2a, gather = funcol.all_to_all_single, funcol.all_gather_tensor
    write_a2a = fake_fill.ACTIVE and _unwritten.get("all_to_all_single", fake_fill._unwritten.get("alltoall_base", True))
    write_gather = fake_fill.ACTIVE and _unwritten.get("all_gather_tensor",
                                                       fake_fill._unwritten.get("_allgather_base", True))

    def all_to_all_single(x, output_split_sizes, input_split_sizes, group, tag=""):
        out = a2a(x, output_split_sizes, input_split_sizes, group, tag)
        if not fake_fill.ACTIVE:
            return out
        if write_a2a:  # functional (aten.copy, no in-place write): Dynamo refuses mutations inside diffusers'
            out = funcol.wait_tensor(out)  # autograd.Function attention
            if out.shape == x.shape:
                out = torch.ops.aten.copy.default(out, x)
            else:  # uneven splits (ulysses_anything): this rank's data repeated to the output's size
                flat = x.reshape(-1)
                reps = -(-out.numel() // max(1, flat.numel()))
                out = torch.ops.aten.copy.default(out.reshape(-1), flat.repeat(reps)[: out.numel()]).view(out.shape)
        if not torch.compiler.is_compiling():
            flat = _Shape((out.numel(),), out)  # one copy of the output's size, whoever wrote it
            fake_fill._note("alltoall_base", flat, flat, "cp_ops" if write_a2a else "torch")
        return out

    def all_gather_tensor(x, gather_dim, group, tag=""):
        out = gather(x, gather_dim, group, tag)
        if not fake_fill.ACTIVE:
            return out
        w = out.shape[gather_dim] // x.shape[gather_dim]
        if write_gather:
            out = torch.ops.aten.copy.default(funcol.wait_tensor(out), torch.cat([x] * w, dim=gather_dim))
        if not torch.compiler.is_compiling():  # as a dim-0 gather of the same sizes (what the replay writes)
            fake_fill._note("_allgather_base", _Shape((w * x.shape[0], *x.shape[1:]), x), x,
                            "cp_ops" if write_gather else "torch")
        return out

    funcol.all_to_all_single, funcol.all_gather_tensor = all_to_all_single, all_gather_tensor
    try:
        yield
    finally:
        funcol.all_to_all_single, funcol.all_gather_tensor = a2a, gather


class _Shape:
    """What :func:`fake_fill._note` reads of a tensor (``shape``, ``dtype``, ``device``): ``shape`` with ``like``'s
    dtype and device."""

    def __init__(self, shape, like: torch.Tensor):
        self.shape, self.dtype, self.device = tuple(shape), like.dtype, like.device


def wrap(call):
    """``call`` run inside :func:`filling` (each call patches and restores: cp_ops' sides, timed between, see the
    original functions)."""

    def filled():
        with filling():
            return call()

    return filled
