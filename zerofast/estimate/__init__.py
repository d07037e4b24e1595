"""The estimator: what a ZeroAdam configuration costs, without running it. Pure arithmetic over the
plan, layouts and stage-3 schedule ZeroAdam runs (no process group, no compiled code), so it accepts
exactly what ZeroAdam accepts and counts what ZeroAdam does.
  memory.py     estimate_memory: per-rank bytes by the ZeRO paper's formulas, plus zerofast's buffers
  traffic.py    estimate_traffic: the bytes each collective moves per step, as report().comm counts them
  timemodel.py  step_time: the step those bytes and the compute take ([Note: the time model])
`python -m zerofast.estimate` runs zerofast/tools/estimate.py.
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
