"""What every ``cp-ops`` command's arguments share, torch-free (``--help`` and a wrong flag answer before torch
loads): the usage error, reported once (rank 0), the parser, value parsers, shared options and checks."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def csv(kind, what: str | None = None):
    def parse(text):
        items = []
        for x in text.split(","):
            if not x.strip():
                continue
            try:
                items.append(kind(x))
            except ValueError as e:
                why = "" if str(e).startswith("invalid literal") else f" ({e})"  # int()'s own words name no rule
                raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what or kind.__name__}; "
                                                 f"{x.strip()!r} in {text!r} is not one{why}") from e
        if not items:  # '' or ',': an empty list would silently mean the default
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what or kind.__name__}, at least "
                                             f"one; got {text!r}")
        return items

    return parse


def chunks(text: str):
    """A ``--chunks`` item: an int >= 1, or 'auto' (None: the heuristic, or measured with CP_OPS_TUNE_MODES=1)."""
    if text.strip().lower() in ("auto", "none"):
        return None
    v = int(text)
    if v < 1:
        raise ValueError(f"chunks must be >= 1 or auto; got {v}")
    return v


def chunks_arg(text: str):
    """``cp-ops run --chunks``: 'auto' (None) or an int >= 1; argparse's error otherwise."""
    try:
        return chunks(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected auto or an int >= 1; got {text!r}") from e


class UsageError(Exception):
    """A wrong argument or setting: main() prints ``cp-ops: <message>`` once (rank 0) and returns 2."""


def rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def say_once(line: str) -> None:
    """Print one error line to stderr from rank 0 only; other torchrun ranks stay silent and let rank 0 exit
    first (so torchrun's summary names rank 0's exit code 2 as the root cause)."""
    if rank0():
        print(line, file=sys.stderr, flush=True)
    else:
        time.sleep(1.0)


class Parser(argparse.ArgumentParser):
    #: a sentence added to argparse's "the following arguments are required" error (e.g. what to run without them)
    missing_hint: str | None = None

    def error(self, message):  # argparse's own errors (unknown flag, bad choice): once, exit 2
        if rank0():
            self.print_usage(sys.stderr)
        if self.missing_hint and "arguments are required" in message:
            message = f"{message} ({self.missing_hint})"
        say_once(f"{self.prog}: error: {message}")
        sys.exit(2)


#: a flag of :func:`common` folded into another's value -> the spelling its error names
RENAMED = {"--share-device": "--device shared"}


def common(p: argparse.ArgumentParser, repeats_help: str) -> None:
    p.add_argument("--nproc", type=int, default=None,
                   help="CP world size W: local ranks to spawn (default: all visible GPUs on CUDA, 2 on CPU); "
                        "under torchrun, W is torchrun's --nproc-per-node")
    p.add_argument("--device", choices=["auto", "cuda", "cpu", "shared"], default="auto",
                   help="cuda = NCCL, one GPU per rank; cpu = gloo; shared = every rank on cuda:0 over gloo (for "
                        "correctness checks, no speed numbers); default: auto = cuda when available, else cpu")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs before timing (default 5 GPU, 2 CPU)")
    p.add_argument("--repeats", type=int, default=None, help=repeats_help)
    p.add_argument("--out", default=None,
                   help="write the results as JSON to this path (its missing folders are created, an existing file "
                        "is overwritten); default: no file")


def check_comm_dtype(args, what: str) -> None:
    """``--comm-dtype``: a form :func:`cp_ops.comm_dtype.parse` takes, else a UsageError naming them and the value;
    sets ``args.comm_dtype`` to its canonical spelling (:func:`cp_ops.comm_dtype.text`). 'bf16' means the input dtype:
    with another ``args.dtype`` (fp32, the CPU default) it would silently send that, so it is a UsageError there."""
    from cp_ops.comm_dtype import parse, text

    given = str(getattr(args, "comm_dtype", "none"))
    try:
        fmts = parse(given)
    except ValueError:
        fail(f"{what}: --comm-dtype takes none, e4m3, e5m2 or FMT:LETTERS (LETTERS from qkvo, e.g. e4m3:qvo; fp8 = e4m3, "
             f"torch's names such as float8_e4m3fn work too); got {given!r}")
    dtype = getattr(args, "dtype", None)
    if given.strip().lower() == "bf16" and dtype not in (None, "bf16"):
        fail(f"{what}: --comm-dtype bf16 means 'the input dtype' (the link carries the input dtype or FP8, no other "
             f"conversion), and the inputs here are {dtype} (--dtype): use --comm-dtype none ({dtype} on the wire), "
             f"e4m3 or e5m2, or --dtype bf16")
    args.comm_dtype = text(fmts)


def add_mesh(p: argparse.ArgumentParser, extra: str = "") -> None:
    """``--mesh OxI`` (bench and run; checked by :func:`check_mesh`)."""
    p.add_argument("--mesh", default=None, metavar="OxI",
                   help="2-D CP on an O x I DeviceMesh ('agkv', 'ulysses'): O = outer AGKV degree (rows, e.g. nodes), "
                        "I = inner Ulysses degree (ranks of a row, e.g. a node's GPUs); O x I must equal the CP world "
                        "size and I must divide the heads. Each dim's communication time is reported (docs/2d.md)"
                        + extra)


def check_mesh(args, what: str, world: int, heads: int | None, per: str = "", lanes: int = 1) -> None:
    """``--mesh OxI``: two ints >= 1 whose product is the CP world size ``world`` and whose inner one divides ``heads``
    (None: unknown); sets ``args.mesh = (O, I)``. Else a UsageError naming the rule and the values (a wrong product:
    how many ranks the mesh needs, ``lanes`` CFG lanes of O x I each, and how to launch them)."""
    text = getattr(args, "mesh", None)
    if text is None:
        return
    import re

    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", str(text))
    if m is None:
        fail(f"{what}: --mesh takes OxI, two ints >= 1 (outer AGKV degree x inner Ulysses degree, e.g. 2x2); got "
             f"{text!r}")
    o, i = int(m.group(1)), int(m.group(2))
    if min(o, i) < 1:
        fail(f"{what}: --mesh {text}: both degrees must be >= 1; got outer={o}, inner={i}")
    if o * i != world:
        need = o * i * lanes
        how = (f"launch {need} ranks in all (torchrun: --nnodes x --nproc-per-node = {need})" if under_torchrun()
               else f"pass --nproc {need}")
        fail(f"{what}: --mesh {text}: outer x inner must equal the CP world size {world}{per}; got {o} x {i} = {o * i} "
             f"(for this mesh, {how})")
    if heads is not None and heads % i:
        fail(f"{what}: --mesh {text}: the inner (Ulysses) degree must divide the heads; got heads={heads}, inner={i}")
    if str(getattr(args, "comm_dtype", "none")).lower() not in ("none", "", "bf16", "input"):
        fail(f"{what}: --mesh rows run without FP8 for now (cp_ops.attention takes comm_dtype on a mesh; the CLI's mesh "
             f"rows do not yet, docs/fp8.md); got --mesh {text} with --comm-dtype {args.comm_dtype}: drop one")
    args.mesh = (o, i)


def under_torchrun() -> bool:
    """Whether torchrun's variables are set (this process is one of its ranks)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def fail(msg: str) -> None:
    raise UsageError(msg)


def check_out(path: str | None, flag: str) -> None:
    """Fail before the run when ``path`` cannot be written; say when it will be overwritten."""
    if not path:
        return
    full = os.path.abspath(path)
    if os.path.isdir(full):
        fail(f"{flag} {path} is a directory; give a file path")
    parent = os.path.dirname(full)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        fail(f"{flag} {path}: cannot write under {parent}")
    exists = os.path.exists(full)
    if exists and not os.access(full, os.W_OK):
        fail(f"{flag} {path} exists and is not writable")
    try:  # os.access says yes to root everywhere (e.g. /proc, root-squashed NFS): try the write itself
        if exists:
            open(full, "ab").close()  # appends nothing: the file is unchanged
        else:
            tempfile.TemporaryFile(dir=parent).close()
    except OSError as e:
        fail(f"{flag} {path}: cannot write under {parent} ({e.strerror})")
    if exists and rank0():
        print(f"cp-ops: {flag} {path} exists; it will be overwritten", flush=True)


def per_block_graphs(args) -> bool:
    """CUDA graphs over each compiled block (``mode='reduce-overhead'``): ``--compile`` with a bare ``--cuda-graphs``."""
    return bool(args.compile) and args.cuda_graphs is True


def whole_capture(args) -> bool:
    """The whole forward captured in one CUDA graph (:class:`cp_ops.timing.Graphed`): ``--cuda-graphs forward``, or a
    bare ``--cuda-graphs`` without ``--compile``."""
    return args.cuda_graphs == "forward" or (args.cuda_graphs is True and not args.compile)
