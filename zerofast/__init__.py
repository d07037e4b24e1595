"""zerofast: ZeRO stages 1-3 for PyTorch.

Public names: fused_adam_ (the compiled fused Adam/AdamW step), has_cuda_kernels, cpu_isa, and the
reference stages in zerofast.reference (the correctness oracle).
"""
from ._ops import cpu_isa, fused_adam_, has_cuda_kernels

__all__ = ["fused_adam_", "has_cuda_kernels", "cpu_isa"]
__version__ = "0.1.0"
