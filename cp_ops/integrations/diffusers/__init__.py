"""Run a diffusers DiT under context parallelism with cp_ops attention.

:func:`parallelize` installs the model's CP plan (:mod:`.plan`, :mod:`.hooks`: split the tokens over the CP group
after the embeddings, gather them before unpatchify) and routes the self/joint attention modules' processors to
the ``cp_ops`` attention backend registered in diffusers' dispatch (:mod:`.dispatch`); the model code — projections,
norms, RoPE, joint concatenation — runs unchanged. Supported classes and how: :mod:`.registry`.
"""

from __future__ import annotations

from .caches import agree_step_caches
from .install import parallelize
from .pipeline import parallelize_pipeline
from .registry import SUPPORTED

__all__ = ["parallelize", "parallelize_pipeline", "agree_step_caches", "SUPPORTED"]
