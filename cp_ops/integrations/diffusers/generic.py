"""The generic installer: any diffusers transformer class that ships a ``_cp_plan`` runs under cp_ops without a
registry line (:func:`~.registry.spec_for` falls back to it). What a registry line states by hand, this finds:

- **Streams** (:func:`plan`): an input whose name says text (:data:`TEXT_NAMES`) holds ``"text"`` tokens, every
  other entry ``"image"`` ones. Per-block gathers a plan lists by index (Helios: ``blocks.0.ffn`` …
  ``blocks.39.ffn`` beside a ``blocks.*.ffn`` split) become one ``*`` gather, so a model of any depth takes it.
- **Attention modules** (:func:`attention`): every diffusers attention module inside the plan's split region (the
  subtree of each module whose inputs the plan splits, block indices widened to ``*``), cross-attention modules
  (``is_cross_attention``) excepted; modules outside it (a text refiner before the split) are left alone.
- **The streams of each call** (:func:`call`), from the shapes at run time: K/V whose local length is no split
  stream's block (or sum of blocks) are replicated, attended locally on the module's own backend; Q and K/V of one
  such length are CP attention over those streams; cross-attention to split tokens (different lengths, or those of
  ``hidden_states`` and ``encoder_hidden_states``: :func:`watch`) all-gathers K/V and attends locally. Limit:
  unsplit tokens inside the region (LTX-2's audio) are told from split ones by length alone; where that is
  ambiguous the ranks' paths differ and the call check raises on every rank. Two stream combinations that fit
  this rank's length with different per-rank counts raise (name the streams in a registry line instead).

A plan cp_ops cannot take raises ``ValueError`` from :func:`~.plan.from_diffusers` or :func:`~.hooks.resolve`.
"""

from __future__ import annotations

import inspect
import itertools
import re

import torch

from . import _private, hooks
from .plan import Gather, Plan, from_diffusers

#: name fragments of a plan input that holds text tokens
TEXT_NAMES = ("encoder", "txt", "text", "caption", "prompt")


def _is_text(key) -> bool:
    return isinstance(key, str) and any(t in key.lower() for t in TEXT_NAMES)


def _widen_indexed_gathers(plan: Plan) -> Plan:
    """``prefix.<i>.suffix`` gathers (alike) beside a ``prefix.*.suffix`` split become one ``*`` gather, in the
    first one's place."""
    split_paths = {p for p, e in plan if not isinstance(e, Gather)}
    groups: dict[tuple[str, Gather], list[int]] = {}
    for i, (path, entry) in enumerate(plan):
        m = re.fullmatch(r"(.+?)\.(\d+)((?:\..+)?)", path) if isinstance(entry, Gather) else None
        if m and f"{m.group(1)}.*{m.group(3)}" in split_paths:
            groups.setdefault((f"{m.group(1)}.*{m.group(3)}", entry), []).append(i)
    first = {idx[0]: key for key, idx in groups.items()}
    dropped = {i for idx in groups.values() for i in idx}
    return [first.get(i, pair) for i, pair in enumerate(plan) if i in first or i not in dropped]


def plan(model) -> Plan:
    """``type(model)._cp_plan`` as a cp_ops :data:`~.plan.Plan`, its text inputs named by :data:`TEXT_NAMES`.
    ValueError: no ``_cp_plan``, or an entry cp_ops does not handle (:func:`~.plan.from_diffusers`)."""
    cls = type(model)
    source = _private.class_cp_plan(cls) or {}
    text = {(path, key) for path, entry in source.items() if isinstance(entry, dict) for key in entry if _is_text(key)}
    return _widen_indexed_gathers(from_diffusers(cls, text))


def _region(source_plan: dict) -> list[tuple[str, ...]]:
    """The atoms of each module path whose inputs the plan splits, numeric atoms widened to ``*``."""
    return [tuple("*" if a.isdigit() else a for a in path.split(".") if a)
            for path, entry in source_plan.items() if isinstance(entry, dict)]


def _inside(name: str, region: list[tuple[str, ...]]) -> bool:
    atoms = name.split(".") if name else []
    return any(len(atoms) >= len(r) and all(p in ("*", a) for p, a in zip(r, atoms)) for r in region)


def attention(model) -> dict[str, tuple[str, ...]]:
    """``{module path: ()}`` for every attention module :func:`call` serves (``()``: streams found per call)."""
    region = _region(_private.class_cp_plan(type(model)) or {})
    kinds = _private.attention_module_classes()
    return {name: () for name, m in model.named_modules()
            if isinstance(m, kinds) and not getattr(m, "is_cross_attention", False) and _inside(name, region)}


def _local_sizes(state, n_local, single=False):
    """``[(streams, per-rank counts)]``: recorded split streams whose block here (or sum of blocks) is ``n_local``."""
    recorded = [s for s, t in state.totals.items() if not (isinstance(t, int) and t == 0)]
    found = []
    for k in range(1, 2 if single else len(recorded) + 1):
        for streams in itertools.combinations(recorded, k):
            counts = state.seq_lens(streams, "")
            if counts[state.rank] == n_local:
                found.append((streams, counts))
    return found


def streams_of(state, n_local: int, where: str, single: bool = False) -> tuple[str, ...] | None:
    """The split streams a sequence of ``n_local`` tokens on this rank is made of (``single``: one stream only, as
    cross-attention keys are); None: replicated tokens. ValueError: two combinations fit with different counts."""
    found = _local_sizes(state, n_local, single)
    if not found:
        return None
    if single and len(found) > 1 and any(s == ("text",) for s, _ in found):  # cross-attention keys: text first
        found = [f for f in found if f[0] == ("text",)]
    counts = {c for _, c in found}
    if len(counts) > 1:
        raise ValueError(
            f"cp_ops.parallelize ({where}): cannot tell which token streams this attention's {n_local} local tokens "
            f"are: {[s for s, _ in found]} all fit on rank {state.rank} but give the ranks different counts "
            f"{sorted(counts)}; name the module's streams in a registry line "
            "(cp_ops/integrations/diffusers/registry.py)")
    return found[0][0]


def watch(module: torch.nn.Module, config) -> None:
    """Record before each forward of ``module`` the token counts of its ``hidden_states`` and
    ``encoder_hidden_states`` (``config.cross``): a call whose Q and K/V have them is cross-attention."""
    params = list(inspect.signature(module.forward).parameters)

    def arg(name, args, kwargs):
        if name in kwargs:
            return kwargs[name]
        i = params.index(name) if name in params else len(args)
        return args[i] if i < len(args) else None

    def pre_hook(mod, args, kwargs):
        hs, ehs = arg("hidden_states", args, kwargs), arg("encoder_hidden_states", args, kwargs)
        both = isinstance(hs, torch.Tensor) and isinstance(ehs, torch.Tensor) and hs.dim() == ehs.dim() == 3
        config.cross = (hs.shape[1], ehs.shape[1]) if both else None

    config.cross = None
    module.register_forward_pre_hook(pre_hook, with_kwargs=True)


def call(config, query, key, value, attn_mask, dropout_p, is_causal, scale):
    """The attention of a module the generic installer routed (``config``: its :class:`~.dispatch.CPAttention`, with
    no streams): CP attention over the streams the shapes show, or local where K/V are replicated. Raises as
    :func:`streams_of` and :class:`~.dispatch.CPAttention`."""
    st = config.state
    sq, sk = query.shape[1], key.shape[1]
    cross = sq != sk or config.cross == (sq, sk)
    kv = streams_of(st, sk, config.where, single=cross)
    if kv is None:
        return _private.local_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                        getattr(config, "local_backend", None))
    if cross:
        return _cross_to_split(config, kv, query, key, value, attn_mask, dropout_p, is_causal, scale)
    by = config.__dict__.setdefault("_by_streams", {})
    if kv not in by:
        by[kv] = type(config)(st, kv, config.where, once=False)
    return by[kv](query, key, value, attn_mask, dropout_p, is_causal, scale)


def _cross_to_split(config, kv, query, key, value, attn_mask, dropout_p, is_causal, scale):
    """Cross-attention from this rank's queries to keys split over the group (LTX's text): K/V (and a mask over
    them) all-gathered in rank order, then local attention on the module's own backend."""
    st, sk = config.state, key.shape[1]
    if isinstance(attn_mask, torch.Tensor) and attn_mask.shape[-1] == sk:
        attn_mask = hooks.gather_tensor(attn_mask, Gather(attn_mask.dim() - 1, kv[0]), st)
    key, value = hooks.gather_tensor(key, Gather(1, kv[0]), st), hooks.gather_tensor(value, Gather(1, kv[0]), st)
    return _private.local_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                    getattr(config, "local_backend", None))
