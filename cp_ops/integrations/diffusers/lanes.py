"""CFG-parallel lanes: the conditional and unconditional branches of classifier-free guidance on two halves of
the ranks, CP inside each half (docs/pipelines.md, "CFG lanes").

A batch of 2 (``[cond, uncond]`` along dim 0 of every batched input) is split: lane 0 (ranks ``0 .. W/2-1``) runs
the conditional element, lane 1 the unconditional one; the outputs are all-gathered between the ranks of equal CP
rank (one pair group each), so every rank returns the batch-of-2 output.

A pipeline of :data:`PAIRED` calls the transformer once per branch: :func:`attach_pipeline` runs the cond call on
lane 0 (lane 1 returns a NaN placeholder) and the uncond call on lane 1 (lane 0 returns at once); the exchange then
fills lane 1's placeholder in place and hands lane 1's output to lane 0, stream-ordered, before the pipeline reads
either. Any other call runs over the whole group (the switch :func:`.install.parallelize` gives; where none can run,
on both lanes alike), with one warning. A conditional call with no unconditional call after it raises.
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

from ..._peers import Peers
from ..._waits import PeerWait, poll
from ...contract import _within_grace, agree
from ...group import backend_name
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
#: unconditional call after each conditional one. Each read (diffusers 0.42.1): the cond output is left, or sliced.
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


def cfg_kind(pipe_cls: type, config=None) -> str | None:
    """How a pipeline class runs classifier-free guidance with its ``__call__``'s defaults: 'paired' (a class of
    :data:`PAIRED` whose default ``true_cfg_scale``, else ``guidance_scale``, is above 1), 'batched' (a class of
    :data:`BATCHED_CFG` whose default ``guidance_scale`` is above 1), else None (Flux, HunyuanVideo: true CFG off by
    default). ``config``: the pipeline's config where at hand; a distilled one (``is_distilled``) runs no CFG."""
    name = pipe_cls.__name__
    kind = "paired" if name in PAIRED else "batched" if name in BATCHED_CFG else None
    if kind is None or (config is not None and bool(dict(config).get("is_distilled", False))):
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
    """One ``pipe(...)`` call in progress: the pipeline, its :data:`PAIRED` rule (or None) and its arguments."""

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


def _host_waits(tensors) -> bool:
    """Whether the host waits for the lanes' exchange of ``tensors`` (CPU tensors over gloo): cp_ops bounds it and a
    failed lane can join it with placeholders."""
    return all(x.device.type == "cpu" for x in tensors)


def _placeholders(meta: list, args: tuple, kwargs: dict) -> tuple:
    """NaN-filled tensors (zeros for integer dtypes) of ``meta``'s shapes and dtypes, on the inputs' device."""
    dev = next((x.device for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)), None)
    return tuple(torch.full(s, float("nan"), dtype=getattr(torch, d), device=dev)
                 if getattr(torch, d).is_floating_point else
                 torch.zeros(s, dtype=getattr(torch, d), device=dev) for s, d in meta)


def _meta(out) -> list | str:
    """A forward's output (a tuple of tensors) as ``[[shape, dtype], ...]``, or why it is not one."""
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
        self.lane, cp_rank = divmod(pg.rank(), half)
        groups = [_new_group(r, pg, self.lane == i) for i, r in enumerate([ranks[:half], ranks[half:]])]
        self.cp = groups[self.lane]
        pairs = [_new_group([ranks[i], ranks[i + half]], pg, cp_rank == i) for i in range(half)]
        self.pair = pairs[cp_rank]
        self.via = gather_route(self.pair, "torch")  # ranks sharing a GPU: the gather goes through host memory
        # the partner's identity (liveness) and the store its failures are told in (None: a 'fake' group)
        self.peers = None if backend_name(self.pair) == "fake" else Peers(self.pair)
        if self.peers is not None:
            self.peers.announce()
        self.calls = 0  # pipe(...) calls begun (the same count on every rank)
        self.n = 0  # exchanges of this call so far
        self.told = False  # this call's failure is already settled with the partner (told, or told by it)
        self.broken: str | None = None  # why the pair's collectives are out of step (every later call raises it)
        self.stale = None  # (works, exchange, call) of an exchange this rank left unfinished (interrupted)
        self.params = list(inspect.signature(model.forward).parameters)
        self.name = type(model).__name__
        #: ``(object, attribute)`` holding the group of the ranks that share a forward's inputs (both lanes): set to
        #: :attr:`cp` while this lane runs a forward alone (:meth:`alone`)
        self.input_groups: list[tuple[object, str]] = []
        #: the switch of a forward over the whole group (a context manager: :func:`.install.parallelize` gives it),
        #: or why none can run (then an unpaired forward runs on both lanes alike)
        self.whole, self.whole_why = None, "parallelize gave no switch to the whole group"
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
    def alone(self, over_all: bool = False):
        """A forward of one branch, as given (select and gather let it through), run by this lane alone or,
        ``over_all``, by every rank with CP over the whole group (:attr:`whole`)."""
        switch = self.whole() if over_all else swapped([(obj, attr, self.cp) for obj, attr in self.input_groups])
        self.branch = True
        try:
            with switch:
                yield
        finally:
            self.branch = False

    def call(self, inner, args: tuple, kwargs: dict):
        """The model's call ``inner(*args, **kwargs)`` as the lanes run it (see the module docstring)."""
        run = self.run
        found = self._batch(args, kwargs)
        n = found[1] if found is not None else None
        if run is None:  # outside a pipeline call: a batch of 2 is split over the lanes
            if n in (2, None):
                return inner(*args, **kwargs)
            return self._unpaired(inner, args, kwargs, f"{self.name} is called outside a pipeline call with a "
                                                       f"batch of {n} (the lanes split a batch of 2)")
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
        return self._unpaired(inner, args, kwargs, f"{run.name} runs {self.name} where {why}")

    def _unpaired(self, inner, args, kwargs, why: str):
        """A forward with no CFG partner: every rank runs it, CP over the whole group (:attr:`whole`), or where
        that cannot run (:attr:`whole_why`) both lanes run it alike, CP over half the ranks each; one warning."""
        if why not in self.warned:
            self.warned.add(why)
            w = self.cp.size() * 2
            warnings.warn(f"cfg_parallel=True: {why}: this forward runs over all {w} ranks (CP{w}), not on the CFG "
                          "lanes" if self.whole_why is None else
                          f"cfg_parallel=True: {why}: both CFG lanes run this forward alike (CP over half the ranks "
                          f"each; not over all {w}: {self.whole_why}); parallelize_pipeline(pipe, "
                          "cfg_parallel=False) runs it over all of them", stacklevel=4)
        with self.alone(over_all=self.whole_why is None):
            return inner(*args, **kwargs)

    def _no_pending(self, what: str) -> None:
        """Raise (on every rank alike) where a conditional output waits for its unconditional call and the pipeline
        did ``what`` instead."""
        if self.pending is not None:
            self.pending = None
            name = self.run.name if self.run is not None else "the pipeline"
            raise RuntimeError(f"cfg_parallel=True: {name} {what} after a conditional call of {self.name} with no "
                               "unconditional call between, so the conditional output on the second CFG lane was "
                               "never filled; parallelize_pipeline(pipe, cfg_parallel=False) runs this pipeline")

    def _cond(self, inner, args, kwargs):
        """Lane 0 runs the conditional forward; lane 1 returns a placeholder of its output's shape at once."""
        key = _shape_key(args, kwargs)
        meta = self.metas.get(key)
        out = None
        if self.lane == 0:
            try:
                with self.alone():
                    out = inner(*args, **kwargs)
            except BaseException as e:
                if meta is not None and not isinstance(meta, str):  # the partner holds a placeholder: exchange one
                    self.pending = (key, _placeholders(meta, args, kwargs))
                self._forward_failed(e, meta, "cfg-lanes-output")
                raise
            if meta is None:
                meta = _meta(out)
                agree(self.pair, "cfg-lanes-output", json.dumps(meta), f"{self.name}'s conditional output")
        elif meta is None:
            meta = json.loads(agree(self.pair, "cfg-lanes-output", "null", f"{self.name}'s conditional output")[0])
            self._check_told(meta)
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
        if out is None:
            out = _placeholders(meta, args, kwargs)
        self.pending = (key, out)
        return out

    def _uncond(self, inner, args, kwargs):
        """Lane 1 runs the unconditional forward; the exchange fills its placeholder and gives lane 0 its output."""
        (cond_key, cond), self.pending = self.pending, None
        pair_key = (cond_key, _shape_key(args, kwargs))
        out = None
        if self.lane == 1:
            try:
                with self.alone():
                    out = inner(*args, **kwargs)
            except BaseException as e:
                self.pending = (cond_key, cond)  # the placeholder: what this lane sends in the exchange it joins
                self._forward_failed(e, self.metas[cond_key] if pair_key in self.checked else None,
                                     "cfg-lanes-uncond")
                raise
        if pair_key not in self.checked:  # once per shape: lane 1 tells its output, both check it matches
            told = json.dumps(_meta(out)) if out is not None else "null"
            seen = json.loads(agree(self.pair, "cfg-lanes-uncond", told, f"{self.name}'s unconditional output")[1])
            self._check_told(seen)
            if seen != self.metas[cond_key]:
                raise RuntimeError(f"cfg_parallel=True: {self.run.name}'s unconditional {self.name} output "
                                   f"({seen}) differs from its conditional one ({self.metas[cond_key]}) in shape; "
                                   "the lanes exchange equal shapes. parallelize_pipeline(pipe, cfg_parallel=False) "
                                   "runs this pipeline")
            self.checked.add(pair_key)
        mine = out if out is not None else cond
        both = self._exchange(mine)  # [lane 0's; lane 1's] along dim 0
        if self.lane == 1:
            with torch.no_grad():
                for placeholder, x in zip(cond, both):
                    placeholder.copy_(x[:x.shape[0] // 2])
            return out
        return tuple(x[x.shape[0] // 2:] for x in both)

    # ---- a lane that fails: its partner is told, in seconds, and the pair stays in step where it can ----------
    def _store_key(self, lane: int) -> str:
        return f"{self.peers.base}lanes-failed/{lane}"

    def _tell(self, k: int, joins: bool, e: BaseException) -> None:
        """Publish that this rank's call failed (``e``) at its ``k``-th exchange; ``joins``: it still makes that
        exchange (with placeholders), so the partner's collectives stay in step."""
        self.told = True
        if self.peers is None:
            return
        why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
        try:
            self.peers.store.set(self._store_key(self.lane), f"{self.calls}\t{k}\t{int(joins)}\t{why}")
        except Exception:  # noqa: BLE001 - the rank's own error is the one raised
            pass

    def _partner_failed(self, k: int) -> tuple[bool, str, int] | None:
        """(joins, error, exchange) where the partner told a failure of this call at or before exchange ``k``."""
        if self.peers is None:
            return None
        key = self._store_key(1 - self.lane)
        if not self.peers.store.check([key]):
            return None
        call, at, joins, why = self.peers.store.get(key).decode().split("\t", 3)
        if int(call) != self.calls or int(at) > k:
            return None
        return joins == "1", why, int(at)

    def _named(self, why: str, where: str) -> RuntimeError:
        """The error of a rank whose partner failed: one line naming it and its error, what to do after."""
        self.told = True
        name = self.run.name if self.run is not None else "the pipeline"
        return RuntimeError(f"cfg_parallel=True: {name}'s CFG lane exchange: {self.peers.name(1 - self.lane)} raised "
                            f"{why} {where}; this rank stops too. Fix that rank's error (its log has it)"
                            + ("" if self.broken else "; the next pipe(...) call runs again"))

    def _check_told(self, value) -> None:
        if isinstance(value, dict) and "failed" in value:
            raise self._named(value["failed"], "in its forward")

    def _forward_failed(self, e: BaseException, meta, key: str) -> None:
        """This lane's forward of a CFG pair raised ``e``: tell the partner, waiting in the agreement ``key`` (``meta``
        None: the first call of this shape) or in the exchange."""
        if meta is None:
            why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
            self.told = True
            try:
                agree(self.pair, key, json.dumps({"failed": why}), f"{self.name}'s output")
            except Exception:  # noqa: BLE001 - the forward's error is the one raised
                pass
            self.pending = None
            return
        self._join(e)

    def _join(self, e: BaseException) -> None:
        """Tell the partner that ``e`` ends this rank's call, then make the pending exchange with what this lane
        holds (lane 0's output or lane 1's placeholder)."""
        held = self.pending[1] if self.pending is not None else None
        self.pending = None
        if held is None or not _host_waits(held):
            # nothing to exchange (an output the lanes do not pair), or CUDA: the partner's host does not wait for
            # the exchange, so it could not tell placeholders from outputs; it waits for this rank as before
            self._tell(self.n + 1, False, e)
            return
        self._tell(self.n + 1, True, e)
        try:
            self._exchange(held, joining=True)
        except BaseException:  # noqa: BLE001 - ``e`` is the error raised; a failed join leaves the pair broken
            self.broken = self.broken or "an exchange between the CFG lanes was left unfinished after a failure"

    def _exchange(self, mine, joining: bool = False) -> list:
        """Exchange ``mine`` (a tuple of tensors) between the lanes: ``[lane 0's; lane 1's]`` along dim 0 each. On
        the CPU the wait is bounded (the partner's told failure, its exit, ``settings.timeout_s``); on CUDA it is
        stream-ordered, and a failure the partner told before this exchange raises here without making it."""
        self.n += 1
        if self.peers is None or not _host_waits(mine):
            told = self._partner_failed(self.n) if not joining else None
            if told is not None:  # it failed before this exchange (it never joins here): this rank stops before it
                if told[2] < self.n:
                    self.broken = "the partner lane failed after this rank had made an exchange it never made"
                raise self._named(told[1], "and did not come to this exchange")
            return [self._gather(x) for x in mine]
        parts = [[torch.empty_like(x) for _ in range(2)] for x in mine]
        works = [dist.all_gather(p, x.contiguous(), group=self.pair, async_op=True) for p, x in zip(parts, mine)]
        k, partner, wait = self.n, 1 - self.lane, None

        def check() -> bool:
            nonlocal wait
            if wait is None:
                name = self.run.name if self.run is not None else "the pipeline"
                wait = PeerWait(f"cfg_parallel=True: {name}'s CFG lane exchange #{k} with {self.peers.name(partner)}",
                                "the exchange of the CFG lanes' outputs")
            told = self._partner_failed(k)
            if told is not None and not told[0] and not joining:
                self.broken = ("the partner lane failed while this rank waited in an exchange: the lanes' "
                               "collectives are out of step")
                raise self._named(told[1], "and did not come to this exchange")
            gone = self.peers.exited([partner])
            if gone:
                self.broken = self.peers.said(gone)
                raise RuntimeError(f"cfg_parallel=True: the CFG lane exchange: {self.peers.said(gone)}; this rank "
                                   "stops too")
            wait.tick(lambda: self.peers.name(partner))
            if wait.expired():
                self.broken = "an exchange between the CFG lanes timed out"
                raise wait.error(self.peers.name(partner))
            return False

        try:
            for work in works:
                poll(work.is_completed, check)
                try:
                    work.wait()
                except RuntimeError as e:  # the collective failed (a connection reset): name the peer that exited
                    gone = _within_grace(lambda: self.peers.exited([partner]))
                    self.broken = "an exchange between the CFG lanes failed"
                    how = self.peers.said(gone) if gone else (str(e).splitlines() or [""])[0]
                    raise RuntimeError(f"cfg_parallel=True: the CFG lane exchange failed: {how}; this rank stops "
                                       "too") from e
        except BaseException:
            if not all(w.is_completed() for w in works) and not self.broken:
                # interrupted here (KeyboardInterrupt): this rank's part is posted; the partner may still make its
                # own (it joins where its call fails too): the next call settles it (:meth:`_settle`)
                self.stale = (works, k, self.calls)
            raise
        if not joining:
            told = self._partner_failed(k)
            if told is not None:  # it joined with placeholders: its output is not there
                raise self._named(told[1], "in its forward")
        return [torch.cat(p) for p in parts]

    def _settle(self) -> None:
        """An exchange this rank left unfinished (interrupted): wait, bounded, for the partner's part; where it said
        it will not come, or does not within ``settings.timeout_s``, the pair is out of step (:attr:`broken`)."""
        if self.stale is None:
            return
        (works, k, call), self.stale = self.stale, None
        saved, self.calls = self.calls, call
        wait = PeerWait(f"cfg_parallel=True: the CFG lane exchange #{k} left unfinished by an earlier call",
                        "the unfinished exchange of the CFG lanes' outputs")
        def gone() -> bool:  # the partner will not make its part: the pair is out of step
            told = self._partner_failed(k)
            wait.tick(lambda: self.peers.name(1 - self.lane))
            return bool(told is not None and not told[0] or wait.expired() or self.peers.exited([1 - self.lane]))

        try:
            if not poll(lambda: all(w.is_completed() for w in works), gone):
                self.broken = f"an exchange between the CFG lanes was left unfinished (exchange #{k})"
                return
            for w in works:
                w.wait()
        except Exception:  # noqa: BLE001 - a failed collective: the pair cannot be used
            self.broken = f"an exchange between the CFG lanes failed (exchange #{k})"
        finally:
            self.calls = saved

    def abandon(self, e: BaseException) -> None:
        """This rank's ``pipe(...)`` call raised ``e``: an open CFG pair is exchanged with what this lane holds;
        else the partner, should it wait in this call's next exchange, is told."""
        try:
            if self.told:
                return
            if self.pending is not None:
                self._join(e)
            else:
                self._tell(self.n + 1, False, e)
        finally:
            self.pending = None

    def begin(self, run: _PipeCall | None) -> None:
        """A pipe(...) call starts (``run``) or returns (None; a conditional output still pending raises)."""
        try:
            if run is None:
                self._no_pending("returned")
        finally:
            self.pending, self.run = None, run
        if run is not None:
            self._settle()
            self.calls, self.n, self.told = self.calls + 1, 0, False
            if self.broken:
                err = RuntimeError(f"cfg_parallel=True: {run.name}'s CFG lanes cannot run any more: {self.broken} "
                                   "in an earlier call. Parallelize a new pipeline (or restart the ranks)")
                self._tell(1, False, err)
                raise err


@contextlib.contextmanager
def swapped(values: list[tuple[object, str, object]]):
    """Each ``(object, attribute, value)`` set while the block runs, restored after (also where it raises)."""
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in values]
    for obj, attr, value in values:
        setattr(obj, attr, value)
    try:
        yield
    finally:
        for obj, attr, value in saved:
            setattr(obj, attr, value)


def _wrap_call(model: torch.nn.Module, lanes: Lanes) -> None:
    """Route ``model(...)`` through :meth:`Lanes.call`, outside its hooks and capture, and record its
    ``cache_context`` name. The class becomes a same-named subclass."""
    cls = type(model)
    if getattr(cls, "_cp_ops_lanes_call", False):  # already routed (a pipeline sharing the model: from_pipe)
        return

    def __call__(self, *args, **kwargs):
        return lanes.call(functools.partial(cls.__call__, self), args, kwargs)

    model.__class__ = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                                   "__qualname__": cls.__qualname__, "_cp_ops_lanes_call": True})
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
    """Pair the per-branch calls of ``pipe`` over the CFG lanes of ``models``: each model's call goes through
    :meth:`Lanes.call`, each ``pipe(...)`` call tells the lanes its arguments. No-op when no model has lanes."""
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
        except BaseException as e:
            for ln in lanes:
                ln.abandon(e)  # the pipeline's own error, not a pending output's: the partner is told
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
