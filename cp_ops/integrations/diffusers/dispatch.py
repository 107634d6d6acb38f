"""cp_ops attention plugged in at diffusers' attention dispatch.

:func:`route` points a module's processor at the ``cp_ops`` backend (registered in diffusers' backend registry,
:mod:`._private`) with a :class:`CPAttention` as its ``_parallel_config``; the backend calls :func:`cp_ops.attention`
with it, and the model's processor code runs unchanged. Only the modules a registry entry names are routed (Wan's
cross-attention stays local); a routed processor that dispatches without its ``parallel_config`` raises. A routed
module's first attention call of a forward is the CP call over its split streams; later calls (an IP-Adapter's)
attend locally (docs/pipelines.md, "replicated context").
"""

from __future__ import annotations

import torch

from ...api import attention
from . import _private, generic
from .hooks import CPState
from .plan import shard_sizes


#: under 255 characters: CUDA's torch._assert_async refuses a longer message (RuntimeError "Message length must be
#: smaller than 255", raised on the first eager call of a masked model on a GPU)
_MASK_RULE = ("cp_ops.parallelize: an attention call's key mask differs from this rank's block of the forward's mask "
              "input (CPState.note_key_mask); a processor building its mask otherwise is not supported")


def _same_shape(shape: tuple, want: tuple) -> bool:
    """``shape == want`` size by size: under ``torch.compile(dynamic=True)`` each comparison becomes a guard (a
    tuple's ``in`` returned False for a specialized size against the symbolic count equal to it)."""
    return len(shape) == len(want) and all(x == y for x, y in zip(shape, want))


class CPAttention:
    """A processor's ``_parallel_config``: the CP group (via the model's :class:`CPState`) and the streams its
    token sequence is made of (``("text", "image")`` for joint attention: each rank holds its block of each)."""

    def __init__(self, state: CPState, streams: tuple[str, ...], where: str, once: bool = True):
        self.state, self.streams, self.where = state, streams, where
        #: the module attends its streams once per forward (module docstring), or at every call whose shapes fit them
        #: (False: the generic installer's per-call configs, which found the streams from the shapes)
        self.once = once
        #: this forward of the module has made its CP attention call (reset before each forward: :func:`route`)
        self.attended = False

    def __repr__(self):
        return (f"CPAttention({self.where}, streams={self.streams}, W={self.state.world}, mode={self.state.mode!r}, "
                f"chunks={self.state.chunks!r})")

    def key_mask(self, attn_mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
        """A key-padding mask ``[B, S_local]`` (bool, True = attend) from diffusers' bool ``attn_mask`` of this
        rank's keys, ``[B, S_local]`` or ``[B, 1, 1, S_local]``; ValueError for any other kind."""
        if attn_mask is None:
            return None
        b, s = q.shape[0], q.shape[1]
        shape = tuple(attn_mask.shape)
        shaped = any(_same_shape(shape, want) for want in ((b, s), (b, 1, 1, s), (1, s), (1, 1, 1, s)))
        if shaped and attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise ValueError(f"cp_ops.parallelize ({self.where}): the attention mask must be a bool key-padding mask "
                             f"(True = attend): pass a bool mask (for a 0/1 mask: mask > 0); got dtype "
                             f"{attn_mask.dtype}, shape {shape}")
        if attn_mask.dtype != torch.bool or not shaped:
            raise ValueError(
                f"cp_ops.parallelize ({self.where}): CP attention takes key-padding masks only — bool, shape "
                f"[B, S_local] or [B, 1, 1, S_local] = {(b, s)} / {(b, 1, 1, s)}; got dtype {attn_mask.dtype}, shape "
                f"{shape}. Float (additive) and per-query masks are not supported under CP")
        return attn_mask.reshape(attn_mask.shape[0], s).expand(b, s)

    def __call__(self, query, key, value, attn_mask, dropout_p, is_causal, scale):
        if dropout_p != 0.0 or is_causal:
            raise ValueError(f"cp_ops.parallelize ({self.where}): CP attention is non-causal without dropout; got "
                             f"dropout_p={dropout_p}, is_causal={is_causal}")
        if not self.streams:  # a module of a generic _cp_plan model: its streams are found per call
            return generic.call(self, query, key, value, attn_mask, dropout_p, is_causal, scale)
        if self.attended:  # a later call of this forward: replicated context (module docstring)
            return _private.local_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                            getattr(self, "local_backend", None))
        self.attended = self.once
        st = self.state
        totals = [st.total(s, self.where) for s in self.streams]
        if not torch.compiler.is_compiling():
            local = sum(shard_sizes(t, st.world)[st.rank] for t in totals)  # this rank's tokens of the streams
            if query.shape[1] != local or key.shape[1] != local:
                raise ValueError(
                    f"cp_ops.parallelize ({self.where}): the first attention call of this module's forward must "
                    f"attend its split streams {self.streams} ({local} tokens on rank {st.rank}); got query "
                    f"{tuple(query.shape)} and key {tuple(key.shape)} (BSHD). Later calls of the forward attend "
                    "K/V every rank holds whole (IP-Adapter tokens) locally; name the module's streams in its "
                    "registry line (cp_ops/integrations/diffusers/registry.py)")
        kwargs = {}
        mask = self.key_mask(attn_mask, query)
        if any(t % st.world != 0 for t in totals):
            kwargs["seq_lens"] = st.seq_lens(self.streams, self.where)
        if mask is not None:
            kwargs["key_mask"] = self._every_key(mask) if st.key_masks else mask
        chunks = st.chunks
        if kwargs and chunks is not None and chunks > 1:  # seq_lens / key_mask: transport-then-attend only
            chunks = 1
        # tag: the module's path (a rank that skips a layer raises), eager only: compiled, a per-module constant
        # would make every block of a repeated class compile its own graph
        tag = None if torch.compiler.is_compiling() else self.where
        return attention(query, key, value, group=st.attn_group, mode=st.mode, transport=st.transport, scale=scale,
                         chunks=chunks, tag=tag, comm_dtype=st.comm_dtype, **kwargs)
    def _every_key(self, mask: torch.Tensor) -> torch.Tensor:
        """The every-key mask ``[B, S_total]`` of this forward (:meth:`CPState.note_key_mask`), so
        :func:`cp_ops.attention` gathers nothing; ``mask`` where there is none. Its block for this rank must equal
        ``mask``: checked on the device (no host sync), so a processor that builds its mask otherwise stops."""
        st = self.state
        every = st.key_masks.get(self.streams)
        b, s = mask.shape
        if every is None or every.shape[0] not in (1, b) or every.device != mask.device:
            return mask
        seq = st.seq_lens(self.streams, self.where)
        if every.shape[1] != sum(seq) or seq[st.rank] != s:
            return mask
        every = every.expand(b, every.shape[1])
        off = sum(seq[:st.rank])
        # a constant message (the module's path would be a per-block constant: one compile per block)
        torch._assert_async((every[:, off:off + s] == mask).all(), _MASK_RULE)
        return every


def cp_ops_backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask=None,
                   dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False, _parallel_config=None) -> torch.Tensor:
    """diffusers attention backend ``cp_ops``: BSHD in and out, CP attention through the :class:`CPAttention`
    ``_parallel_config``. ValueError: no CPAttention (a path that bypasses CP, or the backend chosen globally);
    ``enable_gqa``."""
    if not isinstance(_parallel_config, CPAttention):
        raise ValueError(
            "diffusers attention backend 'cp_ops' was called without its CP config (parallel_config="
            f"{type(_parallel_config).__name__}): a processor path that bypasses diffusers' parallel_config (e.g. "
            "Flux2's reference-token KV cache) is not supported under cp_ops.parallelize, and the backend is not "
            "for global use (attention_backend('cp_ops'))")
    if enable_gqa:
        raise ValueError(f"cp_ops.parallelize ({_parallel_config.where}): enable_gqa is not supported under CP")
    return _parallel_config(query, key, value, attn_mask, dropout_p, is_causal, scale)


def route(module: torch.nn.Module, state: CPState, streams: tuple[str, ...], where: str) -> CPAttention:
    """Send ``module``'s attention through cp_ops over ``state``'s group; returns its :class:`CPAttention`."""
    member = _private.register_backend(cp_ops_backend)
    config = CPAttention(state, streams, where)
    config.local_backend = getattr(module.processor, "_attention_backend", None)  # for calls that need no CP
    if streams:
        state.attn_streams.add(tuple(streams))

        def new_forward(mod, args, kwargs):
            config.attended = False

        module.register_forward_pre_hook(new_forward, with_kwargs=True)
    else:
        generic.watch(module, config)
    _private.route_processor(module, member, config)
    return config
