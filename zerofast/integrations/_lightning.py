"""ZeroAdam as a Lightning strategy: the code shared by `zerofast.integrations.lightning` (the
`lightning` package, `lightning.pytorch`) and `zerofast.integrations.pytorch_lightning` (the
`pytorch_lightning` package). The two packages hold the same classes under different names, and
Lightning checks a strategy with isinstance against its own, so each module puts these mixins in
front of its package's DDPStrategy and Precision; nothing here imports either package.

Written and tested against Lightning 2.6.6 (lightning and pytorch_lightning: the Makefile's
LIGHTNING_DEPS, which CI installs); supported: the ranges of pyproject.toml's extras `lightning` and
`pytorch-lightning`. The methods overridden are named after its sources
(lightning/pytorch/strategies/ddp.py and strategy.py, plugins/precision/precision.py); every host
member overridden, read or called is in `relies_on` (end of this file), which each of the two modules
checks at import (zerofast.integrations.hosts). What maps to what:
  - the launch, the process group, the samplers, reduce / barrier / broadcast: DDPStrategy's,
    unchanged (Lightning's own launcher for `python script.py`, or torchrun's environment);
  - the model is never wrapped in DDP: configure_optimizers' AdamW / Adam becomes a ZeroAdam over the
    LightningModule with the same parameter groups and hyper-parameters (a ZeroAdam built there is
    taken as it is), and its LR schedulers are pointed at the ZeroAdam's param_groups;
  - accumulate_grad_batches: Lightning's block_backward_sync is ZeroAdam's no_sync;
  - gradient_clip_val: ZeroAdam's clip_grad_norm_ (the global norm across shards) or, with
    gradient_clip_algorithm="value", its clip_grad_value_ (elementwise on each rank's shard);
  - precision: ZeroPrecision (below) maps the flag to ZeroAdam's mixed precision;
  - checkpoints: a folder per checkpoint, `zerofast/` (a zerofast checkpoint, every rank its shard,
    resharded on load at any world size or stage) beside `lightning.ckpt` (the loops', callbacks' and
    schedulers' state, written by rank 0 through Lightning's CheckpointIO); the module's whole
    state_dict only with save_full_weights=True.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import os
import shutil
import weakref
from typing import Any

import torch
import torch.nn as nn
from lightning_utilities.core.apply_func import apply_to_collection

from .. import checkpoint as zckpt
from ..config import MixedPrecisionPolicy, check_stage, comm_policy, resolve_plan
from ..optim.zero_adam import ZeroAdam
from . import hosts

ZERO_DIR = "zerofast"  # <checkpoint>/zerofast: the sharded zerofast checkpoint
LIGHTNING_FILE = "lightning.ckpt"  # <checkpoint>/lightning.ckpt: Lightning's own state, by rank 0
WRITING = ".writing"  # the folder while it is written; renamed when complete

# Lightning's precision flag -> ZeroAdam's mixed_precision ("-mixed" and "-true" alike: the model runs
# in that dtype over an fp32 master shard, as DeepSpeed's bf16 / fp16 do; fp16 with loss scaling).
PRECISIONS = {"32-true": None, "bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16", "16-true": "fp16"}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The precision plugins Lightning's connector builds from a flag alone; any other plugin is the user's.
_FLAG_PLUGINS = {"Precision", "MixedPrecision", "HalfPrecision", "DoublePrecision"}
# Keys of torch.optim.Adam(W)'s param groups that choose its implementation, not its mathematics.
_TORCH_ADAM_KEYS = {"foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay", "amsgrad", "maximize"}
_HYPER_KEYS = ("lr", "betas", "eps", "weight_decay")
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


def _zero_dtype(precision: str) -> torch.dtype | None:
    return _DTYPES.get(PRECISIONS[precision])


class ZeroPrecisionMixin:
    """Lightning's precision flag as ZeroAdam's mixed precision: no autocast and no GradScaler. The
    model runs in the parameters' dtype (ZeroAdam converts it when built), the floating-point tensors
    of each batch are cast to it (convert_input, as Lightning's HalfPrecision and DeepSpeedPrecision
    do), fp16's loss scaling is ZeroAdam's (backward goes through opt.backward), and clipping is
    ZeroAdam's, across the shards."""

    def __init__(self, precision: str = "32-true") -> None:
        super().__init__()
        if precision not in PRECISIONS:
            raise ValueError(
                f"ZeroStrategy: precision={precision!r} is not supported; choose one of "
                f"{', '.join(PRECISIONS)} (zerofast keeps an fp32 master and Adam state)"
            )
        self.precision = precision
        self.zero: ZeroAdam | None = None  # set by the strategy once the optimizer exists

    @property
    def dtype(self) -> torch.dtype | None:
        return _zero_dtype(self.precision)

    def convert_input(self, data: Any) -> Any:
        dtype = self.dtype
        if dtype is None:
            return data
        return apply_to_collection(data, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module  # ZeroAdam converts it when built (its fp32 master from the fp32 initial values)

    def backward(self, tensor: torch.Tensor, model, optimizer, *args: Any, **kwargs: Any) -> None:
        if self.zero is not None and self.zero.plan.scales_loss:
            if args:
                raise TypeError(f"ZeroStrategy: backward takes keyword arguments only under fp16; got {args!r}")
            self.zero.backward(tensor, **kwargs)  # scaled by the loss scale, as ZeroAdam requires
            return
        model.backward(tensor, *args, **kwargs)

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        self._require_zero("gradient_clip_val").clip_grad_norm_(float(clip_val))

    def clip_grad_by_value(self, optimizer, clip_val) -> None:
        self._require_zero("gradient_clip_val").clip_grad_value_(float(clip_val))

    def _require_zero(self, what: str) -> ZeroAdam:
        if self.zero is None:
            raise RuntimeError(f"ZeroStrategy: {what} needs the ZeroAdam, which the strategy builds in fit()")
        return self.zero


def _track_step(opt: torch.optim.Optimizer) -> None:
    """What torch's LRScheduler does to the optimizer it is built with (torch 2.14's lr_scheduler.py,
    patch_track_step_called; torch has no public way to re-point a scheduler): mark step() so that
    the scheduler can tell whether it ran, and so does not warn wrongly that lr_scheduler.step()
    came first. Were torch to change these private marks, the cost is that warning, nothing more."""
    if hasattr(opt.step, "_wrapped_by_lr_sched"):
        return
    ref, func = weakref.ref(opt), type(opt).step

    @functools.wraps(func)
    def step(*args, **kwargs):
        me = ref()
        me._opt_called = True
        return func(me, *args, **kwargs)

    step._wrapped_by_lr_sched = True
    opt.step = step


def _schedulers(scheduler) -> list:
    """A scheduler and those it drives (SequentialLR, ChainedScheduler)."""
    found = [scheduler]
    for child in getattr(scheduler, "_schedulers", []):
        found += _schedulers(child)
    return found


def zero_from(optimizer, module: nn.Module, stage: int | None, options: dict) -> ZeroAdam:
    """The ZeroAdam that trains `module`: `optimizer` itself if it is one built on it, else one with
    torch.optim.AdamW's / Adam's parameter groups and hyper-parameters (frozen parameters left out,
    the groups' other keys, a scheduler's initial_lr, carried over)."""
    if isinstance(optimizer, ZeroAdam):
        if optimizer.model is not module:
            raise ValueError(
                f"ZeroStrategy: configure_optimizers returned a ZeroAdam built on "
                f"{type(optimizer.model).__name__}, not on the LightningModule; build it as "
                f"ZeroAdam(self, ...)"
            )
        given = [k for k, v in dict(options, stage=stage).items() if v is not None]
        if given:
            raise ValueError(
                f"ZeroStrategy: {', '.join(sorted(given))} given to ZeroStrategy and a ZeroAdam "
                f"returned by configure_optimizers; set them in one place (the ZeroAdam's)"
            )
        return optimizer
    kind = type(optimizer)
    if kind not in (torch.optim.AdamW, torch.optim.Adam):
        raise TypeError(
            f"ZeroStrategy: configure_optimizers returned {kind.__module__}.{kind.__qualname__}; "
            f"ZeroStrategy trains with ZeroAdam, converted from torch.optim.AdamW or torch.optim.Adam "
            f"(their parameter groups and hyper-parameters), or a ZeroAdam built on the "
            f"LightningModule (ZeroAdam(self, ...))"
        )
    for g, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ValueError(
                    f"ZeroStrategy: {kind.__name__}.param_groups[{g}] has {flag}=True, which ZeroAdam "
                    f"does not implement"
                )
    adamw = kind is torch.optim.AdamW or bool(optimizer.defaults.get("decoupled_weight_decay", False))
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    left_out = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in in_optimizer]
    if left_out:
        raise ValueError(
            f"ZeroStrategy: {left_out[0]} is trainable (requires_grad=True) but in no parameter group "
            f"of the {kind.__name__} ({len(left_out)} such); ZeroAdam trains every trainable parameter "
            f"of the module: set requires_grad=False on those it should not train"
        )

    def hyper(group: dict) -> dict:
        lr = group["lr"]
        return dict(
            lr=float(lr.item() if isinstance(lr, torch.Tensor) else lr),
            betas=tuple(float(b.item() if isinstance(b, torch.Tensor) else b) for b in group["betas"]),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
        )

    # Frozen parameters are in no ZeroAdam group (torch.optim skips them: they get no gradient); an
    # emptied group stays, so group i is still the scheduler's group i.
    groups = [
        dict(hyper(group), params=[p for p in group["params"] if p.requires_grad]) for group in optimizer.param_groups
    ]
    first = groups[0]
    given = {k: v for k, v in options.items() if v is not None}
    if "shard_size" in given:  # ZeroAdam takes it in its CommPolicy
        given["comm"] = dataclasses.replace(comm_policy(given.get("comm")), shard_size=given.pop("shard_size"))
    zero = ZeroAdam(
        module,
        stage=2 if stage is None else stage,
        adamw=adamw,
        param_groups=groups,
        **{k: first[k] for k in _HYPER_KEYS},
        **given,
    )
    for mine, theirs in zip(zero.param_groups, optimizer.param_groups):
        for key, value in theirs.items():  # a scheduler's keys (initial_lr, max_lr, ...), the user's own
            if key not in mine and key not in _TORCH_ADAM_KEYS:
                mine[key] = value
    return zero


def _into_place(tmp: str, path: str) -> None:
    """Rename the complete folder `tmp` to `path`, replacing what is there (a folder: only after)."""
    old = path + ".replaced"
    if os.path.lexists(path):
        if os.path.isdir(path) and not os.path.islink(path):
            os.replace(path, old)
        else:
            os.remove(path)
    os.replace(tmp, path)
    if os.path.exists(old):
        shutil.rmtree(old)


class ZeroStrategyMixin:
    """ZeroAdam's sharding in Lightning: put before the package's DDPStrategy (see the two modules).

    stage: 1 shards the Adam state, 2 also the gradients, 3 also the parameters (and frozen ones);
      None: 2, or the stage of a ZeroAdam configure_optimizers returns.
    mixed_precision: only to refine the Trainer's precision flag (a MixedPrecisionPolicy of the same
      parameter dtype, e.g. with reduce_dtype=torch.float32); the flag decides the dtype.
    units, comm: ZeroAdam's (a UnitPolicy or the unit modules; a CommPolicy).
    shard_size: ZeroAdam's: shard within groups of that many consecutive ranks (a machine: Lightning
      numbers ranks node by node), replicate across them ([Note: hybrid sharding]); None: every rank.
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
        save_full_weights: bool = False,
        save_async: bool = False,
        **ddp_arguments: Any,
    ) -> None:
        allowed = set(_DDP_ARGUMENTS)
        unknown = sorted(set(ddp_arguments) - allowed)
        if unknown:
            raise TypeError(
                f"ZeroStrategy: unexpected argument {unknown[0]!r}: ZeroStrategy takes stage, "
                f"mixed_precision, units, comm, shard_size, save_full_weights, save_async and DDPStrategy's "
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
        self.zero_options = dict(mixed_precision=mixed_precision, units=units, comm=comm, shard_size=shard_size)
        self.save_full_weights = save_full_weights
        self.zero: ZeroAdam | None = None
        self._restored_zero = False  # load_checkpoint loaded the sharded state: nothing left for Lightning
        self._torch_order: list | None = None
        super().__init__(**ddp_arguments)
        hosts.check_instance(self._relies_on, self)

    # --- precision: whatever the connector builds from the flag becomes a ZeroPrecision -----------
    # Lightning 2.6.6's connector builds the plugin from the flag and sets it here, with no hook to
    # choose its class: the setter converts it, and both halves keep Strategy's property underneath.

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
        # DDPStrategy's: the module to the device, no DDP wrapper (configure_ddp), and when fitting the
        # optimizer (setup_optimizers: a ZeroAdam); otherwise the plain module on every rank.
        super().setup(trainer)
        if not fitting and self.precision_plugin.dtype is not None:
            self.model.to(self.precision_plugin.dtype)  # evaluation only: in the precision's dtype

    def configure_ddp(self) -> None:
        """No DDP wrapper: ZeroAdam reduces the gradients (DDPStrategy.setup calls this when fitting,
        before setup_optimizers builds the ZeroAdam)."""

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
        if isinstance(given, ZeroAdam):
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

    def teardown(self) -> None:
        if self.zero is None:
            return super().teardown()
        zckpt.wait()  # the last asynchronous save is complete when fit / validate returns
        # Not DDPStrategy.teardown, whose Strategy.teardown moves the module and the optimizer's state to
        # the CPU: the parameters are views of ZeroAdam's flat buffers (stage 3: shards), which must stay
        # where ZeroAdam put them for later validate / test / predict calls and checkpoints. The rest of
        # what it does, as Lightning 2.6.6's own sharded strategies (FSDPStrategy, ModelParallelStrategy) do:
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


# --- what the strategy relies on in Lightning, checked at import by each of the two modules --------
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
