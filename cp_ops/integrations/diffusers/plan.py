"""The CP plan: where a model's tokens are split over the CP group and where they are gathered back.

A plan is a list of ``(module path, entry)`` pairs (``"blocks.0"``, ``"transformer_blocks.*"``: ``*`` = every child;
hooks of a module in several pairs run in list order), each entry a dict ``{input name or output index: Split}``
(split that input before the module runs, or that output after) or a :class:`Gather` (all-gather the output).
Every split tensor belongs to a *stream* (``"image"``, ``"text"``, ...), split by :func:`cp_ops.layout.shard_sizes`,
rank r holding the r-th block; a concatenation of full streams (HunyuanVideo's joint mask) names them all and is
split stream by stream. This is diffusers' ``_cp_plan`` with the stream made explicit (:func:`from_diffusers`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...layout import shard_sizes  # noqa: F401 - the split rule (the prefix split), re-exported for the hooks
from . import _private


@dataclass(frozen=True)
class Split:
    """Split a tensor along ``dim`` (its token dimension). ``streams``: the stream(s) it holds, in order;
    ``expected_dims``: split only a tensor of this many dimensions (others pass, as in diffusers); ``every_rank``: why
    the model needs a token of the stream on every rank (it cuts by ``x[:, :-n]``), or None (ranks may hold none)."""

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
    """Convert ``model_cls._cp_plan`` into a :data:`Plan`. ``text``: the ``(module path, key)`` entries whose tokens
    are text (else image); ``drop``: entries left out. ValueError: no ``_cp_plan``, or an entry cp_ops does not handle.
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
