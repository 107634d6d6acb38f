"""Inductor lowerings that make the cp_ops launches *collectives* to Inductor.

Without them Inductor lowers the launches (``cp_ops.ops.LAUNCH_OPS``: ``agkv_gather_start``,
``ulysses_start``, ``ulysses_inverse_start``) as ordinary fallback kernels: ``_c10d_functional.wait_tensor`` on their outputs then tracks nothing, and the
memory planner may hand a launch's *input* buffer to a later kernel while the transport is still reading it
(on CUDA: an NCCL stream reading what a compute kernel is overwriting).

Lowered here as ``ir._CollectiveKernel`` (out of place), exactly as Inductor lowers
``symm_mem._low_contention_all_gather`` (``torch/_inductor/comm_lowering.py``):

* the launch's outputs are collective outputs; ``wait_tensor`` on one of them is modelled as a mutation of
  that output, so nothing reads it before the wait;
* ``_WaitKernel.get_volatile_reads`` adds the launch input behind each output as a read of the wait, so that
  input stays alive (is not reused) until the wait — for AGKV, ``wait(k_full)`` keeps ``k`` alive and
  ``wait(v_full)`` keeps ``v`` alive;
* ``is_collective`` is true for the launch, so Inductor's comm ordering (``decide_global_ordering_of_comms``)
  keeps the launches of all ranks in one order.

Ulysses launches have one output but several inputs, and Inductor's wait tracks only the *first* input
behind a single output; the fast transport reads every input after the launch returns (copy engines), so the
``wait_tensor`` lowering is wrapped to report all of a Ulysses launch's inputs as reads of its wait.

Inputs are made contiguous first (as Inductor does for c10d collectives), so the buffer the transport reads
is the buffer Inductor keeps alive. Outputs are never recycled by Inductor's buffer reuse (the fast
transport returns views of pooled symmetric buffers that peers write again at a later call).
"""

from __future__ import annotations

import logging

import torch

from cp_ops.ops import LAUNCH_OPS

log = logging.getLogger("cp_ops.passes")
_registered = False


def _lower_one_output_per_input(kernel):
    """A launch with one output per tensor input (AGKV: ``(k, v) → (k_full, v_full)``)."""

    def lower(*args):
        from torch._inductor import ir
        from torch._inductor.virtualized import V

        args = [ir.ExternKernel.require_contiguous(a) if isinstance(a, ir.IRNode) else a for a in args]
        with V.graph.fake_mode:
            example, tensor_args, non_tensor_args, unflatten_args, unbacked = ir._CollectiveKernel.process_kernel(
                kernel, *args
            )
        assert not unbacked, f"{kernel}: unexpected unbacked symbols {unbacked}"
        for t in tensor_args:
            t.realize()
        device = tensor_args[0].get_device()
        packed = ir._CollectiveKernel(ir.MultiOutputLayout(device=device), kernel, tensor_args, non_tensor_args, unflatten_args)
        # Output i is written from input i: _WaitKernel.get_volatile_reads maps index i back to inputs[i].
        packed.outputs = [
            ir.MultiOutput(ir._CollectiveKernel.tensor_to_layout(t), packed, [(list, i)]) for i, t in enumerate(example)
        ]
        _mark_unaligned(packed.outputs, example)
        _never_reuse(packed.outputs)
        return [ir.TensorBox.create(o) for o in packed.outputs]

    return lower


def _never_reuse(bufs) -> None:
    """Inductor must not recycle a launch's output memory for other tensors: the fast transport's outputs are
    views of pooled symmetric buffers that peers write into again at a later call (see its module docs)."""
    from torch._inductor.virtualized import V

    for buf in bufs:
        V.graph.never_reuse_buffers.add(buf.get_name())


def _mark_unaligned(bufs, examples) -> None:
    """As ``_CollectiveKernel.create_out_of_place`` does: outputs Inductor may not assume aligned."""
    try:
        from torch._inductor import config
        from torch._inductor.utils import tensor_is_aligned
        from torch._inductor.virtualized import V
    except ImportError:  # pragma: no cover - depends on the torch version
        return
    for buf, t in zip(bufs, examples):
        if getattr(config, "assume_unaligned_fallback_output", False) or not tensor_is_aligned(t):
            V.graph.unaligned_buffers.add(buf.get_name())


def _lower_out_of_place(kernel):
    def lower(inputs, *args):
        from torch._inductor import ir

        if isinstance(inputs, (list, tuple)):
            inputs = [ir.ExternKernel.require_contiguous(t) for t in inputs]
        else:
            inputs = ir.ExternKernel.require_contiguous(inputs)
        node = ir._CollectiveKernel.create_out_of_place(kernel, inputs, *args)
        _never_reuse([node])
        if len(node.inputs) > 1:
            # One output read from several inputs: the wait must keep all of them alive (see _lower_wait).
            node._cp_ops_volatile_inputs = list(node.inputs)
        return ir.TensorBox.create(node)

    return lower


def _wrap_wait_lowering(lowerings: dict) -> None:
    """Make ``wait_tensor`` on a multi-input Ulysses launch keep *every* input alive until the wait.

    Inductor's ``_WaitKernel.get_volatile_reads`` returns the first input behind a single-output collective;
    a Ulysses launch of ``[k, v]`` has one output and two inputs, and a transport that reads its inputs after
    the launch returns (the fast transport's copy engines do) needs both. The registered ``wait_tensor``
    lowering is wrapped: it runs unchanged, then a wait on such a launch reports all the launch's inputs as
    volatile reads (read deps of the wait: their buffers are neither freed nor reused before it).
    """
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    wait = torch.ops._c10d_functional.wait_tensor.default
    orig = lowerings.get(wait)
    if orig is None or getattr(orig, "_cp_ops_wrapped", False):
        return

    def lower_wait(*args, **kwargs):
        first = len(V.graph.operations)
        out = orig(*args, **kwargs)
        for op in V.graph.operations[first:]:
            if isinstance(op, ir._WaitKernel) and op.inputs:
                extra = getattr(op.inputs[0], "_cp_ops_volatile_inputs", None)
                if extra:
                    op.get_volatile_reads = lambda extra=extra: list(extra)
        return out

    lower_wait._cp_ops_wrapped = True
    lowerings[wait] = lower_wait


def register() -> bool:
    """Register the Inductor lowerings of the cp_ops launches (idempotent).

    Returns True when they are registered, False when this torch's Inductor lacks what they need
    (``ir._CollectiveKernel``, ``lowering.register_lowering``); then Inductor lowers the launches as plain
    fallback kernels and a warning says so. Importing :mod:`torch._inductor` costs about a second, so this runs
    on the first trace of a cp_ops op (the compile hook :mod:`cp_ops` registers in :mod:`cp_ops._hooks` imports this module then) or when the pass is installed, never when :mod:`cp_ops` is imported.
    """
    global _registered
    if _registered:
        return True
    try:
        from torch._inductor import ir
        from torch._inductor.lowering import add_layout_constraint, constrain_to_fx_strides, register_lowering

        needed = (ir._CollectiveKernel, ir.MultiOutput, ir.MultiOutputLayout, ir._CollectiveKernel.create_out_of_place)
    except (ImportError, AttributeError) as e:  # pragma: no cover - depends on the torch build
        log.warning("cp_ops.passes: Inductor lowerings of the cp_ops launches not registered: %s", e)
        return False
    del needed
    for op in LAUNCH_OPS:  # the ops table of cp_ops.ops
        many = len(op._schema.returns) > 1
        fn = _lower_one_output_per_input(op) if many else _lower_out_of_place(op)
        add_layout_constraint(op.overloadpacket, constrain_to_fx_strides)
        register_lowering(op.overloadpacket, type_promotion_kind=None)(fn)
    try:
        from torch._inductor.lowering import lowerings

        _wrap_wait_lowering(lowerings)
    except (ImportError, AttributeError) as e:  # pragma: no cover - depends on the torch version
        log.warning("cp_ops.passes: Ulysses launches keep only their first input alive until the wait: %s", e)
    _registered = True
    return True
