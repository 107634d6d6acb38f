"""diffusers' step caches on a parallelized model: every rank decides the same (docs/diffusers_compile_caches.md,
"Step caches"). ``FirstBlockCache`` decides from the first block's residual, under CP *this rank's* tokens, so ranks
could decide differently and their collectives pair wrongly or hang (cache-dit #1094, vllm-omni #4814, sglang
#19955): :func:`agree_step_caches` all-reduces the metric's two sums, so all decide on the one-device metric.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types

import torch
import torch.distributed as dist

from ...captured import captured

#: cache hook classes that decide from this rank's tokens and that cp_ops cannot (yet) make agree
_REFUSED = ("SeaCacheRootHook", "SeaCacheLeaderBlockHook", "SeaCacheBlockHook", "SeaCachePostNormHook")


def _hooks(model: torch.nn.Module):
    for module in model.modules():
        registry = getattr(module, "_diffusers_hook", None)
        for hook in (getattr(registry, "hooks", None) or {}).values():
            yield hook


def agree_step_caches(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """Make the step caches enabled on the parallelized ``model`` decide alike on every rank; returns how many
    decision points it changed. Idempotent; ``parallelize`` calls it, and again after each ``model.enable_cache``.
    ``group``: the ranks whose tokens make up the input (default: both CFG lanes' where there are lanes). A forward
    captured by default (``cuda_graphs="auto"``) runs eager from then on, with one warning. ValueError: SeaCache
    (not reduced); a model not parallelized and no group."""
    pg = group if group is not None else getattr(model, "_cp_ops_input_group", None)
    if pg is None:
        raise ValueError("agree_step_caches: the model is not parallelized (cp_ops.integrations.diffusers."
                         "parallelize) and no group was given")
    why = refused_cache(model)
    if why:
        raise ValueError(why)
    cf = captured(model)  # parallelize's default whole-forward capture goes eager
    if cf is not None and cf.fallback is not None and (why := host_hooks(model)) is not None:
        cf.go_eager(why)
    n = 0
    for hook in _hooks(model):
        if type(hook).__name__ == "FBCHeadBlockHook" and not getattr(hook, "_cp_ops_group", None):
            # the group read at each decision: a forward one CFG lane runs alone (a pipeline's branch call) is
            # the lane's (.lanes.Lanes.alone sets the model's _cp_ops_input_group for it)
            hook._cp_ops_group = (lambda: group) if group is not None else (lambda: model._cp_ops_input_group)
            hook._should_compute_remaining_blocks = types.MethodType(_fbc_should_compute, hook)
            n += 1
    return n


@contextlib.contextmanager
def state_apart(model: torch.nn.Module, suffix: str):
    """Step caches' state kept apart for the forwards run inside: the ``cache_context`` name in force gets ``suffix``
    (a forward over other ranks than the CFG lane's never compares its residual with a lane's)."""
    managers = [m for hook in _hooks(model) for m in vars(hook).values()
                if type(m).__name__ == "StateManager" and getattr(m, "_context", None) is not None]
    saved = [m._context for m in managers]
    for m, ctx in zip(managers, saved):
        m.set_context(dataclasses.replace(ctx, name=ctx.name + suffix))
    try:
        yield
    finally:
        for m, ctx in zip(managers, saved):
            m.set_context(ctx)


#: diffusers hooks whose per-call work a CUDA graph replays as recorded (layerwise casting: the same casts each call)
_REPLAYABLE = ("LayerwiseCastingHook", "PeftInputAutocastDisableHook")


def host_hooks(model: torch.nn.Module) -> str | None:
    """Why a whole-forward CUDA graph cannot replay ``model``'s forward: hooks that act on the host at each call
    (diffusers' hooks but layerwise casting, accelerate's offloading, peft's LoRA layers), or None."""
    for module in model.modules():
        if getattr(module, "_hf_hook", None) is not None:
            return "accelerate moves its weights at each call (CPU offloading), which a CUDA graph cannot replay"
        if type(module).__module__.startswith("peft."):
            return (f"LoRA layers ({type(module).__name__}) read their adapter scales on the host at each call, "
                    "which a CUDA graph cannot replay (fuse the LoRA, pipe.fuse_lora(), and unload it first)")
    for hook in _hooks(model):
        if type(hook).__name__ not in _REPLAYABLE:
            what = "a step cache" if getattr(hook, "_is_stateful", False) else "a diffusers hook"
            return f"{what} ({type(hook).__name__}) acts on the host at each call, which a CUDA graph cannot replay"
    return None


def refused_cache(model: torch.nn.Module) -> str | None:
    """The error for a step cache on ``model`` that cp_ops cannot make agree across ranks (SeaCache), or None."""
    for hook in _hooks(model):
        name = type(hook).__name__
        if name in _REFUSED:
            return (f"cp_ops: diffusers' {name} decides from each rank's own tokens, which under context parallelism "
                    "makes ranks skip different steps (collectives then pair wrongly); cp_ops reduces "
                    "FirstBlockCache's metric over the group but not SeaCache's. Use FirstBlockCacheConfig, "
                    "MagCacheConfig or TaylorSeerCacheConfig with a parallelized model")
    return None


@torch.compiler.disable
def _fbc_should_compute(self, hidden_states_residual: torch.Tensor) -> bool:
    """``FBCHeadBlockHook._should_compute_remaining_blocks`` over the whole group: ``mean|r - r_prev| / mean|r_prev|``
    of all ranks' tokens (both sums all-reduced: the ratio of sums is the ratio of means) against the threshold."""
    prev = self.state_manager.get_state().head_block_residual
    if prev is None:
        return True
    sums = torch.stack([(hidden_states_residual - prev).abs().sum(), prev.abs().sum()]).double()
    dist.all_reduce(sums, group=self._cp_ops_group())
    return (sums[0] / sums[1]).item() > self.threshold


def wrap_enable_cache(model: torch.nn.Module) -> None:
    """After ``model.enable_cache(config)``, call :func:`agree_step_caches` (this instance only; else a no-op)."""
    inner = getattr(model, "enable_cache", None)
    if inner is None or getattr(inner, "_cp_ops_wrapped", False):
        return

    def enable_cache(*args, **kwargs):
        cf = captured(model)
        if cf is not None and cf.fallback is None:  # captured as asked (cuda_graphs='forward'): no eager to go to
            raise ValueError(f"{type(model).__name__}.enable_cache: its whole forward is captured in CUDA graphs "
                             "(parallelize(..., cuda_graphs='forward')), which replay one recorded forward, while a "
                             "step cache decides on the host at each call; parallelize with cuda_graphs='auto' "
                             "(captured until a cache is enabled, then eager) or False. The cache was not enabled")
        out = inner(*args, **kwargs)
        agree_step_caches(model)
        return out

    enable_cache._cp_ops_wrapped = True
    enable_cache.__doc__ = inner.__doc__
    model.enable_cache = enable_cache
