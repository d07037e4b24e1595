"""What ZeroStrategy relies on in Lightning (the versions, the members the mixins override, read and call)
and relies_on, which builds the table that each of the two modules checks at import (zerofast.integrations.hosts)."""

from __future__ import annotations

import importlib

from .. import hosts
from .precision import _FLAG_PLUGINS, ZeroPrecisionMixin
from .strategy import _DDP_ARGUMENTS, ZeroStrategyMixin

# The versions: the Makefile's LIGHTNING_DEPS pins (tested) and pyproject.toml's extras (supported).
TESTED, SUPPORTED = "2.6.6", ">=2.6.6,<2.7"
# DDPStrategy's members ZeroStrategyMixin replaces (all public in Lightning 2.6.6).
STRATEGY_OVERRIDES = (
    "precision_plugin",
    "setup",
    "configure_ddp",
    "setup_optimizers",
    "training_step",
    "validation_step",
    "test_step",
    "predict_step",
    "block_backward_sync",
    "on_train_end",
    "teardown",
    "restore_checkpoint_after_setup",
    "lightning_module_state_dict",
    "optimizer_state",
    "save_checkpoint",
    "remove_checkpoint",
    "load_checkpoint",
    "load_model_state_dict",
    "load_optimizer_state_dict",
)
PRECISION_OVERRIDES = ("convert_input", "convert_module", "backward", "clip_grad_by_norm", "clip_grad_by_value")
# What the strategy reads and calls on itself as DDPStrategy has it.
STRATEGY_READS = ("accelerator", "model", "lightning_module", "optimizers", "checkpoint_io", "is_global_zero")
STRATEGY_CALLS = ("broadcast", "barrier", "setup_precision_plugin")
# Set by the constructors (Strategy, ParallelStrategy, DDPStrategy), found on no class: checked on the
# strategy when it is made. The last two are private in Lightning 2.6.6.
STRATEGY_INSTANCE_READS = ("cluster_environment", "lr_scheduler_configs", "_layer_sync", "_forward_redirection")
PRECISION_READS = (
    "precision",
    "teardown",
    "train_step_context",
    "val_step_context",
    "test_step_context",
    "predict_step_context",
)


def relies_on(package: str, distribution: str) -> hosts.Reliance:
    """The table for one of the two packages: "lightning.pytorch" (distribution "lightning") or
    "pytorch_lightning" (distribution "pytorch-lightning")."""
    strategies = importlib.import_module(f"{package}.strategies")
    plugins = importlib.import_module(f"{package}.plugins")
    precision_plugins = importlib.import_module(f"{package}.plugins.precision")
    accelerators = importlib.import_module(f"{package}.accelerators")
    module = importlib.import_module(f"{package}.core.module")
    lightning_types = importlib.import_module(f"{package}.utilities.types")
    states = importlib.import_module(f"{package}.trainer.states")
    ddp, precision, checkpoint_io = strategies.DDPStrategy, precision_plugins.Precision, plugins.CheckpointIO
    return hosts.Reliance(
        f"zerofast.integrations.{package.split('.')[0]}",
        extra=distribution,
        pins=(hosts.Pin(distribution, tested=TESTED, supported=SUPPORTED),),
        entries=(
            hosts.Overrides(ZeroStrategyMixin, ddp, STRATEGY_OVERRIDES),
            hosts.Overrides(ZeroPrecisionMixin, precision, PRECISION_OVERRIDES),
            hosts.Calls(ddp, "__init__", keywords=_DDP_ARGUMENTS),
            hosts.Calls(precision, "__init__"),
            hosts.Reads(ddp, STRATEGY_READS + STRATEGY_CALLS),
            hosts.Reads(ddp, STRATEGY_INSTANCE_READS, on_instance=True),
            hosts.Reads(precision, PRECISION_READS),
            hosts.Reads(precision_plugins, tuple(sorted(_FLAG_PLUGINS))),
            hosts.Calls(checkpoint_io, "save_checkpoint", 2),
            hosts.Calls(checkpoint_io, "load_checkpoint", 1, ("weights_only",)),
            hosts.Reads(checkpoint_io, ("teardown",)),
            hosts.Reads(plugins.ClusterEnvironment, ("teardown",)),
            hosts.Reads(accelerators.Accelerator, ("setup", "teardown")),
            hosts.Reads(module.LightningModule, ("automatic_optimization", "trainer", "backward")),
            hosts.Reads(lightning_types.LRSchedulerConfig, ("scheduler",)),
            hosts.Reads(states.TrainerState, ("fn",)),
        ),
    )
