"""The cross-rank call contract (this rank's input rules: :mod:`cp_ops.validate`).

Every rank of a CP group makes the same cp_ops calls, in the same order, with the same local shape, dtype, transport argument and collective settings (:data:`cp_ops.config.COLLECTIVE_FIELDS`).
A rank cannot decide alone whether to check (it would skip the check exactly when the ranks disagree), so
every op call makes one exchange that all ranks always make (:func:`exchange`): a fixed-size int64 signature
all-gathered through host shared memory when the group's ranks share one host (:mod:`cp_ops._shm_exchange`,
5 µs per call at W=2 measured on the 2-core CI machine), else over a host-only gloo side group of the CP group
(~0.4-0.6 ms per call) — no GPU work, no GPU sync, the host may run ahead of the GPU; bounded by
``settings.timeout_s``. Any difference, or any rank whose own input checks failed,
raises on every rank before any data moves; a second exchange (only then) carries each rank's description so
the message names what each rank called. ``settings.check_ranks``:

* default (``'once'``): every call exchanges (call, call number, shape, dtype, transport, settings);
  :func:`cp_ops.parallelize` checksums its full inputs once per input shape;
* ``'always'`` (debug): as the default, and :func:`cp_ops.parallelize` checksums its inputs on every forward
  (a GPU sync each);
* ``'off'``: only the first call on each group exchanges (so ranks with different settings still meet once).

Eager :func:`cp_ops.attention` makes **one** exchange per call (:mod:`cp_ops._eager`: a :class:`CallCheck` whose
signature is packed once per call key, named after the call's first op); compiled code makes one per op call.

CUDA graphs: the exchange is host code, so it runs when a graph is *captured* (``torch.cuda.graph``, or the
recording run of ``torch.compile(mode="reduce-overhead")``), never when it is replayed: a replay is not checked,
and the ranks must replay the same graphs in the same order (as they must make the same calls).
"""

from __future__ import annotations

import datetime
import operator
import pickle
import struct
import zlib
from typing import Callable

import torch
import torch.distributed as dist

from . import config
from .group import backend_name

# ---- the rank contract ---------------------------------------------------------------------------
#: Every call that exchanges a signature: name -> id (a stable hash, equal on every rank). The ops register
#: themselves (``cp_ops._library``), the public API and integrations add the calls they check.
OPS: dict[str, int] = {}
# signature fields (int64 each): what they are called in messages
_FIELDS = ("call", "group", "call #", "failed", "transport", "settings", "B", "S_local", "H", "D", "dtype", "tensors",
           "checksum0", "checksum1", "checksum2", "chunks", "tag")
_N = len(_FIELDS)
_PACK = struct.Struct(f"<{_N}q")
_ASPECT = {0: "call", 1: "call", 2: "call number", 4: "transport", 5: "settings", 6: "shape", 7: "shape",
           8: "shape", 9: "shape", 10: "dtype", 11: "count", 12: "inputs", 13: "inputs", 14: "inputs",
           15: "chunks",
           16: "layout"}  # tag: a call's own extra agreement (cp_ops.modes.uneven: seq_lens, key_mask), named by its note
_ids: dict = {}  # str/dtype/settings tuple -> stable int id
_collective_values = operator.attrgetter(*config.COLLECTIVE_FIELDS)  # == settings.collective_values(), faster


def _id(key) -> int:
    v = _ids.get(key)
    if v is None:
        v = _ids[key] = zlib.crc32(repr(key).encode()) & 0x7FFFFFFF
    return v


#: What a call's ``extra`` integer means in messages, per call name (default: the number of tensors).
_EXTRA_LABEL: dict[str, str] = {}


def register_op(name: str, extra_label: str = "tensors") -> int:
    """Add ``name`` to :data:`OPS` (the calls whose signatures are exchanged); returns its id. ``extra_label``
    names the call's ``extra`` integer in error messages (e.g. 'chunks')."""
    OPS[name] = _id(name)
    if extra_label != "tensors":
        _EXTRA_LABEL[name] = extra_label
    return OPS[name]


class _Group:
    """Per CP group: the gloo side group (made at the first exchange), the call count, the signature buffers."""

    __slots__ = ("pg", "w", "skip", "side", "shm", "count", "lbuf", "gbuf", "local", "gathered", "seen")

    def __init__(self, pg: dist.ProcessGroup):
        self.pg, self.w = pg, pg.size()
        self.skip = self.w == 1 or backend_name(pg) == "fake"
        self.side, self.shm, self.count, self.seen = None, None, 0, set()
        self.lbuf, self.gbuf = bytearray(8 * _N), bytearray(8 * _N * self.w)
        self.local = torch.frombuffer(self.lbuf, dtype=torch.int64)
        self.gathered = torch.frombuffer(self.gbuf, dtype=torch.int64)


_groups: dict[str, _Group] = {}


def _release_side_groups() -> None:
    """At interpreter exit, drop the gloo side groups and shared-memory maps while the interpreter is whole: a
    gloo group left to die in the final teardown can abort the process ("terminate called without an active
    exception") after its store is gone."""
    for st in _groups.values():
        st.side = None
        st.shm = None
    _groups.clear()
    import gc

    gc.collect()


import atexit  # noqa: E402

atexit.register(_release_side_groups)
_side_made: dict[str, int] = {}


def _state(pg: dist.ProcessGroup) -> _Group:
    st = _groups.get(pg.group_name)
    if st is None or st.pg is not pg:  # a new group of that name (after destroy/init): start over
        st = _groups[pg.group_name] = _Group(pg)
    return st


def call_count(group: dist.ProcessGroup) -> int:
    """How many rank-checked cp_ops calls this rank has made on ``group`` (0 before the first)."""
    st = _groups.get(group.group_name)
    return st.count if st is not None and st.pg is group else 0


def _make_side(st: _Group, op: str):
    """A gloo process group over the CP group's ranks, private to cp_ops (its own store prefix): the exchange
    never queues behind data collectives and never touches the GPU. Made by the group's ranks only."""
    from torch.distributed.distributed_c10d import _get_default_store

    pg = st.pg
    n = _side_made[pg.group_name] = _side_made.get(pg.group_name, -1) + 1
    store = dist.PrefixStore(f"cp_ops/rank_check/{pg.group_name}/{n}/", _get_default_store())
    timeout = config.settings.timeout_s
    try:
        st.side = dist.ProcessGroupGloo(store, pg.rank(), st.w, datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        raise RuntimeError(
            f"{op}: the ranks of CP group '{pg.group_name}' (ranks {dist.get_process_group_ranks(pg)}) did not all "
            f"make their first cp_ops call within CP_OPS_TIMEOUT_S={timeout:g} s (a rank skipped it, crashed or is "
            f"stuck): {str(e).splitlines()[0]}"
        ) from e
    if _USE_SHM:
        st.shm = _make_shm(st)


#: Exchange through host shared memory when every rank of the group is on one host (else over gloo).
_USE_SHM = True


def _make_shm(st: _Group):
    """The shared-memory exchange for a group whose ranks share one host, agreed by every rank (None: gloo)."""
    import socket

    from ._shm_exchange import ShmExchange

    if len(set(_gather_objects(st, socket.gethostname()))) != 1:
        return None
    rank, x, err = st.pg.rank(), None, None
    try:
        x = ShmExchange.create(st.w, _N) if rank == 0 else None
    except OSError as e:
        err = str(e)
    path = _gather_objects(st, x.path if x is not None else None)[0]
    if rank != 0 and path is not None:
        try:
            x = ShmExchange.attach(path, st.w, rank, _N)
        except OSError as e:  # e.g. another container's /dev/shm under the same host name
            err = str(e)
    ok = all(e is None for e in _gather_objects(st, err if path is not None else "no file"))
    if rank == 0 and x is not None:
        x.unlink()  # every rank has it mapped (or gave up): the name is no longer needed
    return x if ok else None


def exchange(pg: dist.ProcessGroup, op: str, transport: str, t=None, extra: int = 0,
             failed: BaseException | None = None, inputs: dict | None = None, tag: int = 0,
             note: str | None = None) -> None:
    """Check the rank contract for one call: all ranks of ``pg`` exchange a signature; raise on every rank on
    any difference. See the module docstring for what is compared under each ``settings.check_ranks``.

    Args:
        pg: the CP group. op: the call's name (an entry of :data:`OPS`, or a new one). transport: the
            transport argument as given to the op. t: the tensor whose shape and dtype are compared (a
            ``[B, S_local, H, D]`` tensor, or None). extra: the number of tensors in the call.
        failed: this rank's own input error: peers learn that this rank stops (the caller re-raises it).
        inputs: name -> tensor (at most 3) whose checksums (:func:`input_checksum`) must be equal on every rank.
        tag: one more int64 that must be equal on every rank (e.g. a hash of the call's ``seq_lens``);
            note: what ``tag`` stands for, in words, for the error message (e.g. ``'seq_lens=[3, 2]'``).
    Raises:
        ValueError: on every rank (but a rank that passed ``failed``), naming each rank's call and what differs.
        RuntimeError: the ranks did not all reach the exchange within ``settings.timeout_s``.
    """
    st = _groups.get(pg.group_name)
    if st is None or st.pg is not pg:
        st = _state(pg)
    if st.skip or (st.count and config.settings.check_ranks == "off"):
        return
    sums = (0, 0, 0)
    if inputs is not None:
        b, s, h, d, dtype = _id(tuple(None if x is None else (tuple(x.shape), x.dtype) for x in inputs.values())), \
            -1, -1, -1, 0
        sums = (tuple(input_checksum(x) for x in inputs.values()) + sums)[:3]
    elif isinstance(t, torch.Tensor) and t.dim() == 4:
        b, s, h, d = t.shape
        dtype = _id(t.dtype)
    else:
        b = s = h = d = -1
        dtype = 0
    if not _signed(st, op, OPS.get(op) or register_op(op), _id(transport), b, s, h, d, dtype, extra, *sums, 0, tag,
                   failed is not None):
        t_ok = isinstance(t, torch.Tensor)
        _disagree(st, op, transport, list(t.shape) if t_ok else None,
                  str(t.dtype).replace("torch.", "") if t_ok else None, extra, failed, inputs, 0, note)


def _signed(st: _Group, op: str, op_id: int, tid: int, b, s, h, d, dt: int, extra: int, s0: int, s1: int, s2: int,
            chunks: int, tag: int, failed: bool) -> bool:
    """The one signature packer: this call's words into ``st.lbuf``, then the all-gather. True when every rank's
    signature equals this rank's (or this call does not exchange: one rank, 'fake' backend, ``check_ranks='off'``
    after the first call)."""
    if st.skip or (st.count and config.settings.check_ranks == "off"):
        return True
    if st.side is None:
        _make_side(st, op)
    st.count += 1
    _PACK.pack_into(st.lbuf, 0, op_id, _id(st.pg.group_name), st.count, failed, tid,
                    _id(_collective_values(config.settings)), b, s, h, d, dt, extra, s0, s1, s2, chunks, tag)
    return _gather(st, op)


def _gather(st: _Group, op: str) -> bool:
    """All-gather the signature packed in ``st.lbuf``; True when every rank's equals this rank's."""
    mine = bytes(st.lbuf)
    try:
        if st.shm is not None:
            if not st.shm.allgather(st.count, mine, st.gbuf, config.settings.timeout_s):
                raise RuntimeError("shared-memory rank check timed out")
        else:
            st.side._allgather_base(st.gathered, st.local).wait()
    except RuntimeError as e:
        raise RuntimeError(
            f"{op}: call #{st.count} on CP group '{st.pg.group_name}': not every rank made this call within "
            f"CP_OPS_TIMEOUT_S={config.settings.timeout_s:g} s (a rank skipped a call, crashed, or is stuck; "
            f"CP_OPS_CHECK_RANKS=always names skipped calls earlier): {str(e).splitlines()[0]}"
        ) from e
    return st.gbuf == mine * st.w


class CallCheck:
    """The rank contract's exchange for one repeated call, its signature fixed once (what the eager fast path of
    :func:`cp_ops.attention` runs per call: the same exchange as :func:`exchange`, without rebuilding the
    signature). ``check()`` compares (call, call number, shape, dtype, transport, tensor count, chunks and the
    collective settings, read at each call) across the ranks of ``pg``; raises as :func:`exchange`.

    Args:
        pg: the CP group. op: the call's name. transport: the transport argument as given. shape, dtype: the
            compared tensor's ``[B, S_local, H, D]`` and dtype. extra: the tensor count (or chunks, see
            :func:`register_op`). chunks: the pipeline stages of the call (0: not a pipelined call). tag, note:
            as :func:`exchange`'s (e.g. a hash of the call's ``seq_lens`` and those in words).
    """

    __slots__ = ("pg", "st", "op", "transport", "shape", "dtype", "extra", "chunks", "tag", "words", "note")

    def __init__(self, pg: dist.ProcessGroup, op: str, transport: str, shape, dtype: torch.dtype, extra: int,
                 chunks: int = 0, tag: int = 0, note: str | None = None):
        self.pg, self.st, self.op, self.transport = pg, _state(pg), op, transport
        self.shape, self.dtype, self.extra, self.chunks, self.tag, self.note = \
            tuple(shape), dtype, extra, chunks, tag, note
        b, s, h, d = shape
        self.words = (OPS.get(op) or register_op(op), _id(transport), b, s, h, d, _id(dtype))

    def check(self) -> None:
        op_id, tid, b, s, h, d, dt = self.words
        if not _signed(self.st, self.op, op_id, tid, b, s, h, d, dt, self.extra, 0, 0, 0, self.chunks, self.tag, False):
            _disagree(self.st, self.op, self.transport, list(self.shape), str(self.dtype).replace("torch.", ""),
                      self.extra, None, None, self.chunks, self.note)


def _disagree(st: _Group, op, transport, shape, dtype, extra, failed, inputs, chunks, note=None) -> None:
    """Every rank gets here together (the gathered rows are the same everywhere): exchange descriptions,
    then raise on every rank — except on a rank whose own checks failed (its caller raises its own error)."""
    rows = [_PACK.unpack_from(st.gbuf, i * 8 * _N) for i in range(st.w)]
    mine = {
        "call": op, "n": st.count, "transport": transport,
        "settings": dict(zip(config.COLLECTIVE_FIELDS, config.settings.collective_values())),
        "shape": shape, "dtype": dtype, "tensors": extra, "chunks": chunks,
        "inputs": None if inputs is None else {k: (None if x is None else (list(x.shape), str(x.dtype)))
                                               for k, x in inputs.items()},
        "error": None if failed is None else f"{type(failed).__name__}: {str(failed).splitlines()[0]}",
        "note": note,
    }
    desc = _gather_objects(st, mine)
    if failed is not None:
        return
    g = st.pg.group_name
    bad = [i for i, r in enumerate(rows) if r[3]]
    if bad:
        errors = "; ".join(f"rank {i}: {desc[i]['call']}: {desc[i]['error']}" for i in bad)
        raise ValueError(
            f"{op}: rank(s) {bad} of CP group '{g}' rejected their inputs ({errors}); this rank stops too, so no "
            "rank waits in a collective"
        )
    aspects = []
    for j in range(_N):
        if any(r[j] != rows[0][j] for r in rows) and _ASPECT.get(j) and _ASPECT[j] not in aspects:
            aspects.append(_ASPECT[j])
    per_rank = "; ".join(f"rank {i}: {_describe(d, aspects, desc)}" for i, d in enumerate(desc))
    raise ValueError(
        f"{op}: the ranks of CP group '{g}' must make the same cp_ops calls in the same order; they differ in "
        f"{', '.join(aspects)}: {per_rank}{_uneven_hint(aspects, desc)}{_variant_hint(aspects, desc)}"
    )


def _uneven_hint(aspects: list[str], desc: list[dict]) -> str:
    """Where the ranks differ only in S_local (uneven shards without ``seq_lens``): the ``seq_lens`` to pass."""
    shapes = [d["shape"] for d in desc]
    if aspects != ["shape"] or any(s is None or len(s) != 4 for s in shapes) or len(
            {(s[0], s[2], s[3]) for s in shapes}) != 1:
        return ""
    return (f"; only S_local differs: for uneven shards pass seq_lens={tuple(s[1] for s in shapes)} (the same tuple "
            "on every rank; cp_ops.layout.shard_sizes(total, W) is the standard split)")


#: The ops an attention call's exchange is made for (its variant's first op): ranks at the same call number with
#: different ones were most likely given different ``mode`` or ``chunks``.
_VARIANT_OPS = frozenset(f"cp_ops::{n}" for n in ("agkv_gather_start", "ulysses_start", "agkv_pipelined_attention",
                                                   "agkv_gather_uneven_start", "ulysses_uneven_start"))


def _variant_hint(aspects: list[str], desc: list[dict]) -> str:
    """Where the ranks started different CP variants at the same call number: name mode/chunks as the likely cause."""
    if "call" not in aspects or "call number" in aspects or not all(d["call"] in _VARIANT_OPS for d in desc):
        return ""
    return ("; the ranks started different CP variants at the same call: cp_ops.attention (and parallelize) must get "
            "the same mode and chunks on every rank")


def _describe(d: dict, aspects: list[str], everyone: list[dict]) -> str:
    out = f"{d['call']} (call #{d['n']})"
    label = _EXTRA_LABEL.get(d["call"], "tensors")
    if d["shape"] is not None:
        out += f" [B, S_local, H, D]={d['shape']} dtype={d['dtype']} {label}={d['tensors']}"
    elif d["tensors"]:
        out += f" {'count' if label == 'tensors' else label}={d['tensors']}"
    if d["inputs"] is not None:
        out += f" inputs={d['inputs']}"
    if d.get("note"):
        out += f" {d['note']}"
    if "chunks" in aspects:
        out += f" chunks={d.get('chunks') or 'none (not pipelined)'}"
    if "transport" in aspects:
        out += f" transport={d['transport']!r}"
    if "settings" in aspects:
        differ = [f for f in config.COLLECTIVE_FIELDS if any(e["settings"][f] != d["settings"][f] for e in everyone)]
        out += " " + " ".join(f"{f}={d['settings'][f]!r}" for f in differ)
    if "inputs" in aspects:
        out += " (input checksums differ: the ranks were given different inputs; seed them alike)"
    return out


def _gather_objects(st: _Group, obj) -> list:
    """All-gather one picklable object per rank over the side group (only on the error path)."""
    data = pickle.dumps(obj)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = torch.empty(st.w, dtype=torch.int64)
    st.side._allgather_base(sizes, size).wait()
    n = int(sizes.max())
    buf = torch.zeros(n, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = torch.empty(st.w * n, dtype=torch.uint8)
    st.side._allgather_base(out, buf).wait()
    return [pickle.loads(bytes(out[i * n: i * n + int(sizes[i])].tolist())) for i in range(st.w)]


def input_checksum(t) -> int:
    """A cheap fingerprint of ``t``'s values: 61 strided samples, index-weighted, summed in fp64 (its bits as an
    int). Equal tensors give equal checksums on the same device type; a GPU tensor costs one tiny sync."""
    if t is None or not isinstance(t, torch.Tensor) or t.numel() == 0:
        return 0
    flat = t.detach().reshape(-1)
    s = flat[:: max(1, flat.numel() // 61)].double()
    w = torch.arange(1, s.numel() + 1, dtype=torch.float64, device=s.device)
    return struct.unpack("<q", struct.pack("<d", float((s * w).sum())))[0]


def check_inputs_agree(group: dist.ProcessGroup, what: str, inputs: dict) -> None:
    """Raise on every rank unless ``inputs`` (name -> tensor or None, at most 3) have the same shapes, dtypes and
    checksums on every rank of ``group`` (inputs that must be replicated, e.g. a DiT's latents and timestep).

    Raises:
        ValueError: on every rank, naming the inputs whose checksums differ.
    """
    if len(inputs) > 3:
        raise ValueError(f"check_inputs_agree compares at most 3 inputs; got {len(inputs)}")
    exchange(group, what, "", inputs=inputs)


def check_settings_agree(group: dist.ProcessGroup) -> None:
    """Compare the collective settings (:data:`cp_ops.config.COLLECTIVE_FIELDS`) across the ranks of ``group`` now
    (e.g. at start-up). Every op call's exchange compares them too; this makes one more exchange.

    Raises:
        ValueError: on every rank, naming each differing setting and each rank's value.
    """
    exchange(group, "cp_ops.check_settings_agree", "")


def api_checked(group: dist.ProcessGroup, api: str, checks: Callable[[], None]) -> None:
    """Run a public function's input checks; if they fail, tell the peers (waiting in the op's rank check)
    before raising, so no rank is left in a collective. While ``torch.compile`` traces, only the checks run."""
    try:
        checks()
    except (ValueError, RuntimeError, TypeError) as e:
        if not torch.compiler.is_compiling():
            exchange(group, api, "", failed=e)
        raise


def op_checked(group: dist.ProcessGroup, op: str, transport: str, t, rules: Callable[[], None], extra: int = 0) -> None:
    """An op's real kernel: its input rules (the fake kernel's), then the rank contract's exchange."""
    try:
        rules()
    except (ValueError, RuntimeError, TypeError) as e:
        exchange(group, op, transport, None, extra, failed=e)
        raise
    exchange(group, op, transport, t, extra)
