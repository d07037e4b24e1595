"""ZeroAdam as a Lightning strategy: the code shared by `zerofast.integrations.lightning` (the `lightning`
package, `lightning.pytorch`) and `zerofast.integrations.pytorch_lightning`. The two packages hold the same
classes under different names, and Lightning checks a strategy with isinstance against its own, so each module
puts these mixins in front of its package's DDPStrategy and Precision; nothing here imports either package.

Written and tested against Lightning 2.6.6 (the Makefile's LIGHTNING_DEPS, which CI installs); supported: the
ranges of pyproject.toml's extras `lightning` and `pytorch-lightning`. What maps to what: docs/integrations.md.
One concern a module:
  - strategy: ZeroStrategyMixin over DDPStrategy (its launch, process group and samplers unchanged), no DDP
    wrapper, the steps routed through the module ([Note: the root unit in Lightning]), saving and loading;
  - optimizers: zero_from, configure_optimizers' AdamW / Adam as a ZeroAdam, its LR schedulers re-pointed;
  - precision: ZeroPrecisionMixin, the precision flag as ZeroAdam's mixed precision;
  - checkpoints: the folder's layout, `zerofast/` (every rank its shard) beside `lightning.ckpt` (rank 0);
  - reliance: relies_on, every host member overridden, read or called, which each module checks at import
    (zerofast.integrations.hosts); package: classes_for, the two classes a package gets.
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
