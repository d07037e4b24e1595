"""ZeroAdam as a Lightning strategy: the code shared by `zerofast.integrations.lightning` (the
`lightning` package, `lightning.pytorch`) and `zerofast.integrations.pytorch_lightning` (the
`pytorch_lightning` package). The two packages hold the same classes under different names, and
Lightning checks a strategy with isinstance against its own, so each module puts these mixins in
front of its package's DDPStrategy and Precision; nothing here imports either package.

Written and tested against Lightning 2.6.6 (lightning and pytorch_lightning: the Makefile's
LIGHTNING_DEPS, which CI installs); supported: the ranges of pyproject.toml's extras `lightning` and
`pytorch-lightning`. The methods overridden are named after its sources
(lightning/pytorch/strategies/ddp.py and strategy.py, plugins/precision/precision.py); every host
member overridden, read or called is in `relies_on` (reliance.py), which each of the two modules
checks at import (zerofast.integrations.hosts). What maps to what:
  - the launch, the process group, the samplers, reduce / barrier / broadcast: DDPStrategy's,
    unchanged (Lightning's own launcher for `python script.py`, or torchrun's environment);
  - the model is never wrapped in DDP: configure_optimizers' AdamW / Adam becomes a ZeroAdam over the
    LightningModule with the same parameter groups and hyper-parameters (a ZeroAdam built there is
    taken as it is), and its LR schedulers are pointed at the ZeroAdam's param_groups;
  - accumulate_grad_batches: Lightning's block_backward_sync is ZeroAdam's no_sync;
  - gradient_clip_val: ZeroAdam's clip_grad_norm_ (the global norm across shards) or, with
    gradient_clip_algorithm="value", its clip_grad_value_ (elementwise on each rank's shard);
  - precision: ZeroPrecision (precision.py) maps the flag to ZeroAdam's mixed precision;
  - offload=: ZeroAdam's (the optimizer state in host memory or on disk), as given; with the
    delayed update, on_train_end applies the last step's update, so fit() returns the trained module;
  - checkpoints: a folder per checkpoint, `zerofast/` (a zerofast checkpoint, every rank its shard,
    resharded on load at any world size or stage) beside `lightning.ckpt` (the loops', callbacks' and
    schedulers' state, written by rank 0 through Lightning's CheckpointIO); the module's whole
    state_dict only with save_full_weights=True.

The package, one concern a module: precision (ZeroPrecisionMixin: the precision flag as ZeroAdam's
mixed precision), optimizers (zero_from: configure_optimizers' optimizer as a ZeroAdam, its
schedulers re-pointed), checkpoints (the checkpoint folder's layout), strategy (ZeroStrategyMixin),
reliance (relies_on: what the two modules check at import).
"""

from .checkpoints import LIGHTNING_FILE, WRITING, ZERO_DIR
from .optimizers import zero_from
from .precision import PRECISIONS, ZeroPrecisionMixin
from .reliance import (
    PRECISION_OVERRIDES,
    PRECISION_READS,
    STRATEGY_CALLS,
    STRATEGY_INSTANCE_READS,
    STRATEGY_OVERRIDES,
    STRATEGY_READS,
    SUPPORTED,
    TESTED,
    relies_on,
)
from .strategy import ZeroStrategyMixin

__all__ = [
    "LIGHTNING_FILE",
    "PRECISIONS",
    "PRECISION_OVERRIDES",
    "PRECISION_READS",
    "STRATEGY_CALLS",
    "STRATEGY_INSTANCE_READS",
    "STRATEGY_OVERRIDES",
    "STRATEGY_READS",
    "SUPPORTED",
    "TESTED",
    "WRITING",
    "ZERO_DIR",
    "ZeroPrecisionMixin",
    "ZeroStrategyMixin",
    "relies_on",
    "zero_from",
]
