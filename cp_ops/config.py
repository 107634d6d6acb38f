"""Process-wide cp_ops settings, read once from the environment and changeable at run time.

``CP_OPS_BLOCKING=1``       every async launch waits for its own completion before returning, the way
                            ``CUDA_LAUNCH_BLOCKING=1`` does for kernels: a debugging aid for races.
``CP_OPS_CHECK_RANKS``      ``once`` (default): the first call of each op at each shape exchanges the
                            shape among the ranks and raises if they disagree; ``always``: every call
                            does (slow, a host sync per call); ``off``: never.
``CP_OPS_TIMEOUT_S``        seconds after which a process group created by cp_ops (CLI, launcher) gives
                            up on a collective and raises instead of hanging (default 300).
"""

from __future__ import annotations

import os


def _flag(name: str, default: str) -> bool:
    raw = os.environ.get(name, default).strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 1/0 (or true/false, yes/no, on/off); got {raw!r}")


blocking: bool = _flag("CP_OPS_BLOCKING", "0")
check_ranks: str = os.environ.get("CP_OPS_CHECK_RANKS", "").strip() or "once"
try:
    timeout_s: float = float(os.environ.get("CP_OPS_TIMEOUT_S", "300"))
except ValueError:
    raise ValueError(
        f"CP_OPS_TIMEOUT_S must be a number of seconds; got {os.environ['CP_OPS_TIMEOUT_S']!r}"
    ) from None

if check_ranks not in ("once", "always", "off"):
    raise ValueError(f"CP_OPS_CHECK_RANKS must be one of once/always/off; got {check_ranks!r}")
