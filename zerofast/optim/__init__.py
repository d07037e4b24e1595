"""The optimizer front and the parts of a step it orders (see zero_adam.py's docstring)."""
from .zero_adam import ZeroAdam

__all__ = ["ZeroAdam"]
