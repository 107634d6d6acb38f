"""The attention kernels every mode body calls (a leaf: modes import it, it imports no mode): :mod:`.sdpa`
(:func:`local_attention`), :mod:`.lse` (:func:`attention_with_lse`: also each query row's log-sum-exp) and
:mod:`.lse_merge` (:func:`merge`: partial outputs merged by their LSEs in fp32); the FP8 codec in :mod:`.fp8`.
"""

from .lse import attention_with_lse
from .lse_merge import merge
from .sdpa import local_attention

__all__ = ["local_attention", "attention_with_lse", "merge"]
