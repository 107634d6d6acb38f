"""``comm_dtype``: which tensors of a CP attention call cross the link in FP8, and in which format.

The argument: ``None`` or the input dtype (bitwise the call without it); ``torch.float8_e4m3fn`` /
``torch.float8_e5m2`` or their names ``'e4m3'`` / ``'e5m2'`` (every tensor the mode moves); a dict naming tensors of
``"q", "k", "v", "o"`` (AGKV needs K and V alike). Table and errors: ``docs/fp8.md`` ("The argument"). The normal
form (:func:`normalize`) is a hashable 4-tuple of format names for (q, k, v, o), '' = the input dtype.
"""

from __future__ import annotations

import torch

from .kernels.fp8 import FORMATS, format_name

#: the tensors a call may move, in the order of the normal form
NAMES = ("q", "k", "v", "o")
#: the normal form of "every tensor in the input dtype"
NONE = ("", "", "", "")


def normalize(comm_dtype, input_dtype: torch.dtype | None = None) -> tuple[str, str, str, str]:
    """The normal form of a ``comm_dtype`` argument (module docstring).

    Raises:
        ValueError: a dtype other than float8_e4m3fn / float8_e5m2 / ``input_dtype``, a str other than 'e4m3' /
            'e5m2' (the CLI's other forms, 'none' or 'e4m3:qvo', are the CLI's: :func:`parse`); a dict key not in
            ``("q", "k", "v", "o")``; a value that is not an FP8 dtype, its name or None.
    """
    if comm_dtype is None:
        return NONE
    if isinstance(comm_dtype, tuple) and len(comm_dtype) == 4 and all(f in ("", *FORMATS) for f in comm_dtype):
        return comm_dtype  # already normal
    if isinstance(comm_dtype, dict):
        bad = [k for k in comm_dtype if k not in NAMES]
        if bad:
            raise ValueError(f"comm_dtype: a dict's keys name the tensors that travel, from {NAMES}; got {bad!r}")
        return tuple("" if comm_dtype.get(n) is None or comm_dtype.get(n) == input_dtype
                     else _fmt(comm_dtype[n], f"comm_dtype[{n!r}]") for n in NAMES)
    if input_dtype is not None and comm_dtype == input_dtype:
        return NONE
    f = _fmt(comm_dtype, "comm_dtype")
    return (f, f, f, f)


def _fmt(dtype, what: str) -> str:
    try:
        return format_name(dtype)
    except ValueError:
        raise ValueError(f"{what} must be torch.float8_e4m3fn, torch.float8_e5m2 (or their names 'e4m3', 'e5m2'), "
                         f"None (the input dtype) or, for comm_dtype, a dict of them keyed by {NAMES}; got {dtype!r}"
                         + (" (the CLI's --comm-dtype forms none / FMT:LETTERS are cp_ops.comm_dtype.parse's: pass "
                            "None, or a dict)" if isinstance(dtype, str) else "")) from None


#: the modes whose K and V travel together in one gather (so in one format): AGKV, and the 2-D mode's outer dim
GATHERS_KV = ("agkv", "agkv_ulysses")


def for_mode(fmts: tuple, mode: str) -> tuple[str, str, str, str]:
    """The formats a call of ``mode`` uses: AGKV keeps K and V only, 'agkv_ulysses' all four. ValueError: either
    with K and V in different formats (one gather moves both)."""
    if mode not in GATHERS_KV or fmts == NONE:
        return fmts
    if fmts[1] != fmts[2]:
        where = " over the outer ('agkv') mesh dim" if mode != "agkv" else ""
        raise ValueError(f"comm_dtype: mode={mode!r} gathers K and V together{where}, so they travel in one format; "
                         f"got k={fmts[1] or 'input dtype'!r}, v={fmts[2] or 'input dtype'!r} (name both or neither)")
    return fmts if mode != "agkv" else ("", fmts[1], fmts[2], "")


def outer(fmts: tuple) -> tuple[str, str, str, str]:
    """The formats of a 2-D call's outer (AGKV) dim, from the call's :func:`for_mode` ``'agkv_ulysses'`` formats."""
    return ("", fmts[1], fmts[2], "") if fmts != NONE else NONE


def tag(fmts: tuple) -> str | None:
    """The variant tag's field for the rank contract (None when nothing travels in FP8: the tag is unchanged)."""
    if fmts == NONE:
        return None
    return ",".join(f"{n}={f}" for n, f in zip(NAMES, fmts) if f)


#: the CLI's spellings of the two formats (lower case; a leading 'torch.' is dropped first)
ALIASES = {"e4m3": "e4m3", "fp8": "e4m3", "e4m3fn": "e4m3", "float8_e4m3fn": "e4m3", "fp8_e4m3": "e4m3",
           "fp8_e4m3fn": "e4m3", "e5m2": "e5m2", "float8_e5m2": "e5m2", "fp8_e5m2": "e5m2"}


def parse(text: str) -> tuple[str, str, str, str]:
    """The CLI's form: 'none' (input dtype; also 'bf16' and 'input'), 'e4m3' / 'e5m2' (every tensor, or spelled as
    :data:`ALIASES` lists), or 'e4m3:qvo' (the tensors named by their letters). Raises ValueError naming the forms."""
    t = text.strip().lower()
    if t in ("", "none", "bf16", "input"):
        return NONE
    fmt, colon, which = t.partition(":")
    fmt = ALIASES.get(fmt.removeprefix("torch."), fmt)
    if fmt not in FORMATS or any(c not in "qkvo" for c in which) or (colon and not which):
        raise ValueError(f"comm dtype must be none, e4m3, e5m2 or e4m3:LETTERS (LETTERS from qkvo, e.g. e4m3:qvo; "
                         f"at least one); got {text!r}")
    which = which or "qkvo"
    return tuple(fmt if n in which else "" for n in NAMES)


def text(fmts: tuple) -> str:
    """The CLI's spelling of a normal form (the inverse of :func:`parse`): 'none', 'e4m3', 'e5m2', 'FMT:LETTERS';
    mixed formats, which the CLI cannot spell, as :func:`tag` writes them."""
    used = {f for f in fmts if f}
    if not used:
        return "none"
    if len(used) > 1:
        return tag(fmts)
    (fmt,) = used
    letters = "".join(n for n, f in zip(NAMES, fmts) if f)
    return fmt if letters == "qkvo" else f"{fmt}:{letters}"
