"""The CP plan: where a model's tokens are split over the CP group and where they are gathered back.

A plan is a list of ``(module path, entry)`` pairs (paths such as ``"blocks.0"``, ``"transformer_blocks.*"``:
``*`` = every child; a module may appear in several pairs, whose hooks run in list order), each entry either

- a dict ``{input name or output index: Split}`` — split that forward input (by parameter name) before the
  module runs, or that output (by index; 0 for a plain tensor) after it runs; or
- a :class:`Gather` — all-gather the module's output along the token dimension.

Every split tensor belongs to a *stream* (``"image"``, ``"text"``, or a model's own name): the tokens of one
stream are split by :func:`cp_ops.layout.shard_sizes` over the ranks, rank r holding the r-th contiguous block. A tensor that
is the concatenation of several full streams (HunyuanVideo's joint mask: ``[image, text]``) names them all and is
split stream by stream, each rank keeping ``[its image block, its text block]``.

This is diffusers' ``_cp_plan`` (``ContextParallelInput`` / ``ContextParallelOutput``) with the stream made
explicit; :func:`from_diffusers` converts a class's plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...layout import shard_sizes  # noqa: F401 - the split rule (the prefix split), re-exported for the hooks
from . import _private


@dataclass(frozen=True)
class Split:
    """Split a tensor along ``dim`` (its token dimension). ``streams``: the stream(s) it holds, in order;
    ``expected_dims``: split only a tensor of this many dimensions (others pass unchanged, as in diffusers).
    ``every_rank``: why the model needs at least one token of the stream on every rank (a model whose code cuts the
    stream off by a negative count, ``x[:, :-n]``, which is every row for ``n = 0``), or None: fewer tokens than ranks
    leave some ranks none (their tensors empty)."""

    dim: int
    streams: tuple[str, ...] = ("image",)
    expected_dims: int | None = None
    every_rank: str | None = None


@dataclass(frozen=True)
class Gather:
    """All-gather a module's output (a tensor) along ``dim``; ``stream``: the stream its tokens belong to."""

    dim: int
    stream: str = "image"
    expected_dims: int | None = None


Plan = list  # of (path, dict[str | int, Split] | Gather)


def from_diffusers(model_cls: type, text: set[tuple[str, str | int]] = frozenset(),
                   drop: set[tuple[str, str | int]] = frozenset()) -> Plan:
    """Convert ``model_cls._cp_plan`` into a :data:`Plan`. ``text``: the ``(module path, key)`` entries whose
    tokens are text (the others are image tokens); ``drop``: entries left out (e.g. text kept replicated).

    Raises:
        ValueError: the class has no ``_cp_plan``, or an entry of a kind cp_ops does not handle (lists).
    """
    cp_input, cp_output = _private.cp_plan_classes()
    source = _private.class_cp_plan(model_cls)
    if not source:
        raise ValueError(f"{model_cls.__name__} has no diffusers _cp_plan")
    plan: Plan = []
    for path, entry in source.items():
        if isinstance(entry, cp_output):
            plan.append((path, Gather(entry.gather_dim, expected_dims=entry.expected_dims)))
            continue
        if not isinstance(entry, dict):
            raise ValueError(f"{model_cls.__name__}._cp_plan[{path!r}] is {entry!r}; cp_ops handles one "
                             "ContextParallelOutput or a dict of ContextParallelInput per module")
        specs = {}
        for key, spec in entry.items():
            if (path, key) in drop:
                continue
            if not isinstance(spec, cp_input):
                raise ValueError(f"{model_cls.__name__}._cp_plan[{path!r}][{key!r}] is {spec!r}; cp_ops handles "
                                 "one ContextParallelInput per input")
            if isinstance(key, int) != spec.split_output:
                raise ValueError(f"{model_cls.__name__}._cp_plan[{path!r}][{key!r}]: integer keys (outputs) need "
                                 "split_output=True, names (inputs) split_output=False")
            stream = "text" if (path, key) in text else "image"
            specs[key] = Split(spec.split_dim, (stream,), spec.expected_dims)
        if specs:
            plan.append((path, specs))
    return plan
