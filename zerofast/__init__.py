"""zerofast: ZeRO stages 1-3 for PyTorch (the ZeRO paper, Rajbhandari et al., 2020).

  optimizers  ZeroAdam (sharded), ZeroMuon (Muon + AdamW on whole-matrix owners), ZeroOptimizer
              (their shared front, for isinstance)
  inference   shard_frozen: a reference or reward model sharded for inference only (ShardedFrozenModel)
  policies    MixedPrecisionPolicy, LossScalePolicy, CommPolicy, UnitPolicy, OffloadPolicy (config.py)
  errors      CollectiveError, OutOfStepError, StepNotAppliedError, OffloadError, GradientError,
              UnsafeCheckpoint; ShardedParameterError, ShardedGradientError and ModelConversionError
              when the model is used in a way its sharding cannot serve (docs/your-model.md)
  estimates   estimate_memory (the paper's memory table), estimate_traffic (report().comm, no run)
  kernels     fused_adam_ (the compiled fused Adam/AdamW step), fused_adam_8bit_ (with 8-bit moments),
              nonfinite_check_ (its overflow check alone), has_cuda_kernels, cpu_isa
  elsewhere   zerofast.reference (the reference stages, the oracle), zerofast.checkpoint (sharded checkpoints)

torch 2.11 to 2.14 only (compat.py): another is refused at import, naming the range. The names that
need the compiled extension (zerofast._C) are imported on first use, so `import zerofast` and the
estimator (`python -m zerofast.estimate`, pure arithmetic) work where it was never built.
"""

from importlib import import_module

import torch as _torch

from .compat import check_torch as _check_torch

# First: an unsupported torch is an ImportError naming the range, not whatever a later import trips over.
_check_torch(_torch.__version__)

from .config import CommPolicy, LossScalePolicy, MixedPrecisionPolicy, OffloadPolicy, UnitPolicy  # noqa: E402
from .errors import (  # noqa: E402
    CollectiveError,
    GradientError,
    ModelConversionError,
    OffloadError,
    OutOfStepError,
    ShardedGradientError,
    ShardedParameterError,
    StepNotAppliedError,
    UnsafeCheckpoint,
)
from .estimate import estimate_memory, estimate_traffic  # noqa: E402

# name -> the module that defines it, imported when the name is first read (PEP 562).
_LAZY = {
    "ZeroAdam": "zerofast.optim.zero_adam",
    "ZeroMuon": "zerofast.optim.muon",
    "ZeroOptimizer": "zerofast.optim.base",
    "shard_frozen": "zerofast.stage3.inference",
    "ShardedFrozenModel": "zerofast.stage3.inference",
    "fused_adam_": "zerofast._ops",
    "fused_adam_8bit_": "zerofast._ops",
    "nonfinite_check_": "zerofast._ops",
    "has_cuda_kernels": "zerofast._ops",
    "cpu_isa": "zerofast._ops",
}

__all__ = [
    "ZeroAdam",
    "ZeroMuon",
    "ZeroOptimizer",
    "shard_frozen",
    "ShardedFrozenModel",
    "MixedPrecisionPolicy",
    "LossScalePolicy",
    "CommPolicy",
    "UnitPolicy",
    "OffloadPolicy",
    "OffloadError",
    "CollectiveError",
    "OutOfStepError",
    "StepNotAppliedError",
    "GradientError",
    "ShardedParameterError",
    "ShardedGradientError",
    "ModelConversionError",
    "UnsafeCheckpoint",
    "estimate_memory",
    "estimate_traffic",
    "fused_adam_",
    "fused_adam_8bit_",
    "nonfinite_check_",
    "has_cuda_kernels",
    "cpu_isa",
]
from ._version import __version__ as __version__  # noqa: E402 (re-exported)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value  # later reads skip this function
        return value
    raise AttributeError(f"module 'zerofast' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
