"""A call of :func:`cp_ops.attention`: its arguments normalized once, at the API, into one value that flows down:
BSHD tensors (a BHSD call's are transposed views), ``comm_dtype`` in its normal form (an invalid one kept as given,
so the plan's checks raise it on every rank). :meth:`Call.key`: the plan cache's key.
"""

from __future__ import annotations

import torch

from .. import comm_dtype as cd
from .. import config

_dispatch_modes = torch._C._len_torch_dispatch_stack  # > 0 while a TorchDispatchMode (tracing, fake, ...) is active


class Call:
    """One CP attention call (arguments as :func:`cp_ops.attention`; tensors BSHD, inputs detached), made by
    :func:`make` and never changed after: :meth:`replace` gives a changed copy. Slots, not a NamedTuple: an eager call
    reads its fields about 20 times, and a slot is read in a fraction of a tuple field's time."""

    __slots__ = ("q", "k", "v", "group", "mode", "transport", "scale", "chunks", "seq_lens", "key_mask", "tag",
                 "comm_dtype")  # comm_dtype: the normal form, or the caller's value when it is not valid

    def replace(self, **changes) -> Call:
        """A copy with the fields ``changes`` names set to its values."""
        unknown = changes.keys() - set(Call.__slots__)
        if unknown:
            raise TypeError(f"Call.replace: no fields {sorted(unknown)}")
        c = Call()
        for name in Call.__slots__:
            setattr(c, name, changes[name] if name in changes else getattr(self, name))
        return c

    def __repr__(self) -> str:
        return "Call(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in Call.__slots__) + ")"

    def key(self):
        """The plan cache's key of this call, or None: take the traced path (not plain tensors, a dispatch mode
        active, ``seq_lens`` not ints, a key mask not a tensor). Every argument is in it (tensors by shape, dtype and
        device; ``chunks``, ``scale`` and a non-str/int ``tag`` by type too: ``True``, ``1`` and ``1.0`` hash alike),
        and the measuring setting. May raise TypeError/AttributeError: the traced path then raises the error."""
        q, k, v = self.q, self.k, self.v
        if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor \
                or _dispatch_modes():
            return None
        tag, chunks, scale = self.tag, self.chunks, self.scale
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, self.group,
               self.mode, self.transport, chunks, type(chunks), config.settings.tune_modes,
               tag if tag is None or type(tag) is str or type(tag) is int else (type(tag), repr(tag)), self.comm_dtype,
               scale, type(scale))
        if self.seq_lens is not None or self.key_mask is not None:
            extra = _layout_key(self.seq_lens, self.key_mask)
            if extra is None:
                return None
            key += extra
        return key


def make(q, k, v, *, group=None, mode="auto", transport="auto", scale=None, chunks=None, seq_lens=None, key_mask=None,
         tag=None, comm_dtype=None) -> Call:
    """The :class:`Call` of :func:`cp_ops.attention`'s keywords (BSHD tensors): ``comm_dtype`` normalized."""
    fmts = cd.NONE
    if comm_dtype is not None:
        try:
            fmts = cd.normalize(comm_dtype, getattr(q, "dtype", None))
        except ValueError:  # kept as given: the plan's checks raise it on every rank
            fmts = comm_dtype
    c = Call()
    c.q = q
    c.k = k
    c.v = v
    c.group = group
    c.mode = mode
    c.transport = transport
    c.scale = scale
    c.chunks = chunks
    c.seq_lens = seq_lens
    c.key_mask = key_mask
    c.tag = tag
    c.comm_dtype = fmts
    return c


def _layout_key(seq_lens, key_mask):
    """What a ``seq_lens`` / ``key_mask`` call adds to its key; None: the traced path (it raises on a bad one). Ints
    only, by type: ``4.0`` and ``True`` hash like ``4`` and ``1`` but are not token counts."""
    if seq_lens is not None:
        if type(seq_lens) is not tuple:
            if type(seq_lens) is not list:
                return None
            seq_lens = tuple(seq_lens)
        for n in seq_lens:
            if type(n) is not int:
                return None
    if key_mask is None:
        return (seq_lens, None)
    if type(key_mask) is not torch.Tensor:
        return None
    return (seq_lens, key_mask.shape, key_mask.dtype, key_mask.device)
