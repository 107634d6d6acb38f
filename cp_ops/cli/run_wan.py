"""Former home of ``cp-ops run wan``; the body is now :mod:`cp_ops.cli.run` (every model), the Wan config in
:mod:`cp_ops.cli.models`. Kept so imports of ``run_wan``, ``CONFIGS`` and ``TEXT_TOKENS`` keep working."""

from __future__ import annotations

from .models import CONFIGS, WAN
from .run import run_model as run_wan

TEXT_TOKENS = WAN.text_tokens

__all__ = ["CONFIGS", "TEXT_TOKENS", "run_wan"]
