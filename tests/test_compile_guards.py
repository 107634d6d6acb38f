"""``cp_ops.compile`` leaves out Dynamo's guards on cp_ops' own code (the identity of its functions, classes and
modules: about half of a compiled block's guards, host time at every call of the block) and keeps every guard on
values: a collective setting read while tracing still recompiles when it changes; a user's own ``guard_filter_fn``
runs too, for every function a ``cp_ops.compile(...)`` decorator compiles."""

import types

import torch
import torch.distributed as dist

import cp_ops
from cp_ops import config
from cp_ops.compiler import skip_cp_ops_code_guards
from dist_util import run_ranks


def _guards(rank, w):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 4, 16) for _ in range(3))
    seen = []

    def spy(entries):  # a user's filter: keeps everything, records what Dynamo offered
        seen.append(list(entries))
        return [True] * len(entries)

    def attend(q, k, v):
        return cp_ops.attention(q, k, v, group=dist.group.WORLD, comm_dtype=torch.float8_e4m3fn) * 2

    f = cp_ops.compile(attend, fullgraph=True, dynamic=False, options={"guard_filter_fn": spy})
    with torch.no_grad():
        plain = f(q, k, v)
        assert torch.equal(plain, attend(q, k, v))  # one rank: nothing crosses a link, no FP8 round trip
        assert len(seen) == 1
        entries = seen[0]
        keep = skip_cp_ops_code_guards(entries)
        dropped = [e for e, kept in zip(entries, keep) if not kept]
        assert len(dropped) >= 20, [(e.guard_type, e.name) for e in entries]  # cp_ops' frontend: functions, modules
        assert all(e.is_global and e.name.startswith("G['__import_cp_ops") for e in dropped)
        assert {e.guard_type for e in dropped} <= {"CLOSURE_MATCH", "MODULE_MATCH", "CLASS_MATCH", "DUPLICATE_INPUT",
                                                    "ID_MATCH"}
        code = (types.ModuleType, types.FunctionType, types.CodeType, type)
        assert all(isinstance(e.value, code) for e in dropped)  # code only: never a group's or a number's identity
        # an identity guard on anything else reached from cp_ops' globals stays (a group, a number), code goes
        like = dict(is_global=True, guard_type="ID_MATCH", name="G['__import_cp_ops_dot_group'].x", has_value=True)
        probe = [types.SimpleNamespace(**like, value=v) for v in (dist.group.WORLD, -100, attend, cp_ops)]
        assert skip_cp_ops_code_guards(probe) == [True, True, False, False]
        kept = [e for e, kept in zip(entries, keep) if kept]
        assert sum(e.guard_type == "TENSOR_MATCH" for e in kept) == 3
        assert any("emulate_comm" in e.name for e in kept), [e.name for e in kept]  # the setting read while tracing

        # the one-rank FP8 emulation: its value guard must recompile. (torch 2.11's Inductor cannot lower the
        # emulation's codec on CPU: "self.stride(-1) must be 1 to view Float as Byte"; 2.13, CI's, can.)
        if torch.torch_version.TorchVersion(torch.__version__) >= "2.13":
            config.configure(emulate_comm=True)
            try:
                emulated = f(q, k, v)
                assert len(seen) == 2  # recompiled
                assert torch.equal(emulated, attend(q, k, v))
                assert not torch.equal(emulated, plain)
            finally:
                config.configure(emulate_comm=False)
            assert torch.equal(f(q, k, v), plain)

        # a decorator compiles several functions: each keeps the filters (torch.compile pops them from options)
        dec = cp_ops.compile(fullgraph=True, dynamic=False, options={"guard_filter_fn": spy})
        n = len(seen)
        g1 = dec(lambda q, k, v: cp_ops.attention(q, k, v, group=dist.group.WORLD) + 1)
        g2 = dec(lambda q, k, v: cp_ops.attention(q, k, v, group=dist.group.WORLD) - 1)
        out = cp_ops.attention(q, k, v, group=dist.group.WORLD)
        assert torch.equal(g1(q, k, v), out + 1) and torch.equal(g2(q, k, v), out - 1)
        assert len(seen) == n + 2


def test_cp_ops_code_guards_left_out_value_guards_kept():
    run_ranks(_guards, 1)
