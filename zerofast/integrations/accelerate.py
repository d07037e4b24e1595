"""Hugging Face Accelerate with ZeroAdam: ZeroAccelerator, an `accelerate.Accelerator` for custom loops.

  ZeroAccelerator   the user's accelerator: the model left unwrapped, ZeroAdam (or ZeroMuon) stepping at
                    Accelerate's sync points, its checkpoint inside `save_state`'s folder
  ZeroAccelerating  the overrides it shares with ZeroTrainer's accelerator (zerofast/integrations/hf.py):
                    no DDP, and `backward`, `no_sync`, the clip functions, `optimizer_step_was_skipped`
                    answered by ZeroAdam ([Note: Accelerate's calls onto ZeroAdam])
RELIES_ON lists every Accelerator member overridden, read or called, checked at import
(zerofast.integrations.hosts). docs/integrations.md has the table of what maps to what.
"""

from __future__ import annotations

import contextlib
import os
import shutil

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType

from .. import checkpoint as zckpt
from ..optim.base import ZeroOptimizer
from ..optim.muon import ZeroMuon
from ..optim.zero_adam import ZeroAdam
from . import hosts

# ZeroAdam and ZeroMuon too: a script's one import line (examples/accelerate_nlp_example.py)
__all__ = ["RELIES_ON", "ZERO_DIR", "ZeroAccelerating", "ZeroAccelerator", "ZeroAdam", "ZeroMuon"]

ZERO_DIR = "zerofast"  # <save_state's folder>/zerofast: the sharded zerofast checkpoint
# Accelerator arguments that hand the model to another sharding engine.
_OTHER_ENGINES = ("deepspeed_plugin", "fsdp_plugin", "megatron_lm_plugin", "parallelism_config")
_MODES = ("no", "bf16", "fp16")  # Accelerate's mixed_precision values that ZeroAdam serves


class ZeroAccelerating(Accelerator):
    """[Note: Accelerate's calls onto ZeroAdam]
    A loop written for Accelerate calls five things that DDP would otherwise serve: prepare_model
    (which wraps the model in DDP), backward (which divides the loss by gradient_accumulation_steps),
    no_sync (entered by accumulate() on every micro-batch but the last), clip_grad_norm_ and
    clip_grad_value_, and optimizer_step_was_skipped (read by the prepared scheduler, so that an fp16
    overflow does not advance it). Here: the model is never wrapped (ZeroAdam reduces its gradients
    itself; a DDP wrapper would reduce them twice); backward is ZeroAdam's (its fp16 loss scale);
    no_sync is ZeroAdam's for the model it trains (no other model of the accelerator has a
    collective to skip); a clip over every parameter ZeroAdam trains, in the 2-norm, is ZeroAdam's
    own (folded into the step's kernel), any other is torch's function over the model's gradients,
    which answer through ZeroAdam's shards ([Note: the model stays a torch model] in
    zerofast/guard/__init__.py). Used by ZeroAccelerator and by ZeroTrainer's accelerator, which
    differ only in how they hand out the optimizer. `_zero`: the ZeroAdam, once prepared."""

    _zero: ZeroOptimizer | None = None

    def _trains(self, model) -> bool:
        return self._zero is not None and self.unwrap_model(model) is self._zero.model

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        # evaluation_mode=True: Accelerate's prepare_model then only places the model (and compiles
        # it where its dynamo plugin says so), never wraps it in DDP.
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)

    @property
    def optimizer_step_was_skipped(self):
        if self._zero is None:
            return super().optimizer_step_was_skipped
        return self._zero.step_was_skipped  # fp16: an overflow skipped the step, so the schedule waits

    @contextlib.contextmanager
    def no_sync(self, model):
        if self._zero is None:
            with super().no_sync(model):
                yield
        elif self._trains(model):
            with self._zero.no_sync():
                yield
        else:
            yield

    def backward(self, loss, **kwargs):
        if self._zero is None:
            return super().backward(loss, **kwargs)
        kwargs.pop("scale_wrt_gas", None)
        self._zero.backward(loss / self.gradient_accumulation_steps, **kwargs)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        if self._zero is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        parameters = _listed(parameters)
        if float(norm_type) == 2.0 and self._covers(parameters):
            return self._zero.clip_grad_norm_(max_norm)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters, clip_value):
        if self._zero is None:
            return super().clip_grad_value_(parameters, clip_value)
        parameters = _listed(parameters)
        if self._covers(parameters):
            return self._zero.clip_grad_value_(clip_value)
        return torch.nn.utils.clip_grad_value_(parameters, clip_value)

    def _covers(self, parameters: list) -> bool:
        """Whether `parameters` hold every parameter the ZeroAdam trains (frozen ones may come too)."""
        given = {id(p) for p in parameters}
        return all(id(p) in given for group in self._zero.param_groups for p in group["params"])


def _listed(parameters) -> list:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


class _ZeroOptimizerStep(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper over a ZeroAdam: step() and zero_grad() only at the sync points
    of accumulate(), as for any optimizer; the state never moved (AcceleratedOptimizer would round-trip
    ZeroAdam's state_dict, a DCP dict of this rank's shards, through move_to_device); the fp16 skip
    is ZeroAdam's; every other attribute is ZeroAdam's (opt.gathered_params(), opt.report(), ...)."""

    def __init__(self, optimizer: ZeroOptimizer):
        super().__init__(optimizer, device_placement=False, scaler=None)

    @property
    def step_was_skipped(self):
        return self.optimizer.step_was_skipped

    def __getattr__(self, name):
        if name == "optimizer":  # not yet set (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.optimizer, name)


class ZeroAccelerator(ZeroAccelerating):
    """accelerate.Accelerator for ZeroAdam and ZeroMuon: the same loop as with Accelerator and DDP.

        accelerator = ZeroAccelerator(mixed_precision="bf16")  # any Accelerator argument
        optimizer = ZeroAdam(model, lr=lr, stage=3, mixed_precision=accelerator.mixed_precision)
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    prepare leaves the model unwrapped and hands ZeroAdam back in Accelerate's optimizer wrapper, so
    that its step() and zero_grad() run only at accumulate()'s sync points; dataloaders and schedulers
    are prepared as Accelerate prepares them. backward, accumulate / no_sync, clip_grad_norm_,
    clip_grad_value_ and optimizer_step_was_skipped are ZeroAdam's ([Note: Accelerate's calls onto
    ZeroAdam]). mixed_precision ("bf16" or "fp16", given here or by `accelerate config`) is ZeroAdam's
    own policy: the model runs in that dtype with an fp32 master, without Accelerate's autocast or
    GradScaler, so the ZeroAdam prepared must have been built with the same one (a ValueError says
    so). save_state / load_state write and read a zerofast checkpoint in the folder's `zerofast/`
    beside Accelerate's files (RNG, scheduler, dataloader position), loadable at another world size
    or stage; get_state_dict and save_model give the whole model (stage 3 gathers it unit by unit).

    One ZeroAdam or ZeroMuon per accelerator. Errors, at once: DeepSpeed, FSDP or Megatron-LM (given
    here or by the configuration), fp8, a second ZeroAdam, a torch optimizer prepared on more than one
    process (its gradients would never be reduced: the model is not wrapped in DDP), and a backward on
    more than one process before a ZeroAdam was prepared."""

    def __init__(self, *args, **kwargs):
        for key in _OTHER_ENGINES:
            if kwargs.get(key) is not None:
                raise ValueError(
                    f"ZeroAccelerator: {key}= hands the model to another sharding engine; ZeroAdam shards "
                    f"it (drop {key}=, or use accelerate.Accelerator without ZeroAdam)"
                )
        mode = kwargs.pop("mixed_precision", None)
        if mode is None:
            mode = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")  # `accelerate config` / launch's flag
        mode = str(getattr(mode, "value", mode)).lower()
        if mode not in _MODES:
            raise ValueError(
                f"ZeroAccelerator: mixed_precision must be one of {', '.join(map(repr, _MODES))} "
                f"(ZeroAdam's mixed_precision); got {mode!r}"
            )
        # Accelerate itself runs in full precision: ZeroAdam's policy casts the model, no autocast, no GradScaler.
        super().__init__(*args, mixed_precision="no", **kwargs)
        self._mode = mode
        self._state_dict_rank0 = False  # inside save_model: ranks other than the main one copy nothing
        hosts.check_instance(RELIES_ON, self)
        engine = self.distributed_type
        if engine in (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM) or self.is_fsdp2:
            raise ValueError(
                f"ZeroAccelerator: Accelerate's configuration enables {engine.value}; ZeroAdam shards the "
                f"model itself (set distributed_type to MULTI_CPU / MULTI_GPU in `accelerate config`)"
            )

    @property
    def mixed_precision(self):
        return self._mode

    # --- prepare ---------------------------------------------------------------------------------

    def prepare_optimizer(self, optimizer, device_placement=None):
        if isinstance(optimizer, _ZeroOptimizerStep):  # prepared already
            if optimizer not in self._optimizers:
                self._optimizers.append(optimizer)
            return optimizer
        if not isinstance(optimizer, ZeroOptimizer):
            if self.num_processes > 1:
                raise ValueError(
                    f"ZeroAccelerator: prepare got a {type(optimizer).__qualname__} on {self.num_processes} "
                    "processes; ZeroAccelerator does not wrap the model in DDP, so its gradients would "
                    "never be reduced: use zerofast.ZeroAdam (or ZeroMuon) built on the model"
                )
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        if self._zero is not None and self._zero is not optimizer:
            raise ValueError(
                "ZeroAccelerator: a second ZeroAdam was prepared; one accelerator serves one ZeroAdam or "
                "ZeroMuon (give it every parameter group)"
            )
        wanted = None if self._mode == "no" else self._mode
        if optimizer.plan.mixed_precision != wanted:
            raise ValueError(
                f"ZeroAccelerator: mixed_precision={self._mode!r} (given to the accelerator, or by "
                f"`accelerate config`), but the {type(optimizer).__name__} was built with "
                f"mixed_precision={optimizer.plan.mixed_precision!r}: build it with "
                f"{type(optimizer).__name__}(model, ..., mixed_precision=accelerator.mixed_precision)"
            )
        self._zero = optimizer
        wrapped = _ZeroOptimizerStep(optimizer)
        self._optimizers.append(wrapped)
        return wrapped

    def backward(self, loss, **kwargs):
        if self._zero is None and self.num_processes > 1:
            raise RuntimeError(
                f"ZeroAccelerator: backward on {self.num_processes} processes with no ZeroAdam prepared; "
                "the model is not wrapped in DDP, so build ZeroAdam(model, ...) and pass it to "
                "accelerator.prepare() before training"
            )
        return super().backward(loss, **kwargs)

    def free_memory(self, *objects):
        self._zero = None  # Accelerate forgets its optimizers here (clear() calls it too)
        return super().free_memory(*objects)

    # --- the whole model -------------------------------------------------------------------------

    def get_state_dict(self, model, unwrap=True):
        if not self._trains(model):
            return super().get_state_dict(model, unwrap)
        # Whole tensors on the CPU on every rank (the main one only inside save_model): at stage 3
        # gathered one unit at a time. Every rank calls it: the gathers are collectives.
        return self._zero.full_state_dict(keep=self.is_main_process or not self._state_dict_rank0)

    def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization=True):
        if not self._trains(model):
            return super().save_model(model, save_directory, max_shard_size, safe_serialization)
        self._state_dict_rank0 = True  # the other ranks gather with it and get None: they write nothing
        try:
            return super().save_model(model, save_directory, max_shard_size, safe_serialization)
        finally:
            self._state_dict_rank0 = False

    # --- save_state / load_state -----------------------------------------------------------------

    def save_state(self, output_dir=None, safe_serialization=True, **save_model_func_kwargs):
        if self._zero is None:
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        zero = self._zero

        def write(models, weights, folder):  # Accelerate's pre-hook, once the folder is decided
            _save_zero(os.path.join(folder, ZERO_DIR), zero, self.is_main_process)

        with self._without_zero(), _hooked(self.register_save_state_pre_hook(write)):
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)

    def load_state(self, input_dir=None, load_kwargs=None, **load_model_func_kwargs):
        if self._zero is None:
            return super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        zero = self._zero

        def read(models, folder):
            path = os.path.join(folder, ZERO_DIR)
            if not os.path.isdir(path):
                raise FileNotFoundError(
                    f"ZeroAccelerator.load_state: {folder} holds no zerofast checkpoint ({ZERO_DIR}/); it was "
                    "not written by ZeroAccelerator.save_state"
                )
            zckpt.load(path, zero.model, zero)

        with self._without_zero(), _hooked(self.register_load_state_pre_hook(read)):
            return super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)

    @contextlib.contextmanager
    def _without_zero(self):
        """Accelerate's own save and load, without the model ZeroAdam trains and its optimizer: the
        zerofast checkpoint holds both (weights and state, sharded)."""
        models, optimizers = self._models, self._optimizers
        self._models = [m for m in models if not self._trains(m)]
        self._optimizers = [o for o in optimizers if getattr(o, "optimizer", None) is not self._zero]
        try:
            yield
        finally:
            self._models, self._optimizers = models, optimizers


@contextlib.contextmanager
def _hooked(handle):
    try:
        yield
    finally:
        handle.remove()


def _save_zero(path: str, zero: ZeroOptimizer, main: bool) -> None:
    """The zerofast checkpoint at `path`. A checkpoint is never overwritten in place: the new one is
    written beside it and moved over the old one once complete, so a failed save leaves the old."""
    zckpt.wait()  # an asynchronous save of this process in flight (checkpoint.save(blocking=False))
    if not os.path.exists(path):
        zckpt.save(path, zero.model, zero)
        return
    fresh = path + ".new"
    if main and os.path.exists(fresh):
        shutil.rmtree(fresh)  # a save that died before its move
    dist.barrier()
    zckpt.save(fresh, zero.model, zero)
    if main:
        shutil.rmtree(path)
        os.rename(fresh, path)
    dist.barrier()


# --- what this module relies on in Accelerate, checked at import (zerofast.integrations.hosts) -------
# The versions: the Makefile's HF_DEPS pin (tested) and pyproject.toml's extra `hf` (supported).
ACCELERATE = hosts.Pin("accelerate", tested="1.15.0", supported=">=1.15.0,<1.16")
RELIES_ON = hosts.Reliance(
    "zerofast.integrations.accelerate",
    extra="hf",
    pins=(ACCELERATE,),
    entries=(
        hosts.Overrides(
            ZeroAccelerating,
            Accelerator,
            (
                "prepare_model",
                "no_sync",
                "backward",
                "clip_grad_norm_",
                "clip_grad_value_",
                "optimizer_step_was_skipped",
            ),
        ),
        hosts.Overrides(
            ZeroAccelerator,
            Accelerator,
            (
                "mixed_precision",
                "prepare_optimizer",
                "backward",
                "free_memory",
                "get_state_dict",
                "save_model",
                "save_state",
                "load_state",
            ),
        ),
        hosts.Overrides(_ZeroOptimizerStep, AcceleratedOptimizer, ("step_was_skipped",)),
        # What the overrides pass on, and what they read.
        hosts.Calls(Accelerator, "__init__", keywords=("mixed_precision",)),
        hosts.Calls(Accelerator, "prepare_model", 1, ("device_placement", "evaluation_mode")),
        hosts.Calls(Accelerator, "prepare_optimizer", 1, ("device_placement",)),
        hosts.Calls(Accelerator, "get_state_dict", 1, ("unwrap",)),
        hosts.Calls(Accelerator, "save_model", 2, ("max_shard_size", "safe_serialization")),
        hosts.Calls(Accelerator, "save_state", 1, ("safe_serialization",)),
        hosts.Calls(Accelerator, "load_state", 1, ("load_kwargs",)),
        hosts.Calls(Accelerator, "register_save_state_pre_hook", 1),
        hosts.Calls(Accelerator, "register_load_state_pre_hook", 1),
        hosts.Calls(AcceleratedOptimizer, "__init__", 1, ("device_placement", "scaler")),
        hosts.Reads(
            Accelerator,
            (
                "gradient_accumulation_steps",
                "num_processes",
                "is_main_process",
                "distributed_type",
                "is_fsdp2",
                "unwrap_model",
            ),
        ),
        hosts.Reads(Accelerator, ("_models", "_optimizers"), on_instance=True),
        hosts.Reads(AcceleratedOptimizer, ("optimizer",), on_instance=True),
        hosts.Reads(DistributedType, ("DEEPSPEED", "FSDP", "MEGATRON_LM")),
    ),
)
hosts.check(RELIES_ON)
