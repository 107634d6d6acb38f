"""The attention kernels every mode body calls, and nothing else (a leaf: modes import it, it imports no mode).

- :mod:`.sdpa` — :func:`local_attention`: SDPA on BSHD tensors with cp_ops' CUDA backend priority, optional key mask.
- :mod:`.lse` — :func:`attention_with_lse`: attention that also returns each query row's log-sum-exp (LSE).
- :mod:`.lse_merge` — :func:`merge`: partial outputs merged by their LSEs in fp32 (CUDA kernel, Triton, or torch ops).
"""

from .lse import attention_with_lse
from .lse_merge import merge
from .sdpa import local_attention

__all__ = ["local_attention", "attention_with_lse", "merge"]
