import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
# The project root: `benchmarks.blocks` (the reference DiT blocks shared by the pass tests and benchmarks).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.append(_ROOT)
