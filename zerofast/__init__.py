"""zerofast: ZeRO stages 1-3 for PyTorch.

Public names: ZeroAdam (the sharded optimizer), estimate_memory (the seed's table), fused_adam_ (the compiled fused Adam/AdamW step), nonfinite_check_ (its overflow check alone), has_cuda_kernels, cpu_isa, and the
reference stages in zerofast.reference (the correctness oracle); sharded checkpoints in zerofast.checkpoint.
"""
from ._ops import cpu_isa, fused_adam_, has_cuda_kernels, nonfinite_check_
from .tools.estimate import estimate_memory
from .optim import ZeroAdam

__all__ = ["ZeroAdam", "fused_adam_", "nonfinite_check_", "estimate_memory", "has_cuda_kernels", "cpu_isa"]
__version__ = "0.1.0"
