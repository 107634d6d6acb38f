"""Run a diffusers DiT under context parallelism with cp_ops attention.

:func:`parallelize` reads the model class's own CP plan (``_cp_plan``: which module inputs/outputs to split
along the token dimension and where to gather), installs forward hooks that do exactly that for this
rank, and swaps the self-attention processors for :class:`CPWanAttnProcessor`, which calls
:func:`cp_ops.attention`. Cross-attention to the text stays local: its K/V (text tokens) are replicated on
every rank, and attention is independent per query token.

Supported: ``WanTransformer3DModel`` (Wan 2.1 / 2.2 T2V shapes).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from .. import modes
from ..attention import attention
from ..group import resolve_group
from ..transport.base import names as transport_names
from .. import config
from ..validate import call_count, check_inputs_agree, check_seq_divisible, exchange

SUPPORTED = ("WanTransformer3DModel",)
# torch 2.13 renamed all_gather_tensor to all_gather_single (same signature); 2.11 has only the old name.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _apply_rotary_emb(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    # Wan's interleaved RoPE (same arithmetic, in the same order, as diffusers' WanAttnProcessor).
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class CPWanAttnProcessor:
    """Wan self-attention (``attn1``) over a CP group: local Q/K/V projections, norms and RoPE on this
    rank's tokens, then :func:`cp_ops.attention` (AGKV or Ulysses) for full context.

    Input ``hidden_states``: ``[B, S_local, dim]``; ``rotary_emb``: this rank's ``(cos, sin)``,
    ``[1, S_local, 1, head_dim]`` each. Returns ``[B, S_local, dim]``.
    """

    def __init__(self, group: dist.ProcessGroup, mode: str, transport: str):
        self.group, self.mode, self.transport = group, mode, transport

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError(
                "CPWanAttnProcessor handles self-attention without a mask; got "
                f"encoder_hidden_states={'set' if encoder_hidden_states is not None else None}, "
                f"attention_mask={'set' if attention_mask is not None else None}"
            )
        if getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query = _apply_rotary_emb(query, *rotary_emb)
            key = _apply_rotary_emb(key, *rotary_emb)
        out = attention(query, key, value, group=self.group, mode=self.mode, transport=self.transport)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def _split(x: torch.Tensor, dim: int, pg: dist.ProcessGroup, where: str) -> torch.Tensor:
    w = pg.size()
    check_seq_divisible(x.shape[dim], w, what=f"token count at {where} (dim {dim})",
                        hint=" (choose latent frames/height/width whose patch count the CP group divides)")
    n = x.shape[dim] // w
    return x.narrow(dim, pg.rank() * n, n).contiguous()


def _spec_applies(spec, x) -> bool:
    return isinstance(x, torch.Tensor) and (spec.expected_dims is None or x.dim() == spec.expected_dims)


def _install_input_split(module: torch.nn.Module, specs: dict, pg, where: str) -> None:
    by_name = {k: v for k, v in specs.items() if isinstance(k, str)}
    by_output = {k: v for k, v in specs.items() if isinstance(k, int)}
    if by_name:
        params = list(inspect.signature(module.forward).parameters)

        def pre_hook(mod, args, kwargs):
            args = list(args)
            for name, spec in by_name.items():
                if name in kwargs and _spec_applies(spec, kwargs[name]):
                    kwargs[name] = _split(kwargs[name], spec.split_dim, pg, f"{where}.{name}")
                elif name in params and params.index(name) < len(args):
                    i = params.index(name)
                    if _spec_applies(spec, args[i]):
                        args[i] = _split(args[i], spec.split_dim, pg, f"{where}.{name}")
            return tuple(args), kwargs

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    if by_output:

        def out_hook(mod, args, output):
            single = not isinstance(output, (tuple, list))
            outs = [output] if single else list(output)
            for i, spec in by_output.items():
                if _spec_applies(spec, outs[i]):
                    outs[i] = _split(outs[i], spec.split_dim, pg, f"{where} output {i}")
            return outs[0] if single else type(output)(outs)

        module.register_forward_hook(out_hook)


_CHECKED_INPUTS = ("hidden_states", "timestep", "encoder_hidden_states")


class _RankChecks:
    """The same-call contract at the model level (eager only; compiled code keeps the per-op checks):
    the full inputs agree across ranks (a checksum; once per input shape, every forward under
    ``CP_OPS_CHECK_RANKS=always``), and every rank made the same number of cp_ops calls before the output
    gather (a rank that skipped a layer's attention raises on every rank instead of pairing layers off by one)."""

    def __init__(self, model: torch.nn.Module, pg: dist.ProcessGroup):
        self.pg, self.seen, self.start = pg, set(), 0
        self.params = list(inspect.signature(model.forward).parameters)
        model.register_forward_pre_hook(self.before_forward, with_kwargs=True)

    def before_forward(self, mod, args, kwargs):
        if torch.compiler.is_compiling():
            return
        mode = config.settings.check_ranks
        if mode != "off":
            inputs = {}
            for n in _CHECKED_INPUTS:
                i = self.params.index(n) if n in self.params else len(args)
                inputs[n] = kwargs[n] if n in kwargs else args[i] if i < len(args) else None
            key = tuple(None if x is None else (tuple(x.shape), x.dtype) for x in inputs.values())
            if mode == "always" or key not in self.seen:
                check_inputs_agree(self.pg, "cp_ops.parallelize inputs", inputs)
                self.seen.add(key)
        self.start = call_count(self.pg)

    def before_gather(self):
        if torch.compiler.is_compiling() or config.settings.check_ranks == "off":
            return
        exchange(self.pg, "cp_ops.parallelize output gather (calls this forward)", "",
                 extra=call_count(self.pg) - self.start)


def _install_output_gather(module: torch.nn.Module, spec, pg, checks: _RankChecks | None = None) -> None:
    def gather_hook(mod, args, output):
        if not _spec_applies(spec, output):
            return output
        if checks is not None:
            checks.before_gather()
        # Gather along dim 0 (token dim moved to the front) then move it back: the rank-ordered blocks
        # concatenate along the token dim, and no chunk/cat helper is traced (torch 2.11's Dynamo skips it).
        d = spec.gather_dim % output.dim()
        gathered = _all_gather(output.movedim(d, 0).contiguous(), gather_dim=0, group=pg)
        return gathered.movedim(0, d)

    module.register_forward_hook(gather_hook)


def parallelize(transformer: torch.nn.Module, group: Any = None, *, mode: str = "auto", transport: str = "auto"):
    """Make ``transformer`` run context-parallel over ``group``, in place; returns it.

    After this call every rank runs the same forward on the same full inputs (identical on every rank: same
    latents, timestep and text embeddings — seed them alike); internally each rank keeps
    only its ``S / W`` tokens after patch embedding (and the matching RoPE rows), self-attention gets full
    context through cp_ops, and the output is all-gathered before unpatchify, so every rank returns the
    full output, equal to the unparallelized model's.

    Args:
        transformer: a diffusers ``WanTransformer3DModel``.
        group: the CP group (None, ProcessGroup or 1-D DeviceMesh).
        mode, transport: as :func:`cp_ops.attention`.

    Grad mode: the forward runs with or without ``torch.no_grad()`` (parameters that require grad are fine),
    eager and under ``torch.compile(fullgraph=True)`` alike; a backward raises (cp_ops is forward only).

    Raises:
        ValueError: unsupported model class, unknown mode/transport, model already parallelized; at run time, a token count not
            divisible by the CP world size (the message names it); on every rank, when the ranks were given
            different inputs (checksums of hidden_states, timestep, encoder_hidden_states: per-rank seeds) or
            made different cp_ops calls in one forward (see :mod:`cp_ops.validate`).
        RuntimeError: torch.distributed not initialized.
    """
    name = type(transformer).__name__
    if name not in SUPPORTED:
        raise ValueError(f"cp_ops.parallelize supports {SUPPORTED}; got {name}")
    if mode not in modes.names():
        raise ValueError(f"mode must be one of {modes.names()}; got {mode!r}")
    if transport not in transport_names():
        raise ValueError(f"transport must be one of {transport_names()}; got {transport!r}")
    if getattr(transformer, "_cp_ops_group", None) is not None:
        raise ValueError(
            f"this {name} is already parallelized over CP group '{transformer._cp_ops_group.group_name}'; "
            "parallelize a fresh model (hooks installed twice would split the tokens twice)"
        )
    pg = resolve_group(group)
    from diffusers.models._modeling_parallel import ContextParallelOutput

    plan = type(transformer)._cp_plan
    for path in plan:  # resolve every module first, so a failure installs nothing
        transformer.get_submodule(path)
    transformer._cp_ops_group = pg  # marks the model before any hook goes in
    checks = _RankChecks(transformer, pg)  # its pre-hook runs first: it sees the full inputs

    for path, spec in plan.items():
        module = transformer.get_submodule(path) if path else transformer
        if isinstance(spec, ContextParallelOutput):
            _install_output_gather(module, spec, pg, checks)
        else:
            _install_input_split(module, spec, pg, path or name)

    processor = CPWanAttnProcessor(pg, mode, transport)
    for block in transformer.blocks:
        block.attn1.set_processor(processor)
    return transformer
