"""CFG-parallel lanes: the conditional and unconditional branches of classifier-free guidance on two halves of
the ranks, CP inside each half.

The caller passes every rank the same batch of 2 — ``[cond, uncond]`` along dim 0 of every batched input (latents,
timestep, text embeddings, masks; list inputs such as Z-Image's ``x`` as lists of 2). Ranks ``0 .. W/2-1`` (lane 0)
run the conditional element, ranks ``W/2 .. W-1`` (lane 1) the unconditional one, each lane a CP group of W/2 ranks
(e.g. 4 ranks = 2 lanes × CP2); every rank returns the full batch-of-2 output, equal to the single-device batch:
the lane outputs are all-gathered between the ranks of equal CP rank (one pair group per CP rank). With the fast
transport, its lane width (``CP_OPS_FAST_LANE_WIDTH``) is the CP group's width, W/2.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from .hooks import _all_gather, gather_route

# forward parameters that carry the batch (dim 0 of a tensor, or a list with one item per sample)
BATCHED = ("hidden_states", "encoder_hidden_states", "timestep", "encoder_hidden_states_mask",
           "encoder_attention_mask", "pooled_projections", "guidance", "img_shapes", "x", "cap_feats", "t",
           "control_hidden_states", "encoder_hidden_states_image", "additional_t_cond")


def _new_group(ranks: list[int], pg: dist.ProcessGroup, mine: bool):
    if pg is dist.group.WORLD:
        return dist.new_group(ranks)  # every rank calls every new_group, in the same order
    return dist.new_group(ranks, use_local_synchronization=True) if mine else None


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

    def _pick(self, name, x):
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == 2:
            return x[self.lane:self.lane + 1]
        if isinstance(x, (list, tuple)) and len(x) == 2:
            return type(x)([x[self.lane]])
        return x

    def select(self, mod, args, kwargs):
        """Keep this lane's sample of every batched input (hidden input's batch must be 2)."""
        args = list(args)
        first = True
        for name in BATCHED:
            i = self.params.index(name) if name in self.params else None
            if name in kwargs:
                val = kwargs[name]
            elif i is not None and i < len(args):
                val = args[i]
            else:
                continue
            if first and val is not None:
                n = val.shape[0] if isinstance(val, torch.Tensor) else len(val)
                if n != 2:
                    raise ValueError(f"cfg_parallel=True takes a batch of 2 ([cond, uncond]) on every rank; got "
                                     f"{name} with batch {n}")
                first = False
            if name in kwargs:
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
        if isinstance(output, tuple):
            return (self._gather(output[0]),) + tuple(output[1:])
        if hasattr(output, "sample"):
            output.sample = self._gather(output.sample)
            return output
        return self._gather(output)
