"""The same-call contract at the model level (eager only; compiled code keeps the per-op checks): the full inputs
agree across ranks (a checksum, once per input shape; every forward under ``CP_OPS_CHECK_RANKS=debug``), and every
rank made the same number of cp_ops calls before the output gather (a skipped layer raises on every rank).
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from ... import config
from ...contract import call_count, check_inputs_agree, exchange, waiting_in


class RankChecks:
    """Installed as the model's first forward pre-hook, so it sees the full inputs. ``inputs``: up to 3 forward
    parameter names to checksum (a list argument, as Z-Image's ``x``, is checked by its first element)."""

    def __init__(self, model: torch.nn.Module, pg: dist.ProcessGroup, inputs: tuple[str, ...],
                 input_pg: dist.ProcessGroup | None = None):
        # pg: the CP group (call counts); input_pg: the ranks that get the same full inputs (all CFG lanes)
        self.pg, self.input_pg, self.seen, self.start, self.inputs = pg, input_pg or pg, set(), 0, inputs
        self.forwards = 0  # eager forwards started (their number names them in the waits' messages)
        self.params = list(inspect.signature(model.forward).parameters)
        model.register_forward_pre_hook(self.before_forward, with_kwargs=True)

    def _arg(self, name, args, kwargs) -> tuple[str, torch.Tensor | None]:
        """The forward's input ``name`` (a tensor, or None) and how the caller passed it, in words for the rank
        contract's message: ``"hidden_states (keyword)"``, ``"x (positional argument 0)"``, a list's ``"x[0] ..."``."""
        i = self.params.index(name) if name in self.params else len(args)
        if name in kwargs:
            x, where = kwargs[name], "keyword"
        elif i < len(args):
            x, where = args[i], f"positional argument {i}"
        else:
            x, where = None, "not given"
        label = name
        if isinstance(x, (list, tuple)):
            x = x[0] if x and isinstance(x[0], torch.Tensor) else None
            label += "[0]"
        return f"{label} ({where})", x if isinstance(x, torch.Tensor) else None

    def before_forward(self, mod, args, kwargs):
        if torch.compiler.is_compiling():
            return
        self.forwards += 1
        mode = config.settings.check_ranks
        if mode != "off":
            inputs = dict(self._arg(n, args, kwargs) for n in self.inputs)
            # per group: each group's ranks check its first forward of a shape (CFG lanes: a lane, or all ranks)
            key = (self.input_pg, tuple(None if x is None else (tuple(x.shape), x.dtype) for x in inputs.values()))
            if mode == "debug" or key not in self.seen:
                with waiting_in(f"cp_ops.parallelize inputs of forward #{self.forwards}"):
                    check_inputs_agree(self.input_pg, "cp_ops.parallelize inputs", inputs)
                self.seen.add(key)
        self.start = call_count(self.pg)

    def before_gather(self):
        if torch.compiler.is_compiling() or config.settings.check_ranks == "off":
            return
        exchange(self.pg, "cp_ops.parallelize output gather (calls this forward)", "",
                 extra=call_count(self.pg) - self.start)
