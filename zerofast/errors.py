"""Every error class zerofast raises for users to catch, exported from `zerofast` (the integrations'
from their integration); each message names the argument, parameter, rank or call and what to do
instead. Pure Python: the compiled core raises this GradientError (csrc/bindings.cpp looks it up).

  the ranks        CollectiveError, OutOfStepError, StepNotAppliedError ([Note: faults] in zerofast/comm.py)
  gradients        GradientError (a gradient the path cannot take), ShardedGradientError
  the model        ShardedParameterError, ModelConversionError ([Note: the model stays a torch model]
                   in zerofast/guard/__init__.py)
  offload          OffloadError
  checkpoints      UnsafeCheckpoint (a file that reading would run code from)
  integrations     GenerationSyncError (generate() unsynced on stage 3), IncompatibleHostError (a
                   framework an integration cannot serve), LayoutMismatchError (torchft's healing)
"""

from __future__ import annotations

__all__ = [
    "CollectiveError",
    "OutOfStepError",
    "StepNotAppliedError",
    "GradientError",
    "ShardedParameterError",
    "ShardedGradientError",
    "ModelConversionError",
    "OffloadError",
    "UnsafeCheckpoint",
    "GenerationSyncError",
    "IncompatibleHostError",
    "LayoutMismatchError",
]


class CollectiveError(RuntimeError):
    """A collective of the optimizer failed or timed out: another rank died, is stuck, or is out of step."""


class OutOfStepError(RuntimeError):
    """The ranks are not running the same collectives, steps or micro-batches."""


class StepNotAppliedError(RuntimeError):
    """step() applied nothing on any rank, because some rank failed before the update."""


class GradientError(RuntimeError):
    """A gradient the optimizer cannot take (sparse, or of another dtype, device or shape than its
    parameter, or a second one before step()), named by its parameter, raised on the rank where it
    arrived (by the compiled gradient path: csrc/errors.h)."""


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


class OffloadError(RuntimeError):
    """The offloaded state could not be placed, read or written: names the path and what failed."""


class UnsafeCheckpoint(ValueError):
    """A checkpoint file names something that loading it would run or build beyond plain data."""


class GenerationSyncError(RuntimeError):
    """generate() was asked not to sync the ranks on a model whose forwards gather collectively."""


class IncompatibleHostError(ImportError):
    """The installed framework lacks, or has changed, what an integration overrides, reads or calls
    (or is a version outside the range the integration supports)."""


class LayoutMismatchError(RuntimeError):
    """A replica group's state cannot be healed from its peer: they shard it differently."""
