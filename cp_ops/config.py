"""The one cp_ops settings object: every ``CP_OPS_*`` environment variable is parsed here, once, at import; nothing
else reads or writes them (code reads ``settings`` and changes it with :func:`configure`). Each variable, its
meaning and default: ``docs/settings.md``. :data:`COLLECTIVE_FIELDS` must be equal on every rank of a group (the
rank contract compares them). A bad value raises :class:`ConfigError`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


class ConfigError(ValueError):
    """A ``CP_OPS_*`` value (or a :func:`configure` argument) outside its allowed values."""


def _flag(name: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("", "0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r} is not a flag: use 1/0 (or true/false, yes/no, on/off)")


def _choice_renamed(allowed: tuple[str, ...], old: dict[str, str]) -> Callable[[str, str], str]:
    """:func:`_choice` that also takes the old spellings in ``old`` (old -> new), with a DeprecationWarning."""
    plain = _choice(*allowed)

    def parse(name: str, raw: str) -> str:
        v = raw.strip().lower()
        if v in old:
            import warnings

            warnings.warn(f"{name}={raw!r} is the old spelling of {old[v]!r} (values now: {'/'.join(allowed)})",
                          DeprecationWarning, stacklevel=4)
            return old[v]
        return plain(name, raw)

    return parse


def _choice(*allowed: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        v = raw.strip().lower()
        if v not in allowed:
            raise ConfigError(f"{name}={raw!r} is not allowed: use one of {'/'.join(allowed)}")
        return v

    return parse


def _positive_float(name: str, raw: str) -> float:
    try:
        v = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number: give a positive number") from None
    if not v > 0 or v != v or v == float("inf"):
        raise ConfigError(f"{name}={raw!r} must be a positive finite number")
    return v


def _optional_width(name: str, raw: str) -> int | None:
    if raw.strip() == "":
        return None
    try:
        v = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer: give a CP group width >= 1, or leave it unset") from None
    if v < 1:
        raise ConfigError(f"{name}={raw!r} must be a CP group width >= 1 (or unset)")
    return v


def _path(name: str, raw: str) -> str | None:
    return raw.strip() or None


def _node_id(name: str, raw: str) -> str | None:
    """A node identity: printable text (stripped; empty = unset: the host name); no control character (the ranks'
    identity records are tab-separated)."""
    v = raw.strip()
    if any(not c.isprintable() for c in v):
        raise ConfigError(f"{name}={raw!r} must be printable text (no tab, newline or other control character): "
                          "it names this rank's node (cp_ops.node)")
    return v or None


# field -> (environment variable, parser, default)
_FIELDS: dict[str, tuple[str, Callable[[str, str], Any], Any]] = {
    "blocking": ("CP_OPS_BLOCKING", _flag, False),
    "check_ranks": ("CP_OPS_CHECK_RANKS", _choice_renamed(("on", "debug", "off"), {"once": "on", "always": "debug"}),
                    "on"),
    "timeout_s": ("CP_OPS_TIMEOUT_S", _positive_float, 300.0),
    "wait_warn_s": ("CP_OPS_WAIT_WARN_S", _positive_float, 10.0),  # per rank: what this rank logs
    "fast_pool_gb": ("CP_OPS_FAST_POOL_GB", _positive_float, 8.0),
    "fast_heap": ("CP_OPS_FAST_HEAP", _choice("nvshmem", "ipc"), "nvshmem"),
    "fast_path": ("CP_OPS_FAST_PATH", _choice("auto", "ce", "sm"), "auto"),
    "fast_lane_width": ("CP_OPS_FAST_LANE_WIDTH", _optional_width, None),
    "fast_tune": ("CP_OPS_FAST_TUNE", _flag, True),
    "ext_dir": ("CP_OPS_EXT_DIR", _path, None),
    "tune_modes": ("CP_OPS_TUNE_MODES", _flag, False),  # off: reproducible by default
    "tune_cache": ("CP_OPS_TUNE_CACHE", _path, None),
    "emulate_comm": ("CP_OPS_EMULATE_COMM", _flag, False),
    "network_gbps": ("CP_OPS_NETWORK_GBPS", _positive_float, 50.0),
    "node_id": ("CP_OPS_NODE_ID", _node_id, None),  # per rank by design: not a collective field
}

#: Settings that change what a collective does: every rank of a group must hold the same values.
COLLECTIVE_FIELDS = ("check_ranks", "fast_heap", "fast_path", "fast_lane_width", "fast_tune", "fast_pool_gb",
                     "tune_modes", "network_gbps")


@dataclass
class Settings:
    """Every cp_ops setting. ``sources[field]``: ``'default'``, ``'env CP_OPS_X'`` or ``'configure()'``."""

    blocking: bool = False
    check_ranks: str = "on"
    timeout_s: float = 300.0
    wait_warn_s: float = 10.0
    fast_pool_gb: float = 8.0
    fast_heap: str = "nvshmem"
    fast_path: str = "auto"
    fast_lane_width: int | None = None
    fast_tune: bool = True
    ext_dir: str | None = None
    tune_modes: bool = False
    tune_cache: str | None = None
    emulate_comm: bool = False
    network_gbps: float = 50.0
    node_id: str | None = None
    sources: dict = field(default_factory=dict, repr=False, compare=False)

    def collective_values(self) -> tuple:
        """The values of :data:`COLLECTIVE_FIELDS`, in that order (compared across the ranks of a group)."""
        return tuple(getattr(self, f) for f in COLLECTIVE_FIELDS)

    def describe(self) -> list[dict]:
        """One row per setting: field, variable, value, source (what ``cp-ops env`` prints)."""
        return [
            {"field": f, "variable": var, "value": getattr(self, f), "source": self.sources.get(f, "default")}
            for f, (var, _, _) in _FIELDS.items()
        ]


def _warn_unknown(environ: Mapping[str, str]) -> None:
    """Warn about a ``CP_OPS_*`` variable that names no setting (a typo), naming the closest known variable."""
    import difflib
    import logging

    known = [var for var, _, _ in _FIELDS.values()]
    for name in sorted(k for k in environ if k.startswith("CP_OPS_") and k not in known):
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        logging.getLogger("cp_ops").warning("cp_ops: %s is not a cp_ops setting and is ignored; %sknown: %s",
                                            name, hint, ", ".join(known))


def from_env(environ: Mapping[str, str] | None = None) -> Settings:
    """Parse every ``CP_OPS_*`` variable of ``environ`` (default ``os.environ``); ConfigError for a bad value."""
    environ = os.environ if environ is None else environ
    _warn_unknown(environ)
    values, sources = {}, {}
    for f, (var, parse, default) in _FIELDS.items():
        raw = environ.get(var)
        if raw is None:
            values[f], sources[f] = default, "default"
        else:
            values[f], sources[f] = parse(var, raw), f"env {var}"
    return Settings(**values, sources=sources)


def configure(**changes: Any) -> Settings:
    """Change settings at run time (fields of :class:`Settings`, values checked as the environment's); returns the
    settings. The fast transport's heap, pool and lane width apply when its lane is created. ConfigError: an unknown
    field or a bad value."""
    for f, value in changes.items():
        if f not in _FIELDS:
            raise ConfigError(f"unknown cp_ops setting {f!r}; known: {', '.join(_FIELDS)}")
        var, parse, _ = _FIELDS[f]
        if value is not None and not isinstance(value, str):
            value = parse(var, "1" if value is True else "0" if value is False else str(value))
        elif isinstance(value, str):
            value = parse(var, value)
        elif f not in ("fast_lane_width", "ext_dir", "tune_cache", "node_id"):
            raise ConfigError(f"setting {f} cannot be None")
        setattr(settings, f, value)
        settings.sources[f] = "configure()"
    return settings


def snapshot() -> Settings:
    """A copy of the current settings (for tests that change and restore them)."""
    return dataclasses.replace(settings, sources=dict(settings.sources))


def restore(saved: Settings) -> None:
    """Put back a :func:`snapshot`."""
    for f in _FIELDS:
        setattr(settings, f, getattr(saved, f))
    settings.sources = dict(saved.sources)


settings: Settings = from_env()


#: Environment every process cp_ops starts (or joins torch.distributed in) gets: NVLink multicast / NVLS off in NCCL,
#: PyTorch symmetric memory and NVSHMEM (a program using it can take a host's shared GPUs out of service).
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
