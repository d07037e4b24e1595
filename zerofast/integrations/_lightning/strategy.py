"""ZeroStrategyMixin, put before the package's DDPStrategy: its arguments, the precision plugin, setup (no DDP
wrapper; the optimizer becomes a ZeroAdam), the steps routed through the module ([Note: the root unit in
Lightning]), and saving and loading the checkpoint folders."""

from __future__ import annotations

import contextlib
import os
import shutil
import weakref
from typing import Any

import torch
import torch.nn as nn

from ... import checkpoint as zckpt
from ...config import MixedPrecisionPolicy, check_stage, resolve_plan
from ...optim.base import ZeroOptimizer
from ...optim.zero_adam import ZeroAdam
from .. import hosts
from .checkpoints import LIGHTNING_FILE, WRITING, ZERO_DIR, _into_place
from .optimizers import _schedulers, _track_step, zero_from
from .precision import _DTYPES, _FLAG_PLUGINS, PRECISIONS

# DDPStrategy's arguments that ZeroStrategy passes on (the model is never wrapped in DDP, so DDP's own do not apply).
_DDP_ARGUMENTS = (
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
    "process_group_backend",
    "timeout",
    "start_method",
)
# The LightningModules a ZeroAdam built here manages: a second strategy must not lay out another.
_MANAGED: weakref.WeakKeyDictionary[nn.Module, ZeroAdam] = weakref.WeakKeyDictionary()


class ZeroStrategyMixin:
    """ZeroAdam's sharding in Lightning: put before the package's DDPStrategy (see the two modules).

    stage: 1 shards the Adam state, 2 also the gradients, 3 also the parameters (and frozen ones);
      None: 2, or the stage of a ZeroAdam configure_optimizers returns.
    mixed_precision: only to refine the Trainer's precision flag (a MixedPrecisionPolicy of the same
      parameter dtype, e.g. with reduce_dtype=torch.float32); the flag decides the dtype.
    units, comm: ZeroAdam's (a UnitPolicy or the unit modules; a CommPolicy).
    shard_size: ZeroAdam's: shard within groups of that many consecutive ranks (a machine: Lightning
      numbers ranks node by node), replicate across them ([Note: hybrid sharding]); None: every rank.
    offload: ZeroAdam's: where the optimizer state lives, an OffloadPolicy or its shortcuts "host" and
      "disk:PATH" (None: with the parameters); with delayed_update=True, fit() applies the last
      step's update when training ends (on_train_end).
    save_full_weights: also put the module's whole state_dict in lightning.ckpt (gathered; stage 3
      one unit at a time), for tools that read a plain Lightning checkpoint. Off: the sharded
      zerofast/ folder holds the weights, and zerofast.checkpoint.export makes a safetensors file.
    save_async: write the zerofast/ folder in the background (zerofast.checkpoint.save(blocking=
      False)): each rank copies its shard and training goes on; the checkpoint's folder is renamed
      into place, and ModelCheckpoint's removals of older ones run, once it is complete.
    The rest are DDPStrategy's: accelerator, parallel_devices, cluster_environment, checkpoint_io,
    precision_plugin (a ZeroPrecision), process_group_backend, timeout, start_method.
    """

    strategy_name = "zero"
    _precision_class: type  # the package's ZeroPrecision, set by each module
    _relies_on: hosts.Reliance  # the package's table (relies_on), set by each module

    def __init__(
        self,
        stage: int | None = None,
        *,
        mixed_precision=None,
        units=None,
        comm=None,
        shard_size: int | None = None,
        offload=None,
        save_full_weights: bool = False,
        save_async: bool = False,
        **ddp_arguments: Any,
    ) -> None:
        allowed = set(_DDP_ARGUMENTS)
        unknown = sorted(set(ddp_arguments) - allowed)
        if unknown:
            raise TypeError(
                f"ZeroStrategy: unexpected argument {unknown[0]!r}: ZeroStrategy takes stage, "
                f"mixed_precision, units, comm, shard_size, offload, save_full_weights, save_async and DDPStrategy's "
                f"{', '.join(sorted(allowed))} (the model is never wrapped in DDP, so DDP's own "
                f"arguments do not apply)"
            )
        if stage is not None:
            check_stage(stage)
        # Every combination ZeroAdam rejects is named now, not at fit().
        resolve_plan(
            2 if stage is None else stage,
            adamw=True,
            max_grad_norm=None,
            mixed_precision=mixed_precision,
            comm=comm,
            units=units,
            offload=offload,
        )
        if shard_size is not None and not (
            isinstance(shard_size, int) and not isinstance(shard_size, bool) and shard_size >= 1
        ):
            raise ValueError(f"ZeroStrategy: shard_size must be None or an integer >= 1; got {shard_size!r}")
        if not isinstance(save_full_weights, bool):
            raise TypeError(f"ZeroStrategy: save_full_weights must be a bool; got {save_full_weights!r}")
        if not isinstance(save_async, bool):
            raise TypeError(f"ZeroStrategy: save_async must be a bool; got {save_async!r}")
        self.save_async = save_async
        self.zero_stage = stage
        self.zero_options = dict(
            mixed_precision=mixed_precision, units=units, comm=comm, shard_size=shard_size, offload=offload
        )
        self.save_full_weights = save_full_weights
        self.zero: ZeroAdam | None = None
        self._restored_zero = False  # load_checkpoint loaded the sharded state: nothing left for Lightning
        self._torch_order: list | None = None
        super().__init__(**ddp_arguments)
        hosts.check_instance(self._relies_on, self)

    # --- precision: whatever the connector builds from the flag becomes a ZeroPrecision -----------
    # Lightning 2.6.6's connector sets the plugin here with no hook to choose its class: the setter
    # converts it, and both halves keep Strategy's property underneath.

    def _strategy_precision_plugin(self) -> property:
        return super(ZeroStrategyMixin, type(self)).precision_plugin  # Strategy's, not this class's

    @property
    def precision_plugin(self):
        plugin = self._strategy_precision_plugin().fget(self)  # a fresh Precision() when none was set
        return plugin if isinstance(plugin, self._precision_class) else self._precision_class()

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        if plugin is not None and not isinstance(plugin, self._precision_class):
            name = type(plugin).__name__
            if name not in _FLAG_PLUGINS:
                raise ValueError(
                    f"ZeroStrategy: the precision plugin {name} is not supported; pass precision= one of "
                    f"{', '.join(PRECISIONS)} (ZeroAdam's mixed precision)"
                )
            plugin = self._precision_class(getattr(plugin, "precision", "32-true"))
        self._strategy_precision_plugin().fset(self, plugin)

    def _mixed_precision(self):
        dtype = self.precision_plugin.dtype
        given = self.zero_options["mixed_precision"]
        wanted = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
        if given is None:
            return wanted
        given_dtype = given.param_dtype if isinstance(given, MixedPrecisionPolicy) else _DTYPES.get(given)
        if given_dtype != dtype:
            raise ValueError(
                f"ZeroStrategy: mixed_precision={given!r} disagrees with the Trainer's "
                f"precision={self.precision_plugin.precision!r}; the flag sets the dtype"
            )
        return given

    # --- setup: no DDP; the optimizer becomes ZeroAdam --------------------------------------------

    def setup(self, trainer) -> None:
        if self._layer_sync is not None:  # private in Lightning 2.6.6: sync_batchnorm's converter, or None
            raise ValueError(
                "ZeroStrategy: sync_batchnorm=True is not supported (Lightning's swap of the module's "
                "norm layers for SyncBatchNorm, and back, around ZeroAdam's layout is untested)"
            )
        fitting = trainer.state.fn == "fit"
        if self.zero is not None:  # this strategy trained the module: ZeroAdam's state is the model's
            if fitting:
                raise RuntimeError(
                    "ZeroStrategy: fit() was called again on a strategy whose ZeroAdam trained "
                    "this module; make a new Trainer (and resume with ckpt_path=...)"
                )
            # Not DDPStrategy.setup: it would move the module to the device and broadcast rank 0's
            # parameters into it, and they are views of ZeroAdam's buffers (stage 3: each rank's
            # shards). The rest of what it does:
            self.accelerator.setup(trainer)
            self.setup_precision_plugin()
            return
        # DDPStrategy's: the module to the device, then when fitting configure_ddp and setup_optimizers.
        super().setup(trainer)
        if not fitting and self.precision_plugin.dtype is not None:
            self.model.to(self.precision_plugin.dtype)  # evaluation only: in the precision's dtype

    def configure_ddp(self) -> None:
        """No DDP wrapper: ZeroAdam reduces the gradients (called before setup_optimizers builds it)."""

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        module = self.lightning_module
        if len(self.optimizers) != 1:
            raise ValueError(
                f"ZeroStrategy: configure_optimizers returned {len(self.optimizers)} optimizers; "
                f"ZeroStrategy trains the module with one ZeroAdam"
            )
        if module in _MANAGED:
            raise RuntimeError(
                "ZeroStrategy: this LightningModule is already managed by a ZeroAdam (an earlier "
                "fit); make a new module and resume from a checkpoint"
            )
        given = self.optimizers[0]
        # The order of a plain checkpoint's AdamW state (load_model_state_dict): this optimizer's.
        self._torch_order = [p for group in given.param_groups for p in group["params"]]
        if isinstance(given, ZeroOptimizer):
            wanted = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.precision_plugin.dtype)
            if given.plan.mixed_precision != wanted:
                raise ValueError(
                    f"ZeroStrategy: the ZeroAdam's mixed_precision={given.plan.mixed_precision!r} "
                    f"disagrees with the Trainer's precision={self.precision_plugin.precision!r}"
                )
            zero = zero_from(given, module, self.zero_stage, self.zero_options)
        else:
            zero = zero_from(
                given, module, self.zero_stage, dict(self.zero_options, mixed_precision=self._mixed_precision())
            )
        for config in self.lr_scheduler_configs:
            for scheduler in _schedulers(config.scheduler):
                if getattr(scheduler, "optimizer", None) is given:
                    scheduler.optimizer = zero
                    _track_step(zero)
        _MANAGED[module] = zero
        self.zero = zero
        self.precision_plugin.zero = zero
        self.optimizers = [zero]

    # --- the steps: through the module's own __call__ in stage 3 -----------------------------------
    # [Note: the root unit in Lightning]
    # Stage 3 gathers the root unit (the parameters outside every block: embeddings, head, final
    # norm) in the hooks of the module ZeroAdam was built on, and prefetches the next unit from
    # there. Lightning calls training_step, never forward, so those hooks would not run and the root
    # unit would be gathered on demand, later and unprefetched (+6% step time on the bench GPT). As
    # Lightning's FSDP strategies do with their wrapper, each step is routed through the module's
    # __call__ (Lightning's _forward_redirection: forward patched to the step for one call), so the
    # hooks run around it. Not in manual optimization, whose training_step runs backward and step()
    # itself, inside what would be the root's forward.

    def _through_module(self, name: str, context, *args: Any, **kwargs: Any):
        module = self.lightning_module
        with context():  # _forward_redirection: private in Lightning 2.6.6 (Strategy's, DDPStrategy's)
            return self._forward_redirection(module, module, name, *args, **kwargs)

    def _redirects(self) -> bool:
        return self.zero is not None and self.zero.plan.params_sharded

    def training_step(self, *args: Any, **kwargs: Any):
        if not (self._redirects() and self.lightning_module.automatic_optimization):
            return super().training_step(*args, **kwargs)
        return self._through_module("training_step", self.precision_plugin.train_step_context, *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any):
        if not self._redirects():
            return super().validation_step(*args, **kwargs)
        return self._through_module("validation_step", self.precision_plugin.val_step_context, *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any):
        if not self._redirects():
            return super().test_step(*args, **kwargs)
        return self._through_module("test_step", self.precision_plugin.test_step_context, *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any):
        if not self._redirects():
            return super().predict_step(*args, **kwargs)
        return self._through_module("predict_step", self.precision_plugin.predict_step_context, *args, **kwargs)

    @contextlib.contextmanager
    def block_backward_sync(self):
        if self.zero is None:
            yield
            return
        with self.zero.no_sync():
            yield

    def on_train_end(self) -> None:
        """The fit loop's normal end, on every rank: with OffloadPolicy(delayed_update=True) the last
        step's update, still in flight, is applied, so that fit() returns the trained module."""
        if self.zero is not None:
            self.zero.flush()  # nothing to do without a delayed update
        super().on_train_end()

    def teardown(self) -> None:
        if self.zero is None:
            return super().teardown()
        zckpt.wait()  # the last asynchronous save is complete when fit / validate returns
        # Not DDPStrategy.teardown: Strategy.teardown moves the module and optimizer state to the CPU, but the
        # parameters are views of ZeroAdam's flat buffers (stage 3: shards), kept in place for later validate /
        # test / predict and checkpoints. The rest, as Lightning 2.6.6's FSDPStrategy and ModelParallelStrategy do:
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # --- checkpoints ------------------------------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the sharded state loads into the ZeroAdam that setup() builds

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.zero is None:
            return super().lightning_module_state_dict()
        if not self.save_full_weights:
            return {}
        return self.zero.full_state_dict(keep=self.is_global_zero)  # every rank takes part in the gathers

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        if self.zero is None:
            return super().optimizer_state(optimizer)
        return {}  # in the sharded zerofast/ folder

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """Every rank calls it (Trainer.save_checkpoint, ModelCheckpoint). The folder `filepath` is
        written as `filepath.writing` and renamed when complete (with save_async: by the writer
        thread, once the shards are written); one already there (ModelCheckpoint's last.ckpt, saved
        again) is replaced only then."""
        if self.zero is None:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(
                "ZeroStrategy: storage_options is not supported (the shards are written with "
                "torch.distributed.checkpoint)"
            )
        zckpt.wait()  # the previous asynchronous save (it may be this path's) first
        path = os.path.abspath(self.broadcast(os.fspath(filepath)))  # rank 0's path on every rank
        tmp = path + WRITING
        if self.is_global_zero:
            if os.path.exists(tmp):
                shutil.rmtree(tmp)  # what a killed save left behind
            os.makedirs(tmp)
        self.barrier("ZeroStrategy.save_checkpoint")
        # every rank its shard (save_async: copied now, written by the writer thread)
        written = zckpt.save(
            os.path.join(tmp, ZERO_DIR), self.lightning_module, self.zero, blocking=not self.save_async
        )
        if self.is_global_zero:
            rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            if self.save_full_weights:
                rest["state_dict"] = checkpoint["state_dict"]
            self.checkpoint_io.save_checkpoint(rest, os.path.join(tmp, LIGHTNING_FILE))
            if self.save_async:
                written.then(lambda: _into_place(tmp, path))
            else:
                _into_place(tmp, path)
        self.barrier("ZeroStrategy.save_checkpoint")

    def remove_checkpoint(self, filepath) -> None:
        """ModelCheckpoint deleting an older checkpoint: with an asynchronous save in flight, once
        that one is complete, and not at all if it failed (never leave no complete checkpoint)."""
        pending = zckpt.in_flight() if self.zero is not None else None
        if pending is not None:  # then(): now if it is written, never if it failed
            pending.then(lambda: super(ZeroStrategyMixin, self).remove_checkpoint(filepath))
            return
        super().remove_checkpoint(filepath)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = os.fspath(checkpoint_path)
        zero_dir = os.path.join(path, ZERO_DIR)
        if not os.path.isdir(zero_dir):  # a plain Lightning checkpoint (DDP's ...): load_model_state_dict converts
            return super().load_checkpoint(path, weights_only=weights_only)
        loaded = self.checkpoint_io.load_checkpoint(os.path.join(path, LIGHTNING_FILE), weights_only=weights_only)
        loaded.setdefault("optimizer_states", [])  # Lightning asks for the key; the state is in zerofast/
        if self.zero is not None:
            zckpt.load(zero_dir, self.lightning_module, self.zero)  # any world size, stage or precision
            self._restored_zero = True
        else:  # validate / test / predict: the whole model on each rank, from the shards
            loaded["state_dict"], _ = zckpt.to_torch(zero_dir)
        return loaded

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        if self._restored_zero:
            return
        if self.zero is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        # A plain Lightning checkpoint (DDPStrategy's): weights and, when fitting, AdamW's state.
        states = checkpoint.get("optimizer_states") or [None]
        if len(states) != 1:
            raise ValueError(f"ZeroStrategy: the checkpoint holds {len(states)} optimizers' states; ZeroAdam is one")
        fitting = self.lightning_module.trainer.state.fn == "fit"
        zckpt.from_torch(
            checkpoint["state_dict"],
            states[0] if fitting else None,
            self.lightning_module,
            self.zero,
            param_order=self._torch_order,
        )

    def load_optimizer_state_dict(self, checkpoint) -> None:
        if self.zero is None:
            return super().load_optimizer_state_dict(checkpoint)
        # The sharded state came with the weights (load_checkpoint or load_model_state_dict).
