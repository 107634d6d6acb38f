"""CFG-parallel lanes: the conditional and unconditional branches of classifier-free guidance on two halves of
the ranks, CP inside each half.

The caller passes every rank the same batch of 2 — ``[cond, uncond]`` along dim 0 of every batched input (latents,
timestep, text embeddings, masks; list inputs such as Z-Image's ``x`` as lists of 2). Ranks ``0 .. W/2-1`` (lane 0)
run the conditional element, ranks ``W/2 .. W-1`` (lane 1) the unconditional one, each lane a CP group of W/2 ranks
(e.g. 4 ranks = 2 lanes × CP2); every rank returns the full batch-of-2 output, equal to the single-device batch:
the lane outputs are all-gathered between the ranks of equal CP rank (one pair group per CP rank). With the fast
transport, its lane width (``CP_OPS_FAST_LANE_WIDTH``) is the CP group's width, W/2.

Pipelines that call the transformer once per branch — diffusers' Wan 2.1/2.2 (both experts), Qwen-Image, Flux with
true CFG, HunyuanVideo, Flux 2 Klein: a batch of 1 under ``cache_context("cond")``, then one under
``cache_context("uncond")`` — run their two calls on the two lanes at the same time under
:func:`~cp_ops.integrations.diffusers.parallelize_pipeline` (:func:`attach_pipeline`, :data:`PAIRED`): at the cond
call lane 0 runs the forward while lane 1 returns at once a placeholder (NaN-filled, of the output's shape: lane 0
tells it once per input shape); at the uncond call lane 1 runs the forward while lane 0 enqueues the exchange and
returns; the exchange (an all-gather between the two lanes' ranks of equal CP rank) writes lane 0's conditional output
into lane 1's placeholder in place and hands lane 1's unconditional output to lane 0, stream-ordered, before the
pipeline reads either. Every rank then holds both outputs, each computed once by a batch-1 forward, as on one device.
This needs the pipeline to leave the first output untouched (or only sliced: a view) until its second call: the
pipelines in :data:`PAIRED` were read for it (diffusers 0.42.1). Any other batch-1 call inside a pipeline call (no
CFG in that call, a pipeline not in :data:`PAIRED`) runs on both lanes alike (each lane its CP group, the same
output on every rank; one warning says why); a conditional call with no unconditional call after it raises.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import warnings

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from ...contract import agree
from .hooks import _all_gather, gather_route

# forward parameters that carry the batch (dim 0 of a tensor, or a list with one item per sample)
BATCHED = ("hidden_states", "encoder_hidden_states", "timestep", "encoder_hidden_states_mask",
           "encoder_attention_mask", "pooled_projections", "guidance", "img_shapes", "x", "cap_feats", "t",
           "control_hidden_states", "encoder_hidden_states_image", "additional_t_cond")


def _guidance_property(pipe, args: dict) -> bool:
    return bool(pipe.do_classifier_free_guidance)  # read at the conditional call: the pipeline has set its scale


def _true_cfg(pooled: bool):
    """diffusers' ``do_true_cfg = true_cfg_scale > 1 and has_neg_prompt`` (Qwen-Image: a negative prompt or its
    embeddings; Flux, HunyuanVideo: a negative prompt, or its embeddings and its pooled embeddings)."""
    def rule(pipe, a: dict) -> bool:
        embeds = a.get("negative_prompt_embeds") is not None and (
            not pooled or a.get("negative_pooled_prompt_embeds") is not None)
        return bool(a.get("true_cfg_scale", 1.0) > 1 and (a.get("negative_prompt") is not None or embeds))
    return rule


#: diffusers pipelines (class name) whose calls cp_ops pairs over the lanes -> whether a ``pipe(...)`` call makes the
#: unconditional call after each conditional one. Each was read (diffusers 0.42.1): the conditional output is left
#: as it is, or sliced (a view), until the unconditional call.
PAIRED = {
    **dict.fromkeys(("WanPipeline", "WanImageToVideoPipeline", "WanVACEPipeline", "Flux2KleinPipeline"),
                    _guidance_property),
    **dict.fromkeys(("QwenImagePipeline", "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline",
                     "QwenImageEditPipeline", "QwenImageEditPlusPipeline", "QwenImageEditInpaintPipeline",
                     "QwenImageLayeredPipeline", "QwenImageControlNetPipeline",
                     "QwenImageControlNetInpaintPipeline"), _true_cfg(pooled=False)),
    **dict.fromkeys(("FluxPipeline", "HunyuanVideoPipeline"), _true_cfg(pooled=True)),
}


#: diffusers pipelines (class name) that run both CFG branches in one call of a batch of 2 (read: diffusers 0.42.1)
BATCHED_CFG = ("LTXPipeline", "LTXImageToVideoPipeline", "LTXConditionPipeline", "ZImagePipeline")


def cfg_kind(pipe_cls: type) -> str | None:
    """How a pipeline class runs classifier-free guidance with its own defaults (its ``__call__``'s): 'paired' (a
    class of :data:`PAIRED` whose default scale — ``true_cfg_scale`` where it has one, else ``guidance_scale`` — is
    above 1: Wan, Qwen-Image, Flux 2 Klein; Qwen-Image's true CFG then runs whenever a negative prompt is given),
    'batched' (a class of :data:`BATCHED_CFG` whose default ``guidance_scale`` is above 1), else None (Flux and
    HunyuanVideo: ``true_cfg_scale`` 1 by default; any other pipeline)."""
    name = pipe_cls.__name__
    kind = "paired" if name in PAIRED else "batched" if name in BATCHED_CFG else None
    if kind is None:
        return None
    params = inspect.signature(pipe_cls.__call__).parameters
    scale = params.get("true_cfg_scale") if kind == "paired" else None
    scale = scale if scale is not None else params.get("guidance_scale")
    default = None if scale is None else scale.default
    return kind if isinstance(default, (int, float)) and default > 1 else None


def _new_group(ranks: list[int], pg: dist.ProcessGroup, mine: bool):
    if pg is dist.group.WORLD:
        return dist.new_group(ranks)  # every rank calls every new_group, in the same order
    return dist.new_group(ranks, use_local_synchronization=True) if mine else None


class _PipeCall:
    """One ``pipe(...)`` call in progress: the pipeline, its rule from :data:`PAIRED` (None: not there) and its
    arguments (defaults applied)."""

    def __init__(self, pipe, args: dict):
        self.pipe, self.args, self.rule = pipe, args, PAIRED.get(type(pipe).__name__)
        self.name = type(pipe).__name__

    def unpaired(self) -> str | None:
        """Why this call's conditional calls have no unconditional partner (None: they have one)."""
        if self.rule is None:
            return (f"cp_ops has not checked that {self.name} leaves the conditional output untouched until its "
                    "unconditional call")
        if not self.rule(self.pipe, self.args):
            return "classifier-free guidance is off in this call"
        return None


def _shape_key(args: tuple, kwargs: dict) -> str:
    """What fixes a forward's output shapes: each tensor leaf's shape and dtype, the plain values."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    return repr((str(spec), [(tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else
                             x if isinstance(x, (int, float, str, bool, type(None))) else type(x).__name__
                             for x in leaves]))


def _meta(out) -> list | str:
    """A forward's output as ``[[shape, dtype], ...]`` (a tuple of tensors: ``return_dict=False``), or why it is not
    one."""
    if isinstance(out, tuple) and out and all(isinstance(x, torch.Tensor) for x in out):
        return [[list(x.shape), str(x.dtype).replace("torch.", "")] for x in out]
    return f"the output is a {type(out).__name__}" + (
        f" of {[type(x).__name__ for x in out]}" if isinstance(out, tuple) else "")


class Lanes:
    """Split ``pg`` into two CFG lanes; :attr:`cp` is this rank's CP group (its lane)."""

    def __init__(self, model: torch.nn.Module, pg: dist.ProcessGroup):
        w = pg.size()
        if w < 2 or w % 2:
            raise ValueError(f"cfg_parallel=True splits the ranks into two equal lanes; the group has {w} ranks "
                             "(needs an even number ≥ 2)")
        half = w // 2
        ranks = [dist.get_global_rank(pg, i) for i in range(w)]
        me = pg.rank()
        self.lane, cp_rank = divmod(me, half)
        lanes = [ranks[:half], ranks[half:]]
        groups = [_new_group(r, pg, self.lane == i) for i, r in enumerate(lanes)]
        self.cp = groups[self.lane]
        pairs = [_new_group([ranks[i], ranks[i + half]], pg, cp_rank == i) for i in range(half)]
        self.pair = pairs[cp_rank]
        self.via = gather_route(self.pair, "torch")  # ranks sharing a GPU: the gather goes through host memory
        self.params = list(inspect.signature(model.forward).parameters)
        self.name = type(model).__name__
        #: ``(object, attribute)`` holding the group of the ranks that share a forward's inputs (both lanes): set to
        #: :attr:`cp` while this lane runs a forward alone (:meth:`alone`)
        self.input_groups: list[tuple[object, str]] = []
        self.run: _PipeCall | None = None  # the pipe(...) call in progress (attach_pipeline)
        self.context: str | None = None  # the model's cache_context name in force ("cond", "uncond")
        self.pending = None  # the conditional output (lane 0) or its placeholder (lane 1) until the uncond call
        self.metas: dict[str, list | str] = {}  # conditional call's shape key -> its output (_meta), told by lane 0
        self.checked: set = set()  # (cond key, uncond key) pairs whose outputs were found alike
        self.branch = False  # a forward of one branch (batch as given): select/gather let it through
        self.warned: set = set()

    def _batched(self, args, kwargs):
        """``[(name, index or None, value)]`` of the batched inputs given."""
        found = []
        for name in BATCHED:
            i = self.params.index(name) if name in self.params else None
            if name in kwargs:
                found.append((name, None, kwargs[name]))
            elif i is not None and i < len(args):
                found.append((name, i, args[i]))
        return found

    def _batch(self, args, kwargs) -> tuple[str, int] | None:
        for name, _, val in self._batched(args, kwargs):
            if val is not None:
                return name, val.shape[0] if isinstance(val, torch.Tensor) else len(val)
        return None

    def _pick(self, name, x):
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == 2:
            return x[self.lane:self.lane + 1]
        if isinstance(x, (list, tuple)) and len(x) == 2:
            return type(x)([x[self.lane]])
        return x

    def select(self, mod, args, kwargs):
        """Keep this lane's sample of every batched input (hidden input's batch must be 2)."""
        if self.branch:
            return args, kwargs
        found = self._batch(args, kwargs)
        if found is not None and found[1] != 2:
            raise ValueError(f"cfg_parallel=True takes a batch of 2 ([cond, uncond]) on every rank; got {found[0]} "
                             f"with batch {found[1]} (pipelines that call the transformer once per branch: "
                             "parallelize_pipeline(pipe, cfg_parallel=True) pairs their calls over the lanes)")
        args = list(args)
        for name, i, val in self._batched(args, kwargs):
            if i is None:
                kwargs[name] = self._pick(name, val)
            else:
                args[i] = self._pick(name, val)
        return tuple(args), kwargs

    def _gather(self, x):
        if isinstance(x, torch.Tensor):
            return _all_gather(x.contiguous(), 0, self.pair, self.via)
        if isinstance(x, list):  # one item per sample (Z-Image)
            return list(self._gather(torch.stack(x)).unbind(0))
        return x

    def gather(self, mod, args, output):
        """The batch-of-2 output: lane 0's sample, then lane 1's."""
        if self.branch:
            return output
        if isinstance(output, tuple):
            return (self._gather(output[0]),) + tuple(output[1:])
        if hasattr(output, "sample"):
            output.sample = self._gather(output.sample)
            return output
        return self._gather(output)

    # ---- calls of a pipeline that runs each branch in its own call -------------------------------------------
    @contextlib.contextmanager
    def alone(self):
        """A forward this lane runs by itself (one branch, as given): the lane's ranks share its inputs."""
        saved = [(obj, attr, getattr(obj, attr)) for obj, attr in self.input_groups]
        for obj, attr, _ in saved:
            setattr(obj, attr, self.cp)
        self.branch = True
        try:
            yield
        finally:
            self.branch = False
            for obj, attr, value in saved:
                setattr(obj, attr, value)

    def call(self, inner, args: tuple, kwargs: dict):
        """The model's call ``inner(*args, **kwargs)`` as the lanes run it (see the module docstring)."""
        run = self.run
        if run is None:
            return inner(*args, **kwargs)  # outside a pipeline call: the batch of 2
        found = self._batch(args, kwargs)
        n = found[1] if found is not None else None
        if n == 2:
            self._no_pending(f"called {self.name} with a batch of 2")
            return inner(*args, **kwargs)
        if self.context == "uncond" and self.pending is not None and n == 1:
            return self._uncond(inner, args, kwargs)
        why = None
        if n != 1:
            why = f"the transformer is called with a batch of {n} (the lanes split a batch of 2)"
        elif self.context != "cond":
            why = f"the call is not the conditional one of a CFG pair (cache_context {self.context!r}, not 'cond')"
        elif kwargs.get("return_dict", True) is not False:
            why = "the call asks for return_dict=True (the lanes pair calls that return a tuple)"
        else:
            why = run.unpaired()
        self._no_pending(f"called {self.name} again")
        if why is None:
            return self._cond(inner, args, kwargs)
        if why not in self.warned:
            self.warned.add(why)
            warnings.warn(f"cfg_parallel=True: {run.name} runs {self.name} where {why}: both CFG lanes run this "
                          "forward alike (CP over half the ranks each); parallelize_pipeline without cfg_parallel "
                          "runs it over all of them", stacklevel=3)
        with self.alone():
            return inner(*args, **kwargs)

    def _no_pending(self, what: str) -> None:
        """Raise (on every rank: they all see the same calls) when a conditional output waits for its unconditional
        call and the pipeline did ``what`` instead."""
        if self.pending is not None:
            self.pending = None
            name = self.run.name if self.run is not None else "the pipeline"
            raise RuntimeError(f"cfg_parallel=True: {name} {what} after a conditional call of {self.name} with no "
                               "unconditional call between, so the conditional output on the second CFG lane was "
                               "never filled; parallelize_pipeline without cfg_parallel runs this pipeline")

    def _cond(self, inner, args, kwargs):
        """Lane 0 runs the conditional forward; lane 1 returns a placeholder of its output's shape at once."""
        key = _shape_key(args, kwargs)
        meta = self.metas.get(key)
        out = None
        if self.lane == 0:
            with self.alone():
                out = inner(*args, **kwargs)
            if meta is None:
                meta = _meta(out)
                agree(self.pair, "cfg-lanes-output", json.dumps(meta), f"{self.name}'s conditional output")
        elif meta is None:
            meta = json.loads(agree(self.pair, "cfg-lanes-output", "null", f"{self.name}'s conditional output")[0])
        if len(self.metas) >= 64:  # every rank sees the same keys: all clear alike
            self.metas.clear()
            self.checked.clear()
        self.metas[key] = meta
        if isinstance(meta, str):  # an output the exchange does not take: this call runs on both lanes
            warnings.warn(f"cfg_parallel=True: {self.run.name}'s {self.name} call returns what the lanes cannot "
                          f"pair ({meta}): both CFG lanes run its calls", stacklevel=3)
            if out is None:
                with self.alone():
                    out = inner(*args, **kwargs)
            return out
        if out is None:  # on the inputs' device (the model's)
            dev = next((x.device for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)), None)
            out = tuple(torch.full(s, float("nan"), dtype=getattr(torch, d), device=dev)
                        if getattr(torch, d).is_floating_point else
                        torch.zeros(s, dtype=getattr(torch, d), device=dev) for s, d in meta)
        self.pending = (key, out)
        return out

    def _uncond(self, inner, args, kwargs):
        """Lane 1 runs the unconditional forward; both exchange: lane 1's placeholder gets lane 0's conditional
        output (in place), lane 0 returns lane 1's unconditional output."""
        (cond_key, cond), self.pending = self.pending, None
        out = None
        if self.lane == 1:
            with self.alone():
                out = inner(*args, **kwargs)
        pair_key = (cond_key, _shape_key(args, kwargs))
        if pair_key not in self.checked:  # once per shape: lane 1 tells its output, both check it matches
            told = json.dumps(_meta(out)) if out is not None else "null"
            seen = json.loads(agree(self.pair, "cfg-lanes-uncond", told, f"{self.name}'s unconditional output")[1])
            if seen != self.metas[cond_key]:
                raise RuntimeError(f"cfg_parallel=True: {self.run.name}'s unconditional {self.name} output "
                                   f"({seen}) differs from its conditional one ({self.metas[cond_key]}) in shape; "
                                   "the lanes exchange equal shapes. parallelize_pipeline without cfg_parallel "
                                   "runs this pipeline")
            self.checked.add(pair_key)
        mine = out if out is not None else cond
        both = [self._gather(x) for x in mine]  # [lane 0's; lane 1's] along dim 0
        if self.lane == 1:
            with torch.no_grad():
                for placeholder, x in zip(cond, both):
                    placeholder.copy_(x[:x.shape[0] // 2])
            return out
        return tuple(x[x.shape[0] // 2:] for x in both)

    def begin(self, run: _PipeCall | None) -> None:
        """A pipe(...) call starts (``run``) or returns (None; a conditional output still pending raises)."""
        try:
            if run is None:
                self._no_pending("returned")
        finally:
            self.pending, self.run = None, run


def _wrap_call(model: torch.nn.Module, lanes: Lanes) -> None:
    """Route ``model(...)`` through :meth:`Lanes.call`, outside everything else the model's call does (its hooks, a
    whole-forward capture), and record its ``cache_context`` name. The class becomes a same-named subclass."""
    cls = type(model)

    def __call__(self, *args, **kwargs):
        return lanes.call(functools.partial(cls.__call__, self), args, kwargs)

    model.__class__ = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                                   "__qualname__": cls.__qualname__})
    inner = getattr(model, "cache_context", None)
    if inner is not None:
        @contextlib.contextmanager
        def cache_context(name, *args, **kwargs):
            saved, lanes.context = lanes.context, name
            try:
                with inner(name, *args, **kwargs):
                    yield
            finally:
                lanes.context = saved

        model.cache_context = cache_context


def attach_pipeline(pipe, models: list[torch.nn.Module]) -> None:
    """Pair the per-branch calls of ``pipe`` over the CFG lanes of ``models`` (parallelized with ``cfg_parallel``):
    each model's call goes through :meth:`Lanes.call`, and each ``pipe(...)`` call tells the lanes which pipeline
    call is in progress (its arguments, defaults applied). No-op when no model has lanes."""
    lanes = [m._cp_ops_lanes for m in models if getattr(m, "_cp_ops_lanes", None) is not None]
    if not lanes:
        return
    for m in models:
        _wrap_call(m, m._cp_ops_lanes)
    cls = type(pipe)
    sig = inspect.signature(cls.__call__)

    def __call__(self, *args, **kwargs):
        try:
            bound = sig.bind(self, *args, **kwargs)
            bound.apply_defaults()
            run = _PipeCall(self, dict(bound.arguments))
        except TypeError:  # arguments the pipeline itself refuses: its own error
            run = _PipeCall(self, {})
        for ln in lanes:
            ln.begin(run)
        try:
            out = cls.__call__(self, *args, **kwargs)
        except BaseException:
            for ln in lanes:
                ln.pending = None  # the pipeline's own error, not a pending output's
                ln.begin(None)
            raise
        errors = []
        for ln in lanes:  # every model's pipeline call ends, also where one raises
            try:
                ln.begin(None)
            except RuntimeError as e:
                errors.append(e)
        if errors:
            raise errors[0]
        return out

    pipe.__class__ = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                                 "__qualname__": cls.__qualname__})
