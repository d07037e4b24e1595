"""ZeroAdam inside the Hugging Face Trainer: `ZeroTrainer`, `ZeroTrainerMixin`, and TRL's trainers with
it where trl is installed: `ZeroSFTTrainer`, `ZeroDPOTrainer`, `ZeroGRPOTrainer`, `ZeroRLOOTrainer`.

    trainer = ZeroTrainer(model=model, args=TrainingArguments(...), train_dataset=...,
                          zero={"stage": 3})            # any ZeroAdam option but those the arguments own
    trainer.train()

    class MyTrainer(ZeroTrainerMixin, SomeTrainerSubclass): ...

What maps to what: docs/integrations.md. The trainer builds ZeroAdam itself (create_optimizer, after PEFT
wrapping and device placement) with the Trainer's decay / no-decay groups; its Accelerator gets a class of its
own ([Note: the Trainer's accelerator]); TRL's reference and reward models are frozen in the policy's precision
and sharded at stage 3 ([Note: frozen models in the Trainer]); TRL's generation and vLLM weight sync: _trl.py.
Written and tested against transformers 5.24.0 and accelerate 1.15.0 (the Makefile's HF_DEPS, which CI
installs); supported: the ranges of pyproject.toml's extra `hf`. RELIES_ON (below the classes) lists every host
member overridden, read or called, checked at import (zerofast.integrations.hosts): a member renamed or changed
in another release is an ImportError naming it, never an override silently skipped.
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from accelerate import Accelerator
from transformers import PreTrainedModel, Trainer, TrainerState, TrainingArguments, trainer_utils, training_args
from transformers import trainer as trainer_module
from transformers.trainer_pt_utils import AcceleratorConfig

from .. import checkpoint as zckpt
from ..config import MixedPrecisionPolicy, UnitPolicy, precision_policy
from ..model_setup import in_precision
from ..optim.base import ZeroOptimizer
from ..optim.zero_adam import ZeroAdam
from ..stage3.inference import shard_frozen, sharded_frozen_of
from . import hf_generation, hosts  # noqa: F401 (hf_generation: generate() on stage 3 syncs the ranks)
from .accelerate import ACCELERATE, ZeroAccelerating
from .hosts import IncompatibleHostError

__all__ = [
    "RELIES_ON",
    "ZeroTrainer",
    "ZeroTrainerMixin",
    "last_complete_checkpoint",
]  # and TRL_TRAINERS' classes (ZeroSFTTrainer, ...), made on first use where trl imports

ZERO_DIR = "zerofast"  # checkpoint-N/zerofast: the sharded zerofast checkpoint
# ZeroAdam options that TrainingArguments owns: zero= must not repeat them.
_FROM_ARGS = {
    "lr": "learning_rate",
    "betas": "adam_beta1 / adam_beta2",
    "eps": "adam_epsilon",
    "weight_decay": "weight_decay",
    "max_grad_norm": "max_grad_norm",
    "param_groups": "the Trainer's decay / no-decay groups",
    "adamw": "optim",
}


class _ZeroAccelerator(ZeroAccelerating):
    """The Trainer's accelerator: ZeroAccelerating's overrides ([Note: Accelerate's calls onto ZeroAdam]
    in accelerate.py), with the optimizer handed back as it is and the Trainer's frozen models
    prepared for inference.

    [Note: the Trainer's accelerator]
    Trainer 5.24 calls five things on its Accelerator inline, with no Trainer method around them:
    prepare (trainer.py, _prepare_for_training), no_sync (the accumulation loop), backward
    (training_step), clip_grad_norm_ (_clip_grad_norm and _get_grad_norm) and
    optimizer_step_was_skipped. Accelerate 1.15 has no public way to change what they do, and the
    Trainer builds a plain Accelerator inline (create_accelerator_and_postprocess, with no factory to
    override); so the trainer's accelerator is moved into this subclass once built (its constructor
    never runs: the subclass adds no state beyond the class attributes `_zero`, the optimizer once it
    exists, and `_for_inference`, the trainer's hook for frozen models). prepare_optimizer returns
    ZeroAdam as it is: the Trainer steps it only at its own sync points, and reads trainer.optimizer
    as the ZeroAdam."""

    _for_inference = None  # the trainer's _prepare_for_inference: [Note: frozen models in the Trainer]

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        if self._zero is not None:
            device_placement = False
        prepared = super().prepare_model(model, device_placement=device_placement)
        if evaluation_mode and self._for_inference is not None:
            prepared = self._for_inference(prepared)
        return prepared

    def prepare_optimizer(self, optimizer, device_placement=None):
        if isinstance(optimizer, ZeroOptimizer):
            return optimizer
        return super().prepare_optimizer(optimizer, device_placement=device_placement)


def _units_for(units):
    """The units in zero= for a model other than the policy: a UnitPolicy of classes or a callable applies to
    any model; a list of the policy's submodules names none of the other's, which gets the default units."""
    modules = units.modules if isinstance(units, UnitPolicy) else units
    if isinstance(modules, (list, tuple)) and any(isinstance(m, nn.Module) for m in modules):
        return UnitPolicy(min_unit_mb=units.min_unit_mb) if isinstance(units, UnitPolicy) else None
    return units


def _ensure_process_group(device: torch.device) -> None:
    """ZeroAdam needs a process group; a plain `python train.py` (no launcher) has none: one of one rank."""
    if dist.is_initialized():
        return
    backend = "gloo" if device.type == "cpu" else f"cpu:gloo,{device.type}:nccl"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


class ZeroTrainerMixin:
    """Put before a transformers.Trainer subclass: `class ZeroSFTTrainer(ZeroTrainerMixin, SFTTrainer)`.
    zero: ZeroAdam's options ({"stage": 3, "units": ..., "comm": CommPolicy(...), "offload": ...}), except those
    TrainingArguments owns (learning_rate, adam_beta1/2, adam_epsilon, weight_decay, max_grad_norm,
    bf16 / fp16: mixed_precision may be given only to refine them, e.g. a MixedPrecisionPolicy with
    reduce_dtype=torch.float32)."""

    def __init__(self, *args, zero: dict | None = None, save_async: bool = False, **kwargs):
        if not isinstance(save_async, bool):
            raise TypeError(f"ZeroTrainer: save_async must be True or False; got {save_async!r}")
        self.save_async = save_async
        if zero is not None and not isinstance(zero, dict):
            raise TypeError(f"ZeroTrainer: zero must be a dict of ZeroAdam options; got {type(zero).__name__}")
        zero = dict(zero or {})
        for key, arg in _FROM_ARGS.items():
            if key in zero:
                raise ValueError(
                    f"ZeroTrainer: zero={{'{key}': ...}} is set by TrainingArguments ({arg}); set it there"
                )
        self.zero = zero
        optimizers = kwargs.get("optimizers", (None, None))
        if optimizers[0] is not None and not isinstance(optimizers[0], ZeroOptimizer):
            raise ValueError(
                f"ZeroTrainer: optimizers=({type(optimizers[0]).__name__}, ...) next to zero=; the "
                f"trainer builds its ZeroAdam (pass optimizers=(None, scheduler), or a ZeroAdam)"
            )
        if kwargs.get("optimizer_cls_and_kwargs") is not None:
            raise ValueError("ZeroTrainer: optimizer_cls_and_kwargs= next to zero=; the trainer builds ZeroAdam")
        self._prepared_for_inference = weakref.WeakSet()  # models frozen by _prepare_for_inference
        super().__init__(*args, **kwargs)
        hosts.check_instance(RELIES_ON, self)
        self._check_arguments()
        self._check_frozen_models()
        if "trl" in sys.modules:  # a TRL trainer: its generation mode ([Note: TRL's generation mode])
            from . import _trl  # imports trl, an optional package

            _trl.adopt(self)

    def _check_arguments(self) -> None:
        a = self.args
        if a.n_gpu > 1:
            raise ValueError(f"ZeroTrainer: one process per GPU (torchrun), not nn.DataParallel over {a.n_gpu}")
        if a.fp16_full_eval or a.bf16_full_eval:
            raise ValueError(
                "ZeroTrainer: fp16_full_eval / bf16_full_eval cast the model, whose parameters "
                "ZeroAdam owns; use bf16= / fp16="
            )
        if a.auto_find_batch_size:
            raise ValueError(
                "ZeroTrainer: auto_find_batch_size retries a step after running out of memory, "
                "which leaves ZeroAdam's collectives in flight; set the batch size"
            )
        if a.device.type not in ("cpu", "cuda"):
            raise ValueError(f"ZeroTrainer: the device is {a.device.type!r}; zerofast runs on CPU and CUDA")
        ga = a.accelerator_config.gradient_accumulation_kwargs or {}
        if ga.get("sync_each_batch") and a.gradient_accumulation_steps > 1:
            raise ValueError(
                "ZeroTrainer: gradient_accumulation_kwargs sync_each_batch: ZeroAdam's no_sync "
                "decides what each micro-batch communicates"
            )
        if getattr(self.model, "is_loaded_in_4bit", False) or getattr(self.model, "is_loaded_in_8bit", False):
            raise ValueError("ZeroTrainer: quantized (bitsandbytes) models are not supported")
        if a.optim not in (training_args.OptimizerNames.ADAMW_TORCH, training_args.OptimizerNames.ADAMW_TORCH_FUSED):
            optim = str(getattr(a.optim, "value", a.optim))
            raise ValueError(f"ZeroTrainer: optim={optim!r}; ZeroAdam is AdamW (optim='adamw_torch')")
        self._mixed_precision()  # a disagreement between zero= and bf16= / fp16= is named now

    # --- the accelerator: no DDP, no autocast, no GradScaler -------------------------------------

    def _build_accelerator_args(self, **kwargs):
        # Private in transformers 5.24.0 (create_accelerator_and_postprocess's arguments for Accelerator):
        # the one place that decides the Accelerator's mixed precision before it is built.
        hosts.check_instance(RELIES_ON, self.args)
        if self.args.deepspeed or self.args.deepspeed_plugin is not None:
            raise ValueError("ZeroTrainer: zero= and DeepSpeed are exclusive: unset deepspeed=")
        if self.args.fsdp or self.args.fsdp_plugin_args is not None:
            raise ValueError("ZeroTrainer: zero= and FSDP are exclusive: unset fsdp=")
        args = super()._build_accelerator_args(**kwargs)
        args["mixed_precision"] = "no"  # ZeroAdam's own bf16 / fp16: the model runs in that dtype
        return args

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:  # from `accelerate launch`'s config or env
            raise ValueError("ZeroTrainer: zero= with DeepSpeed or FSDP enabled in Accelerate's configuration")
        if type(self.accelerator) is not Accelerator:  # a subclass of someone else's would lose its methods
            raise TypeError(
                f"ZeroTrainer: the Trainer built a {type(self.accelerator).__qualname__}, not an "
                f"accelerate.Accelerator; ZeroTrainer gives the accelerator a class of its own"
            )
        self.accelerator.__class__ = _ZeroAccelerator  # see [Note: the Trainer's accelerator]
        self.accelerator._for_inference = self._prepare_for_inference

    # --- models run for inference only beside the policy ------------------------------------------

    def _prepare_for_inference(self, model):
        """[Note: frozen models in the Trainer]
        TRL's trainers keep frozen models beside the policy: DPO's and GRPO's (beta > 0) reference,
        built by TRL 1.16.0 from the policy's path as a whole copy, and GRPO's reward models. Outside
        DeepSpeed and FSDP, TRL hands each to `self.accelerator.prepare_model(m, evaluation_mode=True)`
        once, in its constructor (DPOTrainer, GRPOTrainer, RLOOTrainer, KTOTrainer, the distillation
        teacher): the one point where every such model passes, and already ours ([Note: the
        Trainer's accelerator]). There every model other than the policy is frozen and brought to
        the policy's precision (bf16= / fp16=, or the mixed_precision given in zero=), so that policy and
        reference give identical log-probs at step 0, as under TRL + DDP's autocast; at stage 3 it
        is also sharded (zerofast.shard_frozen: 1/N per rank plus two units, on the trainer's
        process group), at stages 1 and 2 kept whole. The Trainer's own evaluation passes the
        policy through the same call: left as it is. Checked after the host's constructor
        (_check_frozen_models): a reference model that did not pass here is an error, not a whole
        copy silently kept."""
        if not isinstance(model, nn.Module) or model is self.model or model is getattr(self, "model_wrapped", None):
            return model
        if sharded_frozen_of(model) is not None or model in self._prepared_for_inference:
            return model
        self._prepared_for_inference.add(model)
        precision = self._mixed_precision()
        if self.zero.get("stage", 2) == 3:
            _ensure_process_group(self.args.device)
            units = _units_for(self.zero.get("units"))
            shard_frozen(model, self.zero.get("process_group"), mixed_precision=precision, units=units)
            return model
        for p in model.parameters():
            p.requires_grad_(False)
        in_precision(model, precision_policy(precision).param_dtype if precision is not None else None)
        return model

    def _check_frozen_models(self) -> None:
        """What the host built for inference passed _prepare_for_inference: [Note: frozen models in the Trainer]."""
        models = [getattr(self, "ref_model", None)] + [
            f for f in getattr(self, "reward_funcs", None) or [] if isinstance(f, PreTrainedModel)
        ]
        for model in models:
            if isinstance(model, nn.Module) and model not in self._prepared_for_inference:
                from ._trl import TRL  # a TRL trainer: trl, an optional package, is imported already

                raise IncompatibleHostError(
                    f"ZeroTrainer: {type(self).__name__} built a {type(model).__name__} for inference that "
                    f"never passed through accelerator.prepare_model(..., evaluation_mode=True), where "
                    f"zerofast shards it and brings it to the policy's precision (written against trl "
                    f"{TRL.tested}); it would stay a whole copy in another precision"
                )

    # --- the optimizer ---------------------------------------------------------------------------

    def _mixed_precision(self):
        """bf16= / fp16= (or ACCELERATE_MIXED_PRECISION) as ZeroAdam's mixed_precision; zero= may
        refine it with a MixedPrecisionPolicy of the same parameter dtype."""
        mode = self.args.mixed_precision
        if mode not in ("no", "bf16", "fp16"):
            raise ValueError(f"ZeroTrainer: mixed precision {mode!r} is not supported (bf16, fp16 or none)")
        wanted = None if mode == "no" else mode
        given = self.zero.get("mixed_precision")
        if given is None:
            return wanted
        dtype = (
            given.param_dtype
            if isinstance(given, MixedPrecisionPolicy)
            else {"bf16": torch.bfloat16, "fp16": torch.float16}.get(given)
        )
        if {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype) != wanted:
            raise ValueError(
                f"ZeroTrainer: zero={{'mixed_precision': {given!r}}} disagrees with the arguments' "
                f"bf16={self.args.bf16}, fp16={self.args.fp16}"
            )
        return given

    def create_optimizer(self, model=None):
        if self.optimizer is not None:  # given as optimizers=(ZeroAdam, ...)
            self.accelerator._zero = self.optimizer
            return self.optimizer
        opt_model = self.model if model is None else model
        _ensure_process_group(self.args.device)
        decay = set(self.get_decay_parameter_names(opt_model))
        named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        options = dict(self.zero, mixed_precision=self._mixed_precision())
        self.optimizer = ZeroAdam(
            opt_model,
            lr=self.args.learning_rate,
            betas=(self.args.adam_beta1, self.args.adam_beta2),
            eps=self.args.adam_epsilon,
            weight_decay=self.args.weight_decay,
            param_groups=[g for g in groups if g["params"]],
            **options,
        )
        self.accelerator._zero = self.optimizer
        return self.optimizer

    # --- saving ----------------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """A consolidated model that from_pretrained loads (with PEFT: the adapter), written by the
        ranks that save (args.should_save) from opt.full_state_dict(): gathered unit by unit, so no
        rank holds more than the model on the CPU plus one unit. Every rank must call it."""
        if not isinstance(self.optimizer, ZeroOptimizer):
            return super().save_model(output_dir, _internal_call)
        output_dir = self.args.output_dir if output_dir is None else output_dir
        state_dict = self.optimizer.full_state_dict(keep=self.args.should_save)
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint is True:  # the Trainer would take the highest checkpoint-N, complete or not
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir) or True
        out = super().train(resume_from_checkpoint, *args, **kwargs)
        if isinstance(self.optimizer, ZeroOptimizer):
            # delayed_update=True: the last step's update, still in flight, applied so that train()
            # returns the trained model (nothing to do otherwise; every rank calls it)
            self.optimizer.flush()
        zckpt.wait()  # the last asynchronous save (save_async=True) is complete when train() returns
        return out

    def _save_checkpoint(self, model, trial):
        """Private in transformers 5.24.0 (each save step). With save_async: the previous save (and its rotation)
        completes before this checkpoint's folder is made, and save_total_limit's rotation, which transformers
        5.24 runs inline at the end (trainer_utils.rotate_checkpoints), runs from AsyncSave.then with the same
        arguments once this one is written: run now, it could delete the newest complete checkpoint mid-write.
        The last step's save is waited for here, before the Trainer's end-of-training cleanup may delete any."""
        if not (self.save_async and isinstance(self.optimizer, ZeroOptimizer)):
            return super()._save_checkpoint(model, trial)
        zckpt.wait()
        limit = self.args.save_total_limit
        self.args.save_total_limit = None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        handle = zckpt.in_flight()
        if limit and self.args.should_save and handle is not None:
            run_dir, best = self._get_output_dir(trial=trial), self.state.best_model_checkpoint
            handle.then(
                lambda: trainer_utils.rotate_checkpoints(
                    output_dir=run_dir, save_total_limit=limit, best_model_checkpoint=best, use_mtime=True
                )
            )
        if self.state.max_steps > 0 and self.state.global_step >= self.state.max_steps:
            zckpt.wait()

    def _save_optimizer_and_scheduler(self, output_dir):
        # Private in transformers 5.24.0 (_save_checkpoint's optimizer.pt and scheduler.pt).
        if not isinstance(self.optimizer, ZeroOptimizer):
            return super()._save_optimizer_and_scheduler(output_dir)
        path = os.path.join(output_dir, ZERO_DIR)
        zckpt.wait()  # the previous asynchronous save first (it may be this folder's)
        if self.args.process_index == 0 and os.path.exists(path):
            shutil.rmtree(path)  # checkpoint-N written again at the same step; zerofast never overwrites
        # every rank its shard; barriers inside; with save_async, written in the background
        zckpt.save(path, self.model, self.optimizer, blocking=not self.save_async)
        if self.args.should_save:
            with warnings.catch_warnings(record=True):
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, trainer_module.SCHEDULER_NAME))

    # --- resuming --------------------------------------------------------------------------------

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # Private in transformers 5.24.0 (train()'s resume). The Trainer loads weights here, before the optimizer
        # exists; a zerofast checkpoint holds them and loads with it (_load_optimizer_and_scheduler).
        if os.path.isdir(os.path.join(resume_from_checkpoint, ZERO_DIR)):
            return None
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint):
        # Private in transformers 5.24.0 (train()'s resume, once the optimizer exists).
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, ZERO_DIR)
        if not os.path.isdir(path) and not os.path.isdir(path + zckpt.INCOMPLETE):  # (load names an unfinished one)
            if os.path.isfile(os.path.join(checkpoint, "optimizer.pt")):
                raise ValueError(
                    f"ZeroTrainer: {checkpoint} was written by a plain Trainer (optimizer.pt, no "
                    f"{ZERO_DIR}/); convert it with zerofast.checkpoint.from_torch"
                )
            # Not silently on with fresh Adam moments and schedule (what the Trainer would do).
            raise ValueError(
                f"ZeroTrainer: {checkpoint} holds no optimizer state (no {ZERO_DIR}/): it was saved with "
                f"save_only_model, or its save never completed; resume from a complete checkpoint"
            )
        zckpt.load(path, self.model, self.optimizer)
        with warnings.catch_warnings(record=True):
            self.lr_scheduler.load_state_dict(
                torch.load(os.path.join(checkpoint, trainer_module.SCHEDULER_NAME), weights_only=True)
            )

    def _load_best_model(self):
        # Private in transformers 5.24.0 (load_best_model_at_end).
        if not isinstance(self.optimizer, ZeroOptimizer):
            return super()._load_best_model()
        zckpt.load(os.path.join(self.state.best_model_checkpoint, ZERO_DIR), self.model, self.optimizer)


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The highest checkpoint-N under output_dir with its trainer_state.json and a complete zerofast/ folder
    (or a plain Trainer's optimizer.pt, which resuming then names), or None; train(resume_from_checkpoint=True)
    resumes from it. A run killed while checkpoint-N's shards were being written (save_async, or a blocking
    save cut short) leaves only zerofast.incomplete there, which the Trainer's get_last_checkpoint
    (transformers 5.24) would pick."""
    prefix = trainer_utils.PREFIX_CHECKPOINT_DIR
    found = []
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        step = name[len(prefix) + 1 :]
        folder = os.path.join(output_dir, name)
        if name.startswith(prefix + "-") and step.isdigit() and os.path.isdir(folder):
            found.append((int(step), folder))
    for _, folder in sorted(found, reverse=True):
        zero = os.path.join(folder, ZERO_DIR)
        optimizer_saved = os.path.isfile(os.path.join(zero, zckpt.MANIFEST)) or os.path.isfile(
            os.path.join(folder, "optimizer.pt")
        )  # a plain Trainer's: named later
        if optimizer_saved and os.path.isfile(os.path.join(folder, trainer_module.TRAINER_STATE_NAME)):
            return folder
        warnings.warn(
            f"ZeroTrainer: {folder} was never completed (no {trainer_module.TRAINER_STATE_NAME}, or its {ZERO_DIR}/ "
            f"unfinished); "
            f"resuming from an earlier checkpoint",
            stacklevel=3,
        )
    return None


class ZeroTrainer(ZeroTrainerMixin, Trainer):
    """transformers.Trainer with ZeroAdam: ZeroTrainer(..., zero={"stage": 3, ...})."""


# --- what this module relies on in its hosts, checked at import (zerofast.integrations.hosts) ------
# The versions: the Makefile's HF_DEPS pins (tested) and pyproject.toml's extra `hf` (supported).
TRANSFORMERS = hosts.Pin("transformers", tested="5.24.0", supported=">=5.24.0,<5.25")
# The Trainer methods ZeroTrainerMixin replaces; the private ones are named after transformers 5.24.0.
TRAINER_OVERRIDES = (
    "create_accelerator_and_postprocess",
    "create_optimizer",
    "save_model",
    "train",
    "_build_accelerator_args",
    "_save_checkpoint",
    "_save_optimizer_and_scheduler",
    "_load_from_checkpoint",
    "_load_optimizer_and_scheduler",
    "_load_best_model",
)
RELIES_ON = hosts.Reliance(
    "zerofast.integrations.hf",
    extra="hf",
    pins=(TRANSFORMERS, ACCELERATE),
    entries=(
        hosts.Overrides(ZeroTrainerMixin, Trainer, TRAINER_OVERRIDES),
        hosts.Overrides(_ZeroAccelerator, Accelerator, ("prepare_model", "prepare_optimizer")),
        # What the overrides pass on, and what ZeroTrainerMixin reads from the Trainer's arguments.
        hosts.Calls(Trainer, "__init__", keywords=("optimizers", "optimizer_cls_and_kwargs")),
        hosts.Calls(Accelerator, "prepare_model", 1, ("device_placement", "evaluation_mode")),
        hosts.Calls(Accelerator, "prepare_optimizer", 1, ("device_placement",)),
        hosts.Calls(Trainer, "get_decay_parameter_names", 1),
        hosts.Calls(Trainer, "_save", 1, ("state_dict",)),  # private: save_model's writer
        hosts.Calls(Trainer, "_get_output_dir", keywords=("trial",)),  # private: the run's folder
        hosts.Calls(Trainer, "push_to_hub", keywords=("commit_message", "revision")),
        hosts.Calls(
            trainer_utils,
            "rotate_checkpoints",
            keywords=("output_dir", "save_total_limit", "best_model_checkpoint", "use_mtime"),
        ),
        hosts.Reads(trainer_utils, ("PREFIX_CHECKPOINT_DIR",)),
        hosts.Reads(trainer_module, ("SCHEDULER_NAME", "TRAINER_STATE_NAME")),
        hosts.Reads(training_args.OptimizerNames, ("ADAMW_TORCH", "ADAMW_TORCH_FUSED")),
        hosts.Reads(Accelerator, ("gradient_accumulation_steps",)),
        hosts.Reads(
            TrainingArguments,
            (
                "n_gpu",
                "device",
                "fp16_full_eval",
                "bf16_full_eval",
                "auto_find_batch_size",
                "accelerator_config",
                "gradient_accumulation_steps",
                "optim",
                "deepspeed",
                "fsdp",
                "bf16",
                "fp16",
                "learning_rate",
                "adam_beta1",
                "adam_beta2",
                "adam_epsilon",
                "weight_decay",
                "max_grad_norm",
                "output_dir",
                "save_total_limit",
                "should_save",
                "process_index",
                "push_to_hub",
                "hub_revision",
            ),
        ),
        hosts.Reads(AcceleratorConfig, ("gradient_accumulation_kwargs",)),
        hosts.Reads(TrainerState, ("best_model_checkpoint", "global_step", "max_steps")),
        # Set by the constructors (TrainingArguments.__post_init__, Trainer.__init__): checked on the objects.
        hosts.Reads(TrainingArguments, ("deepspeed_plugin", "fsdp_plugin_args", "mixed_precision"), on_instance=True),
        hosts.Reads(
            Trainer,
            (
                "args",
                "model",
                "accelerator",
                "optimizer",
                "lr_scheduler",
                "state",
                "is_deepspeed_enabled",
                "is_fsdp_enabled",
            ),
            on_instance=True,
        ),
    ),
)
hosts.check(RELIES_ON)


# TRL's trainers made with the mixin, by the name each is exported under here.
TRL_TRAINERS = {
    "ZeroSFTTrainer": "SFTTrainer",
    "ZeroDPOTrainer": "DPOTrainer",
    "ZeroGRPOTrainer": "GRPOTrainer",
    "ZeroRLOOTrainer": "RLOOTrainer",
}


def _trl_reliance(name: str, host: type, pin: hosts.Pin) -> hosts.Reliance:
    """ZeroTrainerMixin over one of TRL's trainers: the same overrides, against what it changes."""
    return hosts.Reliance(
        f"zerofast.integrations.hf.{name}",
        extra="hf",
        pins=(pin,),
        entries=(hosts.Overrides(ZeroTrainerMixin, host, TRAINER_OVERRIDES),),
    )


def __getattr__(name: str):
    if name in TRL_TRAINERS:  # TRL's trainer with ZeroAdam, made where trl imports
        try:
            import trl

            from ._trl import TRL  # imports trl, an optional package

            host = getattr(trl, TRL_TRAINERS[name])
        except ImportError as e:
            raise AttributeError(f"zerofast.integrations.hf.{name} needs trl ({e})") from e
        hosts.check(_trl_reliance(name, host, TRL))
        cls = type(
            name,
            (ZeroTrainerMixin, host),
            {
                "__module__": __name__,
                "__doc__": f"trl.{host.__name__} with ZeroAdam: {name}(..., zero={{...}}); its reference "
                "and reward models frozen in the policy's precision, sharded at stage 3: see "
                "ZeroTrainerMixin._prepare_for_inference.",
            },
        )
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
