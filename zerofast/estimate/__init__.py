"""The estimator: what a ZeroAdam configuration costs, without running it. Pure arithmetic over the
same plan, layouts and stage-3 schedule ZeroAdam runs (no process group, no compiled code), so it
accepts exactly what ZeroAdam accepts and counts what ZeroAdam does.

  memory.py     per-rank bytes by the ZeRO paper's formulas, plus the buffers zerofast adds
  traffic.py    the bytes each collective moves per step, as report().comm reports them
  timemodel.py  the step time those bytes and the compute take ([Note: the time model])

`python -m zerofast.estimate` (__main__.py) is its command line, in zerofast/tools/estimate.py.
"""

from .memory import MemoryEstimate, estimate_memory
from .timemodel import Cluster, Link, StepTime, step_time
from .traffic import Op, estimate_traffic, traffic_ops

__all__ = [
    "MemoryEstimate",
    "estimate_memory",
    "Op",
    "estimate_traffic",
    "traffic_ops",
    "Cluster",
    "Link",
    "StepTime",
    "step_time",
]
