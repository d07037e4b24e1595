"""The errors zerofast raises when the model is used in a way its sharding cannot serve, one place to
import them from: each names the parameter or call, the value it got, and what to do instead.
What each guards is [Note: the model stays a torch model] in zerofast/guard/__init__.py."""

from __future__ import annotations

__all__ = ["ShardedParameterError", "ShardedGradientError", "ModelConversionError"]


class ShardedParameterError(RuntimeError):
    """A stage-3 parameter's values were read outside forward, backward and `opt.gathered_params()`
    (only this rank's shard exists then), or written in a way that cannot be applied to the shards."""


class ShardedGradientError(RuntimeError):
    """An operation on a parameter's `.grad` that a gradient sharded across the ranks cannot serve
    (between the last backward of a step and `step()`, `.grad` stands for the reduced gradient, of
    which each rank holds its shard)."""


class ModelConversionError(RuntimeError):
    """`model.to()`, `.half()`, `.double()`, ..., `load_state_dict(assign=True)` or a parameter
    replaced, after the optimizer was built: its parameters are views of the optimizer's buffers,
    which would not follow."""
